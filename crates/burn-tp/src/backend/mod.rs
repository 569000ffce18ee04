//! The collectives and the parallel linears as a Burn backend extension ([`TpBackend`]), with
//! Megatron adjoints as custom `Autodiff` backward nodes.
//!
//! Two backend ops carry every collective: [`TpBackend::tp_start`] posts it and returns a
//! [`PendingCollective`]; [`TpBackend::tp_resolve`] waits and returns the tensor. The blocking
//! form is start + resolve; the parallel layers put compute in between (`overlap.rs`: the
//! overlapped forward and backward). The default bodies move data through the host (`host.rs`: right for the CPU
//! backends, where a rank is a thread); a device backend overrides them with its own transport
//! (`cuda.rs`, feature `cuda`).
//!
//! | file          | what                                                              |
//! |---------------|-------------------------------------------------------------------|
//! | `mod.rs`      | the `#[backend_extension]` trait and its default bodies           |
//! | `types.rs`    | [`Collective`], [`PendingCollective`], [`CollectiveOutput`], [`LinearSpec`] |
//! | `host.rs`     | the host transport: one dtype switch, dim-first moves, slicing    |
//! | `overlap.rs`  | the parallel-linear math and its overlap schedules (with diagram) |
//! | `flash.rs`    | causal attention by blocks: no `[s, t]` scores (with diagram)     |
//! | `flash_cpu.rs`| its blocks as one CPU kernel on Flex's storage (GEMM calls)       |
//! | `mask.rs`     | which keys a query sees: the one visibility rule of every path    |
//! | `norm.rs`     | layer norm and RMSNorm whose backward keeps only the input        |
//! | `swiglu.rs`   | `silu(gate) * up` whose backward keeps only the input             |
//! | `gemm.rs`     | [`gemm`]: a row-major strided product as a column-major BLAS call |
//! | `flex.rs`     | `TpBackend` for Flex (the defaults)                               |
//! | `autodiff.rs` | `TpBackend` for `Autodiff<B>`: the backward nodes                 |
//! | `cuda.rs`     | `TpBackend` for burn's CUDA backend over NCCL (feature `cuda`)    |
//! | `cublas.rs`   | the GEMM hook ([`TpBackend::tp_matmul`]) on CUDA: cuBLAS          |
//!
//! Adjoints (backward of each forward, per rank):
//!
//! | forward                 | backward                         |
//! |-------------------------|----------------------------------|
//! | all-gather(dim)         | reduce-scatter(dim)              |
//! | reduce-scatter(dim)     | all-gather(dim)                  |
//! | copy-to-tp-region (id)  | all-reduce (sum)                 |
//! | reduce-from-tp-region   | identity                         |
//! | all-reduce(sum / avg)   | all-reduce(sum / avg)            |
//! | all-reduce(max / min)   | all-reduce(sum) x [input == out, lowest tied rank] |
//! | gather-from-region(dim) | split(dim): keep own chunk       |
//! | scatter-to-region(dim)  | all-gather(dim)                  |

mod autodiff;
#[cfg(feature = "cuda")]
mod cublas;
#[cfg(feature = "cuda")]
mod cuda;
pub(crate) mod dropout;
pub(crate) mod flash;
mod flash_cpu;
mod flex;
pub mod gemm;
pub(crate) mod grad_tap;
pub(crate) mod host;
pub(crate) mod mask;
mod norm;
pub(crate) mod overlap;
mod pool;
mod swiglu;
pub(crate) mod types;

// Public for the pool's own test in tests/ and the memory bench (no user needs them).
#[doc(hidden)]
pub use pool::{pool_free_bytes, pool_stats};

use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn_tp_comm::ProcessGroup;

use dropout::DropoutSpec;

pub use mask::{AttentionDropout, AttentionSpec};
pub use norm::NormSpec;
pub use types::Collective;
pub(crate) use types::{LinearSpec, OverlapSchedule, TpMode};
// The types `TpBackend`'s ops cross the dispatch boundary in: public because the trait's
// signatures name them, hidden because users hold `ops::Pending`, an `Option` and a `Result`.
#[doc(hidden)]
pub use grad_tap::GradTap;
#[doc(hidden)]
pub use types::{Bias, CollectiveOutput, PendingCollective};

/// Collectives and parallel linears as backend operations. Implemented for Flex, for burn's
/// CUDA backend (feature `cuda`) and for `Autodiff<B>` (with custom backward nodes); call them
/// through [`crate::ops`] and [`crate::linear`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait TpBackend: Backend {
    /// Posts `op` of `x` on `group` and returns at once.
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingCollective<Self> {
        host::host_start::<Self>(x, op, group)
    }

    /// Waits for a started collective and returns its output.
    fn tp_resolve(#[extension_type] pending: PendingCollective<Self>) -> CollectiveOutput<Self> {
        host::host_resolve::<Self>(pending)
    }

    /// For a started all-gather along dim 0: chunk `chunk` of `chunks` (rows) of rank `part`'s
    /// shard (`[n, ..]`), as soon as it has arrived, without waiting for the rest. Not
    /// differentiable (used inside backward nodes and the overlapped linear ops); the pending
    /// collective is still resolved or dropped after.
    fn tp_resolve_part(
        #[extension_type] pending: PendingCollective<Self>,
        part: usize,
        chunk: usize,
        chunks: usize,
    ) -> CollectiveOutput<Self> {
        host::host_resolve_part::<Self>(pending, part, chunk, chunks)
    }

    /// A row-wise loss with a precomputed gradient: returns `value` (`[n]`); its backward
    /// gives `input` (`[n, c]`) the gradient `jacobian * upstream[:, None]`, computed locally.
    /// Used by [`crate::loss::sharded_cross_entropy`] (softmax minus one-hot, no communication).
    fn tp_rowwise_loss(
        input: FloatTensor<Self>,
        value: FloatTensor<Self>,
        jacobian: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = (input, jacobian);
        value
    }

    /// Identity forward; on `Autodiff`, its backward hands the gradient to `tap` (the overlapped
    /// data-parallel reduction, [`crate::dp::GradReducer`]) and passes it on unchanged.
    fn tp_grad_tap(x: FloatTensor<Self>, tap: GradTap) -> FloatTensor<Self> {
        let _ = tap;
        x
    }

    /// Waits for bucket `bucket` of `tap`'s reducer (`[n]`, the flattened average of its
    /// gradients), started during the backward. `like` (any tensor of the backend that ran the
    /// backward's inner ops) routes the call.
    fn tp_grad_bucket(
        like: FloatTensor<Self>,
        tap: GradTap,
        bucket: usize,
    ) -> CollectiveOutput<Self> {
        let _ = like;
        match tap.shared.take::<Self>(bucket) {
            Ok(pending) => Self::tp_resolve(pending),
            Err(e) => CollectiveOutput::Failed(e),
        }
    }

    /// Causal attention of `q` (`[b, hq, s, hd]`) over `k`, `v` (`[b, hkv, t, hd]`, `hkv`
    /// dividing `hq`) without the `[s, t]` score matrix (`flash.rs`): `[b, hq, s, hd]`. On
    /// `Autodiff` its backward recomputes each block's probabilities from the kept
    /// log-sum-exp.
    fn tp_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> FloatTensor<Self> {
        flash::forward::<Self>(q, k, v, &spec).0
    }

    /// Layer norm or RMSNorm (`spec`) of `x` (`[.., d]`) over the last dim, with `gamma` (and
    /// `beta`, `[d]`): `[.., d]` in x's dtype (`norm.rs`). On `Autodiff` its backward keeps only
    /// `x` and `gamma` and recomputes the row statistics.
    fn tp_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        #[extension_type] beta: Bias<Self>,
        spec: NormSpec,
    ) -> FloatTensor<Self> {
        norm::forward::<Self>(x, gamma, beta.into_option(), &spec)
    }

    /// Dropout of `x` with the logical mask of `spec` (`crate::dropout`): `x` times the scaled
    /// keep mask. On `Autodiff` its backward regenerates the mask (nothing kept).
    fn tp_dropout(x: FloatTensor<Self>, spec: DropoutSpec) -> FloatTensor<Self> {
        dropout::apply_mask::<Self>(x, &spec)
    }

    /// SwiGLU's gate: `silu(gate) * up` of `y = [gate | up]` (`[.., 2 f] -> [.., f]`, in y's
    /// dtype; `swiglu.rs`). On `Autodiff` its backward keeps only `y`.
    fn tp_swiglu(y: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::forward::<Self>(y)
    }

    /// One GEMM of the parallel layers (forward, dgrad, wgrad, each block of the split / ring
    /// schedules) and of the attention's blocks: `a [.., m, k] · b [.., k, n] -> [.., m, n]`.
    /// The default is the backend's own matmul; a backend with a faster GEMM (cuBLAS on CUDA,
    /// issue 36, `gemm.rs` maps the layouts) overrides this one method.
    fn tp_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// `acc + a · b`: a gradient built block by block (BLAS's `beta = 1`, accumulating in
    /// place where the backend can). The default adds the backend's own matmul.
    fn tp_matmul_acc(
        acc: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(acc, Self::float_matmul(a, b))
    }

    /// Column-parallel linear with overlapped communication (see `overlap.rs`):
    /// `x [.., d_in] -> [.., d_out/n]` (ALL_REDUCE) or `x [s/n, .., d_in] -> [s, .., d_out/n]`
    /// (REDUCE_SCATTER). `weight` is `[d_in, d_out/n]`, `bias` `[d_out/n]`.
    fn tp_column_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        overlap::column_forward::<Self>(x, weight, bias.into_option(), spec, &group)
            .map(|(y, _)| y)
            .into()
    }

    /// Row-parallel linear with overlapped communication: `x [.., d_in/n] -> [.., d_out]`
    /// (ALL_REDUCE) or `x [s, .., d_in/n] -> [s/n, .., d_out]` (REDUCE_SCATTER). `weight` is
    /// `[d_in/n, d_out]`, `bias` `[d_out]` (replicated, added once after the reduction).
    fn tp_row_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        overlap::row_forward::<Self>(x, weight, bias.into_option(), spec, &group).into()
    }
}

/// Start + resolve on the inner backend, panicking on failure (for backward nodes, which cannot
/// return errors).
pub(crate) fn collective_blocking<B: TpBackend>(
    x: FloatTensor<B>,
    op: Collective,
    group: &ProcessGroup,
) -> FloatTensor<B> {
    B::tp_resolve(B::tp_start(x, op, group.clone()))
        .into_result()
        .unwrap_or_else(|e| panic!("burn-tp: {op:?} in backward failed: {e}"))
}
