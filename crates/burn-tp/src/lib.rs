#![warn(missing_docs)]
//! burn-tp: tensor parallelism (Megatron / nanotron style) for Burn.
//!
//! Dependencies run one way: `burn-tp-comm` (transport) -> [`backend`] -> [`ops`] -> layers
//! ([`linear`], [`embedding`], [`loss`], [`transformer`]) -> models ([`gpt`]).
//!
//! - [`backend`]: the collectives and the parallel linears as a Burn backend extension
//!   ([`backend::TpBackend`]) with custom `Autodiff` backward nodes; `backend/overlap.rs` is the
//!   seed's algorithm (communication overlapped with compute), with a diagram of the shards.
//! - [`ops`]: differentiable collectives on `Tensor<D>` (all-gather, reduce-scatter, all-reduce,
//!   copy-to / reduce-from the tensor-parallel region), each with an async form.
//! - [`linear`]: [`ColumnParallelLinear`](linear::ColumnParallelLinear) and
//!   [`RowParallelLinear`](linear::RowParallelLinear) in ALL_REDUCE and REDUCE_SCATTER (sequence
//!   parallel) mode, and their functional forms.
//! - [`embedding`]: the vocabulary-parallel embedding; [`loss`]: the sharded cross-entropy.
//! - [`transformer`]: parallel attention, MLP, and a replicated layer norm; [`gpt`]: a tiny GPT.
//! - [`reshard`]: moving a module between tp sizes; [`dp`]: data-parallel gradient averaging.
//! - `init`: initialisation identical at every tp (internal); [`local`]: the runner of ranks as threads;
//!   [`testing`]: a gradient checker by finite differences.
//!
//! Ranks are [`ProcessGroup`] handles from `burn-tp-comm`; on the CPU every rank is a thread
//! ([`LocalGroup`]), all on the one Flex device. Each rank must build (or fork) its own module in
//! its own thread: autodiff graphs that share a node merge and lock together.

pub mod backend;
pub mod dp;
pub mod embedding;
mod error;
pub mod gpt;
pub(crate) mod init;
pub mod linear;
pub mod local;
pub mod loss;
pub mod ops;
pub mod reshard;
pub mod testing;
pub mod transformer;

/// The communication layer (process groups, the store, NCCL with feature `cuda`).
pub use burn_tp_comm as comm;
pub use burn_tp_comm::{
    CommError, LinkModel, LocalGroup, LocalGroupOptions, ProcessGroup, ReduceOp,
};
pub use error::{Result, TpError};
