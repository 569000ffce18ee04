//! Layer norm and RMSNorm over the last dim as one op each, whose backward keeps only the input
//! and the weight (Megatron's fused norms): the row statistics are recomputed in the backward,
//! a pass over the input, instead of keeping the centered, normalized and scaled copies that the
//! composed ops (mean, sub, mul, div, ...) each save, up to three activations per norm.
//!
//! Half inputs are computed in f32 (the output cast back); f32 and f64 in their own precision.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::Shape;
use burn_std::Scalar;

use crate::backend::collective::host::{cast_to, widen};

/// Which normalization, and its epsilon.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    /// RMSNorm (`x / rms(x) * gamma`) if true; else layer norm
    /// (`(x - mean) / std * gamma + beta`, the biased variance).
    pub rms: bool,
    /// Added to the variance (mean square) before the square root.
    pub epsilon: f64,
}

/// `[d]` as `[1, .., 1, d]` of rank `rank`.
fn row<B: Backend>(x: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
    let d = x.shape()[0];
    let mut dims = vec![1; rank];
    dims[rank - 1] = d;
    B::float_reshape(x, Shape::from(dims))
}

/// The widened input and its normalization `x_hat` (zero mean and unit variance for the layer
/// norm, unit mean square for RMSNorm), with `1 / std` per row (`[.., 1]`).
fn normalized<B: Backend>(x: FloatTensor<B>, spec: &NormSpec) -> (FloatTensor<B>, FloatTensor<B>) {
    let last = x.shape().num_dims() - 1;
    let xf = widen::<B>(x);
    let centered = if spec.rms {
        xf
    } else {
        let mean = B::float_mean_dim(xf.clone(), last);
        B::float_sub(xf, mean)
    };
    let var = B::float_mean_dim(B::float_mul(centered.clone(), centered.clone()), last);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(
        var,
        Scalar::Float(spec.epsilon),
    )));
    (B::float_mul(centered, rstd.clone()), rstd)
}

/// The norm of `x` (`[.., d]`) with `gamma` (and `beta`, `[d]`), in x's dtype.
pub(crate) fn forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    spec: &NormSpec,
) -> FloatTensor<B> {
    let dtype = x.dtype();
    if !spec.rms && gamma.dtype() == dtype && beta.as_ref().is_none_or(|b| b.dtype() == dtype) {
        // The backend's own (Flex: one fused pass, halves through f32).
        return B::layer_norm(x, gamma, beta, spec.epsilon);
    }
    let rank = x.shape().num_dims();
    let (x_hat, _) = normalized::<B>(x, spec);
    let y = B::float_mul(x_hat, row::<B>(widen::<B>(gamma), rank));
    let y = match beta {
        Some(b) => B::float_add(y, row::<B>(widen::<B>(b), rank)),
        None => y,
    };
    cast_to::<B>(y, dtype)
}

/// Gradients of the norm: `(dx, dgamma, dbeta)` in the dtypes of x, gamma and gamma (no dbeta
/// for RMSNorm), from the
/// upstream gradient `dy` (`[.., d]`), the input and the weight.
pub(crate) fn backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    dy: FloatTensor<B>,
    spec: &NormSpec,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let (x_dtype, g_dtype) = (x.dtype(), gamma.dtype());
    let shape = x.shape();
    let rank = shape.num_dims();
    let last = rank - 1;
    let d = shape[last];
    let rows = shape.num_elements() / d.max(1);
    let (x_hat, rstd) = normalized::<B>(x, spec);
    let dy = widen::<B>(dy);
    // Sums over every row: `[.., d] -> [d]`.
    let over_rows = |t: FloatTensor<B>| {
        let t = B::float_reshape(t, Shape::from(vec![rows, d]));
        B::float_reshape(B::float_sum_dim(t, 0), Shape::from(vec![d]))
    };
    // RMSNorm has no beta: no pass over dy for it.
    let d_beta = (!spec.rms).then(|| over_rows(dy.clone()));
    let d_gamma = over_rows(B::float_mul(dy.clone(), x_hat.clone()));
    let g = B::float_mul(dy, row::<B>(widen::<B>(gamma), rank));
    // dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)); RMSNorm has no mean(g) term.
    let proj = B::float_mean_dim(B::float_mul(g.clone(), x_hat.clone()), last);
    let mut inner = B::float_sub(g.clone(), B::float_mul(x_hat, proj));
    if !spec.rms {
        inner = B::float_sub(inner, B::float_mean_dim(g, last));
    }
    let dx = B::float_mul(inner, rstd);
    (
        cast_to::<B>(dx, x_dtype),
        cast_to::<B>(d_gamma, g_dtype),
        d_beta.map(|d| cast_to::<B>(d, g_dtype)),
    )
}
