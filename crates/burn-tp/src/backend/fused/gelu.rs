//! The exact (erf) GELU's backward on tensor ops, `dy (Phi(x) + x phi(x))`: the default of
//! `TpBackend::tp_gelu_backward` (Burn's own `gelu_backward` differentiates the tanh
//! approximation, not the erf GELU its forward computes). Half inputs computed in f32.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn_std::Scalar;

use crate::backend::collective::host::{cast_to, widen};

/// `dy (Phi(x) + x phi(x))` with `Phi(x) = (1 + erf(x / sqrt 2)) / 2`,
/// `phi(x) = e^(-x^2 / 2) / sqrt(2 pi)`, in x's dtype.
pub(crate) fn backward<B: Backend>(x: FloatTensor<B>, dy: FloatTensor<B>) -> FloatTensor<B> {
    let dtype = x.dtype();
    let (x, dy) = (widen::<B>(x), widen::<B>(dy));
    let scaled = B::float_mul_scalar(x.clone(), Scalar::Float(std::f64::consts::FRAC_1_SQRT_2));
    let cdf = B::float_mul_scalar(
        B::float_add_scalar(B::float_erf(scaled), Scalar::Float(1.0)),
        Scalar::Float(0.5),
    );
    let x2 = B::float_mul(x.clone(), x.clone());
    let pdf = B::float_mul_scalar(
        B::float_exp(B::float_mul_scalar(x2, Scalar::Float(-0.5))),
        Scalar::Float(0.398_942_280_401_432_7),
    );
    let slope = B::float_add(cdf, B::float_mul(x, pdf));
    cast_to::<B>(B::float_mul(dy, slope), dtype)
}
