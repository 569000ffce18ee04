//! A gated MLP's gate as one op, `act(gate) * up` of `[.., 2 f] = [gate | up]` (SwiGLU's SiLU,
//! or GeGLU's tanh GELU), whose backward keeps only its input (Megatron's fused `bias_swiglu`):
//! composed, the activation's steps and the product each keep an `[.., f]` activation of their
//! own.
//!
//! Half inputs are computed in f32 (the output cast back); f32 and f64 in their own precision.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::config::Config;
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

/// The activation of a gated MLP's gate.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum GluActivation {
    /// `silu(g) * u`: SwiGLU (Llama, Mistral, Qwen, Phi-3; transformers' `silu`).
    Silu,
    /// `gelu_tanh(g) * u`: GeGLU with the tanh approximation of GELU (Gemma; transformers'
    /// `gelu_pytorch_tanh`).
    GeluTanh,
}

/// `sqrt(2 / pi)` and the cubic's coefficient of the tanh GELU.
pub(crate) const GELU_C: f64 = 0.797_884_560_802_865_4;
pub(crate) const GELU_A: f64 = 0.044_715;

/// `act(gate)` and its derivative `act'(gate)` (the latter only with `slope`).
fn activation<B: Backend>(
    gate: FloatTensor<B>,
    act: GluActivation,
    slope: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let one_plus = |t: FloatTensor<B>| B::float_add_scalar(t, Scalar::Float(1.0));
    match act {
        GluActivation::Silu => {
            let sig = B::sigmoid(gate.clone());
            let silu = B::float_mul(gate.clone(), sig.clone());
            // silu'(g) = sig(g) (1 + g (1 - sig(g))).
            let d = slope.then(|| {
                let one_minus = one_plus(B::float_neg(sig.clone()));
                B::float_mul(sig, one_plus(B::float_mul(gate, one_minus)))
            });
            (silu, d)
        }
        GluActivation::GeluTanh => {
            // gelu(g) = g (1 + t) / 2 with t = tanh(c (g + a g^3)).
            let g2 = B::float_mul(gate.clone(), gate.clone());
            let inner = B::float_mul(
                gate.clone(),
                one_plus(B::float_mul_scalar(g2.clone(), Scalar::Float(GELU_A))),
            );
            let t = B::float_tanh(B::float_mul_scalar(inner, Scalar::Float(GELU_C)));
            let half_one_plus_t = B::float_mul_scalar(one_plus(t.clone()), Scalar::Float(0.5));
            let gelu = B::float_mul(gate.clone(), half_one_plus_t.clone());
            // gelu'(g) = (1 + t) / 2 + g (1 - t^2) c (1 + 3 a g^2) / 2.
            let d = slope.then(|| {
                let one_minus_t2 = one_plus(B::float_neg(B::float_mul(t.clone(), t)));
                let dinner = B::float_mul_scalar(
                    one_plus(B::float_mul_scalar(g2, Scalar::Float(3.0 * GELU_A))),
                    Scalar::Float(0.5 * GELU_C),
                );
                B::float_add(
                    half_one_plus_t,
                    B::float_mul(B::float_mul(gate, one_minus_t2), dinner),
                )
            });
            (gelu, d)
        }
    }
}

/// `act(gate) * up` of `y = [gate | up]` (`[.., 2 f] -> [.., f]`), in y's dtype.
pub(crate) fn forward<B: Backend>(y: FloatTensor<B>, act: GluActivation) -> FloatTensor<B> {
    let dtype = y.dtype();
    let (gate, up) = halves::<B>(y);
    let (a, _) = activation::<B>(gate, act, false);
    cast_to::<B>(B::float_mul(a, up), dtype)
}

/// The gradient of `y` (`[.., 2 f]`, `[d_gate | d_up]`) from the upstream `dz` (`[.., f]`).
pub(crate) fn backward<B: Backend>(
    y: FloatTensor<B>,
    dz: FloatTensor<B>,
    act: GluActivation,
) -> FloatTensor<B> {
    let dtype = y.dtype();
    let last = y.shape().num_dims() - 1;
    let (gate, up) = halves::<B>(y);
    let dz = widen::<B>(dz);
    let (a, slope) = activation::<B>(gate, act, true);
    let d_up = B::float_mul(dz.clone(), a);
    let d_gate = B::float_mul(B::float_mul(dz, up), slope.expect("asked for"));
    cast_to::<B>(B::float_cat(vec![d_gate, d_up], last), dtype)
}
