//! The Llama-class model against an independent reference written only with burn-nn's own
//! modules and Burn's tensor ops (`Embedding`, `RmsNorm`, `Linear`, `RotaryEncoding`, `SwiGlu`,
//! `softmax`, `CrossEntropyLoss`), loaded with the same full weights, applying the same logical
//! dropout masks: the logits, the loss and every gradient at tp = 1, 2, 4, both modes, with `n_kv_heads` = 1,
//! < tp, = tp and > tp, a vocabulary tp does not divide, masked and ignored tokens, dropout on and
//! off, tied and untied heads, Qwen3's per-head q / k norms and a sliding window. And checkpoints
//! that move between tp sizes.

use burn::module::Param;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, Linear, RmsNorm, RotaryEncoding, RotaryEncodingConfig, SwiGlu};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, FloatDType, Gradients, Int, Tensor, TensorData};
use burn_tp::dropout::{DropoutKey, DropoutStep, dropout_mask};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::ops::gather_from_tp_region;
use burn_tp::reshard::Reshard;

use crate::common::{Path, assert_close, device, f64s, full_grads, rel_norm, rng_lock};

const V: usize = 11; // not a multiple of 2 or 4: padded to 12
const S: usize = 8;
const B: usize = 2;
const D: usize = 16;
const H: usize = 4;
const HD: usize = D / H;
const FF: usize = 8;
const P: f64 = 0.2;
const SEED: u64 = 99;
const IGNORE: i64 = -100;
/// The sliding window of the windowed cases (shorter than `S`).
const WINDOW: usize = 3;

fn config(n_kv: usize, mode: TpMode, dropout: bool, tied: bool) -> LlamaConfig {
    LlamaConfig::new(V, S, D, H, n_kv, 2, FF)
        .with_norm_eps(norm_eps(n_kv))
        .with_qk_norm(qk_norm(n_kv))
        .with_sliding_window(window(dropout))
        .with_settings(TpSettings::new().with_mode(mode))
        .with_dropout(if dropout { P } else { 0.0 })
        .with_dropout_seed(SEED)
        .with_tie_embeddings(tied)
        .with_ignore_index(Some(IGNORE))
}

/// Qwen3's per-head q / k norms in the cases with one key / value head (replicated at tp 2
/// and 4) and with four (sharded at every tp).
fn qk_norm(n_kv: usize) -> bool {
    n_kv != 2
}

/// A large epsilon in the cases with four key / value heads (the block norms' and the q / k
/// norms'), so every RMSNorm's values and gradients depend on it in f32 too.
fn norm_eps(n_kv: usize) -> f64 {
    if n_kv == 4 { 0.25 } else { 1e-5 }
}

/// A sliding window in the cases with dropout.
fn window(dropout: bool) -> Option<usize> {
    dropout.then_some(WINDOW)
}

/// A Llama block in plain burn-nn, batch-major (`[b, s, d]`).
struct RefBlock {
    attn_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Per-head RMSNorms of q and k (Qwen3's).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    mlp_norm: RmsNorm,
    swiglu: SwiGlu,
    down: Linear,
}

struct RefLlama {
    tok: Embedding,
    blocks: Vec<RefBlock>,
    norm: RmsNorm,
    /// `None`: tied to `tok`.
    head: Option<Linear>,
    rope: RotaryEncoding,
    n_kv: usize,
    window: Option<usize>,
}

fn linear(w: Tensor<2>) -> Linear {
    Linear {
        weight: Param::from_tensor(w.detach()),
        bias: None,
    }
}

/// Columns `from..from + n` of a `Linear`'s weight.
fn columns(l: &Linear, from: usize, n: usize) -> Linear {
    linear(l.weight.val().narrow(1, from, n))
}

impl RefLlama {
    fn load(full: &Llama, n_kv: usize) -> Self {
        let blocks = full
            .blocks
            .iter()
            .map(|b| {
                let qkv = b.attn.qkv[0].to_full().unwrap();
                let mlp = b.mlp.as_ref().expect("a dense block");
                let gate_up = mlp.gate_up.to_full().unwrap();
                RefBlock {
                    attn_norm: b.attn_norm.to_full(),
                    q: columns(&qkv, 0, H * HD),
                    k: columns(&qkv, H * HD, n_kv * HD),
                    v: columns(&qkv, (H + n_kv) * HD, n_kv * HD),
                    o: b.attn.out.to_full().unwrap(),
                    qk_norm: b
                        .attn
                        .q_norm
                        .as_ref()
                        .zip(b.attn.k_norm.as_ref())
                        .map(|(q, k)| (q.to_full(), k.to_full())),
                    mlp_norm: b.mlp_norm.to_full(),
                    swiglu: SwiGlu {
                        linear_inner: columns(&gate_up, 0, FF),
                        linear_outer: columns(&gate_up, FF, FF),
                    },
                    down: mlp.down.to_full().unwrap(),
                }
            })
            .collect();
        RefLlama {
            tok: full.tok.to_full().unwrap(),
            blocks,
            norm: full.norm.to_full(),
            head: full.head.as_ref().map(|h| h.to_full().unwrap()),
            rope: RotaryEncodingConfig::new(S, HD).init(&device()),
            n_kv,
            window: full.blocks[0].attn.sliding_window(),
        }
    }

    /// Logits `[s * b, V]` (seq-major rows) and the mean loss over the kept tokens; `step`:
    /// dropout on with that step's masks.
    fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: &[i64],
        mask: &[f32],
        step: Option<u64>,
    ) -> (Tensor<2>, Tensor<1>) {
        let dev = device();
        let key = step.map(|step| DropoutKey {
            seed: SEED,
            at: DropoutStep::new(step),
        });
        // The logical masks: `[s, b, d]` for the residual branches (seq-major, as the model's
        // activations), `[b, H, s, s]` for the attention probabilities.
        let drop = |x: Tensor<3>, site: u64| match key {
            Some(key) => {
                x * dropout_mask(key, site, [S, B, D], [0..S, 0..B, 0..D], P, &dev).swap_dims(0, 1)
            }
            None => x,
        };
        let mut x = self.tok.forward(ids.transpose()); // [b, s, d]
        // Query i sees keys j <= i (and j > i - w in a window w).
        let hidden: Vec<bool> = (0..S)
            .flat_map(|i| (0..S).map(move |j| j > i || self.window.is_some_and(|w| j + w <= i)))
            .collect();
        let causal =
            Tensor::<2, Bool>::from_data(TensorData::new(hidden, [S, S]), &dev).unsqueeze::<4>();
        // Query head h reads key / value head h / (H / n_kv).
        let kv_of = Tensor::<1, Int>::from_data(
            TensorData::new(
                (0..H)
                    .map(|h| (h / (H / self.n_kv)) as i64)
                    .collect::<Vec<_>>(),
                [H],
            ),
            &dev,
        );
        for (i, blk) in self.blocks.iter().enumerate() {
            let site = 1 + 3 * i as u64;
            let h = blk.attn_norm.forward(x.clone());
            let heads =
                |l: &Linear, n: usize| l.forward(h.clone()).reshape([B, S, n, HD]).swap_dims(1, 2);
            let (qn, kn) = match &blk.qk_norm {
                Some((qn, kn)) => (Some(qn), Some(kn)),
                None => (None, None),
            };
            // Each head's features normalized (over the last dim), before the rotation.
            let norm = |t: Tensor<4>, n: Option<&RmsNorm>| match n {
                Some(n) => n.forward(t),
                None => t,
            };
            // Rotated in the table's f32, back to the activations' dtype (as the model does).
            let rope = |t: Tensor<4>| {
                let dtype = t.dtype();
                self.rope.forward(t.cast(FloatDType::F32)).cast(dtype)
            };
            let q = rope(norm(heads(&blk.q, H), qn));
            let k = rope(norm(heads(&blk.k, self.n_kv), kn)).select(1, kv_of.clone());
            let v = heads(&blk.v, self.n_kv).select(1, kv_of.clone());
            let scores = q.matmul(k.swap_dims(2, 3)) / (HD as f64).sqrt();
            let mut att = softmax(scores.mask_fill(causal.clone(), f32::NEG_INFINITY), 3);
            if let Some(key) = key {
                att =
                    att * dropout_mask(key, site, [B, H, S, S], [0..B, 0..H, 0..S, 0..S], P, &dev);
            }
            let ctx = att.matmul(v).swap_dims(1, 2).reshape([B, S, H * HD]);
            x = x.clone() + drop(blk.o.forward(ctx), site + 1);
            let m = blk
                .down
                .forward(blk.swiglu.forward(blk.mlp_norm.forward(x.clone())));
            x = x + drop(m, site + 2);
        }
        let x = self.norm.forward(x);
        let logits = match &self.head {
            Some(head) => head.forward(x),
            None => x.matmul(self.tok.weight.val().transpose().unsqueeze::<3>()),
        };
        let logits = logits.swap_dims(0, 1).reshape([S * B, V]); // seq-major rows
        // The kept rows: mask 1 and target not ignored.
        let kept: Vec<i64> = (0..S * B)
            .filter(|&i| mask[i] > 0.0 && targets[i] != IGNORE)
            .map(|i| i as i64)
            .collect();
        let n = kept.len();
        let rows = Tensor::<1, Int>::from_data(TensorData::new(kept.clone(), [n]), &dev);
        let kept_targets: Vec<i64> = kept.iter().map(|&i| targets[i as usize]).collect();
        let loss = CrossEntropyLossConfig::new().init(&dev).forward(
            logits.clone().select(0, rows),
            Tensor::from_data(TensorData::new(kept_targets, [n]), &dev),
        );
        (logits, loss)
    }

    fn grads(&self, grads: &Gradients) -> Vec<(String, Vec<f64>)> {
        let g = |t: Tensor<2>| f64s(t.grad(grads).unwrap());
        let g1 = |t: Tensor<1>| f64s(t.grad(grads).unwrap());
        let mut out = vec![("tok".to_string(), g(self.tok.weight.val()))];
        for (i, b) in self.blocks.iter().enumerate() {
            out.push((format!("{i}.attn_norm"), g1(b.attn_norm.gamma.val())));
            for (name, l) in [("q", &b.q), ("k", &b.k), ("v", &b.v), ("o", &b.o)] {
                out.push((format!("{i}.{name}"), g(l.weight.val())));
            }
            if let Some((qn, kn)) = &b.qk_norm {
                out.push((format!("{i}.q_norm"), g1(qn.gamma.val())));
                out.push((format!("{i}.k_norm"), g1(kn.gamma.val())));
            }
            out.push((format!("{i}.mlp_norm"), g1(b.mlp_norm.gamma.val())));
            out.push((format!("{i}.gate"), g(b.swiglu.linear_inner.weight.val())));
            out.push((format!("{i}.up"), g(b.swiglu.linear_outer.weight.val())));
            out.push((format!("{i}.down"), g(b.down.weight.val())));
        }
        out.push(("norm".into(), g1(self.norm.gamma.val())));
        if let Some(h) = &self.head {
            out.push(("head".into(), g(h.weight.val())));
        }
        out
    }
}

/// The same names from the sharded model's gradients gathered to tp = 1.
fn model_grads(full: &Llama, n_kv: usize) -> Vec<(String, Vec<f64>)> {
    let r = RefLlama::load(full, n_kv);
    let w = |l: &Linear| f64s(l.weight.val());
    let mut out = vec![("tok".to_string(), f64s(r.tok.weight.val()))];
    for (i, b) in r.blocks.iter().enumerate() {
        out.push((format!("{i}.attn_norm"), f64s(b.attn_norm.gamma.val())));
        for (name, l) in [("q", &b.q), ("k", &b.k), ("v", &b.v), ("o", &b.o)] {
            out.push((format!("{i}.{name}"), w(l)));
        }
        if let Some((qn, kn)) = &b.qk_norm {
            out.push((format!("{i}.q_norm"), f64s(qn.gamma.val())));
            out.push((format!("{i}.k_norm"), f64s(kn.gamma.val())));
        }
        out.push((format!("{i}.mlp_norm"), f64s(b.mlp_norm.gamma.val())));
        out.push((format!("{i}.gate"), w(&b.swiglu.linear_inner)));
        out.push((format!("{i}.up"), w(&b.swiglu.linear_outer)));
        out.push((format!("{i}.down"), w(&b.down)));
    }
    out.push(("norm".into(), f64s(r.norm.gamma.val())));
    if let Some(h) = &r.head {
        out.push(("head".into(), w(h)));
    }
    out
}

fn batch() -> (Vec<i64>, Vec<i64>, Vec<f32>) {
    let ids = crate::common::token_ids(S * B, V, 7, 3);
    let mut targets = crate::common::token_ids(S * B, V, 5, 1);
    targets[3] = IGNORE;
    targets[10] = V as i64 - 1; // the last real id: next to the padding
    let mut mask = vec![1.0f32; S * B];
    mask[6] = 0.0;
    mask[13] = 0.0;
    (ids, targets, mask)
}

fn int2(values: Vec<i64>) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(values, [S, B]), &device())
}

#[test]
fn llama_equals_a_burn_nn_reference_at_every_tp_mode_and_kv_heads() {
    let _rng = rng_lock();
    let (ids, targets, mask) = batch();
    for n_kv in [1usize, 2, 4] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for dropout in [false, true] {
                let tied = n_kv == 2 && dropout;
                let cases = [1usize, 2, 4]
                    .into_iter()
                    .flat_map(|tp| Path::at(tp).iter().map(move |&path| (tp, path)));
                for (tp, path) in cases {
                    device().seed(41);
                    let (ids, targets, mask) = (ids.clone(), targets.clone(), mask.clone());
                    let out = path
                        .run(tp, move |g| {
                            // Tiles of 4 over the 8 positions: the CPU kernel's online
                            // softmax rescales across tiles.
                            let settings = TpSettings::new()
                                .with_mode(mode)
                                .with_schedule(path.schedule())
                                .with_attention_tile(4);
                            let model = config(n_kv, mode, dropout, tied)
                                .with_settings(settings)
                                .init(&g, &device())
                                .unwrap();
                            let step = dropout.then_some(DropoutStep::new(3));
                            let m = Tensor::<1>::from_floats(mask.as_slice(), &device())
                                .reshape([S, B]);
                            let loss = model
                                .try_loss(int2(ids.clone()), int2(targets.clone()), Some(m), step)
                                .unwrap()
                                .mean;
                            // The logits, gathered over the vocabulary, without the padding.
                            let logits = model.try_forward(int2(ids.clone()), step).unwrap();
                            let logits = gather_from_tp_region(logits, 2, &g).unwrap();
                            let logits = logits.narrow(2, 0, V).reshape([S * B, V]).detach();
                            let grads = loss.backward();
                            let full_grads = full_grads(&model, &grads);
                            // The reference, on this rank's thread, from the same full weights.
                            let reference = RefLlama::load(&model.to_full_module().unwrap(), n_kv);
                            let (ref_logits, ref_loss) = reference.loss(
                                int2(ids.clone()),
                                &targets,
                                &mask,
                                step.map(|s| s.step),
                            );
                            let ref_grads = ref_loss.backward();
                            (
                                [f64s(logits), f64s(ref_logits.detach())],
                                f64s(loss),
                                f64s(ref_loss),
                                model_grads(&full_grads, n_kv),
                                reference.grads(&ref_grads),
                            )
                        })
                        .unwrap();
                    for (r, (logits, loss, ref_loss, grads, ref_grads)) in
                        out.into_iter().enumerate()
                    {
                        let tag = format!(
                            "n_kv {n_kv} {mode:?} dropout {dropout} tied {tied} qk_norm {} \
                             window {:?} tp {tp} {path:?} rank {r}",
                            qk_norm(n_kv),
                            window(dropout)
                        );
                        assert_close(&logits[0], &logits[1], 1e-5, &format!("{tag}: logits"));
                        assert_close(&loss, &ref_loss, 1e-5, &format!("{tag}: loss"));
                        assert_eq!(grads.len(), ref_grads.len(), "{tag}");
                        for ((name, got), (ref_name, want)) in grads.iter().zip(&ref_grads) {
                            assert_eq!(name, ref_name);
                            assert!(want.iter().any(|v| v.abs() > 1e-7), "{tag}: {name} is zero");
                            assert_close(got, want, 1e-4, &format!("{tag}: grad {name}"));
                        }
                    }
                }
            }
        }
    }
}

/// `train_gpt --arch llama` (GQA with 2 key / value heads for 4 query heads, RoPE, RMSNorm,
/// SwiGLU, dropout 0.1, untied head, the corpus's real vocabulary, padded) gives the same loss
/// curve at tp = 1, 2, 4 and tp 2 x dp 2, in both modes; the model learns; and a checkpoint
/// saved at tp = 2 after 5 steps resumes at tp = 4 (and 1) into the uninterrupted 10-step curve
/// (weights, AdamW state, step count, dropout masks).
#[test]
fn train_gpt_llama_agrees_across_tp_and_resumes_across_tp() {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let dir = |name: &str| {
        let d = std::env::temp_dir().join(format!("burn-tp-llama-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    };
    let args = |extra: &[&str], out: &std::path::Path| {
        let mut argv = vec![
            "train_gpt",
            "--quiet",
            "--arch",
            "llama",
            "--batch",
            "4",
            "--seq",
            "8",
            "--d-model",
            "16",
            "--heads",
            "4",
            "--layers",
            "2",
            "--lr",
            "1e-2",
            "--sample-len",
            "8",
            "--eval-every",
            "5",
        ];
        argv.extend_from_slice(extra);
        argv.extend_from_slice(&["--out", out.to_str().unwrap()]);
        Args::try_parse_from(argv).unwrap()
    };
    let out = dir("ref");
    let reference = run(&args(&["--tp", "1", "--steps", "10"], &out))
        .unwrap()
        .losses;
    assert!(
        reference[9] < reference[0] - 0.3,
        "the model learns: {reference:?}"
    );
    for mode in ["reduce-scatter", "all-reduce"] {
        for (tp, dp) in [("2", "1"), ("4", "1"), ("2", "2")] {
            for path in Path::ALL {
                let mut extra = vec!["--tp", tp, "--dp", dp, "--mode", mode, "--steps", "10"];
                extra.extend(path.args());
                let losses = run(&args(&extra, &out)).unwrap().losses;
                assert_close(
                    &losses,
                    &reference,
                    1e-4,
                    &format!("tp {tp} dp {dp} {mode} {path:?}"),
                );
            }
        }
    }
    let first = dir("first");
    let saved = run(&args(&["--tp", "2", "--steps", "5"], &first)).unwrap();
    let ckpt = saved.checkpoint.to_str().unwrap().to_string();
    let [one_block, split, ring] = Path::ALL;
    for (tp, path, mode) in [
        ("4", one_block, "reduce-scatter"),
        ("4", ring, "reduce-scatter"),
        ("2", split, "all-reduce"),
        ("1", one_block, "reduce-scatter"),
    ] {
        let mut extra = vec![
            "--tp", tp, "--mode", mode, "--steps", "5", "--resume", &ckpt,
        ];
        extra.extend(path.args());
        let resumed = run(&args(&extra, &dir(&format!("{tp}-{path:?}")))).unwrap();
        assert_eq!(resumed.first_step, 5);
        assert_close(
            &resumed.losses,
            &reference[5..],
            1e-4,
            &format!("resumed at tp {tp} {mode} {path:?}"),
        );
    }
}

/// Head counts that do not fit are typed errors naming the values, before any communication.
#[test]
fn bad_head_counts_are_errors_naming_them() {
    use burn_tp::TpError;
    use burn_tp::comm::LocalGroup;
    let _rng = rng_lock();
    let groups = LocalGroup::new(3).unwrap();
    let g = &groups[0];
    let err = |c: LlamaConfig, g: &burn_tp::comm::ProcessGroup| c.init(g, &device()).unwrap_err();
    // 4 query heads at tp 3.
    let e = err(LlamaConfig::new(V, S, 16, 4, 2, 1, 6), g);
    assert!(
        matches!(e, TpError::NotDivisible { size: 4, tp: 3, .. }),
        "{e}"
    );
    // 2 key / value heads at tp 3: neither divides the other.
    let e = err(LlamaConfig::new(V, S, 24, 6, 2, 1, 6), g);
    assert!(e.to_string().contains("n_kv_heads = 2 at tp = 3"), "{e}");
    let solo = &LocalGroup::new(1).unwrap()[0];
    // 3 key / value heads for 4 query heads.
    let e = err(LlamaConfig::new(V, S, 16, 4, 3, 1, 8), solo);
    assert!(
        e.to_string()
            .contains("n_kv_heads = 3 must divide n_heads = 4"),
        "{e}"
    );
    // An odd head_dim (RoPE rotates pairs).
    let e = err(LlamaConfig::new(V, S, 12, 4, 2, 1, 8), solo);
    assert!(e.to_string().contains("even head_dim"), "{e}");
    let e = err(
        LlamaConfig::new(V, S, 16, 4, 2, 1, 8).with_dropout(1.0),
        solo,
    );
    assert!(e.to_string().contains("dropout"), "{e}");
    // An odd explicit head_dim, and a Llama 3 scaling with its factors the wrong way round.
    let e = err(
        LlamaConfig::new(V, S, 16, 4, 2, 1, 8).with_head_dim(Some(5)),
        solo,
    );
    assert!(e.to_string().contains("even head_dim (got 5)"), "{e}");
    let scaling = burn_tp::attention::Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 4.0,
        high_freq_factor: 1.0,
        original_max_position_embeddings: 16,
    };
    let e = err(
        LlamaConfig::new(V, S, 16, 4, 2, 1, 8).with_rope_scaling(Some(scaling)),
        solo,
    );
    assert!(
        e.to_string().contains("rope_scaling") && e.to_string().contains("low_freq_factor: 4.0"),
        "{e}"
    );
}

/// The Llama cast to bf16 / f16 against the burn-nn reference built from the same cast weights
/// (so it computes in that dtype too), both modes, tp 1 and 2, 2 key / value heads, untied: the
/// loss and every gradient, in norm relative to the reference's. Both rotate in f32 (the rotary
/// table's dtype) and round differently elsewhere (the sharded cross-entropy computes in f32,
/// the reference in the half dtype), so the bounds are those of a few roundings.
#[test]
fn the_llama_in_half_precision_equals_the_burn_nn_reference_in_the_same_dtype() {
    use burn::tensor::DType;
    use burn_tp::precision::cast_params;
    let _rng = rng_lock();
    let (ids, targets, mask) = batch();
    // Measured: the losses equal, gradients 1.1e-2 (bf16) / 1.3e-3 (f16) apart at worst.
    for (dtype, loss_tol, grad_tol) in [(DType::BF16, 1e-2, 3e-2), (DType::F16, 2e-3, 4e-3)] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for tp in [1usize, 2] {
                device().seed(41);
                let (ids, targets, mask) = (ids.clone(), targets.clone(), mask.clone());
                let out = run_local(tp, move |g| {
                    let model = config(2, mode, false, false).init(&g, &device()).unwrap();
                    let half = cast_params(model, FloatDType::from(dtype));
                    let m = Tensor::<1>::from_floats(mask.as_slice(), &device()).reshape([S, B]);
                    let loss = half
                        .try_loss(int2(ids.clone()), int2(targets.clone()), Some(m), None)
                        .unwrap()
                        .mean;
                    let grads = loss.backward();
                    let full_grads = full_grads(&half, &grads);
                    let reference = RefLlama::load(&half.to_full_module().unwrap(), 2);
                    let (_, ref_loss) = reference.loss(int2(ids.clone()), &targets, &mask, None);
                    let ref_grads = ref_loss.backward();
                    (
                        (loss.dtype(), ref_loss.dtype()),
                        f64s(loss)[0],
                        f64s(ref_loss)[0],
                        model_grads(&full_grads, 2),
                        reference.grads(&ref_grads),
                    )
                })
                .unwrap();
                for (r, (dtypes, loss, ref_loss, grads, ref_grads)) in out.into_iter().enumerate() {
                    let tag = format!("{dtype:?} {mode:?} tp {tp} rank {r}");
                    assert_eq!(dtypes.1, dtype, "{tag}: the reference runs in {dtype:?}");
                    let err = (loss - ref_loss).abs() / ref_loss.abs();
                    eprintln!("{tag}: loss {loss} vs {ref_loss} ({err:.2e})");
                    assert!(err <= loss_tol, "{tag}: loss {loss} vs {ref_loss}");
                    assert_eq!(grads.len(), ref_grads.len(), "{tag}");
                    let mut worst = 0f64;
                    for ((name, got), (ref_name, want)) in grads.iter().zip(&ref_grads) {
                        assert_eq!(name, ref_name);
                        let err = rel_norm(got, want);
                        worst = worst.max(err);
                        assert!(err <= grad_tol, "{tag}: grad {name}: {err:.3e}");
                    }
                    eprintln!("{tag}: worst gradient {worst:.2e}");
                }
            }
        }
    }
}
