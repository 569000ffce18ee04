//! The vocabulary-parallel embedding against Burn's `Embedding`, in every dtype, and vocabularies
//! that tp does not divide (padded, the padding masked) in the whole GPT.

use crate::common::{assert_close, chunk, device, f64s, rng_lock, tensor, uniform};
use crate::loss::ids;
use burn::module::Param;
use burn::nn::Embedding;
use burn::tensor::{DType, FloatDType};
use burn_tp::TpError;
use burn_tp::embedding::{VocabParallelEmbedding, VocabParallelEmbeddingConfig};
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::precision::cast_params;

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
