//! The sharded cross-entropy against Burn's and against its formula: every option (z-loss,
//! smoothing, padding, ignore index, loss mask) at tp 1, 2, 4, its dtypes (f32 compute for half
//! logits), and bad targets and shapes.

use crate::common::{assert_close, chunk, device, f64s, tensor, uniform};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_tp::TpError;
use burn_tp::comm::LocalGroup;
use burn_tp::local::run_local;
use burn_tp::loss::sharded_cross_entropy;

pub(crate) fn ids<const D: usize>(values: Vec<i64>, shape: [usize; D]) -> Tensor<D, Int> {
    Tensor::from_data(TensorData::new(values, shape), &device())
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
