//! SwiGLU's gate as one op, `silu(gate) * up` of `[.., 2 f] = [gate | up]`, whose backward keeps
//! only its input (Megatron's fused `bias_swiglu`): composed, `sigmoid`, `silu` and the product
//! each keep an `[.., f]` activation of their own.
//!
//! Half inputs are computed in f32 (the output cast back); f32 and f64 in their own precision.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn_std::Scalar;

use crate::backend::collective::host::{cast_to, slice_dim, widen};

/// `(gate, up)`: the two halves of the last dim, widened.
fn halves<B: Backend>(y: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = y.shape();
    let last = shape.num_dims() - 1;
    let f = shape[last] / 2;
    let y = widen::<B>(y);
    (
        slice_dim::<B>(y.clone(), last, 0..f),
        slice_dim::<B>(y, last, f..2 * f),
    )
}

/// `silu(gate) * up` of `y = [gate | up]` (`[.., 2 f] -> [.., f]`), in y's dtype.
pub(crate) fn forward<B: Backend>(y: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = y.dtype();
    let (gate, up) = halves::<B>(y);
    let silu = B::float_mul(gate.clone(), B::sigmoid(gate));
    cast_to::<B>(B::float_mul(silu, up), dtype)
}

/// The gradient of `y` (`[.., 2 f]`, `[d_gate | d_up]`) from the upstream `dz` (`[.., f]`).
pub(crate) fn backward<B: Backend>(y: FloatTensor<B>, dz: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = y.dtype();
    let last = y.shape().num_dims() - 1;
    let (gate, up) = halves::<B>(y);
    let dz = widen::<B>(dz);
    let sig = B::sigmoid(gate.clone());
    let silu = B::float_mul(gate.clone(), sig.clone());
    let d_up = B::float_mul(dz.clone(), silu);
    // silu'(g) = sig(g) (1 + g (1 - sig(g))).
    let one_minus = B::float_add_scalar(B::float_neg(sig.clone()), Scalar::Float(1.0));
    let slope = B::float_mul(
        sig,
        B::float_add_scalar(B::float_mul(gate, one_minus), Scalar::Float(1.0)),
    );
    let d_gate = B::float_mul(B::float_mul(dz, up), slope);
    cast_to::<B>(B::float_cat(vec![d_gate, d_up], last), dtype)
}
