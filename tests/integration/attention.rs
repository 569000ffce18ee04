//! The fused attention (`burn_tp::attention::fused_attention`, FlashAttention-2 on the backend's
//! ops) against plain f64 loops and against the materialized path (scores, mask, softmax and
//! probabilities as tracked ops): values and the gradients of q, k and v in f64, f32 and bf16,
//! causal from a query offset (the KV cache), grouped-query heads, dropout, tiles that do not
//! divide the lengths; a finite-difference gradcheck in f64; and the models at sequences of
//! several tiles, fused against materialized.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_tp::attention::fused_attention;
use burn_tp::backend::{AttentionDropout, AttentionSpec};
use burn_tp::dropout::{DropoutKey, DropoutStep, dropout_mask};
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};

use crate::common::{assert_close, device, f64s, full_grads, rel_norm, rng_lock, tensor, uniform};

fn fused(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, spec: AttentionSpec) -> Tensor<4> {
    fused_attention(q, k, v, spec).unwrap()
}

/// q `[b, hq, s, hd]` and k, v `[b, hkv, t, hd]` of `seed`, in `dtype`.
fn qkv([b, hq, hkv, s, t, hd]: [usize; 6], seed: u64, dtype: DType) -> [Tensor<4>; 3] {
    [
        tensor(uniform(b * hq * s * hd, seed), [b, hq, s, hd], dtype),
        tensor(uniform(b * hkv * t * hd, seed + 1), [b, hkv, t, hd], dtype),
        tensor(uniform(b * hkv * t * hd, seed + 2), [b, hkv, t, hd], dtype),
    ]
}

/// Causal attention in plain f64 loops: query `i` (position `start + i`) over keys
/// `0 ..= start + i` (only the last `w` of them with a window `w`; none of sequence `b`'s first
/// `padding[b]` but its own), query head `h` reading key / value head `h / (hq / hkv)`, the
/// probabilities times `keep` (`[b, hq, s, t]`, the scaled dropout mask) if given, the scores
/// soft-capped with `softcap`.
#[allow(clippy::too_many_arguments)]
fn loops(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    [b, hq, s, hd]: [usize; 4],
    [hkv, t]: [usize; 2],
    start: usize,
    window: Option<usize>,
    padding: &[usize],
    keep: Option<&[f64]>,
    softcap: Option<f64>,
) -> Vec<f64> {
    let mut out = vec![0.0; b * hq * s * hd];
    let g = hq / hkv;
    let scale = 1.0 / (hd as f64).sqrt();
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / g;
            for i in 0..s {
                let qrow = &q[((bi * hq + h) * s + i) * hd..][..hd];
                let seen = start + i + 1;
                let first = window.map_or(0, |w| seen.saturating_sub(w));
                let pad = padding.get(bi).copied().unwrap_or(0);
                let keys: Vec<usize> = (first..seen)
                    .filter(|&j| j >= pad || j == start + i)
                    .collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let krow = &k[((bi * hkv + kh) * t + j) * hd..][..hd];
                        let x = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale;
                        softcap.map_or(x, |c| c * (x / c).tanh())
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (&j, ej) in keys.iter().zip(&e) {
                    let mut p = ej / sum;
                    if let Some(keep) = keep {
                        p *= keep[((bi * hq + h) * s + i) * t + j];
                    }
                    let vrow = &v[((bi * hkv + kh) * t + j) * hd..][..hd];
                    for c in 0..hd {
                        out[((bi * hq + h) * s + i) * hd + c] += p * vrow[c];
                    }
                }
            }
        }
    }
    out
}

/// Today's path, materialized, as `ParallelAttention` ran it before the fused kernel: keys and
/// values repeated per group, the `[s, t]` scores (soft-capped with `softcap`), the mask,
/// softmax, dropout, `@ v`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn materialized(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    start: usize,
    window: Option<usize>,
    padding: &[usize],
    keep: Option<Tensor<4>>,
    softcap: Option<f64>,
) -> Tensor<4> {
    let [b, hq, s, hd] = q.dims();
    let [_, hkv, t, _] = k.dims();
    let g = hq / hkv;
    let expand = |x: Tensor<4>| {
        x.unsqueeze_dim::<5>(2)
            .expand([b, hkv, g, t, hd])
            .reshape([b, hq, t, hd])
    };
    // The scale as a tensor: Burn's scalar division's backward rounds the scalar to f32, which
    // an f64 comparison would see (1.7e-8).
    let scale = Tensor::<4>::full(
        [1, 1, 1, 1],
        1.0 / (hd as f64).sqrt(),
        (&q.device(), q.dtype()),
    );
    let scores = q.matmul(expand(k).swap_dims(2, 3)) * scale;
    // The cap as tensors too (the scalar ops' backward rounds to f32).
    let scores = match softcap {
        Some(cap) => {
            let (device, dtype) = (scores.device(), scores.dtype());
            let full = |x: f64| Tensor::<4>::full([1, 1, 1, 1], x, (&device, dtype));
            (scores * full(1.0 / cap)).tanh() * full(cap)
        }
        None => scores,
    };
    // Key j is hidden from query i (position start + i) in its future, before its window
    // (j < start + i + 1 - w), or in its sequence's padding (but its own position).
    let hidden: Vec<bool> = (0..b)
        .flat_map(|bi| (0..s).flat_map(move |i| (0..t).map(move |j| (bi, i, j))))
        .map(|(bi, i, j)| {
            let q = start + i;
            j > q
                || window.is_some_and(|w| j + w < q + 1)
                || (j < padding.get(bi).copied().unwrap_or(0) && j != q)
        })
        .collect();
    let hidden =
        Tensor::<4, Bool>::from_data(TensorData::new(hidden, [b, 1, s, t]), &scores.device());
    let att = softmax(scores.mask_fill(hidden, f32::NEG_INFINITY), 3);
    let att = match keep {
        Some(m) => att * m.cast(q_dtype(&v)),
        None => att,
    };
    att.matmul(expand(v))
}

fn q_dtype(x: &Tensor<4>) -> DType {
    x.dtype()
}

/// Values and gradients of q, k, v (of the loss `sum(out * w)`) of `f`.
fn value_and_grads(
    [q, k, v]: [Tensor<4>; 3],
    w: &Tensor<4>,
    f: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> [Vec<f64>; 4] {
    let [q, k, v] = [q, k, v].map(|x| x.require_grad());
    let out = f(q.clone(), k.clone(), v.clone());
    let loss = (out.clone() * w.clone().cast(out.dtype())).sum();
    let grads = loss.backward();
    [
        f64s(out),
        f64s(q.grad(&grads).unwrap()),
        f64s(k.grad(&grads).unwrap()),
        f64s(v.grad(&grads).unwrap()),
    ]
}

/// A geometry of the grid: `[b, hq, hkv, s, t, hd]`, the query offset, the tile size, the
/// sliding window, the left padding per sequence.
type Case = ([usize; 6], usize, usize, Option<usize>, &'static [usize]);

const CASES: [Case; 15] = [
    ([2, 4, 4, 7, 7, 8], 0, 3, None, &[]), // multi-head, odd length, tiles of 3
    ([1, 4, 2, 9, 9, 4], 0, 4, None, &[]), // grouped-query, 2 heads per key / value head
    ([2, 4, 1, 5, 5, 8], 0, 2, None, &[]), // one key / value head for all
    ([1, 2, 2, 3, 10, 8], 7, 4, None, &[]), // KV cache: 3 new queries after 7 cached positions
    ([1, 4, 2, 1, 6, 8], 5, 128, None, &[]), // one decoding step
    ([2, 2, 1, 16, 16, 8], 0, 4, None, &[]), // tiles that divide
    ([1, 2, 2, 11, 11, 4], 0, 1, None, &[]), // tiles of one row
    // Sliding windows: tiles wholly before a window skipped, the window's edge masked.
    ([1, 4, 2, 13, 13, 4], 0, 3, Some(4), &[]), // window of 4 over tiles of 3
    ([2, 2, 1, 9, 9, 8], 0, 2, Some(2), &[]),   // each query sees itself and one key before
    // Query 11 sees keys 6..=11: none of tile 0..4, which its tile's query 8 sees.
    ([1, 2, 1, 12, 12, 8], 0, 4, Some(6), &[]),
    ([1, 2, 2, 3, 10, 8], 7, 4, Some(5), &[]), // a window after a KV cache
    ([1, 4, 2, 1, 9, 8], 8, 128, Some(3), &[]), // one decoding step in a window
    // Left padding (batched generation): over tiles, one sequence unpadded, a window too.
    ([3, 4, 2, 9, 9, 8], 0, 4, None, &[0, 5, 2]),
    ([2, 2, 1, 2, 12, 8], 10, 4, None, &[7, 0]), // decoding steps after a padded prefill
    ([2, 2, 2, 10, 10, 4], 0, 3, Some(4), &[6, 1]),
];

#[test]
fn fused_attention_equals_f64_loops_and_the_materialized_path() {
    let _rng = rng_lock();
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        // f64: both exact to rounding; f32 and bf16: each path rounds on its own (the fused one
        // in f32 tiles), so relative norms of differences.
        let (val_tol, grad_tol) = match dtype {
            DType::F64 => (1e-12, 1e-10),
            DType::F32 => (1e-5, 1e-4),
            _ => (2e-2, 4e-2),
        };
        let cases = CASES
            .iter()
            .enumerate()
            .flat_map(|(n, c)| [None, Some(0.8)].map(|cap| (n, c, cap)));
        for (n, &(geo, start, tile, window, padding), softcap) in cases {
            let [b, hq, hkv, s, t, hd] = geo;
            let tag = format!(
                "{dtype:?} case {n} (b {b} hq {hq} hkv {hkv} s {s} t {t} start {start} tile \
                 {tile} window {window:?} padding {padding:?} softcap {softcap:?})"
            );
            let inputs = qkv(geo, 11 + n as u64, dtype);
            let w = tensor(uniform(b * hq * s * hd, 99), [b, hq, s, hd], dtype);
            let spec = AttentionSpec {
                tile,
                window,
                padding: padding.to_vec(),
                softcap,
                ..AttentionSpec::causal(start)
            };
            let [out, dq, dk, dv] =
                value_and_grads(inputs.clone(), &w, |q, k, v| fused(q, k, v, spec.clone()));
            let [want, wdq, wdk, wdv] = value_and_grads(inputs.clone(), &w, |q, k, v| {
                materialized(q, k, v, start, window, padding, None, softcap)
            });
            let [q, k, v] = inputs.map(f64s);
            let exact = loops(
                &q,
                &k,
                &v,
                [b, hq, s, hd],
                [hkv, t],
                start,
                window,
                padding,
                None,
                softcap,
            );
            assert!(
                rel_norm(&out, &exact) <= val_tol,
                "{tag}: out vs loops {:.2e}",
                rel_norm(&out, &exact)
            );
            assert!(
                rel_norm(&want, &exact) <= val_tol,
                "{tag}: materialized vs loops"
            );
            for (name, got, want) in [("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)] {
                let err = rel_norm(&got, &want);
                assert!(err <= grad_tol, "{tag}: {name} {err:.2e}");
                assert!(want.iter().any(|x| x.abs() > 1e-6), "{tag}: {name} is zero");
            }
        }
    }
}

/// Dropout regenerated per tile is the materialized path's logical mask: the same values and
/// gradients, and both equal to the f64 loops with that mask.
#[test]
fn fused_dropout_is_the_logical_mask_of_the_materialized_path() {
    let _rng = rng_lock();
    let (b, hq, hkv, s, hd, p) = (2, 4, 2, 9, 8, 0.3);
    let key = DropoutKey {
        seed: 5,
        at: DropoutStep::new(3).with_batch(2, 6),
    };
    // This rank's part of the logical mask: batch rows 2..4 of 6, query heads 4..8 of 8.
    let full = [6, 8, s, s];
    let region = [2..4, 4..8, 0..s, 0..s];
    for tile in [2, 4, 128] {
        let inputs = qkv([b, hq, hkv, s, s, hd], 3, DType::F64);
        let w = tensor(uniform(b * hq * s * hd, 98), [b, hq, s, hd], DType::F64);
        let spec = AttentionSpec {
            tile,
            dropout: Some(AttentionDropout {
                p,
                key,
                site: 7,
                batch_total: 6,
                batch: 2..4,
                heads_total: 8,
                heads: 4..8,
                positions: None,
            }),
            start: 0,
            // With tiles of 2, a window too: dropout's mask inside the band.
            window: (tile == 2).then_some(3),
            padding: Vec::new(),
            // With tiles of 4, a scale of its own (Gemma's): the references take the queries
            // scaled by its ratio to 1 / sqrt(hd).
            scale: (tile == 4).then_some(0.3),
            // And a soft cap (Gemma 2's) on the scaled scores.
            softcap: (tile == 4).then_some(0.5),
            causal: true,
            key_lengths: Vec::new(),
            key_mask: Vec::new(),
        };
        let window = spec.window;
        let ratio = spec.scale.map_or(1.0, |s| s * (hd as f64).sqrt());
        let keep = dropout_mask(key, 7, full, region.clone(), p, &device());
        let [out, dq, dk, dv] =
            value_and_grads(inputs.clone(), &w, |q, k, v| fused(q, k, v, spec.clone()));
        let [want, wdq, wdk, wdv] = value_and_grads(inputs.clone(), &w, |q, k, v| {
            materialized(
                q.mul_scalar(ratio),
                k,
                v,
                0,
                window,
                &[],
                Some(keep.clone()),
                spec.softcap,
            )
        });
        let [q, k, v] = inputs.map(f64s);
        let q: Vec<f64> = q.iter().map(|x| x * ratio).collect();
        let exact = loops(
            &q,
            &k,
            &v,
            [b, hq, s, hd],
            [hkv, s],
            0,
            window,
            &[],
            Some(&f64s(keep.clone())),
            spec.softcap,
        );
        let tag = format!("tile {tile}");
        assert_close(&out, &exact, 1e-12, &format!("{tag}: out vs loops"));
        assert_close(
            &want,
            &exact,
            1e-12,
            &format!("{tag}: materialized vs loops"),
        );
        for (name, got, want) in [("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)] {
            assert_close(&got, &want, 1e-10, &format!("{tag}: {name}"));
        }
    }
}

/// Central differences in f64 through q, k and v at once (tiles of 2 over 5 positions, two
/// query heads per key / value head, a query offset), without and with a soft cap (Gemma 2's,
/// with a scale of its own).
#[test]
fn fused_attention_passes_a_finite_difference_gradcheck() {
    let _rng = rng_lock();
    for (scale, softcap) in [(None, None), (Some(0.7), Some(0.6))] {
        let report = run_local(1, move |g| {
            let [q, k, v] = qkv([1, 2, 1, 3, 5, 4], 21, DType::F64);
            let w = tensor(uniform(2 * 3 * 4, 22), [1, 2, 3, 4], DType::F64);
            let spec = AttentionSpec {
                tile: 2,
                scale,
                softcap,
                ..AttentionSpec::causal(2)
            };
            // One input tensor for the checker: q, k, v stacked along the batch dim of a [3, ..].
            let packed = Tensor::cat(
                vec![
                    q.reshape([1, 2, 3, 4]).reshape([1, 24]),
                    k.reshape([1, 20]).pad_last(4),
                    v.reshape([1, 20]).pad_last(4),
                ],
                0,
            );
            gradcheck(
                &g,
                &[packed],
                LossKind::Replicated,
                GradcheckOptions::default(),
                |x| {
                    let x = x[0].clone();
                    let q = x.clone().narrow(0, 0, 1).reshape([1, 2, 3, 4]);
                    let k = x
                        .clone()
                        .narrow(0, 1, 1)
                        .narrow(1, 0, 20)
                        .reshape([1, 1, 5, 4]);
                    let v = x.narrow(0, 2, 1).narrow(1, 0, 20).reshape([1, 1, 5, 4]);
                    (fused(q, k, v, spec.clone()) * w.clone()).sum()
                },
            )
        })
        .unwrap()
        .remove(0);
        let report = report.unwrap();
        assert!(report.checked > 0, "{report:?}");
    }
}

trait PadLast {
    fn pad_last(self, n: usize) -> Self;
}

impl PadLast for Tensor<2> {
    fn pad_last(self, n: usize) -> Self {
        let [r, _] = self.dims();
        let zeros = Tensor::<2>::zeros([r, n], (&self.device(), self.dtype()));
        Tensor::cat(vec![self, zeros], 1)
    }
}

fn ids(values: Vec<i64>, s: usize, b: usize) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(values, [s, b]), &device())
}

/// The GPT and the Llama (dropout on, grouped-query) at sequences of several tiles (260
/// positions: a full tile of 256 and a part; and 14 positions in tiles of 4, so the last rows'
/// online softmax rescales its running sums up to three times), tp 1 and 2, both modes, in f32
/// (the CPU kernel): the fused attention gives the materialized path's loss and gradients.
#[test]
fn the_models_fused_equal_the_materialized_path_over_several_tiles() {
    let _rng = rng_lock();
    for (s, tile) in [(260usize, 256usize), (14, 4)] {
        let (b, v) = (1usize, 13usize);
        let x = crate::common::token_ids(s * b, v, 7, 3);
        let y = crate::common::token_ids(s * b, v, 5, 1);
        for llama in [false, true] {
            for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
                for tp in [1usize, 2] {
                    let run = |fused: bool| {
                        device().seed(31);
                        let (x, y) = (x.clone(), y.clone());
                        run_local(tp, move |g| {
                            let settings = TpSettings::new()
                                .with_mode(mode)
                                .with_fused_attention(fused)
                                .with_attention_tile(tile);
                            let (loss, grads) = if llama {
                                let model = LlamaConfig::new(v, s, 16, 4, 2, 1, 16)
                                    .with_dropout(0.2)
                                    .with_settings(settings)
                                    .init(&g, &device())
                                    .unwrap();
                                let step = Some(DropoutStep::new(2));
                                let loss = model
                                    .try_loss(
                                        ids(x.clone(), s, b),
                                        ids(y.clone(), s, b),
                                        None,
                                        step,
                                    )
                                    .unwrap()
                                    .mean;
                                let grads = loss.backward();
                                let full = full_grads(&model, &grads);
                                (f64s(loss), crate::common::param_values(&full))
                            } else {
                                let model = GptConfig::new(v, s, 16, 4, 1)
                                    .with_settings(settings)
                                    .init(&g, &device())
                                    .unwrap();
                                let loss = model.loss(ids(x.clone(), s, b), ids(y.clone(), s, b));
                                let grads = loss.backward();
                                let full = full_grads(&model, &grads);
                                (f64s(loss), crate::common::param_values(&full))
                            };
                            (loss, grads)
                        })
                        .unwrap()
                        .remove(0)
                    };
                    let (loss, grads) = run(true);
                    let (want_loss, want_grads) = run(false);
                    let tag = format!("s {s} tile {tile} llama {llama} {mode:?} tp {tp}");
                    assert_close(&loss, &want_loss, 1e-5, &format!("{tag}: loss"));
                    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                        assert_close(g, w, 1e-4, &format!("{tag}: gradient {i}"));
                    }
                }
            }
        }
    }
}

/// `Llama3RopeScaling::apply` against transformers' `_compute_llama3_parameters`, worked by hand
/// at Llama 3.1's settings (factor 8, low / high frequency factors 1 / 4, original context
/// 8192: wavelengths below 2048 kept, above 8192 divided by 8, between them blended): a
/// wavelength of 2 pi (kept), 16384 (divided), 4096 (smooth 1/3: 5/12 of it), and the two edges
/// 2048 (smooth 1: kept) and 8192 (smooth 0: divided), where the blend meets each branch.
#[test]
fn llama3_rope_scaling_scales_each_band_as_transformers() {
    use burn_tp::attention::Llama3RopeScaling;
    let scaling = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let tau = 2.0 * std::f64::consts::PI;
    let cases = [
        (1.0, 1.0),
        (tau / 16384.0, tau / 16384.0 / 8.0),
        (tau / 4096.0, tau / 4096.0 * 5.0 / 12.0),
        (tau / 2048.0, tau / 2048.0),
        (tau / 8192.0, tau / 8192.0 / 8.0),
    ];
    let freqs: Vec<f32> = cases.iter().map(|c| c.0 as f32).collect();
    let n = freqs.len();
    let device = burn::tensor::Device::flex();
    let got = scaling.apply(Tensor::<1>::from_data(TensorData::new(freqs, [n]), &device));
    let want: Vec<f64> = cases.iter().map(|c| c.1).collect();
    assert_close(&f64s(got), &want, 1e-6, "llama3-scaled inverse frequencies");
}

/// `DecodeCache::positions` counts each sequence's positions from its own first token (its left
/// padding at 0): a batch padded by 0, 2 and 3 positions, its first 4 positions.
#[test]
fn decode_positions_count_from_each_sequences_first_token() {
    use burn_tp::attention::DecodeCache;
    let cache = DecodeCache::with_padding(vec![0, 2, 3]);
    // Rows are positions, columns sequences.
    let want = vec![0, 0, 0, 1, 0, 0, 2, 0, 0, 3, 1, 0];
    assert_eq!(cache.positions(4, 3), want);
    assert_eq!(DecodeCache::default().positions(2, 2), vec![0, 0, 1, 1]);
}

/// A soft cap that binds (scores scaled up to several times the cap, so `1 - tanh^2` runs from
/// near 0 to 1) on every path of the kernel: f64 (the tensor-op tiles), f32 and bf16 (Flex's
/// CPU kernel), gradients held to the materialized path's; without the cap's slope in a
/// backward the gradients are off by far more than these tolerances.
#[test]
fn a_binding_soft_cap_has_its_slope_on_every_kernel_path() {
    let _rng = rng_lock();
    let (geo, gain, cap) = ([2, 4, 2, 9, 9, 8], 4.0, 0.5);
    let hd = geo[5];
    let mut off = Vec::new();
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4), (DType::BF16, 4e-2)] {
        let inputs = qkv(geo, 61, dtype);
        let [b, hq, _, s, _, _] = geo;
        let w = tensor(uniform(b * hq * s * hd, 62), [b, hq, s, hd], dtype);
        let spec = AttentionSpec {
            tile: 4,
            scale: Some(gain / (hd as f64).sqrt()),
            softcap: Some(cap),
            ..AttentionSpec::causal(0)
        };
        let got = value_and_grads(inputs.clone(), &w, |q, k, v| fused(q, k, v, spec.clone()));
        let want = value_and_grads(inputs, &w, |q, k, v| {
            materialized(q.mul_scalar(gain), k, v, 0, None, &[], None, Some(cap))
        });
        for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let err = rel_norm(&got[i], &want[i]);
            if err > tol {
                off.push(format!("{dtype:?} {name}: {err:.2e}"));
            }
        }
    }
    assert!(off.is_empty(), "{off:?}");
}
