#![warn(missing_docs)]
//! burn-tp: tensor parallelism (Megatron / nanotron style) for Burn.
//!
//! Dependencies run one way, each floor using only those below it (`.ci/imports.py` checks it
//! in CI: no import circle, no module importing one above its floor):
//!
//! | floor | modules |
//! |---|---|
//! | transport | `burn-tp-comm` ([`comm`]): process groups, no autodiff, no Burn |
//! | base | `error` ([`TpError`]), [`rng`] (SplitMix64: dropout's hash, sampling's draws), [`local`] (the runner of ranks as threads), [`alloc`] (a global allocator keeping freed large blocks) |
//! | backend | [`backend`]: the collectives and the parallel linears as a Burn backend extension ([`backend::TpBackend`]) with custom `Autodiff` backward nodes; `backend/matmul/overlap.rs` is the overlapped forward and backward of the parallel linears, with a diagram of the shards (beside it the GEMM hook, `gemm.rs`, `cublas.rs`); `backend/collective/` the host transport; `backend/attention/` the attention kernels (`flash.rs`, `flash_cpu/`, the visibility rule `mask.rs`, ring attention over a context-parallel group `ring.rs`); `backend/fused/` the norms, SwiGLU gate and dropout (the masks) as ops whose backward keeps only what Megatron keeps; `backend/autodiff/` the backward nodes |
//! | ops | [`ops`]: differentiable collectives on `Tensor<D>`, each with an async form |
//! | shards | [`init`] (initialisation identical at every tp and on every dp replica), [`reshard`] (between tp sizes) |
//! | layers | [`linear`] (column / row parallel, both modes, and their functional forms), [`embedding`] (vocabulary-parallel, and the lm-head), [`loss`] (sharded cross-entropy), [`dropout`] (tp-invariant masks), [`norm`] (layer norm, RMSNorm, replicated weights), [`attention`] (both models' attention, by blocks without the `[s, s]` scores, with the KV cache), [`transformer`] (the MLPs: the GPT's, the gated one), [`moe`] (mixtures of experts, expert parallelism: the router, the all-to-all dispatch, the experts), [`context`] (context parallelism: each rank's chunks of a sequence, ring attention) |
//! | models | [`gpt`] (a tiny GPT), [`llama`] (GQA, RoPE, RMSNorm, SwiGLU or mixtures of experts, padded vocabulary), [`gemma`] (Gemma 2 / 3: sandwich norms, GeGLU, sliding and full layers, soft caps), [`model`]: [`LanguageModel`](model::LanguageModel), the one implementation of the forward, the loss, decoding and pipeline stages every family shares (a family implements its parts), with [`decoder`] (a block as the decode loop sees it, the blocks a stage holds) |
//! | use | [`generate`] (sampling with the KV cache), [`checkpoint`] (sharded, at any tp x dp), [`hf`] (Hugging Face import / export of the Llama and Gemma families), [`dp`] (data parallelism, the distributed optimizer), [`fsdp`] (fully sharded data parallelism: parameters, gradients and optimizer state split over dp, gathered part by part), [`mesh`] (the tp x dp grid), [`precision`] (bf16 / f16 copies), [`recompute`] (full activation recompute: one tensor kept per block), [`pipeline`] (stages, GPipe / 1F1B / interleaved), `train` (feature `train`: Burn's Learner at tp x dp), [`testing`] (a gradient checker by finite differences), [`lora`] (LoRA fine-tuning at tp: the adapters on the parallel linears, the base frozen; PEFT's folders in [`hf`]) |
//!
//! Ranks are [`comm::ProcessGroup`] handles; on the CPU every rank is a thread
//! ([`comm::LocalGroup`]), all on the one Flex device. Each rank must build (or fork) its own module in
//! its own thread: autodiff graphs that share a node merge and lock together.
//!
//! # Usage
//!
//! The layers compose like Burn's own: `forward` returns the tensor (and panics with the
//! [`TpError`] message on misuse), `try_forward` returns the [`Result`].
//!
//! ```
//! use burn::module::Module;
//! use burn::tensor::{Device, Tensor, activation::gelu};
//! use burn_tp::linear::{
//!     ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
//!     TpMode, TpSettings,
//! };
//! use burn_tp::local::run_local;
//! use burn_tp::comm::ProcessGroup;
//!
//! /// A Megatron MLP, written like any Burn module.
//! #[derive(Module, Debug)]
//! struct Mlp {
//!     fc1: ColumnParallelLinear,
//!     fc2: RowParallelLinear,
//! }
//!
//! impl Mlp {
//!     fn new(d: usize, group: &ProcessGroup, device: &Device) -> burn_tp::Result<Self> {
//!         // Sequence parallel, communication overlapped: one settings value for the model.
//!         let settings = TpSettings::new().with_mode(TpMode::ReduceScatter);
//!         Ok(Self {
//!             fc1: ColumnParallelLinearConfig::new(d, 4 * d).with_settings(settings).init(group, device)?,
//!             fc2: RowParallelLinearConfig::new(4 * d, d).with_settings(settings).init(group, device)?,
//!         })
//!     }
//!
//!     /// `[seq / tp, batch, d] -> [seq / tp, batch, d]`
//!     fn forward(&self, x: Tensor<3>) -> Tensor<3> {
//!         self.fc2.forward(gelu(self.fc1.forward(x)))
//!     }
//! }
//!
//! let device = Device::flex().autodiff();
//! device.seed(0); // before the rank threads start: the same model at every tp, on every replica
//! let losses = run_local(2, move |group| -> burn_tp::Result<f32> {
//!     // Each rank builds its own shards in its own thread (tp = 2).
//!     let mlp = Mlp::new(64, &group, &device)?;
//!     let x = Tensor::<3>::ones([8, 4, 64], &device); // this rank's sequence shard
//!     let loss = mlp.forward(x).powi_scalar(2).mean();
//!     let value = loss.clone().into_scalar();
//!     let _grads = loss.backward(); // overlapped, Megatron-exact gradients
//!     Ok(value)
//! })
//! .expect("no rank panicked");
//! assert!(losses.iter().all(|l| l.as_ref().is_ok_and(|v| v.is_finite())));
//! ```

// `#[derive(Reshard)]` names `::burn_tp`, inside this crate too.
extern crate self as burn_tp;

pub mod alloc;
pub mod attention;
pub mod backend;
pub mod checkpoint;
pub mod context;
pub mod decoder;
pub mod dp;
pub mod dropout;
pub mod embedding;
mod error;
pub mod fsdp;
pub mod gemma;
pub mod generate;
pub mod gpt;
pub mod hf;
pub mod init;
pub mod linear;
pub mod llama;
pub mod local;
pub mod lora;
pub mod loss;
pub mod mesh;
pub mod model;
pub mod moe;
pub mod norm;
pub mod ops;
pub mod pipeline;
pub mod precision;
pub mod recompute;
pub mod reshard;
pub mod rng;
pub mod testing;
#[cfg(feature = "train")]
pub mod train;
pub mod transformer;

/// README and the guide's pages (`docs/guide/`), their Rust code blocks compiled (and run, but
/// `no_run` ones) as doc tests, so the docs a user reads stay code that builds (the Learner's
/// page in `burn-tp-examples`, with feature `train`).
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../../../README.md")]
    pub struct Readme;
    #[doc = include_str!("../../../docs/guide/main-job.md")]
    pub struct MainJob;
    #[doc = include_str!("../../../docs/guide/own-model.md")]
    pub struct OwnModel;
    #[doc = include_str!("../../../docs/guide/data-parallel.md")]
    pub struct DataParallel;
    #[doc = include_str!("../../../docs/guide/fsdp.md")]
    pub struct Fsdp;
    #[doc = include_str!("../../../docs/guide/pipeline.md")]
    pub struct Pipeline;
    #[doc = include_str!("../../../docs/guide/context.md")]
    pub struct Context;
    #[doc = include_str!("../../../docs/guide/experts.md")]
    pub struct Experts;
    #[doc = include_str!("../../../docs/guide/long-sequences.md")]
    pub struct LongSequences;
    #[doc = include_str!("../../../docs/guide/checkpoints.md")]
    pub struct Checkpoints;
    #[doc = include_str!("../../../docs/guide/hugging-face.md")]
    pub struct HuggingFace;
    #[doc = include_str!("../../../docs/guide/lora.md")]
    pub struct Lora;
    #[doc = include_str!("../../../docs/guide/mpi-gpu.md")]
    pub struct MpiGpu;
}

/// The communication layer, the one path to its types: process groups ([`comm::ProcessGroup`],
/// [`comm::LocalGroup`]), the rendezvous store, MPI with feature `mpi`, NCCL with feature `cuda`.
pub use burn_tp_comm as comm;
pub use error::{Result, TpError};
