//! Fully sharded data parallelism (`burn_tp::fsdp`): a step on the shards is the plain
//! data-parallel step. The loss, every gradient (the shards' reduce-scattered gradients
//! against the plain dp average cut the same way) and the parameters after two AdamW steps,
//! at fsdp 2 and 4 (x tp 1, 2, both tp modes), resharding after the forward or not, HSDP; a
//! rank's parameters and AdamW state divide by the shard count; a rank failing mid-gather.

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::dp::{average_gradients, broadcast_parameters};
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;

use crate::common::{device, f64s, param_values, rel_norm, rng_lock, token_ids};

const V: usize = 32;
const SEQ: usize = 8;
/// Each dp rank's batch.
const B: usize = 2;
const LR: f64 = 1e-2;

/// How a run shards: the shard group's size (1: plain dp), the replicas (HSDP), whether it
/// reshards after the forward.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    dp: usize,
    shard: usize,
    reshard: bool,
}

/// What each rank ends with: its losses, its gradients of the first step (for fsdp, its
/// shards'; for plain dp, the dp average cut into the shards `cut` names) and its tp shard of
/// every parameter after two steps.
type Out = (Vec<f64>, Vec<Vec<f64>>, Vec<Vec<f64>>);

/// `model` with each parameter replaced by its gradient in `grads`.
fn as_grads<M: Module>(model: M, grads: &GradientsParams) -> M {
    struct ToGrads<'a>(&'a GradientsParams);
    impl ModuleMapper for ToGrads<'_> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let g = self
                .0
                .get::<D>(p.id)
                .expect("every parameter has a gradient");
            p.map(|_| g)
        }
    }
    model.map(&mut ToGrads(grads))
}

fn run<M: LanguageModel>(config: M::Config, l: Layout, cut: usize) -> Vec<Out> {
    device().seed(3);
    run_local(l.tp * l.dp, move |world| {
        let mesh = DeviceMesh::new(world, l.tp).unwrap();
        let dp = mesh.dp_group().clone();
        if dp.rank() > 0 {
            dp.barrier().unwrap();
        }
        let model = M::init(&config, mesh.tp_group(), &device()).unwrap();
        if dp.rank() == 0 && dp.world_size() > 1 {
            dp.barrier().unwrap();
        }
        let mut model = broadcast_parameters(model, &dp).unwrap();
        let (shard, replicas) = mesh.fsdp_groups(l.shard.max(1)).unwrap();
        // The sharding the plain run's gradients are cut by, for the comparison.
        let (cut_group, _) = mesh.fsdp_groups(cut).unwrap();
        let cutter = Fsdp::new(&model, &cut_group);
        let fsdp = (l.shard > 0).then(|| {
            Fsdp::new(&model, &shard)
                .with_replicas(&replicas)
                .with_reshard_after_forward(l.reshard)
        });
        if let Some(f) = &fsdp {
            model = f.shard(model);
        }
        let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
        let (mut losses, mut first) = (Vec::new(), Vec::new());
        for step in 0..2 {
            let r = mesh.dp_rank() as i64;
            let int = |mul, add| {
                let v = token_ids(SEQ * B, V, mul, add + 5 * r + 11 * step);
                Tensor::<2, Int>::from_data(TensorData::new(v, [SEQ, B]), &device())
            };
            let (ids, targets) = (int(7, 3), int(5, 1));
            let dropout = Some(DropoutStep::new(step as u64).with_batch(r as usize * B, l.dp * B));
            let (loss, grads) = match &fsdp {
                Some(f) => {
                    let (loss, mut grads) =
                        f.loss_and_grads(&model, ids, targets, dropout).unwrap();
                    f.finish_grads(&model, &mut grads).unwrap();
                    if step == 0 {
                        first = param_values(&as_grads(model.clone(), &grads));
                    }
                    (loss, grads)
                }
                None => {
                    let loss = model.loss(ids, targets, dropout).unwrap();
                    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
                    average_gradients(&model, &mut grads, &dp).unwrap();
                    if step == 0 {
                        first = param_values(&cutter.shard(as_grads(model.clone(), &grads)));
                    }
                    (loss, grads)
                }
            };
            losses.push(f64s(loss)[0]);
            model = optim.step(LR, model, grads);
        }
        let model = match &fsdp {
            Some(f) => f.unshard(model).unwrap(),
            None => model,
        };
        (losses, first, param_values(&model))
    })
    .unwrap()
}

fn agree<M: LanguageModel>(tag: &str, config: impl Fn(TpMode) -> M::Config) {
    let _rng = rng_lock();
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for (tp, dp) in [(1, 2), (1, 4), (2, 2)] {
            for shard in [dp, 2] {
                let plain = Layout {
                    tp,
                    dp,
                    shard: 0,
                    reshard: false,
                };
                let want = run::<M>(config(mode), plain, shard);
                for reshard in [true, false] {
                    let l = Layout {
                        shard,
                        reshard,
                        ..plain
                    };
                    let got = run::<M>(config(mode), l, shard);
                    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                        let what = format!("{tag} {mode:?} {l:?} rank {rank}");
                        for (a, b) in g.0.iter().zip(&w.0) {
                            assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: loss {a} vs {b}");
                        }
                        assert_eq!(g.1.len(), w.1.len(), "{what}: parameters");
                        for (i, (a, b)) in g.1.iter().zip(&w.1).enumerate() {
                            assert_eq!(a.len(), b.len(), "{what}: parameter {i}'s shard");
                            let err = rel_norm(a, b);
                            assert!(err <= 1e-5, "{what}: parameter {i}'s gradient {err:.2e}");
                        }
                        for (i, (a, b)) in g.2.iter().zip(&w.2).enumerate() {
                            let err = rel_norm(a, b);
                            assert!(err <= 1e-5, "{what}: parameter {i} after 2 steps {err:.2e}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gpt_steps_at_fsdp_are_plain_dp_steps() {
    // Untied head, learned positions: every kind of part (the ends, each block) sharded.
    let config = |mode| {
        GptConfig::new(V, SEQ, 16, 4, 2)
            .with_tie_embeddings(false)
            .with_settings(TpSettings::new().with_mode(mode))
    };
    agree::<Gpt>("gpt", config);
}

#[test]
fn llama_steps_at_fsdp_with_dropout_are_plain_dp_steps() {
    // Rows that do not divide by the shards (d_ff 36: 9 or 18 rows a tp rank, padded), GQA,
    // dropout whose masks the regathered, recomputed blocks must regenerate.
    let config = |mode| {
        LlamaConfig::new(V, SEQ, 24, 4, 2, 2, 36)
            .with_dropout(0.1)
            .with_settings(TpSettings::new().with_mode(mode))
    };
    agree::<Llama>("llama", config);
}
