//! The tiny GPT across tp: replicated parameters kept bitwise identical, the coalesced
//! all-reduce of their gradients, the tied head and separate Q / K / V (the burn-nn reference of
//! `reference.rs` checks the values).

use crate::common::{assert_close, device, f64s, rng_lock};
use crate::loss::ids;
use burn::module::Param;
use burn::tensor::Tensor;
use burn_tp::comm::LocalGroup;
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;

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
                        // The first batch again, after the steps.
                        let x: Vec<i64> = (0..16).map(|i| (i * 7) % 24).collect();
                        let y: Vec<i64> = (0..16).map(|i| (i * 5 + 1) % 24).collect();
                        losses.push(f64s(model.loss(ids(x, [8, 2]), ids(y, [8, 2])))[0]);
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
                assert!(
                    all[0][3] < all[0][0],
                    "it learns its first batch: {:?}",
                    all[0]
                );
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
    use burn_tp::comm::LocalGroupOptions;
    use burn_tp::local::run_ranks;
    use burn_tp::norm::ReplicatedGrads;
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

/// The GPT's learned positions in a left-padded batch: at tp 1 and 4, the model built in either
/// mode and decoding in ALL_REDUCE mode, each prompt's logits at every one of its positions in
/// the padded prefill equal its logits alone (each row's positions counted from its own first
/// token, as `DecodeCache::positions` says), and `generate_batch` gives each prompt the tokens
/// it gives alone.
#[test]
fn batched_generation_counts_each_rows_positions_from_its_first_token() {
    use burn::module::Module;
    use burn::tensor::{Int, TensorData};
    use burn_tp::attention::DecodeCache;
    use burn_tp::generate::{GenerateOptions, generate, generate_batch};
    use burn_tp::model::LanguageModel;
    use burn_tp::ops::gather_from_tp_region;
    let _rng = rng_lock();
    let prompts = vec![vec![3, 1, 4, 1, 5, 9], vec![2, 6], vec![5, 3, 5]];
    let longest = 6;
    let options = GenerateOptions {
        max_new_tokens: 5,
        ..Default::default()
    };
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for tp in [1usize, 4] {
            device().seed(17);
            let ps = prompts.clone();
            let out = run_local(tp, move |g| {
                let model = GptConfig::new(11, 16, 16, 4, 2)
                    .with_settings(TpSettings::new().with_mode(mode))
                    .init(&g, &device())
                    .unwrap()
                    .with_mode(TpMode::AllReduce)
                    .valid();
                // `[s, b, vocab]` logits of `ids` (`[s, b]` row-major) through `cache`.
                let logits = |ids: Vec<i64>, b: usize, cache: &mut DecodeCache| -> Vec<f64> {
                    let s = ids.len() / b;
                    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [s, b]), &device());
                    let l = model.logits_cached(ids, cache).unwrap();
                    f64s(gather_from_tp_region(l, 2, &g).unwrap().narrow(2, 0, 11))
                };
                let padding: Vec<usize> = ps.iter().map(|p| longest - p.len()).collect();
                let ids: Vec<i64> = (0..longest)
                    .flat_map(|i| {
                        ps.iter().zip(&padding).map(
                            move |(p, &pad)| {
                                if i < pad { 7 } else { p[i - pad] }
                            },
                        )
                    })
                    .collect();
                let batched = logits(
                    ids,
                    ps.len(),
                    &mut DecodeCache::with_padding(padding.clone()),
                );
                let mut pairs = Vec::new();
                for (r, p) in ps.iter().enumerate() {
                    let alone = logits(p.clone(), 1, &mut DecodeCache::default());
                    for i in 0..p.len() {
                        let at = ((padding[r] + i) * ps.len() + r) * 11;
                        pairs.push((
                            batched[at..at + 11].to_vec(),
                            alone[i * 11..(i + 1) * 11].to_vec(),
                        ));
                    }
                }
                let batch = generate_batch(&model, &ps, &options, &g, &device()).unwrap();
                let alone: Vec<Vec<i64>> = ps
                    .iter()
                    .map(|p| generate(&model, p, &options, &g, &device()).unwrap())
                    .collect();
                (pairs, batch, alone)
            })
            .unwrap();
            for (r, (pairs, batch, alone)) in out.into_iter().enumerate() {
                let tag = format!("{mode:?} tp {tp} rank {r}");
                for (k, (b, a)) in pairs.iter().enumerate() {
                    assert_close(b, a, 1e-5, &format!("{tag}: logits {k}"));
                }
                assert_eq!(batch, alone, "{tag}");
            }
        }
    }
}
