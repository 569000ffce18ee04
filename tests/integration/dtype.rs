//! Every dtype end to end, and the masked loss: the sharded cross-entropy (f32 compute for half logits), the
//! vocab-parallel embedding, the whole GPT in bf16 / f16 against f32, and `train_gpt --dtype bf16`
//! against f32 over 100 steps. The parallel linears' own dtype grid is in `linear_checks.rs`.
//!
//! Tolerances (relative): bf16 1e-2 per value where one rounding separates the results (8 bits of
//! mantissa: 2^-8 = 3.9e-3 per rounding), f16 2e-3 (11 bits), f64 1e-12; through a whole model,
//! norms of differences (bf16 5e-2 of the gradient's norm, f16 1e-2).

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Gradients, Int, Tensor, TensorData};
use burn_tp::embedding::VocabParallelEmbeddingConfig;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::loss::sharded_cross_entropy;
use burn_tp::precision::cast_params;
use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;

use crate::common::{assert_close, device, f64s, rel_norm, rng_lock, tensor, uniform};

fn ids<const D: usize>(values: Vec<i64>, shape: [usize; D]) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(values, shape), &device())
}

/// The gradient of every parameter of `module`, in its visiting order, with its dtype.
fn param_grads<M: Module>(module: &M, grads: &Gradients) -> Vec<(DType, Vec<f64>)> {
    struct Collect<'a>(&'a Gradients, Vec<(DType, Vec<f64>)>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = param
                .val()
                .grad(self.0)
                .expect("every parameter has a gradient");
            self.1.push((grad.dtype(), f64s(grad)));
        }
    }
    let mut collect = Collect(grads, Vec::new());
    module.visit(&mut collect);
    collect.1
}

/// Half-precision logits: the loss and the gradient come back in the logits' dtype and equal the
/// f32 computation on the same (rounded) logits up to one rounding; f64 stays f64 throughout.
#[test]
fn sharded_cross_entropy_keeps_the_dtype_and_computes_in_f32() {
    let (n, v) = (6usize, 16usize);
    let vals: Vec<f32> = uniform(n * v, 21).iter().map(|x| x * 6.0).collect();
    let targets = vec![0i64, 15, 5, 6, 3, 9];
    for (dtype, rtol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3), (DType::F64, 1e-12)] {
        // Reference: Burn's cross-entropy in f32 (f64 for f64) on the logits rounded to dtype.
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let rounded = tensor(vals.clone(), [n, v], dtype)
            .cast(wide)
            .require_grad();
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&device())
            .forward(rounded.clone(), ids(targets.clone(), [n]));
        let grads = loss.backward();
        let (want_loss, want_grad) = (f64s(loss), rounded.grad(&grads).unwrap());
        for tp in [1usize, 2, 4] {
            let (vals, targets) = (vals.clone(), targets.clone());
            let out = run_local(tp, move |g| {
                let full = tensor(vals.clone(), [n, v], dtype);
                let shard = full
                    .chunk(g.world_size(), 1)
                    .swap_remove(g.rank())
                    .require_grad();
                let loss =
                    sharded_cross_entropy(shard.clone(), ids(targets.clone(), [n]), &g, 0.0, 0.0)
                        .unwrap();
                let grads = loss.backward();
                let grad = shard.grad(&grads).unwrap();
                (loss.dtype(), grad.dtype(), f64s(loss), f64s(grad))
            })
            .unwrap();
            for (r, (loss_dtype, grad_dtype, loss, grad)) in out.into_iter().enumerate() {
                let tag = format!("{dtype:?} tp {tp} rank {r}");
                assert_eq!((loss_dtype, grad_dtype), (dtype, dtype), "{tag}");
                assert_close(&loss, &want_loss, rtol, &format!("loss {tag}"));
                let want = want_grad.clone().chunk(tp, 1).swap_remove(r);
                assert_close(&grad, &f64s(want), rtol, &format!("grad {tag}"));
            }
        }
    }
}

/// The embedding keeps its table's dtype: output and gradient in bf16 / f16 / f64, equal to the
/// f32 lookup of the same rounded table (a lookup and a sum with zeros are exact).
#[test]
fn vocab_parallel_embedding_keeps_the_dtype() {
    let _rng = rng_lock();
    let (v, d, s, b) = (8usize, 4usize, 4usize, 2usize);
    // Ids 1, 2, 4 twice, 0 and 3 once, 5..7 never: the table's gradient is 3 x the count.
    let id_vals: Vec<i64> = (0..8).map(|i| (i * 3 + 1) % 5).collect();
    let count = |id: usize| id_vals.iter().filter(|&&x| x as usize == id).count() as f64;
    let want_dw: Vec<f64> = (0..v)
        .flat_map(|id| std::iter::repeat_n(3.0 * count(id), d))
        .collect();
    for dtype in [DType::BF16, DType::F16, DType::F64] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            device().seed(3);
            let iv = id_vals.clone();
            let out = run_local(2, move |g| {
                let layer = VocabParallelEmbeddingConfig::new(v, d)
                    .with_settings(TpSettings::new().with_mode(mode))
                    .init(&g, &device())
                    .unwrap();
                let reference = layer.forward(ids(iv.clone(), [s, b]));
                let layer = cast_params(layer, FloatDType::from(dtype));
                let y = layer.forward(ids(iv.clone(), [s, b]));
                let grads = (y.clone() * 3.0).sum().backward();
                let dw = layer.weight.val().grad(&grads).unwrap();
                (
                    y.dtype(),
                    dw.dtype(),
                    f64s(y),
                    f64s(reference.cast(dtype)),
                    f64s(dw),
                )
            })
            .unwrap();
            for (r, (y_dtype, dw_dtype, y, want, dw)) in out.into_iter().enumerate() {
                let tag = format!("{dtype:?} {mode:?} rank {r}");
                assert_eq!((y_dtype, dw_dtype), (dtype, dtype), "{tag}");
                assert_eq!(y, want, "{tag}");
                // This rank's rows of the table (ids r * v/2 ..), exact in every dtype.
                let rows = r * (v / 2) * d..(r + 1) * (v / 2) * d;
                assert_eq!(dw, want_dw[rows], "{tag}: the table's gradient");
            }
        }
    }
}

/// Logits and mean loss of a model on a fixed batch (`[8, 2]` ids below 15).
type Run<M> = fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> (Tensor<3>, Tensor<1>);

/// A model cast to bf16 / f16 (both modes, tp 1 and 2): logits, loss and every gradient stay in
/// that dtype, and agree with the f32 model (loss relative 2e-2 / 5e-3; gradients in norm
/// 5e-2 / 1e-2 of the f32 gradient's norm, parameter by parameter).
fn runs_in_half_precision_close_to_f32<M: Module + 'static>(
    build: fn(TpMode, &burn_tp::ProcessGroup) -> M,
    run: Run<M>,
) {
    let _rng = rng_lock();
    for (dtype, loss_tol, grad_tol) in [(DType::BF16, 2e-2, 5e-2), (DType::F16, 5e-3, 1e-2)] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for tp in [1usize, 2] {
                device().seed(11);
                let out = run_local(tp, move |g| {
                    let model = build(mode, &g);
                    let x: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 15).collect();
                    let y: Vec<i64> = (0..16).map(|i| (i * 5 + 1) % 15).collect();
                    let grads_of = |m: &M| {
                        let (logits, loss) = run(m, ids(x.clone(), [8, 2]), ids(y.clone(), [8, 2]));
                        let grads = loss.backward();
                        let mut per_param = Vec::new();
                        let mut dtypes = vec![logits.dtype(), loss.dtype()];
                        for (dtype, grad) in param_grads(m, &grads) {
                            dtypes.push(dtype);
                            per_param.push(grad);
                        }
                        (f64s(loss)[0], per_param, dtypes)
                    };
                    let (want_loss, want_grads, _) = grads_of(&model);
                    let half = cast_params(model, FloatDType::from(dtype));
                    let (loss, grads, dtypes) = grads_of(&half);
                    (want_loss, want_grads, loss, grads, dtypes)
                })
                .unwrap();
                for (r, (want_loss, want_grads, loss, grads, dtypes)) in out.into_iter().enumerate()
                {
                    let tag = format!("{dtype:?} {mode:?} tp {tp} rank {r}");
                    assert!(dtypes.iter().all(|&d| d == dtype), "{tag}: {dtypes:?}");
                    assert!(
                        (loss - want_loss).abs() <= loss_tol * want_loss,
                        "{tag}: loss {loss} vs f32 {want_loss}"
                    );
                    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                        let err = rel_norm(g, w);
                        assert!(err <= grad_tol, "{tag}: parameter {i}: {err:.3e}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_gpt_runs_in_bf16_and_f16_close_to_f32() {
    runs_in_half_precision_close_to_f32(
        |mode, g| {
            GptConfig::new(16, 8, 16, 4, 2)
                .with_settings(TpSettings::new().with_mode(mode))
                .init(g, &device())
                .unwrap()
        },
        |m: &burn_tp::gpt::Gpt, x, y| (m.forward(x.clone()), m.loss(x, y)),
    );
}

/// The Llama (GQA with 2 key / value heads, RoPE, RMSNorm, SwiGLU, a padded vocabulary of 15):
/// the rotary table stays f32 and the rotation comes back in the activations' dtype.
#[test]
fn the_llama_runs_in_bf16_and_f16_close_to_f32() {
    runs_in_half_precision_close_to_f32(
        |mode, g| {
            burn_tp::llama::LlamaConfig::new(15, 8, 16, 4, 2, 2, 16)
                .with_settings(TpSettings::new().with_mode(mode))
                .init(g, &device())
                .unwrap()
        },
        |m: &burn_tp::llama::Llama, x, y| (m.forward(x.clone()), m.loss(x, y)),
    );
}

/// `train_gpt --dtype bf16` (bf16 forward and backward on f32 master weights) follows the f32 run:
/// over 100 steps at tp = 2 (the loss falls by more than 0.8 nats) the two curves stay within
/// 0.06 nats of each other at every step and end within 0.04. Measured: at most 0.021 apart; the
/// bf16 loss itself is a bf16 value (steps of 2^-7 near 1.5).
#[test]
fn train_gpt_in_bf16_follows_the_f32_curve() {
    let _rng = rng_lock();
    let out = std::env::temp_dir().join(format!("burn-tp-test-{}-bf16", std::process::id()));
    let args = |dtype: &str| {
        Args::try_parse_from([
            "train_gpt",
            "--quiet",
            "--tp",
            "2",
            "--steps",
            "100",
            "--batch",
            "4",
            "--seq",
            "16",
            "--d-model",
            "32",
            "--heads",
            "4",
            "--layers",
            "2",
            "--lr",
            "1e-2",
            "--eval-every",
            "100",
            "--sample-len",
            "0",
            "--dtype",
            dtype,
            "--out",
            out.to_str().unwrap(),
        ])
        .unwrap()
    };
    let f32_run = run(&args("f32")).unwrap().losses;
    let bf16_run = run(&args("bf16")).unwrap().losses;
    assert_eq!((f32_run.len(), bf16_run.len()), (100, 100));
    assert!(
        f32_run[99] < f32_run[0] - 0.8,
        "the model learns: {f32_run:?}"
    );
    // f64::max would drop a NaN: every step must be finite first.
    assert!(
        bf16_run.iter().all(|v| v.is_finite()),
        "a bf16 loss is not finite: {bf16_run:?}"
    );
    let worst = f32_run
        .iter()
        .zip(&bf16_run)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst < 0.06,
        "worst step differs by {worst}: {f32_run:?} vs {bf16_run:?}"
    );
    assert!(
        (f32_run[99] - bf16_run[99]).abs() < 0.04,
        "{f32_run:?} vs {bf16_run:?}"
    );
    assert_ne!(f32_run, bf16_run, "the bf16 run computes in bf16");
}

/// A padded vocabulary (5 real ids in 8 columns; at tp = 4 rank 2 holds one real id and rank 3
/// none), an ignore index and a loss mask: the mean equals Burn's `CrossEntropyLoss` on the real
/// columns of the kept rows (with and without smoothing), the per-token losses equal its
/// per-row values, and the padded columns and dropped rows get no gradient.
#[test]
fn sharded_cross_entropy_masks_padding_ignored_targets_and_masked_tokens() {
    use burn_tp::loss::{CrossEntropyOptions, sharded_cross_entropy_with};
    let (n, v, v_pad) = (6usize, 5usize, 8usize);
    // Padded columns hold large logits: a loss that let them in would be far off.
    let vals: Vec<f32> = uniform(n * v_pad, 31)
        .iter()
        .enumerate()
        .map(|(i, x)| if i % v_pad >= v { 50.0 } else { x * 4.0 })
        .collect();
    let targets = vec![0i64, 4, -100, 2, 3, 1];
    let mask = vec![1.0f32, 1.0, 1.0, 0.0, 1.0, 1.0]; // row 3 masked, row 2 ignored
    let kept = [0usize, 1, 4, 5];
    for smoothing in [0.0, 0.1] {
        let real = tensor(vals.clone(), [n, v_pad], DType::F32).slice([0..n, 0..v]);
        let kept_idx = ids(kept.iter().map(|&k| k as i64).collect(), [kept.len()]);
        let rows = real.select(0, kept_idx).detach().require_grad();
        let kept_targets = ids(kept.iter().map(|&k| targets[k]).collect(), [kept.len()]);
        let ce = burn::nn::loss::CrossEntropyLossConfig::new()
            .with_smoothing((smoothing > 0.0).then_some(smoothing as f32));
        let want = ce
            .init(&device())
            .forward(rows.clone(), kept_targets.clone());
        let want_grad = f64s(rows.grad(&want.backward()).unwrap());
        // Per row: the same loss of each kept row alone.
        let want_rows: Vec<f64> = (0..kept.len())
            .map(|i| {
                let one = ids(vec![i as i64], [1]);
                let row = rows.clone().detach().select(0, one.clone());
                f64s(
                    ce.init(&device())
                        .forward(row, kept_targets.clone().select(0, one)),
                )[0]
            })
            .collect();
        for tp in [1usize, 2, 4] {
            let (vals, targets, mask) = (vals.clone(), targets.clone(), mask.clone());
            let out = run_local(tp, move |g| {
                let full = tensor(vals.clone(), [n, v_pad], DType::F32);
                let shard = full
                    .chunk(g.world_size(), 1)
                    .swap_remove(g.rank())
                    .require_grad();
                let options = CrossEntropyOptions {
                    label_smoothing: smoothing,
                    n_vocab: Some(v),
                    ignore_index: Some(-100),
                    ..Default::default()
                };
                let out = sharded_cross_entropy_with(
                    shard.clone(),
                    ids(targets.clone(), [n]),
                    Some(tensor(mask.clone(), [n], DType::F32)),
                    &g,
                    &options,
                )
                .unwrap();
                let grad = shard.grad(&out.mean.backward()).unwrap();
                (f64s(out.mean), f64s(out.per_token), f64s(grad))
            })
            .unwrap();
            // The gathered gradient [n, v_pad], from the shards [n, v_pad / tp].
            let w = v_pad / tp;
            let grad: Vec<f64> = (0..n)
                .flat_map(|i| (0..v_pad).map(move |c| (i, c)))
                .map(|(i, c)| out[c / w].2[i * w + c % w])
                .collect();
            let tag = format!("tp {tp} smoothing {smoothing}");
            for (r, (mean, per_token, _)) in out.iter().enumerate() {
                assert_close(
                    mean,
                    &f64s(want.clone()),
                    1e-5,
                    &format!("{tag} rank {r}: mean"),
                );
                for (k, &row) in kept.iter().enumerate() {
                    assert_close(
                        &[per_token[row]],
                        &[want_rows[k]],
                        1e-5,
                        &format!("{tag}: row {row}"),
                    );
                }
                assert_eq!(
                    (per_token[2], per_token[3]),
                    (0.0, 0.0),
                    "{tag}: dropped rows"
                );
            }
            for i in 0..n {
                let row = &grad[i * v_pad..(i + 1) * v_pad];
                assert!(
                    row[v..].iter().all(|&g| g == 0.0),
                    "{tag}: padded columns of row {i}"
                );
                match kept.iter().position(|&k| k == i) {
                    Some(k) => assert_close(
                        &row[..v],
                        &want_grad[k * v..(k + 1) * v],
                        1e-5,
                        &format!("{tag}: gradient of row {i}"),
                    ),
                    None => assert!(row.iter().all(|&g| g == 0.0), "{tag}: dropped row {i}"),
                }
            }
        }
    }
}
