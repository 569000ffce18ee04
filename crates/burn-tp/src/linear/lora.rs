//! Low-rank adapters (LoRA) on the parallel linears: the frozen weight's output plus
//! `scale * (x A) B`, each factor split so that tp n computes what tp 1 does, and the low-rank
//! activation (`r` wide), not the model's width, is what crosses the ranks.
//!
//! ```text
//!  column (weight [d_in, d_out/tp]): A [d_in, r] the same on every rank, B [r, d_out/tp] this
//!  rank's columns (of each fused part: one adapter per part, q / k / v, gate / up)
//!     AR  u = f(x A)              f: identity, all-reduce of [.., r] in the backward, so A's
//!                                 gradient is whole on every rank
//!     SP  u = all_gather(x_s A)   each rank its own tokens: A's gradient summed over tp
//!     y  += scale * u B
//!  row (weight [d_in/tp, d_out]): A [d_in/tp, r] this rank's rows, B [r, d_out] the same on
//!  every rank
//!     AR  v = all_reduce(x_r A)   B's gradient whole on every rank
//!     SP  v = reduce_scatter(x_r A)   each rank its own tokens: B's gradient summed over tp
//!     y  += scale * v B
//! ```
//!
//! The frozen weight's own op skips its weight gradient (its node sees an untracked weight), so
//! a LoRA step does the forward and the input gradient of the base, not its weight gradient,
//! as PEFT's.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::quantization::QuantScheme;
use burn_tp_comm::ProcessGroup;

use super::TpMode;
use super::parts::{PartPlacement, with_replicas};
use crate::ops::{all_gather, copy_to_tp_region, reduce_from_tp_region, reduce_scatter};

/// A [`ColumnParallelLinear`](super::ColumnParallelLinear)'s adapters: one per adapted part.
#[derive(Module, Debug)]
pub struct ColumnLora {
    /// Per adapted part: `A`, `[d_input, r]`, the same on every rank.
    pub a: Vec<Param<Tensor<2>>>,
    /// Per adapted part: `B`, `[r, this rank's columns of the part]`.
    pub b: Vec<Param<Tensor<2>>>,
    /// The part each adapter is on (0 for an unfused layer).
    #[module(skip)]
    pub(crate) parts: Vec<usize>,
    /// `alpha / r`.
    #[module(skip)]
    pub(crate) scale: f64,
}

/// A [`RowParallelLinear`](super::RowParallelLinear)'s adapter.
#[derive(Module, Debug)]
pub struct RowLora {
    /// `A`, `[d_input / tp, r]`: this rank's rows.
    pub a: Param<Tensor<2>>,
    /// `B`, `[r, d_output]`, the same on every rank.
    pub b: Param<Tensor<2>>,
    /// `alpha / r`.
    #[module(skip)]
    pub(crate) scale: f64,
}

impl ColumnLora {
    /// The rank `r` of the adapters.
    pub fn rank(&self) -> usize {
        self.a.first().map_or(0, |a| a.val().dims()[1])
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The parts adapted (0 for an unfused layer), one per adapter.
    pub fn parts(&self) -> &[usize] {
        &self.parts
    }

    /// The adapters' term of the layer's output on `x` (the layer's input), shaped as `like`
    /// (the frozen weight's output, `[.., d_output / tp]`; `[s, ..]` in sequence-parallel mode).
    pub(crate) fn term<const D: usize>(
        &self,
        x: Tensor<D>,
        like: [usize; D],
        mode: TpMode,
        group: &ProcessGroup,
        placement: &[PartPlacement],
        replicas: Option<&ProcessGroup>,
    ) -> crate::Result<Tensor<D>> {
        let a = Tensor::cat(self.a.iter().map(Param::val).collect(), 1);
        let sequence_parallel = mode == TpMode::ReduceScatter && group.world_size() > 1;
        let a = match sequence_parallel {
            true => copy_to_tp_region(a, group),
            false => a,
        };
        let u = rows(x).matmul(a);
        let u = match sequence_parallel {
            true => all_gather(u, 0, group)?,
            false => copy_to_tp_region(u, group),
        };
        // B of every adapter in its rows and its part's columns: one GEMM for them all.
        let local = like[D - 1];
        let r = self.rank();
        let device = u.device();
        let dtype = u.dtype();
        let blocks = self
            .b
            .iter()
            .zip(&self.parts)
            .map(|(b, &p)| {
                let cols = placement[p].local.clone();
                let mut row = Vec::with_capacity(3);
                if cols.start > 0 {
                    row.push(Tensor::zeros([r, cols.start], (&device, dtype)));
                }
                row.push(b.val());
                if cols.end < local {
                    row.push(Tensor::zeros([r, local - cols.end], (&device, dtype)));
                }
                Tensor::cat(row, 1)
            })
            .collect();
        let b = Tensor::cat(blocks, 0);
        let b = match replicas {
            Some(replicas) => with_replicas(b, 1, placement, replicas),
            None => b,
        };
        Ok(u.matmul(b).mul_scalar(self.scale).reshape(like))
    }
}

impl RowLora {
    /// The rank `r` of the adapter.
    pub fn rank(&self) -> usize {
        self.a.val().dims()[1]
    }

    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The adapter's term of the layer's output on `x` (the layer's input, `[.., d_input /
    /// tp]`), shaped as `like` (the reduced output: `[s / tp, ..]` in sequence-parallel mode).
    pub(crate) fn term<const D: usize>(
        &self,
        x: Tensor<D>,
        like: [usize; D],
        mode: TpMode,
        group: &ProcessGroup,
    ) -> crate::Result<Tensor<D>> {
        let v = rows(x).matmul(self.a.val());
        let sequence_parallel = mode == TpMode::ReduceScatter && group.world_size() > 1;
        let (v, b) = match sequence_parallel {
            true => (
                reduce_scatter(v, 0, group)?,
                copy_to_tp_region(self.b.val(), group),
            ),
            false => (reduce_from_tp_region(v, group)?, self.b.val()),
        };
        Ok(v.matmul(b).mul_scalar(self.scale).reshape(like))
    }
}

/// `[.., d] -> [rows, d]`: the leading dimensions flattened in order (dim 0 slowest, so a
/// sequence shard's rows stay contiguous).
fn rows<const D: usize>(x: Tensor<D>) -> Tensor<2> {
    let dims = x.dims();
    let d = dims[D - 1];
    let n = dims[..D - 1].iter().product();
    x.reshape([n, d])
}

/// `t` as a dense float tensor: a QLoRA base held quantized is dequantized for its use (a
/// transient copy; what the model holds stays packed).
pub(crate) fn dense<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    match t.dtype().is_float() {
        true => t,
        false => t.dequantize(),
    }
}

/// A base weight with its adapters merged in: `merged`, frozen (or not) as `base` was.
pub(crate) fn merged_param(base: &Param<Tensor<2>>, merged: Tensor<2>) -> Param<Tensor<2>> {
    let grad = base.val().is_require_grad();
    Param::from_tensor(crate::init::owned(merged)).set_require_grad(grad)
}

/// QLoRA: a frozen base weight held quantized with `scheme` (this rank's shard over its own
/// range), dequantized at each use ([`dense`]).
pub(crate) fn quantized_param(base: Param<Tensor<2>>, scheme: &QuantScheme) -> Param<Tensor<2>> {
    let scheme = *scheme;
    base.map(|t| quantized(t.detach(), &scheme))
        .set_require_grad(false)
}

/// `t` quantized with `scheme` over its own range (a rank's shard: its own scale).
fn quantized<const D: usize>(t: Tensor<D>, scheme: &QuantScheme) -> Tensor<D> {
    use burn::tensor::quantization::{Calibration, compute_q_params, compute_range};
    let range = compute_range(scheme, &t, &Calibration::MinMax);
    t.quantize(scheme, compute_q_params(scheme, range))
}
