//! The GPT pieces against their unsharded Burn counterparts, the tiny GPT across tp / dp / modes,
//! replicated parameters, checkpoints across tp sizes, and the example's CLI end to end.

use std::path::PathBuf;

use burn::module::Param;
use burn::nn::Embedding;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_tp::embedding::VocabParallelEmbedding;
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::loss::sharded_cross_entropy;
use burn_tp::reshard::Reshard;
use burn_tp::{LocalGroup, TpError};
use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;

use crate::common::{Path, assert_close, device, f64s, rng_lock, tensor, uniform};

fn ids<const D: usize>(values: Vec<i64>, shape: [usize; D]) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(values, shape), &device())
}

fn chunk<const D: usize>(t: Tensor<D>, n: usize, dim: usize, r: usize) -> Tensor<D> {
    if n == 1 {
        t
    } else {
        t.chunk(n, dim).swap_remove(r)
    }
}

#[test]
fn sharded_cross_entropy_matches_burn_cross_entropy() {
    let (n, v) = (6usize, 12usize);
    let logits_vals: Vec<f32> = uniform(n * v, 3).iter().map(|x| x * 4.0).collect();
    let targets_vals = vec![0i64, 11, 5, 6, 3, 7];
    for smoothing in [0.0f64, 0.1] {
        for z_loss in [0.0f64, 1e-2] {
            // Reference: Burn's loss on the full logits, plus z * mean(logsumexp^2).
            let logits = tensor(logits_vals.clone(), [n, v], DType::F32).require_grad();
            let config = CrossEntropyLossConfig::new()
                .with_smoothing((smoothing > 0.0).then_some(smoothing as f32));
            let mut loss = config
                .init(&device())
                .forward(logits.clone(), ids(targets_vals.clone(), [n]));
            if z_loss > 0.0 {
                let m = logits.clone().detach().max_dim(1);
                let lse = (logits.clone() - m.clone()).exp().sum_dim(1).log() + m;
                loss = loss + lse.powi_scalar(2).mean() * z_loss;
            }
            let grads = loss.backward();
            let want_loss = f64s(loss.detach());
            let want_grad = logits.grad(&grads).unwrap();
            for tp in 1..=4usize {
                let (lv, tv) = (logits_vals.clone(), targets_vals.clone());
                let out = run_local(tp, move |g| {
                    let full = tensor(lv.clone(), [n, v], DType::F32);
                    let shard = chunk(full, g.world_size(), 1, g.rank())
                        .detach()
                        .require_grad();
                    let loss = sharded_cross_entropy(
                        shard.clone(),
                        ids(tv.clone(), [n]),
                        &g,
                        z_loss,
                        smoothing,
                    )
                    .unwrap();
                    let grads = loss.backward();
                    (f64s(loss), f64s(shard.grad(&grads).unwrap()))
                })
                .unwrap();
                for (r, (loss, grad)) in out.iter().enumerate() {
                    let tag = format!("tp {tp} rank {r} smoothing {smoothing} z {z_loss}");
                    assert_close(loss, &want_loss, 1e-5, &format!("loss {tag}"));
                    assert_close(
                        grad,
                        &f64s(chunk(want_grad.clone(), tp, 1, r)),
                        1e-5,
                        &format!("grad {tag}"),
                    );
                }
            }
        }
    }
}

/// Every option at once (z-loss, label smoothing, a padded vocabulary, an ignore index and a loss
/// mask) against the formula written out in plain f64 loops: per kept token
/// `(1 - eps) (lse - x_t) + eps (lse - mean_j x_j) + z lse^2` over the real vocabulary, the mean
/// over the kept tokens; its gradient derived by hand and itself checked by central differences;
/// the padding columns get none. (The same formula in Burn's f64 ops and autodiff came out
/// 1.5e-8 relative off both, so the reference uses no tensor op.)
#[test]
fn sharded_cross_entropy_with_every_option_matches_the_formula() {
    use burn_tp::loss::{CrossEntropyOptions, sharded_cross_entropy_with};
    const IGNORE: i64 = -100;
    let (n, vocab, padded) = (8usize, 13usize, 16usize);
    let (eps, z) = (0.1f64, 1e-2f64);
    let logits_vals: Vec<f64> = uniform(n * padded, 5)
        .iter()
        .map(|&x| f64::from(x * 4.0))
        .collect();
    // Row 2 ignored, row 5 masked out, row 6 both; targets at the vocabulary's ends.
    let targets_vals = vec![0i64, 12, IGNORE, 6, 3, 7, IGNORE, 11];
    let mask_vals = vec![1.0f64, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0];
    let keep: Vec<f64> = targets_vals
        .iter()
        .zip(&mask_vals)
        .map(|(&t, &k)| if t == IGNORE { 0.0 } else { k })
        .collect();
    let kept: f64 = keep.iter().sum();

    // The formula, in plain f64: per-token losses and the mean.
    let per_token = |x: &[f64]| -> Vec<f64> {
        (0..n)
            .map(|i| {
                let row = &x[i * padded..i * padded + vocab];
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = row.iter().map(|v| (v - m).exp()).sum::<f64>().ln() + m;
                let t = targets_vals[i].max(0) as usize;
                let mean = row.iter().sum::<f64>() / vocab as f64;
                keep[i] * ((1.0 - eps) * (lse - row[t]) + eps * (lse - mean) + z * lse * lse)
            })
            .collect()
    };
    let mean_of = |x: &[f64]| per_token(x).iter().sum::<f64>() / kept;
    let want_per = per_token(&logits_vals);
    let want_mean = vec![mean_of(&logits_vals)];
    // Its gradient by hand: keep / kept * (softmax (1 + 2 z lse) - (1 - eps) one_hot - eps / V).
    let mut want_grad = vec![0.0f64; n * padded];
    for i in 0..n {
        let row = &logits_vals[i * padded..i * padded + vocab];
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let lse = sum.ln() + m;
        let t = targets_vals[i].max(0) as usize;
        for j in 0..vocab {
            let softmax = (row[j] - m).exp() / sum;
            let one_hot = if j == t { 1.0 } else { 0.0 };
            want_grad[i * padded + j] = keep[i] / kept
                * (softmax * (1.0 + 2.0 * z * lse) - (1.0 - eps) * one_hot - eps / vocab as f64);
        }
    }
    // ... checked by central differences of the formula (padding columns included: zero).
    let h = 1e-5;
    for k in 0..n * padded {
        let (mut up, mut down) = (logits_vals.clone(), logits_vals.clone());
        up[k] += h;
        down[k] -= h;
        let fd = (mean_of(&up) - mean_of(&down)) / (2.0 * h);
        assert!(
            (fd - want_grad[k]).abs() <= 1e-8,
            "the hand-derived gradient [{k}]: {} vs finite differences {fd}",
            want_grad[k]
        );
    }

    let f64_tensor = |v: Vec<f64>, shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(v, shape), (&device(), DType::F64))
    };
    for tp in [1usize, 2, 4] {
        let (lv, tv, mv) = (logits_vals.clone(), targets_vals.clone(), mask_vals.clone());
        let out = run_local(tp, move |g| {
            let full = f64_tensor(lv.clone(), [n, padded]);
            let shard = chunk(full, g.world_size(), 1, g.rank())
                .detach()
                .require_grad();
            let mask =
                Tensor::<1>::from_data(TensorData::new(mv.clone(), [n]), (&device(), DType::F64));
            let options = CrossEntropyOptions {
                z_loss: z,
                label_smoothing: eps,
                n_vocab: Some(vocab),
                ignore_index: Some(IGNORE),
            };
            let out = sharded_cross_entropy_with(
                shard.clone(),
                ids(tv.clone(), [n]),
                Some(mask),
                &g,
                &options,
            )
            .unwrap();
            let grads = out.mean.backward();
            (
                f64s(out.mean),
                f64s(out.per_token),
                f64s(shard.grad(&grads).unwrap()),
            )
        })
        .unwrap();
        let full_grad = f64_tensor(want_grad.clone(), [n, padded]);
        for (r, (mean, per, grad)) in out.iter().enumerate() {
            let tag = format!("tp {tp} rank {r}");
            assert_close(mean, &want_mean, 1e-12, &format!("mean {tag}"));
            assert_close(per, &want_per, 1e-12, &format!("per token {tag}"));
            assert_close(
                grad,
                &f64s(chunk(full_grad.clone(), tp, 1, r)),
                1e-12,
                &format!("grad {tag}"),
            );
        }
    }
}

#[test]
fn sharded_cross_entropy_rejects_bad_targets_and_shapes() {
    let g = LocalGroup::new(1).unwrap().remove(0);
    let logits = tensor(vec![0.0; 8], [2, 4], DType::F32);
    let e = sharded_cross_entropy(logits.clone(), ids(vec![1, 4], [2]), &g, 0.0, 0.0).unwrap_err();
    assert_eq!(e, TpError::OutOfRange { id: 4, vocab: 4 });
    let e =
        sharded_cross_entropy(logits.clone(), ids(vec![1, 2, 3], [3]), &g, 0.0, 0.0).unwrap_err();
    assert!(matches!(e, TpError::Shape { .. }), "{e}");
    let e = sharded_cross_entropy(logits, ids(vec![1, 2], [2]), &g, 0.0, 1.5).unwrap_err();
    assert!(matches!(e, TpError::Config(_)), "{e}");
}

#[test]
fn vocab_parallel_embedding_matches_burn_embedding() {
    let (v, d, s, b) = (12usize, 4usize, 12usize, 2usize);
    let w_vals = uniform(v * d, 9);
    let id_vals: Vec<i64> = (0..24).map(|i| (i * 5 + 3) % 12).collect();
    let g_vals = uniform(s * b * d, 10);
    // Reference.
    let weight = tensor(w_vals.clone(), [v, d], DType::F32).require_grad();
    let emb = burn::tensor::module::embedding(weight.clone(), ids(id_vals.clone(), [s, b]));
    let grads = (emb.clone() * tensor(g_vals.clone(), [s, b, d], DType::F32))
        .sum()
        .backward();
    let (want_y, want_dw) = (emb.detach(), weight.grad(&grads).unwrap());
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for tp in 1..=4usize {
            let (wv, iv, gv) = (w_vals.clone(), id_vals.clone(), g_vals.clone());
            let out = run_local(tp, move |g| {
                let (r, n) = (g.rank(), g.world_size());
                let full = Embedding {
                    weight: Param::from_tensor(tensor(wv.clone(), [v, d], DType::F32)),
                };
                let layer = VocabParallelEmbedding::from_full(&full, &g, mode).unwrap();
                let y = layer.forward(ids(iv.clone(), [s, b]));
                let up = tensor(gv.clone(), [s, b, d], DType::F32);
                let up = if mode == TpMode::ReduceScatter {
                    chunk(up, n, 0, r)
                } else {
                    up
                };
                let grads = (y.clone() * up).sum().backward();
                let bad = layer
                    .try_forward(ids(
                        (0..24).map(|i| if i == 7 { 12 } else { 0 }).collect(),
                        [s, b],
                    ))
                    .unwrap_err();
                (f64s(y), f64s(layer.weight.val().grad(&grads).unwrap()), bad)
            })
            .unwrap();
            for (r, (y, dw, bad)) in out.into_iter().enumerate() {
                let want = if mode == TpMode::ReduceScatter {
                    chunk(want_y.clone(), tp, 0, r)
                } else {
                    want_y.clone()
                };
                assert_close(
                    &y,
                    &f64s(want),
                    1e-6,
                    &format!("embedding {mode:?} tp {tp}"),
                );
                assert_close(
                    &dw,
                    &f64s(chunk(want_dw.clone(), tp, 0, r)),
                    1e-6,
                    "embedding grad",
                );
                assert_eq!(bad, TpError::OutOfRange { id: 12, vocab: 12 });
            }
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-tp-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tiny_args(extra: &[&str], out: &std::path::Path) -> Args {
    let mut argv = vec!["train_gpt", "--quiet"];
    let defaults = [
        ("--batch", "4"),
        ("--seq", "8"),
        ("--d-model", "16"),
        ("--heads", "4"),
        ("--layers", "2"),
        ("--lr", "1e-2"),
        ("--steps", "10"),
        ("--sample-len", "8"),
    ];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            argv.extend_from_slice(&[flag, value]);
        }
    }
    argv.extend_from_slice(extra);
    argv.extend_from_slice(&["--out", out.to_str().unwrap()]);
    Args::try_parse_from(argv).unwrap()
}

/// tp = 1, 2, 4 and tp = 2 x dp = 2 give the same losses, in both modes, async and sync.
#[test]
fn gpt_losses_agree_across_tp_dp_modes_and_async() {
    let _rng = rng_lock();
    let out = temp_dir("agree");
    let reference = run(&tiny_args(&["--tp", "1"], &out)).unwrap().losses;
    assert!(
        reference[9] < reference[0] - 0.3,
        "the model learns: {reference:?}"
    );
    for mode in ["all-reduce", "reduce-scatter"] {
        for asynch in [true, false] {
            for (tp, dp) in [("1", "1"), ("2", "1"), ("4", "1"), ("2", "2")] {
                // The async layers on each path (sync layers have no schedule to run).
                let paths = if asynch {
                    Path::at(tp.parse().unwrap())
                } else {
                    &Path::ALL[..1]
                };
                for path in paths {
                    let mut extra = vec!["--tp", tp, "--dp", dp, "--mode", mode];
                    if !asynch {
                        extra.push("--no-async");
                    }
                    extra.extend(path.args());
                    let report = run(&tiny_args(&extra, &out)).unwrap();
                    let tag = format!("tp {tp} dp {dp} {mode} async {asynch} {path:?}");
                    assert_close(&report.losses, &reference, 1e-4, &format!("losses {tag}"));
                    let linked = report.overlap.starts_with("simulated link");
                    assert_eq!(
                        linked,
                        asynch && matches!(path, Path::Overlapped(_)),
                        "{tag}: {}",
                        report.overlap
                    );
                }
            }
        }
    }
}

/// `--overlap-grad-reduce` (the dp average started in buckets during the backward) gives the
/// losses of the plain average after it, at tp 2 x dp 2 and tp 1 x dp 4, with one bucket and with
/// 1 KiB buckets, in bf16 too (the reducer averages in f32, as the plain path does after its
/// cast); a bucket size that is not positive is an error naming it.
#[test]
fn train_gpt_overlapped_grad_reduce_gives_the_same_losses() {
    let _rng = rng_lock();
    let out = temp_dir("overlap-grad");
    for (tp, dp) in [("2", "2"), ("1", "4")] {
        for dtype in ["f32", "bf16"] {
            let base = ["--tp", tp, "--dp", dp, "--arch", "llama", "--dtype", dtype];
            let plain = run(&tiny_args(&base, &out)).unwrap().losses;
            for bucket in ["4", "0.001"] {
                let mut extra = base.to_vec();
                extra.extend(["--overlap-grad-reduce", "--bucket-mb", bucket]);
                let report = run(&tiny_args(&extra, &out)).unwrap();
                let tag = format!("tp {tp} dp {dp} {dtype} bucket {bucket} MiB");
                assert_close(&report.losses, &plain, 1e-6, &tag);
            }
        }
    }
    let e = run(&tiny_args(&["--bucket-mb", "0"], &out)).unwrap_err();
    assert!(e.contains("--bucket-mb") && e.contains('0'), "{e}");
}

/// `--distributed-optimizer` (AdamW's moments sharded over dp) gives the plain run's losses at
/// tp 2 x dp 2 and tp 1 x dp 4, with and without `--overlap-grad-reduce`; its checkpoint (the
/// chunks gathered into the sharded format) resumes at tp 1 x dp 4 with the distributed
/// optimizer and at tp 2 x dp 1 without it, into the uninterrupted curve.
#[test]
fn train_gpt_distributed_optimizer_gives_the_same_curve_and_resumes_at_another_dp() {
    let _rng = rng_lock();
    for (tp, dp) in [("2", "2"), ("1", "4")] {
        let base = ["--tp", tp, "--dp", dp, "--steps", "20"];
        let plain = run(&tiny_args(&base, &temp_dir("zero-plain")))
            .unwrap()
            .losses;
        for extra in [
            &["--distributed-optimizer"][..],
            &[
                "--distributed-optimizer",
                "--overlap-grad-reduce",
                "--bucket-mb",
                "0.001",
            ],
        ] {
            let mut argv = base.to_vec();
            argv.extend_from_slice(extra);
            let report = run(&tiny_args(&argv, &temp_dir("zero"))).unwrap();
            assert_close(
                &report.losses,
                &plain,
                1e-5,
                &format!("tp {tp} dp {dp} {extra:?}"),
            );
        }
    }
    let whole = run(&tiny_args(
        &["--tp", "2", "--dp", "2", "--steps", "40"],
        &temp_dir("zero-whole"),
    ))
    .unwrap()
    .losses;
    let half = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--steps",
            "20",
            "--distributed-optimizer",
        ],
        &temp_dir("zero-half"),
    ))
    .unwrap();
    let ckpt = half.checkpoint.to_str().unwrap().to_string();
    for (tp, dp, zero) in [("1", "4", true), ("2", "1", false)] {
        let mut argv = vec!["--tp", tp, "--dp", dp, "--steps", "20", "--resume", &ckpt];
        if zero {
            argv.push("--distributed-optimizer");
        }
        let rest = run(&tiny_args(&argv, &temp_dir("zero-rest"))).unwrap();
        assert_close(
            &rest.losses,
            &whole[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} x dp {dp} (distributed {zero})"),
        );
    }
}

/// In REDUCE_SCATTER mode each rank sees only its sequence shard; layer norms, positions and the
/// row biases still get the full gradient and stay bitwise identical on every rank.
#[test]
fn replicated_parameters_stay_bitwise_identical() {
    let _rng = rng_lock();
    device().seed(5);
    for mode in [TpMode::ReduceScatter, TpMode::AllReduce] {
        let out = run_local(2, move |g| {
            let dev = device();
            let mut model = GptConfig::new(24, 8, 16, 4, 2)
                .with_settings(TpSettings::new().with_mode(mode))
                .init(&g, &dev)
                .unwrap();
            let mut optim = burn::optim::AdamWConfig::new().init();
            for step in 0..3i64 {
                let x: Vec<i64> = (0..16).map(|i| (i * 7 + step) % 24).collect();
                let y: Vec<i64> = (0..16).map(|i| (i * 5 + step + 1) % 24).collect();
                let loss = model.loss(ids(x, [8, 2]), ids(y, [8, 2]));
                let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(1e-2, model, grads);
            }
            let bits = |t: Tensor<1>| f64s(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let block = &model.blocks[1];
            vec![
                bits(block.ln1.gamma.val()),
                bits(block.ln2.beta.val()),
                bits(model.ln_f.gamma.val()),
                bits(block.mlp.fc2.bias.as_ref().unwrap().val()),
                bits(block.attn.out.bias.as_ref().unwrap().val()),
                bits(model.pos.val().reshape([8 * 16])),
            ]
        })
        .unwrap();
        assert_eq!(
            out[0], out[1],
            "{mode:?}: replicated parameters differ across ranks"
        );
        let ones = f64s(Tensor::<1>::ones([16], &device()))
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>();
        assert_ne!(out[0][0], ones, "{mode:?}: the layer norm was trained");
    }
}

/// A model saved at tp = 2 resumes at tp = 1, 2 and 4 with the same loss, and continues the run
/// (optimizer state, step count) as if never interrupted; sharding and gathering round-trips the
/// parameters exactly.
#[test]
fn checkpoints_round_trip_across_tp_sizes() {
    let _rng = rng_lock();
    let out = temp_dir("ckpt");
    let first = run(&tiny_args(&["--tp", "2", "--steps", "6"], &out)).unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    let mut resumed = Vec::new();
    for tp in ["1", "2", "4"] {
        let o = temp_dir(&format!("resume-{tp}"));
        let report = run(&tiny_args(
            &["--tp", tp, "--steps", "1", "--resume", &ckpt],
            &o,
        ))
        .unwrap();
        resumed.push(report.losses[0]);
    }
    assert_close(
        &resumed[1..],
        &[resumed[0], resumed[0]],
        1e-5,
        "resumed loss at tp 2 and 4 vs tp 1",
    );
    assert!(
        resumed[0] < first.losses[0] - 0.2,
        "the resumed model is the trained one: {resumed:?} vs {:?}",
        first.losses
    );

    // The checkpoint carries the optimizer state and the step count: 20 steps, then a resume
    // for 20 more (at tp 2, and at tp 4 and 1), give the losses of 40 steps uninterrupted.
    let whole = run(&tiny_args(
        &["--tp", "2", "--steps", "40"],
        &temp_dir("whole"),
    ))
    .unwrap();
    // The first half saves every 7 steps (at 7 and 14), then at its end: the folder keeps the
    // last save only. It also exports the full model, which resumes as well.
    let half_dir = temp_dir("half");
    let full_export = half_dir.join("full.bpk");
    let half = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--steps",
            "20",
            "--save-every",
            "7",
            "--export-full",
            full_export.to_str().unwrap(),
        ],
        &half_dir,
    ))
    .unwrap();
    assert_eq!(half.losses[..], whole.losses[..20]);
    let mut saved: Vec<String> = std::fs::read_dir(&half.checkpoint)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    saved.sort();
    assert_eq!(saved, ["index.json", "step-20"]);
    let rest = run(&tiny_args(
        &[
            "--tp",
            "4",
            "--steps",
            "20",
            "--resume",
            full_export.to_str().unwrap(),
        ],
        &temp_dir("continue-full"),
    ))
    .unwrap();
    assert_close(
        &rest.losses,
        &whole.losses[20..],
        1e-4,
        "steps 20..40 resumed at tp 4 from the full export vs uninterrupted",
    );
    let ckpt = half.checkpoint.to_str().unwrap().to_string();
    // Resumed on every path of the async layers, in both modes (the run above: reduce-scatter,
    // one block).
    let [one_block, split, ring] = Path::ALL;
    for (i, (tp, path, mode)) in [
        ("2", one_block, "reduce-scatter"),
        ("2", split, "reduce-scatter"),
        ("4", ring, "reduce-scatter"),
        ("4", split, "all-reduce"),
        ("2", ring, "all-reduce"),
        ("1", one_block, "all-reduce"),
    ]
    .into_iter()
    .enumerate()
    {
        let o = temp_dir(&format!("continue-{i}"));
        let mut extra = vec![
            "--tp", tp, "--mode", mode, "--steps", "20", "--resume", &ckpt,
        ];
        extra.extend(path.args());
        let rest = run(&tiny_args(&extra, &o)).unwrap();
        assert_eq!(rest.first_step, 20);
        assert_close(
            &rest.losses,
            &whole.losses[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} {mode} {path:?} vs uninterrupted"),
        );
        assert_eq!(rest.held_out.last().unwrap().0, 40);
        let csv = std::fs::read_to_string(o.join("loss.csv")).unwrap();
        assert!(csv.lines().nth(1).unwrap().starts_with("20,"), "{csv}");
    }
    // And with data parallelism: tp 2 x dp 2 and tp 4 x dp 2 (each replica reads the same
    // slices).
    for (tp, dp) in [("2", "2"), ("4", "2")] {
        let rest = run(&tiny_args(
            &["--tp", tp, "--dp", dp, "--steps", "20", "--resume", &ckpt],
            &temp_dir(&format!("continue-{tp}x{dp}")),
        ))
        .unwrap();
        assert_close(
            &rest.losses,
            &whole.losses[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} x dp {dp} vs uninterrupted"),
        );
    }
    // A full export without its optimizer state is an error naming the missing file.
    let bare = temp_dir("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(&full_export, bare.join("checkpoint.bpk")).unwrap();
    std::fs::copy(
        full_export.with_extension("steps"),
        bare.join("checkpoint.steps"),
    )
    .unwrap();
    let e = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--steps",
            "1",
            "--resume",
            bare.join("checkpoint.bpk").to_str().unwrap(),
        ],
        &temp_dir("bare-out"),
    ))
    .unwrap_err();
    assert!(e.contains("checkpoint.optim.bpk"), "{e}");

    device().seed(3);
    let out = run_local(2, |g| {
        let model = GptConfig::new(24, 8, 16, 4, 1).init(&g, &device()).unwrap();
        let full = model.to_full_module().unwrap();
        let again = Gpt::shard_module(&full, &g)
            .unwrap()
            .to_full_module()
            .unwrap();
        let params = |m: &Gpt| {
            vec![
                f64s(m.tok.weight.val()),
                f64s(m.blocks[0].attn.qkv[0].weight.val()),
                f64s(m.head.as_ref().unwrap().weight.val()),
            ]
        };
        (params(&full), params(&again), full.tok.weight.val().dims())
    })
    .unwrap();
    for (full, again, dims) in out {
        assert_eq!(full, again);
        assert_eq!(dims, [24, 16], "the gathered table is the full vocabulary");
    }
}

#[test]
fn the_example_cli_runs_end_to_end_and_writes_its_outputs() {
    let _rng = rng_lock();
    let out = temp_dir("cli");
    let data = out.with_extension("txt");
    std::fs::write(&data, "hello tensor parallel world. ".repeat(20)).unwrap();
    let report = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--steps",
            "4",
            "--mode",
            "reduce-scatter",
            "--schedule",
            "ring",
            "--eval-every",
            "3",
            "--sample-len",
            "40",
            "--profile",
            "--data",
            data.to_str().unwrap(),
        ],
        &out,
    ))
    .unwrap();
    assert_eq!(report.losses.len(), 4);
    // Held out before training, every 3 steps, and after the last.
    let steps: Vec<usize> = report.held_out.iter().map(|h| h.0).collect();
    assert_eq!(steps, vec![0, 3, 4]);
    assert!(report.held_out.iter().all(|h| h.1.is_finite() && h.1 > 0.0));
    // The values: the model learns the repeated sentence (measured 3.61 -> 2.98 -> 2.83), and the
    // checkpoint written at the end, evaluated afresh at tp = 1 and one block, gives the last
    // held-out loss (the held-out text, the evaluation batches, the trained weights).
    let held: Vec<f64> = report.held_out.iter().map(|h| h.1).collect();
    assert!(held[2] < held[1] && held[1] < held[0] - 0.3, "{held:?}");
    let again = run(&tiny_args(
        &[
            "--tp",
            "1",
            "--steps",
            "1",
            "--data",
            data.to_str().unwrap(),
            "--resume",
            out.join("checkpoint").to_str().unwrap(),
        ],
        &temp_dir("cli-eval"),
    ))
    .unwrap();
    assert_eq!(again.held_out[0].0, 4);
    assert_close(
        &[again.held_out[0].1],
        &[held[2]],
        1e-5,
        "held-out loss of the checkpoint at tp 1 vs at the end of the tp 2 run",
    );
    let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
    assert_eq!(csv.lines().count(), 6, "{csv}");
    assert!(csv.starts_with("step,loss,held_out_loss\n0,"), "{csv}");
    assert!(csv.lines().nth(5).unwrap().starts_with("4,,"), "{csv}");
    // The communication profile: the seed's path is there, and in comm.csv.
    let profile = report.profile.as_ref().expect("--profile");
    let row = |label: &str, op: &str| {
        profile
            .rows
            .iter()
            .find(|r| r.label == label && r.op == op)
            .unwrap_or_else(|| panic!("{label} {op} in\n{profile}"))
    };
    // 2 blocks x 2 row layers (attention out, MLP fc2) x 4 steps; the forward also runs in the
    // 3 held-out evaluations of 4 batches each.
    assert_eq!(
        row("RowParallelLinear.backward", "AllGather").calls,
        16,
        "{profile}"
    );
    let forwards = 4 * (4 + 3 * 4);
    assert_eq!(
        row("RowParallelLinear.forward", "ReduceScatter").calls,
        forwards
    );
    assert!(row("RowParallelLinear.backward", "AllGather").bytes > 0);
    let comm_csv = std::fs::read_to_string(out.join("comm.csv")).unwrap();
    assert!(
        comm_csv.contains("RowParallelLinear.backward,AllGather,16,"),
        "{comm_csv}"
    );
    // The sample: 40 characters of the data's own alphabet, also written to sample.txt.
    assert_eq!(report.sample.chars().count(), 40, "{:?}", report.sample);
    assert!(report.sample.chars().all(|c| "helo tnsrpawd.".contains(c)));
    assert_eq!(
        std::fs::read_to_string(out.join("sample.txt")).unwrap(),
        report.sample
    );
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(out.join("checkpoint/index.json").exists());
    assert!(report.tokens_per_s > 0.0);

    // Bad arguments are errors naming the values, not panics.
    let e = run(&tiny_args(&["--tp", "2", "--dp", "3"], &out)).unwrap_err();
    assert!(e.contains("--batch 4") && e.contains("--dp 3"), "{e}");
    let e = run(&tiny_args(&["--tp", "3"], &out)).unwrap_err();
    assert!(e.contains("not divisible") && e.contains('3'), "{e}");
    for (arg, value) in [("--lr", "nan"), ("--seq", "0"), ("--temperature", "inf")] {
        let e = run(&tiny_args(&[arg, value], &out)).unwrap_err();
        assert!(e.contains(arg) && e.to_lowercase().contains(value), "{e}");
    }
    // A diverging run stops with an error naming the step, and keeps its curve up to there.
    let diverge = temp_dir("diverge");
    let e = run(&tiny_args(&["--lr", "1e30", "--steps", "20"], &diverge)).unwrap_err();
    assert!(e.contains("at step") && e.contains("--keep-going"), "{e}");
    let step: usize = e
        .split("at step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    let csv = std::fs::read_to_string(diverge.join("loss.csv")).unwrap();
    let last_loss = csv
        .lines()
        .nth(step + 1)
        .unwrap()
        .split(',')
        .nth(1)
        .unwrap();
    assert!(!last_loss.parse::<f64>().unwrap().is_finite(), "{csv}");
    let kept = run(&tiny_args(
        &["--lr", "1e30", "--steps", "20", "--keep-going"],
        &temp_dir("keep-going"),
    ))
    .unwrap();
    assert_eq!(kept.losses.len(), 20);
    let e = run(&tiny_args(&["--data", "/nonexistent/file.txt"], &out)).unwrap_err();
    assert!(e.contains("/nonexistent/file.txt"), "{e}");
    // `--device cuda`: without the feature, or outside a launch, an error saying what to do.
    let e = run(&tiny_args(&["--device", "cuda"], &out)).unwrap_err();
    if cfg!(feature = "cuda") {
        assert!(
            e.contains("burn-tp-launch") || e.contains("WORLD_SIZE"),
            "{e}"
        );
    } else {
        assert!(e.contains("--features cuda"), "{e}");
    }
}

/// The tied lm-head and the separate Q, K, V projections give the same losses at tp = 1, 2, 4.
#[test]
fn tied_head_and_separate_qkv_agree_across_tp() {
    let _rng = rng_lock();
    for (tie, fused) in [(true, true), (false, false), (true, false)] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for asynch in [true, false] {
                let mut all = Vec::new();
                for tp in [1usize, 2, 4] {
                    device().seed(11);
                    let losses = run_local(tp, move |g| {
                        let config = GptConfig::new(24, 8, 16, 4, 1)
                            .with_settings(
                                TpSettings::new()
                                    .with_mode(mode)
                                    .with_async_communication(asynch),
                            )
                            .with_tie_embeddings(tie)
                            .with_fused_qkv(fused);
                        let mut model = config.init(&g, &device()).unwrap();
                        assert_eq!(model.head.is_none(), tie);
                        let mut optim = burn::optim::AdamWConfig::new().init();
                        let mut losses = Vec::new();
                        for step in 0..3i64 {
                            let x: Vec<i64> = (0..16).map(|i| (i * 7 + step) % 24).collect();
                            let y: Vec<i64> = (0..16).map(|i| (i * 5 + step + 1) % 24).collect();
                            let loss = model.loss(ids(x, [8, 2]), ids(y, [8, 2]));
                            losses.push(f64s(loss.clone())[0]);
                            let grads =
                                burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                            model = optim.step(1e-2, model, grads);
                        }
                        losses
                    })
                    .unwrap();
                    all.push(losses[0].clone());
                }
                for (i, losses) in all.iter().enumerate() {
                    let tag =
                        format!("tie {tie} fused {fused} {mode:?} async {asynch} tp index {i}");
                    assert_close(losses, &all[0], 1e-4, &tag);
                }
                assert!(all[0][2] < all[0][0], "it learns");
            }
        }
    }
}

/// A vocabulary tp does not divide (13 at tp 2 and 4: padded to 14 and 16): the same loss and the
/// same gradients as at tp = 1 (no padding), tied and untied, in both modes; the padding never
/// shows in the full form (`to_full` is `[13, d]`) and gets no gradient.
#[test]
fn any_vocabulary_size_works_at_any_tp() {
    use crate::common::full_grads;
    let _rng = rng_lock();
    let (v, s, b) = (13usize, 8usize, 2usize);
    let x = crate::common::token_ids(s * b, v, 7, 3);
    let y = crate::common::token_ids(s * b, v, 5, 12);
    for tied in [false, true] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            let mut reference: Option<(Vec<f64>, Vec<f64>, Vec<f64>)> = None;
            for tp in [1usize, 2, 4] {
                device().seed(17);
                let (x, y) = (x.clone(), y.clone());
                let out = run_local(tp, move |g| {
                    let model = GptConfig::new(v, s, 16, 4, 1)
                        .with_settings(TpSettings::new().with_mode(mode))
                        .with_tie_embeddings(tied)
                        .init(&g, &device())
                        .unwrap();
                    let loss = model.loss(ids(x.clone(), [s, b]), ids(y.clone(), [s, b]));
                    let grads = loss.backward();
                    // The padding rows of this rank's table shard get no gradient.
                    let shard_grad = f64s(model.tok.weight.val().grad(&grads).unwrap());
                    let rows = model.tok.weight.val().dims()[0];
                    let first = g.rank() * rows;
                    let padded_rows = (first..first + rows).filter(|&id| id >= v);
                    let padding_grad: f64 = padded_rows
                        .flat_map(|id| {
                            shard_grad[(id - first) * 16..(id - first + 1) * 16].to_vec()
                        })
                        .map(f64::abs)
                        .sum();
                    let full = full_grads(&model, &grads);
                    let tok = full.tok.to_full().unwrap().weight.val();
                    assert_eq!(tok.dims(), [v, 16]);
                    let head = full
                        .head
                        .as_ref()
                        .map_or_else(Vec::new, |h| f64s(h.to_full().unwrap().weight.val()));
                    (f64s(loss), f64s(tok), head, padding_grad)
                })
                .unwrap();
                for (r, (loss, tok, head, padding_grad)) in out.into_iter().enumerate() {
                    let tag = format!("tied {tied} {mode:?} tp {tp} rank {r}");
                    assert_eq!(padding_grad, 0.0, "{tag}: padding rows got a gradient");
                    match &reference {
                        None => reference = Some((loss, tok, head)),
                        Some((l, t, h)) => {
                            assert_close(&loss, l, 1e-5, &format!("{tag}: loss"));
                            assert_close(&tok, t, 1e-4, &format!("{tag}: embedding gradient"));
                            assert_close(&head, h, 1e-4, &format!("{tag}: head gradient"));
                        }
                    }
                }
            }
        }
    }
}

/// Inside `ReplicatedGrads::scope` the sequence-parallel GPT's replicated parameters (layer norms,
/// positions) post no collective in the backward; `finish` sums their gradients over tp in one
/// all-reduce: the gradients of every parameter equal the per-use path's (one blocking
/// all-reduce per use), at tp 2 and 4, and the profile counts 1 coalesced all-reduce against
/// one per use before.
#[test]
fn coalesced_replicated_gradients_equal_the_per_use_all_reduces() {
    use burn::module::{Module, ModuleVisitor};
    use burn::optim::GradientsParams;
    use burn_tp::LocalGroupOptions;
    use burn_tp::local::run_ranks;
    use burn_tp::transformer::ReplicatedGrads;
    let _rng = rng_lock();
    for tp in [2usize, 4] {
        device().seed(11);
        let options = LocalGroupOptions {
            profile: true,
            ..Default::default()
        };
        let out = run_ranks(LocalGroup::with_options(tp, options).unwrap(), move |g| {
            let model = GptConfig::new(24, 8, 16, 4, 2)
                .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
                .init(&g, &device())
                .unwrap();
            let x: Vec<i64> = (0..16).map(|i| (i * 7 + 1) % 24).collect();
            let y: Vec<i64> = (0..16).map(|i| (i * 5 + 2) % 24).collect();
            let grads_of = |coalesce: bool| {
                let loss = |m: &Gpt| m.loss(ids(x.clone(), [8, 2]), ids(y.clone(), [8, 2]));
                let mut grads = if coalesce {
                    let replicated = ReplicatedGrads::new(&g);
                    let loss = replicated.scope(|| loss(&model));
                    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
                    replicated.finish(&model, &mut grads).unwrap();
                    grads
                } else {
                    GradientsParams::from_grads(loss(&model).backward(), &model)
                };
                struct Collect<'a>(&'a mut GradientsParams, Vec<Vec<f64>>);
                impl ModuleVisitor for Collect<'_> {
                    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                        let g = self
                            .0
                            .remove::<D>(p.id)
                            .expect("every parameter has a gradient");
                        self.1.push(f64s(g));
                    }
                }
                let mut c = Collect(&mut grads, Vec::new());
                model.visit(&mut c);
                c.1
            };
            let rows = |label: &str| -> u64 {
                g.profile()
                    .unwrap()
                    .rows
                    .iter()
                    .filter(|r| r.label == label)
                    .map(|r| r.calls)
                    .sum()
            };
            let per_use = grads_of(false);
            let before = (
                rows("collective backward"),
                rows("replicated gradients (coalesced)"),
            );
            let coalesced = grads_of(true);
            let after = (
                rows("collective backward"),
                rows("replicated gradients (coalesced)"),
            );
            (per_use, coalesced, before, after)
        })
        .unwrap();
        for (rank, (per_use, coalesced, before, after)) in out.into_iter().enumerate() {
            for (i, (a, b)) in coalesced.iter().zip(&per_use).enumerate() {
                assert_close(a, b, 1e-5, &format!("tp {tp} rank {rank} parameter {i}"));
            }
            // Per use: 2 norms x 2 blocks x (gamma, beta) + the final norm's 2 + positions = 11
            // all-reduces in the backward; coalesced: none of them there, 1 after (the other
            // collectives' backwards, the same in both runs, are counted in both).
            let (per_use_calls, coalesced_calls) = (before.0, after.0 - before.0);
            assert_eq!(
                per_use_calls - coalesced_calls,
                11,
                "tp {tp}: backward collectives per use {per_use_calls}, coalesced {coalesced_calls}"
            );
            assert_eq!(after.1 - before.1, 1, "tp {tp}: one coalesced all-reduce");
        }
    }
}
