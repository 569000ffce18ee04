//! A Burn user's own model made parallel: replicas that start identical by construction (no
//! broadcast), the replica check of every data-parallel helper (a nudged parameter refused,
//! naming it; `sync_replicas` broadcasting), `#[derive(Reshard)]` on a struct of one's own
//! (a tp 4 checkpoint resumed at tp 2 with the same loss), and a plain burn-nn model sharded
//! into the parallel one giving its losses at tp x dp.

use burn::module::{Module, Param};
use burn::nn::{Initializer, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Tensor, activation::gelu};
use burn_tp::checkpoint;
use burn_tp::comm::{LocalGroup, ProcessGroup};
use burn_tp::dp::DpOptimizer;
use burn_tp::gpt::GptConfig;
use burn_tp::init::init_replicated_param;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};
use burn_tp::local::run_ranks;
use burn_tp::mesh::DeviceMesh;
use burn_tp::norm::{TpLayerNorm, replicated_param};
use burn_tp::reshard::{Reshard, Twin, TwinContext};

use crate::common::{assert_close, device, param_values, rng_lock, uniform};

mod records;
mod replicas;

const D: usize = 16;
const ROWS: usize = 8;

/// A model of one's own: a learned offset every tp rank holds whole, a norm, a Megatron MLP;
/// `Twin`: made from its plain twin and back, field by field.
#[derive(Module, Debug, Reshard, Twin)]
#[twin(PlainMlp)]
struct MyMlp {
    offset: Param<Tensor<1>>,
    norm: TpLayerNorm,
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
    #[module(skip)]
    #[twin(mode)]
    mode: TpMode,
    #[module(skip)]
    #[reshard(group)]
    group: ProcessGroup,
}

/// Its plain burn-nn twin.
#[derive(Module, Debug)]
struct PlainMlp {
    offset: Param<Tensor<1>>,
    norm: burn::nn::LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl PlainMlp {
    fn new() -> Self {
        let dev = device();
        Self {
            offset: Initializer::Normal {
                mean: 0.0,
                std: 0.5,
            }
            .init([D], &dev),
            norm: LayerNormConfig::new(D).with_epsilon(1e-3).init(&dev),
            fc1: LinearConfig::new(D, 4 * D).init(&dev),
            fc2: LinearConfig::new(4 * D, D).init(&dev),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = self.norm.forward(x + self.offset.val().unsqueeze::<3>());
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

impl MyMlp {
    fn settings(mode: TpMode) -> TpSettings {
        TpSettings::new().with_mode(mode)
    }

    /// Fresh, drawn by burn-tp on every rank thread alike.
    fn new(mode: TpMode, group: &ProcessGroup) -> Self {
        let dev = device();
        let normal = Initializer::Normal {
            mean: 0.0,
            std: 0.5,
        };
        Self {
            offset: init_replicated_param(&normal, [D], None, None, group, &dev).unwrap(),
            norm: TpLayerNorm::new(D, mode, group, &dev).with_epsilon(1e-3),
            fc1: ColumnParallelLinearConfig::new(D, 4 * D)
                .with_settings(Self::settings(mode))
                .init(group, &dev)
                .unwrap(),
            fc2: RowParallelLinearConfig::new(4 * D, D)
                .with_settings(Self::settings(mode))
                .init(group, &dev)
                .unwrap(),
            mode,
            group: group.clone(),
        }
    }

    /// The plain twin's weights, this rank's shards of them.
    fn from_plain(plain: &PlainMlp, mode: TpMode, group: &ProcessGroup) -> Self {
        let own = |t: Tensor<1>| Param::from_tensor(Tensor::from_data(t.to_data(), &device()));
        Self {
            offset: own(plain.offset.val()),
            norm: TpLayerNorm::from_full(&plain.norm, mode, group),
            fc1: ColumnParallelLinear::from_full(
                &plain.fc1,
                group,
                &ColumnParallelLinearConfig::new(D, 4 * D).with_settings(Self::settings(mode)),
            )
            .unwrap(),
            fc2: RowParallelLinear::from_full(
                &plain.fc2,
                group,
                &RowParallelLinearConfig::new(4 * D, D).with_settings(Self::settings(mode)),
            )
            .unwrap(),
            mode,
            group: group.clone(),
        }
    }

    /// `[rows(/tp), batch, D]` (this rank's row shard in REDUCE_SCATTER mode).
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let offset = replicated_param(&self.offset, self.mode, &self.group);
        let x = self.norm.forward(x + offset.unsqueeze::<3>());
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

/// The batch `step` of `dp`'s replica `r`: `[ROWS, 2, D]`.
fn batch(step: u64, r: usize, dp: usize) -> Tensor<3> {
    let all = uniform(ROWS * 2 * dp * D, 100 + step);
    let t = Tensor::<3>::from_data(
        burn::tensor::TensorData::new(all, [ROWS, 2 * dp, D]),
        &device(),
    );
    t.narrow(1, 2 * r, 2)
}

fn loss_of(y: Tensor<3>) -> Tensor<1> {
    y.powi_scalar(2).mean()
}

/// The held-out batch's loss of `m` in `mode`, averaged over the tp ranks' rows.
fn held_out_loss(m: &MyMlp, mode: TpMode, g: &ProcessGroup) -> f64 {
    let local = loss_of(m.forward(rows(batch(9, 0, 1), mode, g)));
    let avg = burn_tp::ops::all_reduce(local.detach(), burn_tp::comm::ReduceOp::Avg, g);
    avg.unwrap().into_scalar::<f64>()
}

/// This rank's rows of `x` in REDUCE_SCATTER mode.
fn rows(x: Tensor<3>, mode: TpMode, tp: &ProcessGroup) -> Tensor<3> {
    match mode {
        TpMode::AllReduce => x,
        TpMode::ReduceScatter => {
            let n = ROWS / tp.world_size();
            x.narrow(0, tp.rank() * n, n)
        }
    }
}

/// The plain model's losses over 4 AdamW steps on the whole batch (dp replicas' batches
/// side by side), and the parallel model's at tp x dp from the same weights: equal to f32
/// rounding, the replicas identical after the steps.
#[test]
fn a_plain_burn_nn_model_sharded_gives_its_losses_at_tp_x_dp() {
    let _rng = rng_lock();
    device().seed(41);
    let plain = PlainMlp::new();
    let record = plain.clone().into_record();
    let steps = 4;
    for dp in [1usize, 2] {
        let mut model = plain.clone().load_record(record.clone());
        let mut optim = AdamWConfig::new().init();
        let mut want = Vec::new();
        for step in 0..steps {
            let x = Tensor::cat((0..dp).map(|r| batch(step, r, dp)).collect(), 1);
            let loss = loss_of(model.forward(x));
            want.push(loss.clone().into_scalar::<f64>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        for (tp, mode) in [
            (2usize, TpMode::ReduceScatter),
            (2, TpMode::AllReduce),
            (1, TpMode::ReduceScatter),
        ] {
            let (plain, record) = (plain.clone(), record.clone());
            let out = run_ranks(LocalGroup::new(tp * dp).unwrap(), move |world| {
                let mesh = DeviceMesh::new(world, tp).unwrap();
                let (tp_g, dp_g) = (mesh.tp_group().clone(), mesh.dp_group().clone());
                let plain = plain.clone().load_record(record.clone());
                let mut model = MyMlp::from_plain(&plain, mode, &tp_g);
                let mut optim = DpOptimizer::new(AdamWConfig::new().init());
                let mut losses = Vec::new();
                for step in 0..steps {
                    let x = rows(batch(step, mesh.dp_rank(), dp), mode, &tp_g);
                    let local = loss_of(model.forward(x));
                    // REDUCE_SCATTER: each rank's mean over its rows; the model's mean is
                    // their average, the gradient too (Megatron's sequence-parallel loss).
                    let local = match mode {
                        TpMode::AllReduce => local,
                        TpMode::ReduceScatter => burn_tp::ops::reduce_from_tp_region(local, &tp_g)
                            .unwrap()
                            .div_scalar(tp as f64),
                    };
                    let replicas = burn_tp::ops::all_reduce(
                        local.clone().detach(),
                        burn_tp::comm::ReduceOp::Avg,
                        &dp_g,
                    )
                    .unwrap();
                    losses.push(replicas.into_scalar::<f64>());
                    let grads = GradientsParams::from_grads(local.backward(), &model);
                    let working = model.clone();
                    model = optim.step(1e-2, model, &working, grads, &dp_g).unwrap();
                }
                let full = model.to_full_module().unwrap();
                (losses, param_values(&full))
            })
            .unwrap();
            for (r, (losses, params)) in out.iter().enumerate() {
                assert_close(
                    losses,
                    &want,
                    1e-5,
                    &format!("tp {tp} dp {dp} {mode:?} rank {r}"),
                );
                assert_eq!(params, &out[0].1, "tp {tp} dp {dp}: rank {r}'s model");
            }
        }
    }
}

/// `#[derive(Reshard)]` on the struct of one's own: trained 2 steps at tp 4, saved, loaded at
/// tp 2 and tp 1 (a fresh model of another seed filled from the checkpoint), the next loss is
/// the one the tp 4 run goes on to.
#[test]
fn a_derived_reshard_resumes_a_tp_4_checkpoint_at_tp_2_with_the_same_loss() {
    let _rng = rng_lock();
    let dir = std::env::temp_dir().join(format!("burn-tp-derive-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let info = checkpoint::CheckpointInfo::new(2, 4, 1, &serde_json::json!({"d": D}));
    let mode = TpMode::ReduceScatter;
    let eval = move |m: &MyMlp, g: &ProcessGroup| held_out_loss(m, mode, g);
    device().seed(3);
    let (d2, i2) = (dir.clone(), info.clone());
    let tp4 = run_ranks(LocalGroup::new(4).unwrap(), move |g| {
        let mut model = MyMlp::new(mode, &g);
        let mut optim = AdamWConfig::new().init();
        for step in 0..2 {
            let loss = loss_of(model.forward(rows(batch(step, 0, 1), mode, &g)));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        checkpoint::save(&model, None, &d2, &i2, &g, 0).unwrap();
        eval(&model, &g)
    })
    .unwrap();
    for tp in [2usize, 1] {
        device().seed(77);
        let d2 = dir.clone();
        let resumed = run_ranks(LocalGroup::new(tp).unwrap(), move |g| {
            let fresh = MyMlp::new(mode, &g);
            let before = eval(&fresh, &g);
            let (model, got) = checkpoint::load(fresh, &d2, None::<&()>, &g).unwrap();
            assert_eq!(got.step, 2);
            (before, eval(&model, &g))
        })
        .unwrap();
        for (before, after) in resumed {
            assert!(
                (before - tp4[0]).abs() > 1e-4,
                "a fresh model is not the saved one"
            );
            assert_close(&[after], &[tp4[0]], 1e-5, &format!("resumed at tp {tp}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Burn's batch-first ids (`[batch, seq]`) through `loss_batch_first` give the sequence-first
/// loss at tp 1 and 2 (and `logits_batch_first` the logits transposed); batch-first ids handed
/// to the sequence-first `loss` where the shapes tell (a batch longer than the positions) are an
/// error naming the shapes, not a silent run over the batch axis.
#[test]
fn batch_first_ids_give_the_sequence_first_loss_and_a_swap_the_shapes_reveal_is_an_error() {
    use burn::tensor::{Int, TensorData};
    use burn_tp::local::run_local;
    use burn_tp::model::LanguageModel;
    let _rng = rng_lock();
    let (v, s, b) = (12usize, 8usize, 2usize);
    let ids_sf: Vec<i64> = (0..s * b).map(|i| (i as i64 * 5 + 1) % v as i64).collect();
    let tgt_sf: Vec<i64> = (0..s * b).map(|i| (i as i64 * 7 + 2) % v as i64).collect();
    for tp in [1usize, 2] {
        device().seed(13);
        let (ids_sf, tgt_sf) = (ids_sf.clone(), tgt_sf.clone());
        let out = run_local(tp, move |g| {
            let model = GptConfig::new(v, s, 16, 2, 1)
                .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
                .init(&g, &device())
                .unwrap();
            let t = |v: Vec<i64>, shape: [usize; 2]| {
                Tensor::<2, Int>::from_data(TensorData::new(v, shape), &device())
            };
            let (ids, tgt) = (t(ids_sf.clone(), [s, b]), t(tgt_sf.clone(), [s, b]));
            let seq_first = LanguageModel::loss(&model, ids.clone(), tgt.clone(), None).unwrap();
            let (ids_bf, tgt_bf) = (ids.clone().swap_dims(0, 1), tgt.swap_dims(0, 1));
            let batch_first = model.loss_batch_first(ids_bf.clone(), tgt_bf.clone(), None);
            let logits = LanguageModel::logits(&model, ids).unwrap().swap_dims(0, 1);
            let logits_bf = model.logits_batch_first(ids_bf).unwrap();
            // A batch of 16 sequences of 8, batch first, handed to the sequence-first loss.
            let wide = t((0..16 * s as i64).map(|i| i % v as i64).collect(), [16, s]);
            let swapped = LanguageModel::loss(&model, wide.clone(), wide, None);
            let swapped = swapped.unwrap_err().to_string();
            (
                seq_first.into_scalar::<f64>(),
                batch_first.unwrap().into_scalar::<f64>(),
                (logits - logits_bf).abs().max().into_scalar::<f64>(),
                swapped,
            )
        })
        .unwrap();
        for (r, (sf, bf, logit_diff, swapped)) in out.into_iter().enumerate() {
            assert_eq!(sf, bf, "tp {tp} rank {r}: the batch-first loss");
            assert_eq!(logit_diff, 0.0, "tp {tp} rank {r}: the batch-first logits");
            assert!(
                swapped.contains("seq <= 8") && swapped.contains("16"),
                "tp {tp} rank {r}: {swapped}"
            );
        }
    }
}

/// `#[derive(Twin)]`: the parallel model made from its plain twin field by field at tp 2 (both
/// modes) is the hand-written `from_plain`'s, bit for bit, and `to_twin` gives the plain model's
/// values back.
#[test]
fn a_derived_twin_makes_the_parallel_model_from_its_plain_twin_and_back() {
    let _rng = rng_lock();
    device().seed(51);
    let plain = PlainMlp::new();
    let record = plain.clone().into_record();
    let want = param_values(&plain);
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        let (plain, record) = (plain.clone(), record.clone());
        let out = run_ranks(LocalGroup::new(2).unwrap(), move |g| {
            let plain = plain.clone().load_record(record.clone());
            let ctx = TwinContext::new(&g).with_settings(MyMlp::settings(mode));
            let derived = MyMlp::from_twin(&plain, &ctx).unwrap();
            let by_hand = MyMlp::from_plain(&plain, mode, &g);
            let x = rows(batch(3, 0, 1), mode, &g);
            let (a, b) = (derived.forward(x.clone()), by_hand.forward(x));
            let back = derived.to_twin().unwrap();
            (
                param_values(&derived) == param_values(&by_hand),
                (a - b).abs().max().into_scalar::<f64>(),
                param_values(&back),
                derived.mode,
            )
        })
        .unwrap();
        for (r, (same, diff, back, got_mode)) in out.into_iter().enumerate() {
            assert!(same, "{mode:?} rank {r}: the derived twin's shards");
            assert_eq!(diff, 0.0, "{mode:?} rank {r}: outputs");
            assert_eq!(back, want, "{mode:?} rank {r}: to_twin");
            assert_eq!(got_mode, mode);
        }
    }
}
