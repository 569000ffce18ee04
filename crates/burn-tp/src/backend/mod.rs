//! The collectives and the parallel linears as a Burn backend extension ([`TpBackend`]), with
//! Megatron adjoints as custom `Autodiff` backward nodes.
//!
//! Two backend ops carry every collective: [`TpBackend::tp_start`] posts it and returns a
//! [`PendingCollective`]; [`TpBackend::tp_resolve`] waits and returns the tensor. The blocking
//! form is start + resolve; the parallel layers put compute in between (`matmul/overlap.rs`: the
//! overlapped forward and backward). The default bodies move data through the host (`collective/host.rs`: right for the CPU
//! backends, where a rank is a thread); a device backend overrides them with its own transport
//! (`cuda.rs`, feature `cuda`).
//!
//! | file           | what                                                              |
//! |----------------|-------------------------------------------------------------------|
//! | `mod.rs`       | the `#[backend_extension]` trait and its default bodies           |
//! | `types.rs`     | [`Collective`], [`PendingCollective`], [`CollectiveOutput`], [`LinearSpec`] |
//! | `collective/`  | the host transport (`host.rs`: one dtype switch, dim-first moves, slicing; `pool.rs`: pooled output buffers) |
//! | `matmul/`      | the parallel-linear math and its overlap schedules (`overlap.rs`, with diagram), [`gemm`] (a row-major strided product as a column-major BLAS call), the GEMM hook on CUDA (`cublas.rs`) |
//! | `attention/`   | causal attention by tiles (`flash.rs`, with diagram), its CPU kernel on Flex's storage (`flash_cpu.rs`), which keys a query sees (`mask.rs`), ring attention over context-parallel ranks (`ring.rs`, with diagram) |
//! | `fused/`       | ops whose backward keeps only the input: layer norm and RMSNorm (`norm.rs`), `act(gate) * up`: SwiGLU, GeGLU (`swiglu.rs`), the exact GELU's derivative (`gelu.rs`), dropout (`dropout.rs`); Flex's one-pass gate and GELU (`activation_cpu.rs`), norms (`norm_cpu.rs`) and what they share (`cpu_math.rs`, `flex_rows.rs`) |
//! | `grad_tap.rs`  | the data-parallel gradient tap                                     |
//! | `flex.rs`      | `TpBackend` for Flex: its CPU kernels (attention, gate, GELU, norms; [`set_cpu_kernels`] turns them off) |
//! | `autodiff/`    | `TpBackend` for `Autodiff<B>`: each op's forward, its backward node |
//! | `cuda.rs`      | `TpBackend` for burn's CUDA backend over NCCL (feature `cuda`)    |
//!
//! Adjoints (backward of each forward, per rank):
//!
//! | forward                 | backward                         |
//! |-------------------------|----------------------------------|
//! | all-gather(dim)         | reduce-scatter(dim)              |
//! | all-to-all(send, recv)  | all-to-all(recv, send)           |
//! | reduce-scatter(dim)     | all-gather(dim)                  |
//! | copy-to-tp-region (id)  | all-reduce (sum)                 |
//! | reduce-from-tp-region   | identity                         |
//! | all-reduce(sum / avg)   | all-reduce(sum / avg)            |
//! | all-reduce(max / min)   | all-reduce(sum) x [input == out, lowest tied rank] |
//! | gather-from-region(dim) | split(dim): keep own chunk       |
//! | scatter-to-region(dim)  | all-gather(dim)                  |

pub(crate) mod attention;
mod autodiff;
pub(crate) mod collective;
#[cfg(feature = "cuda")]
mod cuda;
mod flex;
pub(crate) mod fused;
pub(crate) mod grad_tap;
pub(crate) mod matmul;
pub(crate) mod types;

pub use matmul::gemm;

// Public for the pool's own test in tests/ and the memory bench (no user needs them).
#[doc(hidden)]
pub use collective::pool::{pool_free_bytes, pool_stats};

use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn_tp_comm::ProcessGroup;

use fused::dropout::DropoutSpec;

pub use attention::mask::{AttentionDropout, AttentionSpec, MaskPositions};
pub use attention::ring::RingSpec;
// For the benches: each rank's ring attention compute and waits.
#[doc(hidden)]
pub use attention::ring::{RingStats, reset_ring_stats, ring_stats};
pub use collective::all_to_all::AllToAllSpec;
pub use flex::{cpu_kernels, set_cpu_kernels};
pub use fused::norm::NormSpec;
pub use fused::swiglu::GluActivation;
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
        collective::host::host_start::<Self>(x, op, group)
    }

    /// Sends `send_rows[p]` rows of `x` (`[rows, ..]`, consecutive in rank order) to each rank
    /// `p` and returns the `recv_rows[p]` rows each rank sent here, in rank order (blocking).
    /// Backward: the reverse exchange.
    fn tp_all_to_all(
        x: FloatTensor<Self>,
        spec: AllToAllSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        collective::all_to_all::host_all_to_all::<Self>(x, &spec, &group).into()
    }

    /// Waits for a started collective and returns its output.
    fn tp_resolve(#[extension_type] pending: PendingCollective<Self>) -> CollectiveOutput<Self> {
        collective::host::host_resolve::<Self>(pending)
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
        collective::host::host_resolve_part::<Self>(pending, part, chunk, chunks)
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
        Self::tp_attention_kernel(q, k, v, spec).0
    }

    /// The attention kernel's forward: the output `[b, hq, s, hd]` and the log-sum-exps its
    /// backward reads, in the kernel's own layout. The backend's kernel: the tiles on the
    /// backend's tensor ops (`flash.rs`) by default; Flex's own CPU kernel (`flash_cpu/`, picked
    /// in `flex.rs`).
    fn tp_attention_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        attention::flash::forward::<Self>(q, k, v, &spec)
    }

    /// The attention kernel's backward: `(dq, dk, dv)` in the dtypes of q, k and v, from the
    /// upstream gradient `d_out` and what [`tp_attention_kernel`](Self::tp_attention_kernel)
    /// returned; the same kernel's.
    fn tp_attention_kernel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        attention::flash::backward::<Self>(q, k, v, out, lse, d_out, &spec)
    }

    /// Causal attention over a ring of context-parallel ranks (`attention/ring.rs`): `q`
    /// (`[b, hq, s, hd]`), `k`, `v` (`[b, hkv, s, hd]`) this rank's chunks of the sequence
    /// (`spec.chunks`), attending to every rank's keys before them: `[b, hq, s, hd]`. On
    /// `Autodiff` its backward passes the key / value blocks and their gradients around the
    /// ring again.
    fn tp_ring_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: RingSpec,
    ) -> CollectiveOutput<Self> {
        attention::ring::forward::<Self>(q, k, v, &spec)
            .map(|(out, _)| out)
            .into()
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
        fused::norm::forward::<Self>(x, gamma, beta.into_option(), &spec)
    }

    /// Gradients of [`tp_norm`](TpBackend::tp_norm): `(dx, dgamma, dbeta)` in the dtypes of x,
    /// gamma and gamma (`[.., d]`, `[d]`, `[d]`; no dbeta for RMSNorm), from the upstream
    /// gradient `dy` (`[.., d]`), the input and the weight, the row statistics recomputed.
    fn tp_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: NormSpec,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        fused::norm::backward::<Self>(x, gamma, dy, &spec)
    }

    /// Dropout of `x` with the logical mask of `spec` (`crate::dropout`): `x` times the scaled
    /// keep mask. On `Autodiff` its backward regenerates the mask (nothing kept).
    fn tp_dropout(x: FloatTensor<Self>, spec: DropoutSpec) -> FloatTensor<Self> {
        fused::dropout::apply_mask::<Self>(x, &spec)
    }

    /// A gated MLP's gate: `act(gate) * up` of `y = [gate | up]` (`[.., 2 f] -> [.., f]`, in
    /// y's dtype; SwiGLU's SiLU or GeGLU's tanh GELU, `swiglu.rs`). On `Autodiff` its backward
    /// keeps only `y`.
    fn tp_glu(y: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        fused::swiglu::forward::<Self>(y, act)
    }

    /// The gradient of [`tp_glu`](TpBackend::tp_glu)'s input `y` (`[.., 2 f]`: `[d_gate |
    /// d_up]`, in y's dtype) from the upstream `dz` (`[.., f]`): the gate's activation
    /// recomputed from `y`.
    fn tp_glu_backward(
        y: FloatTensor<Self>,
        dz: FloatTensor<Self>,
        act: GluActivation,
    ) -> FloatTensor<Self> {
        fused::swiglu::backward::<Self>(y, dz, act)
    }

    /// The exact GELU, `x Phi(x)` (`Phi` the standard normal CDF; Burn's `gelu`, the GPT's
    /// MLP), in x's dtype. On `Autodiff` its backward keeps only `x`.
    fn tp_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::gelu(x)
    }

    /// The gradient of [`tp_gelu`](TpBackend::tp_gelu)'s input: `dy (Phi(x) + x phi(x))`, the
    /// exact GELU's own derivative (`fused/gelu.rs`).
    fn tp_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        fused::gelu::backward::<Self>(x, dy)
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
        matmul::overlap::column_forward::<Self>(x, weight, bias.into_option(), spec, &group)
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
        matmul::overlap::row_forward::<Self>(x, weight, bias.into_option(), spec, &group).into()
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
