//! Flex's norm kernels (picked in `backend/flex.rs`): layer norm and RMSNorm over the last dim,
//! forward and backward, each one pass over the rows on the calling rank's rayon pool. A row
//! (`d` values) stays in cache between the kernel's sweeps over it: its statistics, then the
//! output. The tensor ops of [`super::norm`] make a pass over the whole activation per op, about
//! fifteen in the backward.
//!
//! ```text
//!  forward, row i:   mean, rstd = 1 / sqrt(var + eps)      (RMSNorm: mean 0, var = mean(x^2))
//!                    y_j  = (x_j - mean) rstd gamma_j + beta_j
//!  backward, row i:  x^_j = (x_j - mean) rstd,  g_j = dy_j gamma_j
//!                    dx_j = rstd (g_j - x^_j mean(g x^) - mean(g))    (RMSNorm: no mean(g))
//!  every row:        dgamma_j = sum_i dy_ij x^_ij,  dbeta_j = sum_i dy_ij
//!                    (each task sums its rows; the tasks' sums are added in task order)
//! ```
//!
//! f32 in its own precision, half inputs widened to f32 and the outputs cast back (x's dtype for
//! the output and dx, gamma's for dgamma and dbeta); f64 stays on the tensor ops. Row sums run in
//! [`LANES`] partial sums added in a fixed order, so the values do not depend on the vector
//! width or the thread count, and differ from the tensor ops' in the last bits.

use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::cpu_math::simd;
use super::flex_rows::{TASK_ELEMS, f32_contiguous, output, rows_and_width, rows_of};
use super::norm::NormSpec;

/// Partial sums a row sum keeps: one AVX-512 register of f32, two AVX2 ones.
const LANES: usize = 16;

/// `sum_j f(a_j, b_j, c_j)` over three slices of one length, vectorizable: Rust does not
/// reassociate one running float sum (which would keep the loop scalar), so the sum runs in
/// [`LANES`] independent partial sums, added in a fixed order at the end.
#[inline(always)]
fn sum3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (mut ca, mut cb, mut cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    for ((a, b), c) in (&mut ca).zip(&mut cb).zip(&mut cc) {
        for l in 0..LANES {
            acc[l] += f(a[l], b[l], c[l]);
        }
    }
    let mut tail = 0.0f32;
    for ((&a, &b), &c) in ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder())
    {
        tail += f(a, b, c);
    }
    acc.iter().fold(tail, |s, &v| s + v)
}

/// A row's `(mean, 1 / std)`: for RMSNorm the mean is 0 and the std the root mean square.
/// Two sweeps (the mean, then the centered squares) as the tensor ops, not `E[x^2] - mean^2`,
/// which cancels when the mean is large against the spread.
#[inline(always)]
fn stats(x: &[f32], spec: &NormSpec) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = match spec.rms {
        true => 0.0,
        false => sum3(x, x, x, |v, _, _| v) / d,
    };
    let var = sum3(x, x, x, |v, _, _| (v - mean) * (v - mean)) / d;
    (mean, 1.0 / (var + spec.epsilon as f32).sqrt())
}

/// `t`'s values (contiguous f32).
fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>().expect("contiguous f32")
}

/// Panics naming the sizes unless `gamma` (and `beta`) have the `d` values a row has; the
/// layers build them so, this guards the op itself.
fn check_weight(what: &str, len: usize, d: usize) {
    assert_eq!(
        len, d,
        "norm: {what} has {len} values, the input's last dim is {d}"
    );
}

/// The norm of `x` (`[.., d]`) with `gamma` (and `beta`, `[d]`), in x's dtype.
pub(crate) fn forward(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: Option<FlexTensor>,
    spec: &NormSpec,
) -> FlexTensor {
    let (x, dtype) = f32_contiguous(x);
    let (shape, rows, d) = rows_and_width(&x);
    let gamma = f32_contiguous(gamma).0;
    let beta = beta.map(|b| f32_contiguous(b).0);
    let (xs, gs, bs) = (values(&x), values(&gamma), beta.as_ref().map(values));
    check_weight("gamma", gs.len(), d);
    if let Some(bs) = bs {
        check_weight("beta", bs.len(), d);
    }
    let out = rows_of(
        rows,
        d,
        #[inline(always)]
        |i, dst| {
            let x = &xs[i * d..(i + 1) * d];
            let (mean, rstd) = stats(x, spec);
            match bs {
                Some(bs) => {
                    for (((y, &v), &g), &b) in dst.iter_mut().zip(x).zip(gs).zip(bs) {
                        y.write((v - mean) * rstd * g + b);
                    }
                }
                None => {
                    for ((y, &v), &g) in dst.iter_mut().zip(x).zip(gs) {
                        y.write((v - mean) * rstd * g);
                    }
                }
            }
        },
    );
    output(out, shape, dtype)
}

/// Gradients of the norm: `(dx, dgamma, dbeta)` in the dtypes of x, gamma and gamma (no dbeta
/// for RMSNorm), from the upstream gradient `dy` (`[.., d]`), the input and the weight.
pub(crate) fn backward(
    x: FlexTensor,
    gamma: FlexTensor,
    dy: FlexTensor,
    spec: &NormSpec,
) -> (FlexTensor, FlexTensor, Option<FlexTensor>) {
    let (x, x_dtype) = f32_contiguous(x);
    let (gamma, g_dtype) = f32_contiguous(gamma);
    let dy = f32_contiguous(dy).0;
    let (shape, rows, d) = rows_and_width(&x);
    let (xs, gs, dys) = (values(&x), values(&gamma), values(&dy));
    check_weight("gamma", gs.len(), d);
    assert_eq!(
        dys.len(),
        xs.len(),
        "norm backward: the gradient has {} values, the input {}",
        dys.len(),
        xs.len()
    );
    let rows_per_task = TASK_ELEMS.div_ceil(d.max(1)).max(1);
    let task = (rows_per_task * d).max(1);
    let mut dx: Vec<f32> = Vec::with_capacity(rows * d);
    // Each task's column sums `[dgamma | dbeta]` over its rows, collected in task order.
    let sums: Vec<Vec<f32>> = dx.spare_capacity_mut()[..rows * d]
        .par_chunks_mut(task)
        .enumerate()
        .map(|(t, dst)| {
            simd(
                #[inline(always)]
                || {
                    let mut sums = vec![0.0f32; 2 * d];
                    let (dg, db) = sums.split_at_mut(d);
                    for (r, dst) in dst.chunks_mut(d).enumerate() {
                        let i = t * rows_per_task + r;
                        let (x, dy) = (&xs[i * d..(i + 1) * d], &dys[i * d..(i + 1) * d]);
                        let (mean, rstd) = stats(x, spec);
                        let inv_d = 1.0 / d as f32;
                        let mean_g = match spec.rms {
                            true => 0.0,
                            false => sum3(dy, gs, gs, |dy, g, _| dy * g) * inv_d,
                        };
                        let mean_gx =
                            sum3(x, dy, gs, |v, dy, g| dy * g * ((v - mean) * rstd)) * inv_d;
                        for (((((o, &v), &dy), &g), dg), db) in dst
                            .iter_mut()
                            .zip(x)
                            .zip(dy)
                            .zip(gs)
                            .zip(dg.iter_mut())
                            .zip(db.iter_mut())
                        {
                            let x_hat = (v - mean) * rstd;
                            o.write((dy * g - x_hat * mean_gx - mean_g) * rstd);
                            *dg += dy * x_hat;
                            *db += dy;
                        }
                    }
                    sums
                },
            )
        })
        .collect();
    // Safety: the tasks' chunks cover `0..rows * d` and each writes every element of its own.
    unsafe { dx.set_len(rows * d) };
    let mut total = vec![0.0f32; 2 * d];
    for sums in &sums {
        for (t, &s) in total.iter_mut().zip(sums) {
            *t += s;
        }
    }
    let d_beta = total.split_off(d);
    (
        output(dx, shape, x_dtype),
        output(total, vec![d], g_dtype),
        (!spec.rms).then(|| output(d_beta, vec![d], g_dtype)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fused::flex_rows::testing::{f64s, flex, values as test_values};
    use crate::backend::fused::norm;
    use burn::backend::Flex;
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::{DType, FloatDType};

    fn widen(t: FlexTensor) -> FlexTensor {
        Flex::float_cast(t, FloatDType::F64)
    }

    fn close(what: &str, got: Vec<f64>, want: Vec<f64>, tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    /// The kernels against the tensor ops ([`norm`], in f64 from the same rounded inputs): both
    /// norms, with and without beta, f32 and bf16, over odd shapes (one value, widths not a
    /// multiple of the lanes, more rows than a task, a wide row), values shifted far off zero
    /// (the mean's cancellation); a bf16 input with f32 weights; a transposed input.
    #[test]
    fn the_kernels_give_the_tensor_ops_values_and_gradients() {
        for rms in [false, true] {
            let spec = NormSpec { rms, epsilon: 1e-5 };
            for (rows, d) in [(1, 1), (3, 5), (7, 17), (2, 64), (300, 70), (40, 1030)] {
                for shift in [0.0f32, 100.0] {
                    let x: Vec<f32> = test_values(rows * d, 1)
                        .into_iter()
                        .map(|v| v + shift)
                        .collect();
                    let dy = test_values(rows * d, 2);
                    let gamma = test_values(d, 3);
                    let beta = test_values(d, 4);
                    for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 2e-2)] {
                        // Off zero the values' own rounding (at 100: 4e-6 in f32, against a
                        // spread of ~4.6) passes into x - mean.
                        let tol = tol * (1.0 + shift as f64 / 10.0);
                        let t = |v: &Vec<f32>, shape: Vec<usize>| flex(v.clone(), shape, dtype);
                        let (xt, dyt) = (t(&x, vec![rows, d]), t(&dy, vec![rows, d]));
                        let (gt, bt) = (t(&gamma, vec![d]), t(&beta, vec![d]));
                        let with_beta = (!rms).then_some(bt.clone());
                        let want_y = f64s(norm::forward::<Flex>(
                            widen(xt.clone()),
                            widen(gt.clone()),
                            with_beta.clone().map(widen),
                            &spec,
                        ));
                        let (want_dx, want_dg, want_db) = norm::backward::<Flex>(
                            widen(xt.clone()),
                            widen(gt.clone()),
                            widen(dyt.clone()),
                            &spec,
                        );
                        let what = format!("rms {rms} {dtype:?} [{rows}, {d}] + {shift}");
                        let y = forward(xt.clone(), gt.clone(), with_beta, &spec);
                        assert_eq!(
                            (y.dtype(), y.layout().shape().to_vec()),
                            (dtype, vec![rows, d])
                        );
                        close(&format!("{what} y"), f64s(y), want_y, tol);
                        let (dx, dg, db) = backward(xt.clone(), gt.clone(), dyt, &spec);
                        assert_eq!(dx.dtype(), dtype);
                        close(&format!("{what} dx"), f64s(dx), f64s(want_dx), tol);
                        // Sums over the rows: the error grows with them.
                        let sum_tol = tol * rows as f64;
                        close(&format!("{what} dgamma"), f64s(dg), f64s(want_dg), sum_tol);
                        match (db, want_db) {
                            (Some(db), Some(want)) => {
                                close(&format!("{what} dbeta"), f64s(db), f64s(want), sum_tol)
                            }
                            (None, None) => assert!(rms),
                            (db, want) => panic!("{what}: dbeta {db:?} vs {want:?}"),
                        }
                        // Without beta: the same output less beta.
                        if !rms {
                            let no_beta = f64s(forward(xt, gt.clone(), None, &spec));
                            let want = f64s(norm::forward::<Flex>(
                                widen(t(&x, vec![rows, d])),
                                widen(gt),
                                None,
                                &spec,
                            ));
                            close(&format!("{what} y without beta"), no_beta, want, tol);
                        }
                    }
                }
            }
        }
        // Mixed dtypes: a bf16 input with f32 weights keeps each its dtype.
        let spec = NormSpec {
            rms: false,
            epsilon: 1e-5,
        };
        let x = flex(test_values(6 * 8, 5), vec![6, 8], DType::BF16);
        let gamma = flex(test_values(8, 6), vec![8], DType::F32);
        let dy = flex(test_values(6 * 8, 7), vec![6, 8], DType::BF16);
        let (dx, dg, db) = backward(x.clone(), gamma.clone(), dy, &spec);
        assert_eq!(
            (dx.dtype(), dg.dtype(), db.map(|t| t.dtype())),
            (DType::BF16, DType::F32, Some(DType::F32))
        );
        assert_eq!(forward(x, gamma, None, &spec).dtype(), DType::BF16);
        // A transposed input: read through a contiguous copy.
        let t = flex(test_values(6 * 4, 8), vec![4, 6], DType::F32).transpose(0, 1);
        let gamma = flex(test_values(4, 9), vec![4], DType::F32);
        let want = f64s(norm::forward::<Flex>(
            widen(t.to_contiguous()),
            widen(gamma.clone()),
            None,
            &spec,
        ));
        close(
            "transposed",
            f64s(forward(t, gamma, None, &spec)),
            want,
            2e-5,
        );
    }

    /// The gradients the kernel gives at every thread count are the same bits: the tasks' sums
    /// are added in task order, not as they finish.
    #[test]
    fn the_backward_does_not_depend_on_the_thread_count() {
        let spec = NormSpec {
            rms: false,
            epsilon: 1e-5,
        };
        let (rows, d) = (1000, 300);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let x = flex(test_values(rows * d, 1), vec![rows, d], DType::F32);
                let gamma = flex(test_values(d, 2), vec![d], DType::F32);
                let dy = flex(test_values(rows * d, 3), vec![rows, d], DType::F32);
                let (dx, dg, db) = backward(x, gamma, dy, &spec);
                (f64s(dx), f64s(dg), f64s(db.unwrap()))
            })
        };
        assert_eq!(run(1), run(3));
    }
}
