//! The MoE Llama at tp x ep: its losses and gradients against the unsplit model's, training at
//! dp x ep (buckets, the distributed optimizer) against ep 1, recompute.

use burn::tensor::Tensor;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;

use crate::common::{assert_close, f64s};

/// A Llama whose second block is a mixture of experts (Qwen2-MoE's shape: a shared expert
/// behind its gate; the first block dense, `mlp_only_layers`), the aux and z-losses on.
fn moe_llama(mode: TpMode) -> burn_tp::llama::LlamaConfig {
    use burn_tp::moe::ExpertsConfig;
    burn_tp::llama::LlamaConfig::new(40, 16, 16, 4, 2, 2, 32)
        .with_experts(Some(
            ExpertsConfig::new(4, 2, 16)
                .with_shared_expert(Some(16))
                .with_mlp_only_layers(vec![0])
                .with_aux_loss_coef(0.05)
                .with_z_loss_coef(0.01),
        ))
        .with_settings(TpSettings::new().with_mode(mode).with_attention_tile(4))
}

#[test]
fn a_moe_llama_gives_the_unsplit_losses_and_gradients_at_every_tp_x_ep() {
    use crate::common::{full_grads, param_values, token_ids};
    use burn::module::Module;
    use burn::tensor::{Int, TensorData};
    use burn_tp::llama::Llama;
    use burn_tp::model::LanguageModel;
    use burn_tp::reshard::Reshard;
    let _lock = crate::common::rng_lock();
    for (n_tp, n_ep, mode) in [
        (1, 2, TpMode::AllReduce),
        (2, 2, TpMode::AllReduce),
        (2, 2, TpMode::ReduceScatter),
        (1, 4, TpMode::AllReduce),
    ] {
        crate::common::device().seed(7);
        run_local(n_tp * n_ep, move |world| {
            let (q, r) = (world.rank() / n_tp, world.rank() % n_tp);
            let tp = world.split(q, r).unwrap();
            let ep = world.split(n_ep + r, q).unwrap();
            let solo = world.split(world.rank(), 0).unwrap();
            let device = crate::common::device();
            // The unsplit model, the same on every rank (world rank 0's draws).
            let full = moe_llama(mode).init(&solo, &device).unwrap();
            let full = burn_tp::dp::broadcast_parameters(full, &world).unwrap();
            // Replica q's batch: [seq 8, batch 2].
            let ids = |add: i64| {
                let v = token_ids(16, 40, 7, add + 3 * q as i64);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let (x, y) = (ids(0), ids(1));
            let loss_of = |m: &Llama| {
                let loss = LanguageModel::loss(m, x.clone(), y.clone(), None).unwrap();
                let value = f64s(loss.clone())[0];
                (value, loss.backward())
            };
            let (want, g_full) = loss_of(&full);
            let want_grads = full.clone().map(&mut crate::common::ToGrads(&g_full));
            let model = Llama::shard_module(&full, &tp)
                .unwrap()
                .expert_parallel(&ep)
                .unwrap();
            let (got, g) = loss_of(&model);
            let got_grads = full_grads(&model, &g);
            let at = format!("tp {n_tp} x ep {n_ep} {mode:?}, replica {q} tp rank {r}");
            assert_close(&[got], &[want], 1e-5, &format!("{at}: loss"));
            // The experts' parameters divide by ep (and by tp within each expert).
            let count = |m: &Llama| -> usize {
                m.blocks
                    .iter()
                    .filter_map(|b| b.moe.as_ref())
                    .flat_map(|m| param_values(&m.experts))
                    .map(|v| v.len())
                    .sum()
            };
            assert_eq!(
                count(&model) * n_ep * n_tp,
                count(&full),
                "{at}: expert parameters"
            );
            let same = |a: Vec<Vec<f64>>, b: Vec<Vec<f64>>, what: &str| {
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    assert_close(a, b, 1e-4, &format!("{at}: {what} {i}"));
                }
            };
            same(
                param_values(&got_grads.tok),
                param_values(&want_grads.tok),
                "tok",
            );
            same(
                param_values(&got_grads.norm),
                param_values(&want_grads.norm),
                "norm",
            );
            for (b, (gb, wb)) in got_grads.blocks.iter().zip(&want_grads.blocks).enumerate() {
                same(
                    param_values(&gb.attn),
                    param_values(&wb.attn),
                    &format!("block {b} attn"),
                );
                same(
                    param_values(&gb.mlp),
                    param_values(&wb.mlp),
                    &format!("block {b} mlp"),
                );
                let (Some(gm), Some(wm)) = (&gb.moe, &wb.moe) else {
                    assert!(gb.moe.is_none() && wb.moe.is_none(), "{at}: block {b}");
                    continue;
                };
                same(param_values(&gm.router), param_values(&wm.router), "router");
                same(param_values(&gm.shared), param_values(&wm.shared), "shared");
                same(
                    param_values(&gm.shared_gate),
                    param_values(&wm.shared_gate),
                    "gate",
                );
                // Each local expert's gradient: the sum over every replica's tokens.
                let flat = |m: &burn_tp::transformer::ParallelSwiGlu| -> Vec<f64> {
                    param_values(m).into_iter().flatten().collect()
                };
                let all: Vec<f64> = wm.experts.iter().flat_map(flat).collect();
                let summed = ep.all_reduce(all, burn_tp::comm::ReduceOp::Sum).unwrap();
                let (per, size) = (4 / n_ep, summed.len() / 4);
                for (j, expert) in gm.experts.iter().enumerate() {
                    let e = q * per + j;
                    let want = &summed[e * size..(e + 1) * size];
                    assert_close(
                        &flat(expert),
                        want,
                        1e-4,
                        &format!("{at}: block {b} expert {e}"),
                    );
                }
            }
        })
        .unwrap();
    }
}

/// A rank's view of a MoE Llama: its non-expert parameters (tp gathered) and its experts' by
/// (block, global expert).
type Split = (Vec<Vec<f64>>, Vec<((usize, usize), Vec<f64>)>);

fn split_params(model: &burn_tp::llama::Llama, first_expert: usize) -> Split {
    use crate::common::param_values;
    use burn_tp::reshard::Reshard;
    let full = model.to_full_module().unwrap();
    let mut dense = param_values(&full.tok);
    dense.extend(param_values(&full.norm));
    let mut experts = Vec::new();
    for (b, block) in full.blocks.iter().enumerate() {
        dense.extend(param_values(&block.attn));
        dense.extend(param_values(&block.attn_norm));
        dense.extend(param_values(&block.mlp_norm));
        dense.extend(param_values(&block.mlp));
        if let Some(m) = &block.moe {
            dense.extend(param_values(&m.router));
            dense.extend(param_values(&m.shared));
            dense.extend(param_values(&m.shared_gate));
            for (j, e) in m.experts.iter().enumerate() {
                let v = param_values(e).into_iter().flatten().collect();
                experts.push(((b, first_expert + j), v));
            }
        }
    }
    (dense, experts)
}

/// How [`train_moe`] reduces the gradients over dp.
#[derive(Clone, Copy, Debug)]
enum Sync {
    /// After the backward.
    After,
    /// In buckets of this many bytes during the backward.
    Buckets(usize),
    /// The distributed optimizer (buckets of this many bytes).
    Zero(usize),
}

/// Three AdamW steps of the MoE Llama at tp x dp with the experts over `ep` (of the dp ranks),
/// each dp rank on its own batches: per world rank, its (dp rank, losses, parameters after).
fn train_moe(n_tp: usize, dp: usize, ep: usize, mode: TpMode) -> Vec<(usize, Vec<f64>, Split)> {
    train_moe_with(n_tp, dp, ep, mode, Sync::After)
}

/// [`train_moe`], the gradients reduced as `sync` says.
fn train_moe_with(
    n_tp: usize,
    dp: usize,
    ep: usize,
    mode: TpMode,
    sync: Sync,
) -> Vec<(usize, Vec<f64>, Split)> {
    use crate::common::token_ids;
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Int, TensorData};
    use burn_tp::dp::{
        DistributedAdamW, DpOptimizer, Experts, GradReducer, ReduceGroups, broadcast_parameters,
    };
    use burn_tp::llama::Llama;
    use burn_tp::mesh::DeviceMesh;
    use burn_tp::model::LanguageModel;
    use burn_tp::reshard::Reshard;
    crate::common::device().seed(11);
    run_local(n_tp * dp, move |world| {
        let mesh = DeviceMesh::new(world.clone(), n_tp).unwrap();
        let (ep_group, expert_dp) = mesh.expert_groups(ep).unwrap();
        let solo = world.split(world.rank(), 0).unwrap();
        let device = crate::common::device();
        // The unsplit model, world rank 0's draws (drawn before any other rank's, so the
        // same in every run), the same everywhere; then this rank's tp shard and experts.
        let draw = || moe_llama(mode).init(&solo, &device).unwrap();
        let full = if world.rank() == 0 {
            let full = draw();
            world.barrier().unwrap();
            full
        } else {
            world.barrier().unwrap();
            draw()
        };
        let full = broadcast_parameters(full, &world).unwrap();
        let mut model = Llama::shard_module(&full, mesh.tp_group())
            .unwrap()
            .expert_parallel(&ep_group)
            .unwrap();
        let experts = Experts {
            params: model.expert_params().into_iter().collect(),
            group: expert_dp,
        };
        let groups = ReduceGroups {
            summed: None,
            experts: Some(experts.clone()),
        };
        let dp_group = mesh.dp_group();
        let optim = match sync {
            Sync::After => DpOptimizer::new(AdamWConfig::new().init()),
            Sync::Buckets(bytes) => DpOptimizer::new(AdamWConfig::new().init())
                .with_reducer(GradReducer::with_groups(&model, dp_group, bytes, groups)),
            Sync::Zero(bytes) => {
                let config = AdamWConfig::new();
                let zero = DistributedAdamW::with_groups(&config, &model, dp_group, bytes, groups);
                DpOptimizer::distributed(config.init(), zero, config)
            }
        };
        let mut optim = optim.with_experts(experts);
        let d = mesh.dp_rank();
        let mut losses = Vec::new();
        for step in 0..3i64 {
            let ids = |add: i64| {
                let v = token_ids(16, 40, 5 + step, add + 7 * d as i64);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let view = optim.attach(model.clone());
            let loss = LanguageModel::loss(&view, ids(0), ids(1), None).unwrap();
            losses.push(f64s(loss.clone())[0]);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let working = model.clone();
            model = optim
                .step(1e-2, model, &working, grads, mesh.dp_group())
                .unwrap();
        }
        let per = 4 / ep;
        (d, losses, split_params(&model, ep_group.rank() * per))
    })
    .unwrap()
}

#[test]
fn moe_training_at_dp_x_ep_gives_the_ep_1_runs_losses_and_parameters() {
    let _lock = crate::common::rng_lock();
    for (n_tp, dp, ep, mode) in [
        (1, 4, 2, TpMode::AllReduce),
        (1, 4, 4, TpMode::AllReduce),
        (2, 2, 2, TpMode::ReduceScatter),
    ] {
        let at = format!("tp {n_tp} x dp {dp} x ep {ep} {mode:?}");
        let plain = train_moe(n_tp, dp, 1, mode);
        let split = train_moe(n_tp, dp, ep, mode);
        for ((d, want_losses, (want_dense, want_experts)), (d2, losses, (dense, experts))) in
            plain.iter().zip(&split)
        {
            assert_eq!(d, d2);
            assert_close(
                losses,
                want_losses,
                1e-5,
                &format!("{at}: dp rank {d} losses"),
            );
            for (i, (a, b)) in dense.iter().zip(want_dense).enumerate() {
                assert_close(a, b, 1e-5, &format!("{at}: dp rank {d} parameter {i}"));
            }
            assert_eq!(experts.len() * ep, want_experts.len(), "{at}");
            for (key, v) in experts {
                let (_, want) = want_experts.iter().find(|(k, _)| k == key).unwrap();
                assert_close(v, want, 1e-5, &format!("{at}: dp rank {d} expert {key:?}"));
            }
        }
    }
}

/// The experts' gradients reduced in buckets during the backward, or sharded by the
/// distributed optimizer over the ranks holding the same experts, give the ep 1 run's
/// (reduced after the backward) losses and parameters. Buckets of one parameter each and of
/// everything: the experts' buckets stay apart from the dense ones either way.
#[test]
fn moe_training_with_buckets_or_the_distributed_optimizer_gives_the_ep_1_runs() {
    let _lock = crate::common::rng_lock();
    for (n_tp, dp, ep, mode) in [
        (1, 4, 2, TpMode::AllReduce),
        (2, 2, 2, TpMode::ReduceScatter),
    ] {
        let plain = train_moe(n_tp, dp, 1, mode);
        for sync in [
            Sync::Buckets(1),
            Sync::Buckets(1 << 30),
            Sync::Zero(1 << 30),
        ] {
            let at = format!("tp {n_tp} x dp {dp} x ep {ep} {mode:?} {sync:?}");
            let split = train_moe_with(n_tp, dp, ep, mode, sync);
            for ((d, want_losses, (want_dense, want_experts)), (_, losses, (dense, experts))) in
                plain.iter().zip(&split)
            {
                assert_close(losses, want_losses, 1e-5, &format!("{at}: dp {d} losses"));
                for (i, (a, b)) in dense.iter().zip(want_dense).enumerate() {
                    assert_close(a, b, 1e-5, &format!("{at}: dp {d} parameter {i}"));
                }
                for (key, v) in experts {
                    let (_, want) = want_experts.iter().find(|(k, _)| k == key).unwrap();
                    assert_close(v, want, 1e-5, &format!("{at}: dp {d} expert {key:?}"));
                }
            }
        }
    }
}

/// Full recompute of a MoE Llama (a dense and a MoE block, the aux and z-losses on) gives the
/// plain backward's loss and gradients: the routers' loss spans the blocks, each recomputed
/// block's part of its gradient taken with the others held.
#[test]
fn recompute_of_a_moe_llama_gives_the_plain_loss_and_gradients() {
    use crate::common::{param_values, token_ids};
    use burn::module::Module;
    use burn::optim::GradientsParams;
    use burn::tensor::{Int, TensorData};
    use burn_tp::model::LanguageModel;
    let _lock = crate::common::rng_lock();
    for (n_tp, mode) in [(1, TpMode::AllReduce), (2, TpMode::ReduceScatter)] {
        crate::common::device().seed(5);
        run_local(n_tp, move |tp| {
            let device = crate::common::device();
            let model = moe_llama(mode).init(&tp, &device).unwrap();
            let ids = |add: i64| {
                let v = token_ids(16, 40, 3, add);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let loss = LanguageModel::loss(&model, ids(0), ids(1), None).unwrap();
            let want = f64s(loss.clone())[0];
            let plain = GradientsParams::from_grads(loss.backward(), &model);
            let (got, grads) =
                burn_tp::recompute::loss_and_grads(&model, ids(0), ids(1), None).unwrap();
            let at = format!("tp {n_tp} {mode:?}");
            assert_close(&[f64s(got)[0]], &[want], 1e-6, &format!("{at}: loss"));
            let as_values = |g: &GradientsParams| param_values(&model.clone().map(&mut GradsOf(g)));
            for (i, (a, b)) in as_values(&grads).iter().zip(&as_values(&plain)).enumerate() {
                assert_close(a, b, 1e-5, &format!("{at}: gradient {i}"));
            }
        })
        .unwrap();
    }
}

/// Every parameter replaced by its gradient in `GradientsParams`.
struct GradsOf<'a>(&'a burn::optim::GradientsParams);

impl burn::module::ModuleMapper for GradsOf<'_> {
    fn map_float<const R: usize>(
        &mut self,
        param: burn::module::Param<Tensor<R>>,
    ) -> burn::module::Param<Tensor<R>> {
        let g = self
            .0
            .get::<R>(param.id)
            .expect("every parameter has a gradient");
        param.map(|_| g)
    }
}
