#![warn(missing_docs)]
//! Collective communication for burn-tp, free of autodiff and of Burn itself.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of `world_size` ranks. On the CPU the ranks
//! are threads of one process ([`LocalGroup`], the embedded default: no setup); with feature
//! `mpi` they can be processes (`ProcessGroup::from_mpi`, one per rank under `mpirun`), and with
//! feature `nccl` GPUs. Every collective
//! has two forms: async, reading the input in place ([`SendBuf`]) and writing into the caller's
//! output ([`RecvBuf`]), returning a [`Work`] handle; and blocking, from a `Vec` into a new `Vec`.
//! [`Communicator`] is the transport extension point: the same collectives over host buffers
//! and, with feature `nccl`, CUDA buffers (the conformance tests run one check on both).
//!
//! | file | what |
//! |---|---|
//! | `group.rs`, `collectives.rs`, `work.rs` | [`ProcessGroup`], its collectives, [`Work`] (a call in flight) |
//! | `all_to_all.rs` | the all-to-all with per-rank counts (expert parallelism's dispatch) |
//! | `local.rs`, `link.rs` | ranks as threads ([`LocalGroup`]), a simulated link ([`LinkModel`]) |
//! | `op.rs`, `element.rs`, `buffer.rs`, `error.rs` | what ranks agree on, element types, buffers, [`CommError`] |
//! | `communicator.rs` | [`Communicator`], the transport extension point |
//! | `p2p.rs` | [`RingLinks`]: transfers between neighbouring ranks (pipeline stages) |
//! | `profile.rs` | [`profile`]: bytes, time in flight and time waited per scope |
//! | `store.rs` | [`store`]: the rendezvous store of multi-process launches |
//! | `mpi/`, `nccl/` | the MPI (feature `mpi`) and NCCL (feature `nccl`) transports |
//!
//! ```
//! use burn_tp_comm::{LocalGroup, ReduceOp};
//!
//! let groups = LocalGroup::new(2).unwrap();
//! let handles: Vec<_> = groups
//!     .into_iter()
//!     .map(|pg| std::thread::spawn(move || {
//!         let mine = vec![pg.rank() as f32; 2];
//!         let gathered = pg.all_gather(mine.clone()).unwrap();   // [0, 0, 1, 1]
//!         let summed = pg.all_reduce(mine, ReduceOp::Sum).unwrap(); // [1, 1]
//!         (gathered, summed)
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), (vec![0.0, 0.0, 1.0, 1.0], vec![1.0, 1.0]));
//! }
//! ```
//!
//! Failures never hang: ranks that disagree on a call, a rank that leaves, or one that never
//! arrives (timeout) make the call fail on every rank, and abort the group.

mod all_to_all;
mod buffer;
mod collectives;
mod communicator;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod descriptor;
mod element;
mod error;
mod group;
mod link;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod op;
mod p2p;
pub mod profile;
pub mod store;
mod work;

pub use buffer::{RecvBuf, SendBuf};
pub use communicator::Communicator;
pub use element::{CommElement, DType, ReduceOp};
pub use error::{CommError, Result};
pub use group::ProcessGroup;
pub use link::LinkModel;
pub use local::{DEFAULT_TIMEOUT, LocalGroup, LocalGroupOptions};
pub use op::{OpDesc, OpKind};
pub use p2p::{Neighbour, RingLinks, Transfer};
pub use work::Work;
