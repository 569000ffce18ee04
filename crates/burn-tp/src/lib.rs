#![warn(missing_docs)]
//! burn-tp: tensor parallelism (Megatron / nanotron style) for Burn.
//!
//! - [`ops`]: differentiable collectives on `Tensor<D>` (all-gather, reduce-scatter, all-reduce,
//!   copy-to / reduce-from the tensor-parallel region), each with an async form.
//! - [`backend`]: the same collectives as a Burn backend extension ([`backend::TpBackend`]) with
//!   custom `Autodiff` backward nodes.
//!
//! Ranks are [`ProcessGroup`] handles from `burn-tp-comm`; on the CPU every rank is a thread
//! ([`LocalGroup`]), all on the one Flex device. Each rank must build (or fork) its own module in
//! its own thread: autodiff graphs that share a node merge and lock together.

pub mod backend;
#[cfg(feature = "cuda")]
mod cuda;
pub mod dp;
pub mod embedding;
mod error;
pub mod gpt;
pub mod init;
pub mod linear;
pub mod loss;
pub mod ops;
pub mod testing;
pub mod transformer;

/// The communication layer (process groups, the store, NCCL with feature `cuda`).
pub use burn_tp_comm as comm;
pub use burn_tp_comm::{
    CommError, LinkModel, LocalGroup, LocalGroupOptions, ProcessGroup, ReduceOp,
};
pub use error::{Result, TpError};
