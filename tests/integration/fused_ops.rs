//! The ops whose backward keeps only their input. The norms (`TpLayerNorm`, `TpRmsNorm`) against
//! Burn's own `layer_norm` and `RmsNorm` (composed tracked ops) and against plain f64 loops:
//! values and the gradients of x, gamma and beta in f64, f32 and bf16; a finite-difference
//! gradcheck in f64; REDUCE_SCATTER mode at tp 2 (each rank its sequence shard, the weight's
//! gradient summed over the group). SwiGLU's gate (`ParallelSwiGlu`) against `silu(gate) * up`
//! composed, and a gradcheck.

use burn::module::Param;
use burn::nn::RmsNormConfig;
use burn::tensor::{DType, Tensor};
use burn_tp::comm::ProcessGroup;
use burn_tp::linear::TpMode;
use burn_tp::local::run_local;
use burn_tp::norm::TpLayerNorm;
use burn_tp::norm::TpRmsNorm;
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};

use crate::common::{assert_close, f64s, rng_lock, tensor, uniform};

const SHAPE: [usize; 3] = [4, 3, 16];

/// Layer norm (or RMSNorm) of each row of `x` (`rows x d`) in f64 loops.
fn loops(x: &[f64], gamma: &[f64], beta: &[f64], d: usize, rms: bool, eps: f64) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|r| {
            let mean = if rms {
                0.0
            } else {
                r.iter().sum::<f64>() / d as f64
            };
            let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            r.iter()
                .enumerate()
                .map(move |(j, v)| (v - mean) * rstd * gamma[j] + beta[j])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// x, gamma, beta and an upstream weight `w` (the loss is `sum(norm(x) * w)`), in `dtype`.
fn inputs(seed: u64, dtype: DType) -> (Tensor<3>, Tensor<1>, Tensor<1>, Tensor<3>) {
    let n: usize = SHAPE.iter().product();
    let d = SHAPE[2];
    // Rows with an offset and a spread, so centering matters; but for bf16 (too coarse for
    // it), row 0 quiet: a variance near epsilon (1e-5), so the values and the gradients depend
    // on epsilon's place in rstd, forward and backward, in f32 too.
    let x: Vec<f32> = uniform(n, seed)
        .iter()
        .enumerate()
        .map(|(i, v)| match i / d {
            0 if dtype != DType::BF16 => 0.5 + 4e-3 * v,
            row => 3.0 * v + row as f32 * 0.5,
        })
        .collect();
    let gamma: Vec<f32> = uniform(d, seed + 1).iter().map(|v| 1.0 + v).collect();
    (
        tensor(x, SHAPE, dtype),
        tensor(gamma, [d], dtype),
        tensor(uniform(d, seed + 2), [d], dtype),
        tensor(uniform(n, seed + 3), SHAPE, dtype),
    )
}

/// Values and the gradients of x, gamma and beta of `f` at one set of inputs.
fn value_and_grads(
    x: Tensor<3>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    w: Tensor<3>,
    f: impl Fn(Tensor<3>, Tensor<1>, Tensor<1>) -> Tensor<3>,
) -> [Vec<f64>; 4] {
    let (x, gamma, beta) = (x.require_grad(), gamma.require_grad(), beta.require_grad());
    let y = f(x.clone(), gamma.clone(), beta.clone());
    let grads = (y.clone() * w).sum().backward();
    [
        f64s(y),
        f64s(x.grad(&grads).unwrap()),
        f64s(gamma.grad(&grads).unwrap()),
        f64s(
            beta.grad(&grads)
                .unwrap_or_else(|| gamma.zeros_like().inner()),
        ),
    ]
}

type NormFn = Box<dyn Fn(Tensor<3>, Tensor<1>, Tensor<1>) -> Tensor<3>>;

fn layer_norm(
    group: &ProcessGroup,
    mode: TpMode,
) -> impl Fn(Tensor<3>, Tensor<1>, Tensor<1>) -> Tensor<3> + use<> {
    let group = group.clone();
    move |x, gamma, beta| {
        let mut n = TpLayerNorm::new(SHAPE[2], mode, &group, &x.device());
        n.gamma = Param::from_tensor(gamma);
        n.beta = Param::from_tensor(beta);
        n.forward(x)
    }
}

fn rms_norm(
    group: &ProcessGroup,
    mode: TpMode,
) -> impl Fn(Tensor<3>, Tensor<1>, Tensor<1>) -> Tensor<3> + use<> {
    let group = group.clone();
    move |x, gamma, _beta| {
        let mut n = TpRmsNorm::new(SHAPE[2], 1e-5, mode, &group, &x.device());
        n.gamma = Param::from_tensor(gamma);
        n.forward(x)
    }
}

#[test]
fn fused_norms_match_burns_norms_and_f64_loops() {
    let _rng = rng_lock();
    run_local(1, |g| {
        for (dtype, rtol) in [(DType::F64, 1e-12), (DType::F32, 2e-5), (DType::BF16, 3e-2)] {
            let (x, gamma, beta, w) = inputs(7, dtype);
            let d = SHAPE[2];
            // Layer norm: Burn's composed ops (the reference autodiff) against the fused op.
            let ours = value_and_grads(
                x.clone(),
                gamma.clone(),
                beta.clone(),
                w.clone(),
                layer_norm(&g, TpMode::AllReduce),
            );
            let burns = value_and_grads(
                x.clone(),
                gamma.clone(),
                beta.clone(),
                w.clone(),
                |x, gm, b| burn::tensor::module::layer_norm(x, gm, Some(b), 1e-5),
            );
            for (i, what) in ["y", "dx", "dgamma", "dbeta"].iter().enumerate() {
                assert_close(
                    &ours[i],
                    &burns[i],
                    rtol,
                    &format!("layer norm {dtype:?} {what}"),
                );
            }
            let expect = loops(
                &f64s(x.clone()),
                &f64s(gamma.clone()),
                &f64s(beta.clone()),
                d,
                false,
                1e-5,
            );
            assert_close(
                &ours[0],
                &expect,
                rtol,
                &format!("layer norm {dtype:?} vs loops"),
            );

            // RMSNorm: Burn's `RmsNorm` module against the fused op.
            let ours = value_and_grads(
                x.clone(),
                gamma.clone(),
                beta.clone(),
                w.clone(),
                rms_norm(&g, TpMode::AllReduce),
            );
            let burns = value_and_grads(x.clone(), gamma.clone(), beta.clone(), w, |x, gm, _| {
                let mut n = RmsNormConfig::new(d).with_epsilon(1e-5).init(&x.device());
                n.gamma = Param::from_tensor(gm);
                n.forward(x)
            });
            // Burn's RmsNorm takes the mean square in f32, also for f64 inputs.
            for (i, what) in ["y", "dx", "dgamma"].iter().enumerate() {
                assert_close(
                    &ours[i],
                    &burns[i],
                    rtol.max(1e-6),
                    &format!("rms norm {dtype:?} {what}"),
                );
            }
            let zeros = vec![0.0; d];
            let expect = loops(&f64s(x), &f64s(gamma), &zeros, d, true, 1e-5);
            assert_close(
                &ours[0],
                &expect,
                rtol,
                &format!("rms norm {dtype:?} vs loops"),
            );
        }
    })
    .unwrap();
}

/// Central differences in f64 through x, gamma and beta at once (packed in one tensor).
#[test]
fn fused_norms_pass_a_finite_difference_gradcheck() {
    let _rng = rng_lock();
    let reports = run_local(1, |g| {
        let (x, gamma, beta, w) = inputs(11, DType::F64);
        let n: usize = SHAPE.iter().product();
        [false, true].map(|rms| {
            let f: NormFn = if rms {
                Box::new(rms_norm(&g, TpMode::AllReduce))
            } else {
                Box::new(layer_norm(&g, TpMode::AllReduce))
            };
            let inputs = [x.clone().reshape([n]), gamma.clone(), beta.clone()];
            gradcheck(
                &g,
                &inputs,
                LossKind::Replicated,
                GradcheckOptions::default(),
                |p| (f(p[0].clone().reshape(SHAPE), p[1].clone(), p[2].clone()) * w.clone()).sum(),
            )
        })
    })
    .unwrap()
    .remove(0);
    for report in reports {
        let report = report.unwrap();
        assert!(report.checked > 0, "{report:?}");
    }
}

/// REDUCE_SCATTER mode at tp 2: each rank normalizes its sequence shard; the output and x's
/// gradient are that shard's, and the weights' gradients the sum over both shards (the same on
/// both ranks), as the unsharded norm's.
#[test]
fn fused_norms_in_sequence_parallel_mode_match_the_unsharded_norm() {
    let _rng = rng_lock();
    let (x, gamma, beta, w) = inputs(13, DType::F32);
    let full = value_and_grads(
        x.clone(),
        gamma.clone(),
        beta.clone(),
        w.clone(),
        |x, gm, b| burn::tensor::module::layer_norm(x, gm, Some(b), 1e-5),
    );
    let [xs, gs, bs, ws] = [f64s(x), f64s(gamma), f64s(beta), f64s(w)];
    let shard = SHAPE[0] / 2;
    let per_row = SHAPE[1] * SHAPE[2];
    let per_rank = run_local(2, move |g| {
        let from = |v: &[f64]| {
            let n = v.len();
            tensor(v.iter().map(|&x| x as f32).collect(), [n], DType::F32)
        };
        let rows = |v: &[f64]| {
            let at = g.rank() * shard * per_row;
            from(&v[at..at + shard * per_row]).reshape([shard, SHAPE[1], SHAPE[2]])
        };
        value_and_grads(
            rows(&xs),
            from(&gs),
            from(&bs),
            rows(&ws),
            layer_norm(&g, TpMode::ReduceScatter),
        )
    })
    .unwrap();
    for (rank, ours) in per_rank.iter().enumerate() {
        let mine = rank * shard * per_row..(rank + 1) * shard * per_row;
        assert_close(
            &ours[0],
            &full[0][mine.clone()],
            2e-5,
            &format!("rank {rank} y"),
        );
        assert_close(&ours[1], &full[1][mine], 2e-5, &format!("rank {rank} dx"));
        assert_close(
            &ours[2],
            &full[2],
            2e-5,
            &format!("rank {rank} dgamma (summed)"),
        );
        assert_close(
            &ours[3],
            &full[3],
            2e-5,
            &format!("rank {rank} dbeta (summed)"),
        );
    }
}

/// `ParallelSwiGlu` at tp 1 and 2 (its gate and up columns sharded) against Burn's linears with
/// `silu(gate) * up` (SwiGLU) or `gelu_approximate(gate) * up` (Gemma's GeGLU) composed, values
/// and the gradients of the input and the three weights, in f64, f32 and bf16.
#[test]
fn fused_swiglu_matches_the_composed_ops() {
    use burn::tensor::activation::{gelu_approximate, silu};
    use burn_tp::llama::{GluActivation, ParallelSwiGluConfig};
    use burn_tp::reshard::Reshard;
    let _rng = rng_lock();
    let cases = [(DType::F64, 1e-12), (DType::F32, 2e-5), (DType::BF16, 3e-2)]
        .into_iter()
        .flat_map(|c| [GluActivation::Silu, GluActivation::GeluTanh].map(|a| (c, a)));
    for ((dtype, rtol), act) in cases {
        for tp in [1, 2] {
            let out = run_local(tp, move |g| {
                let mlp = ParallelSwiGluConfig::new(8, 12)
                    .with_activation(act)
                    .init(&g, &crate::common::device())
                    .unwrap();
                let mlp = burn_tp::precision::cast_params(mlp, dtype.into());
                let x = tensor(uniform(3 * 2 * 8, 31), [3, 2, 8], dtype).require_grad();
                let w = tensor(uniform(3 * 2 * 8, 32), [3, 2, 8], dtype);
                let y = mlp.forward(x.clone());
                let grads = (y.clone() * w.clone()).sum().backward();
                let full_grads = crate::common::full_grads(&mlp, &grads);
                let full = mlp.to_full_module().unwrap();
                // The same weights, composed ops.
                let gate_up = full.gate_up.weight.val().detach().require_grad();
                let down = full.down.weight.val().detach().require_grad();
                let xr = x.clone().detach().require_grad();
                let h = xr.clone().matmul(gate_up.clone().unsqueeze());
                let (gate, up) = (h.clone().narrow(2, 0, 12), h.narrow(2, 12, 12));
                let gate = match act {
                    GluActivation::Silu => silu(gate),
                    GluActivation::GeluTanh => gelu_approximate(gate),
                };
                let yr = (gate * up).matmul(down.clone().unsqueeze());
                let rgrads = (yr.clone() * w).sum().backward();
                (
                    [
                        f64s(y),
                        f64s(x.grad(&grads).unwrap()),
                        f64s(full_grads.gate_up.weight.val()),
                        f64s(full_grads.down.weight.val()),
                    ],
                    [
                        f64s(yr),
                        f64s(xr.grad(&rgrads).unwrap()),
                        f64s(gate_up.grad(&rgrads).unwrap()),
                        f64s(down.grad(&rgrads).unwrap()),
                    ],
                )
            })
            .unwrap();
            for (rank, (ours, reference)) in out.iter().enumerate() {
                for (i, what) in ["y", "dx", "d gate_up", "d down"].iter().enumerate() {
                    assert_close(
                        &ours[i],
                        &reference[i],
                        rtol,
                        &format!("{act:?} {dtype:?} tp {tp} rank {rank} {what}"),
                    );
                }
            }
        }
    }
}

/// The GPT's GELU (`ops::gelu`, the exact erf GELU with its exact derivative): its values are
/// Burn's `gelu`'s in f64, f32 and bf16, its f64 gradient passes a finite-difference gradcheck
/// (Burn's own backward differentiates the tanh approximation: off by up to ~1e-3), and the f32
/// and bf16 gradients (Flex's one-pass kernel; f64 runs the tensor ops) are the f64 one's.
#[test]
fn the_gelu_is_burns_forward_with_the_exact_derivative() {
    use burn::tensor::activation::gelu;
    let _rng = rng_lock();
    let n = 3 * 5 * 7;
    let x = move || uniform(n, 41).iter().map(|v| v * 8.0).collect::<Vec<f32>>();
    let w = move || uniform(n, 42);
    let report = run_local(1, move |g| {
        let inputs = [tensor(x(), [n], DType::F64)];
        let wt = tensor(w(), [n], DType::F64);
        gradcheck(
            &g,
            &inputs,
            LossKind::Replicated,
            GradcheckOptions::default(),
            |p| (burn_tp::ops::gelu(p[0].clone()) * wt.clone()).sum(),
        )
    })
    .unwrap()
    .remove(0)
    .unwrap();
    assert!(report.checked > 0, "{report:?}");
    let grad = |dtype: DType| {
        let xt = tensor(x(), [3, 5, 7], dtype).require_grad();
        let y = burn_tp::ops::gelu(xt.clone());
        let burn_y = gelu(xt.clone().detach());
        let g = (y.clone() * tensor(w(), [3, 5, 7], dtype)).sum().backward();
        (f64s(y), f64s(burn_y), f64s(xt.grad(&g).unwrap()))
    };
    let (_, _, want) = grad(DType::F64);
    for (dtype, rtol) in [(DType::F64, 1e-12), (DType::F32, 2e-5), (DType::BF16, 3e-2)] {
        let (y, burn_y, dx) = grad(dtype);
        assert_close(&y, &burn_y, rtol, &format!("{dtype:?}: values"));
        assert_close(&dx, &want, rtol.max(1e-5), &format!("{dtype:?}: gradient"));
    }
}
