//! Flex's activation kernels (picked in `backend/flex.rs`), each one pass over Flex's storage on
//! the calling rank's rayon pool instead of a chain of tensor ops (each a read and a write of an
//! activation):
//! - the gated MLP's gate, `act(gate) * up` of `y = [gate | up]`, and its backward
//!   ([`super::swiglu`]'s tensor ops: the halves' strided views, the sigmoid, the products; four
//!   passes forward, ten backward);
//! - the exact (erf) GELU of the GPT's MLP and its exact derivative (Burn's own: a pass per op,
//!   libm's scalar `erff`, and a backward that differentiates the tanh approximation instead).
//!
//! f32 in its own precision; half inputs widened to f32 and the output cast back (as
//! [`super::swiglu`]); f64 stays on the tensor ops. The exponential is [`exp`] (vectorized, ~1e-7
//! relative) and the normal CDF a rational `erfc` (~1.2e-7 relative), so values differ from the
//! tensor ops' in the last bits.
//!
//! ```text
//!  y row:  [ g_0 .. g_{f-1} | u_0 .. u_{f-1} ]      forward:  z_j = act(g_j) u_j
//!  dy row: [ dz_j u_j act'(g_j) | dz_j act(g_j) ]   backward, from dz [.., f]
//! ```

use burn_flex::FlexTensor;

use super::cpu_math::exp;
use super::flex_rows::{TASK_ELEMS, f32_contiguous, output, par_fill, rows_and_width, rows_of};
use super::swiglu::{GELU_A, GELU_C, GluActivation};

/// `(act(g), act'(g))`. The tanh GELU through the sigmoid: with `z = c (g + a g^3)`,
/// `(1 + tanh z) / 2 = sig(2 z)` and `1 - tanh^2 z = 4 sig(2 z) (1 - sig(2 z))`, which keeps the
/// tails exact where `1 - t^2` would cancel.
#[inline(always)]
fn act_and_slope(g: f32, act: GluActivation) -> (f32, f32) {
    match act {
        GluActivation::Silu => {
            let sig = sigmoid(g);
            (g * sig, sig * (1.0 + g * (1.0 - sig)))
        }
        GluActivation::GeluTanh => {
            let (c, a) = (GELU_C as f32, GELU_A as f32);
            let s = sigmoid(2.0 * c * g * (1.0 + a * g * g));
            (
                g * s,
                s + 2.0 * g * s * (1.0 - s) * c * (1.0 + 3.0 * a * g * g),
            )
        }
    }
}

#[inline(always)]
fn act_only(g: f32, act: GluActivation) -> f32 {
    match act {
        GluActivation::Silu => g * sigmoid(g),
        GluActivation::GeluTanh => {
            let (c, a) = (GELU_C as f32, GELU_A as f32);
            g * sigmoid(2.0 * c * g * (1.0 + a * g * g))
        }
    }
}

/// `1 / (1 + e^-x)` through [`exp`] (which saturates, so no infinity).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `act(gate) * up` of `y = [gate | up]` (`[.., 2 f] -> [.., f]`), in y's dtype.
pub(crate) fn glu_forward(y: FlexTensor, act: GluActivation) -> FlexTensor {
    let (y, dtype) = f32_contiguous(y);
    let (mut shape, rows, two_f) = rows_and_width(&y);
    let f = two_f / 2;
    let data = y.as_slice::<f32>().expect("contiguous f32");
    let out = rows_of(
        rows,
        f,
        #[inline(always)]
        |i, dst| {
            let (g, u) = data[i * two_f..(i + 1) * two_f].split_at(f);
            for ((z, &g), &u) in dst.iter_mut().zip(g).zip(u) {
                z.write(act_only(g, act) * u);
            }
        },
    );
    *shape.last_mut().expect("checked") = f;
    output(out, shape, dtype)
}

/// The gradient of `y` (`[.., 2 f]`: `[d_gate | d_up]`) from the upstream `dz` (`[.., f]`), in
/// y's dtype.
pub(crate) fn glu_backward(y: FlexTensor, dz: FlexTensor, act: GluActivation) -> FlexTensor {
    let (y, dtype) = f32_contiguous(y);
    let (dz, _) = f32_contiguous(dz);
    let (shape, rows, two_f) = rows_and_width(&y);
    let f = two_f / 2;
    let (data, dz) = (
        y.as_slice::<f32>().expect("contiguous f32"),
        dz.as_slice::<f32>().expect("contiguous f32"),
    );
    let out = rows_of(
        rows,
        two_f,
        #[inline(always)]
        |i, dst| {
            let (g, u) = data[i * two_f..(i + 1) * two_f].split_at(f);
            let dz = &dz[i * f..(i + 1) * f];
            let (d_gate, d_up) = dst.split_at_mut(f);
            for j in 0..f {
                let (a, slope) = act_and_slope(g[j], act);
                d_gate[j].write(dz[j] * u[j] * slope);
                d_up[j].write(dz[j] * a);
            }
        },
    );
    output(out, shape, dtype)
}

/// The standard normal CDF `Phi(x) = erfc(-x / sqrt 2) / 2`, with Numerical Recipes' `erfcc`
/// (a Chebyshev fit, fractional error below 1.2e-7 everywhere): accurate in both tails, where
/// `(1 + erf) / 2` would cancel.
// The published coefficients, as written (f32 rounds them).
#[allow(clippy::excessive_precision)]
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    // Horner steps as FMAs: half the dependent chain (measured on an AVX2 Zen 3 core: the
    // exact GELU 2.4 -> 1.5 ns a value), one rounding instead of two.
    let p = 0.170_872_77f32;
    let p = p.mul_add(t, -0.822_152_23);
    let p = p.mul_add(t, 1.488_515_87);
    let p = p.mul_add(t, -1.135_203_98);
    let p = p.mul_add(t, 0.278_868_07);
    let p = p.mul_add(t, -0.186_288_06);
    let p = p.mul_add(t, 0.096_784_18);
    let p = p.mul_add(t, 0.374_091_96);
    let p = p.mul_add(t, 1.000_023_68);
    let p = p.mul_add(t, -1.265_512_23);
    // erfc(z) for z = |x| / sqrt 2: the lower tail's CDF, or one minus it.
    let half_erfc = 0.5 * t * exp(p - z * z);
    if x >= 0.0 { 1.0 - half_erfc } else { half_erfc }
}

/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `x Phi(x)` elementwise (the exact GELU), in x's dtype.
pub(crate) fn gelu_forward(x: FlexTensor) -> FlexTensor {
    let (x, dtype) = f32_contiguous(x);
    let shape = x.layout().shape().to_vec();
    let data = x.as_slice::<f32>().expect("contiguous f32");
    let out = par_fill(
        data.len(),
        TASK_ELEMS,
        #[inline(always)]
        |start, dst| {
            for (y, &x) in dst.iter_mut().zip(&data[start..]) {
                y.write(x * normal_cdf(x));
            }
        },
    );
    output(out, shape, dtype)
}

/// The gradient of the exact GELU's input `x` from the upstream `dy`: `dy (Phi(x) + x phi(x))`,
/// in x's dtype.
pub(crate) fn gelu_backward(x: FlexTensor, dy: FlexTensor) -> FlexTensor {
    let (x, dtype) = f32_contiguous(x);
    let (dy, _) = f32_contiguous(dy);
    let shape = x.layout().shape().to_vec();
    let (data, dy) = (
        x.as_slice::<f32>().expect("contiguous f32"),
        dy.as_slice::<f32>().expect("contiguous f32"),
    );
    let out = par_fill(
        data.len(),
        TASK_ELEMS,
        #[inline(always)]
        |start, dst| {
            for ((g, &x), &d) in dst.iter_mut().zip(&data[start..]).zip(&dy[start..]) {
                let pdf = INV_SQRT_2PI * exp(-0.5 * x * x);
                g.write(d * (normal_cdf(x) + x * pdf));
            }
        },
    );
    output(out, shape, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fused::flex_rows::testing::{f64s, flex, values};
    use crate::backend::fused::swiglu;
    use burn::backend::Flex;
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::{DType, FloatDType};

    /// The kernel against the tensor ops ([`swiglu`], f64 for the reference) over odd shapes
    /// (one row, widths not a multiple of the vector, more rows than a task), both activations,
    /// f32 and bf16, forward and backward; and a transposed (non-contiguous) input.
    #[test]
    fn the_kernel_gives_the_tensor_ops_values_and_gradients() {
        for act in [GluActivation::Silu, GluActivation::GeluTanh] {
            for (rows, f) in [(1, 1), (3, 5), (7, 17), (2, 64), (300, 70)] {
                let y = values(rows * 2 * f, 1);
                let dz = values(rows * f, 2);
                let reference = |dtype: DType| {
                    let y64 = flex(y.clone(), vec![rows, 2 * f], dtype);
                    let y64 = Flex::float_cast(y64, FloatDType::F64);
                    let dz64 =
                        Flex::float_cast(flex(dz.clone(), vec![rows, f], dtype), FloatDType::F64);
                    (
                        f64s(swiglu::forward::<Flex>(y64.clone(), act)),
                        f64s(swiglu::backward::<Flex>(y64, dz64, act)),
                    )
                };
                for (dtype, tol) in [(DType::F32, 2e-6), (DType::BF16, 1e-2)] {
                    let (want_z, want_dy) = reference(dtype);
                    let yt = flex(y.clone(), vec![rows, 2 * f], dtype);
                    let z = glu_forward(yt.clone(), act);
                    assert_eq!(z.dtype(), dtype);
                    assert_eq!(z.layout().shape().to_vec(), vec![rows, f]);
                    let dy = glu_backward(yt, flex(dz.clone(), vec![rows, f], dtype), act);
                    assert_eq!(dy.layout().shape().to_vec(), vec![rows, 2 * f]);
                    for (what, got, want) in [("z", f64s(z), want_z), ("dy", f64s(dy), want_dy)] {
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (g - w).abs() <= tol * (1.0 + w.abs()),
                                "{act:?} {dtype:?} [{rows}, {f}] {what}[{i}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        // The GELU against the f64 reference (Burn's erf GELU; the exact derivative on tensor
        // ops), over lengths around a task's.
        for n in [1, 7, TASK_ELEMS - 1, TASK_ELEMS + 3] {
            let x = values(n, 5);
            let dy = values(n, 6);
            for (dtype, tol) in [(DType::F32, 2e-6), (DType::BF16, 1e-2)] {
                let xt = flex(x.clone(), vec![n], dtype);
                let x64 = Flex::float_cast(xt.clone(), FloatDType::F64);
                let dy64 = Flex::float_cast(flex(dy.clone(), vec![n], dtype), FloatDType::F64);
                use burn::backend::ops::ActivationOps;
                let want_y = f64s(<Flex as ActivationOps<Flex>>::gelu(x64.clone()));
                let want_dx = f64s(super::super::gelu::backward::<Flex>(x64, dy64));
                let y = gelu_forward(xt.clone());
                assert_eq!(y.dtype(), dtype);
                let dx = gelu_backward(xt, flex(dy.clone(), vec![n], dtype));
                for (what, got, want) in [("y", f64s(y), want_y), ("dx", f64s(dx), want_dx)] {
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= tol * (1.0 + w.abs()),
                            "GELU {dtype:?} [{n}] {what}[{i}]: {g} vs {w}"
                        );
                    }
                }
            }
        }
        // A transposed input: read through a contiguous copy.
        let y = values(6 * 4, 3);
        let t = flex(y, vec![4, 6], DType::F32).transpose(0, 1);
        let contiguous = t.to_contiguous();
        let want = f64s(swiglu::forward::<Flex>(contiguous, GluActivation::Silu));
        let got = f64s(glu_forward(t, GluActivation::Silu));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 2e-6 * (1.0 + w.abs()), "{g} vs {w}");
        }
    }
}
