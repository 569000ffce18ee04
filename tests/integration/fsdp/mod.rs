//! Fully sharded data parallelism (`burn_tp::fsdp`): a step on the shards is the plain
//! data-parallel step. The loss, every gradient (the shards' reduce-scattered gradients
//! against the plain dp average cut the same way) and the parameters after two AdamW steps,
//! at fsdp 2 and 4 (x tp 1, 2, both tp modes), resharding after the forward or not, HSDP; a
//! rank's parameters and AdamW state divide by the shard count; a rank failing mid-gather.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::dp::{average_gradients, broadcast_parameters};
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::lora::{LoraConfig, apply_lora};
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::reshard::move_optimizer_state;

use crate::common::{device, f64s, param_values, rel_norm, rng_lock, token_ids};

/// A group of one (tp 1).
fn solo() -> burn_tp::comm::ProcessGroup {
    burn_tp::comm::LocalGroup::new(1).unwrap().remove(0)
}

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

/// `M` of `config` on this rank of `mesh`, with dp rank 0's weights on every replica (the Flex
/// RNG is one for every rank thread: the first replica draws alone, the others after it, then
/// take its weights).
fn replicated<M: LanguageModel>(config: &M::Config, mesh: &DeviceMesh) -> M {
    let dp = mesh.dp_group();
    if dp.rank() > 0 {
        dp.barrier().unwrap();
    }
    let model = M::init(config, mesh.tp_group(), &device()).unwrap();
    if dp.rank() == 0 && dp.world_size() > 1 {
        dp.barrier().unwrap();
    }
    broadcast_parameters(model, dp).unwrap()
}

fn run<M: LanguageModel>(config: M::Config, l: Layout, cut: usize) -> Vec<Out> {
    device().seed(3);
    run_local(l.tp * l.dp, move |world| {
        let mesh = DeviceMesh::new(world, l.tp).unwrap();
        let dp = mesh.dp_group().clone();
        let mut model = replicated::<M>(&config, &mesh);
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

/// Between steps a rank holds `1 / fsdp` of the parameters and of the AdamW moments (but the
/// padding of rows that do not divide): counted over the tensors it holds, at fsdp 1, 2, 4.
/// With LoRA, `1 / fsdp` of the frozen base too, and gradients and moments of the adapters
/// alone.
#[test]
fn a_rank_holds_its_share_of_the_parameters_and_the_optimizer_state() {
    for lora in [false, true] {
        holds_its_share(lora);
    }
}

fn holds_its_share(lora: bool) {
    let _rng = rng_lock();
    let config = LlamaConfig::new(V, SEQ, 32, 4, 2, 2, 64);
    let mut per_fsdp = Vec::new();
    for n in [1, 2, 4] {
        let config = config.clone();
        device().seed(5);
        let bytes = run_local(n, move |world| {
            let mesh = DeviceMesh::new(world, 1).unwrap();
            let dp = mesh.dp_group().clone();
            let model = replicated::<Llama>(&config, &mesh);
            let model = match lora {
                true => {
                    let targets = ["q", "k", "v", "o", "gate", "up", "down"].map(String::from);
                    let lora = LoraConfig::new(4, 8.0).with_targets(targets.to_vec());
                    broadcast_parameters(apply_lora(model, &lora).unwrap(), &dp).unwrap()
                }
                false => model,
            };
            let whole = (Fsdp::param_bytes(&model), trainable_bytes(&model));
            let fsdp = Fsdp::new(&model, &dp);
            if n > 1 {
                // The whole model, not cut: an error naming the rows, before any gather.
                let ids = Tensor::<2, Int>::from_data(
                    TensorData::new(token_ids(SEQ * B, V, 7, 0), [SEQ, B]),
                    &device(),
                );
                let err = fsdp
                    .loss_and_grads(&model, ids.clone(), ids, None)
                    .unwrap_err();
                assert!(
                    err.to_string().contains("shard the model with Fsdp::shard"),
                    "{err}"
                );
            }
            let mut model = fsdp.shard(model);
            let mut optim = AdamWConfig::new().init();
            let ids = Tensor::<2, Int>::from_data(
                TensorData::new(token_ids(SEQ * B, V, 7, dp.rank() as i64), [SEQ, B]),
                &device(),
            );
            let (_, mut grads) = fsdp.loss_and_grads(&model, ids.clone(), ids, None).unwrap();
            fsdp.finish_grads(&model, &mut grads).unwrap();
            let grad_bytes = grads_bytes(&model, &grads);
            model = optim.step(LR, model, grads);
            (
                whole,
                Fsdp::param_bytes(&model),
                grad_bytes,
                moments_bytes(&optim, &model),
            )
        })
        .unwrap();
        per_fsdp.push((n, bytes));
    }
    let (_, solo) = &per_fsdp[0];
    let ((whole, trainable), _, _, moments) = solo[0];
    assert_eq!(
        moments,
        2 * trainable,
        "AdamW keeps two moments a trainable parameter"
    );
    match lora {
        true => assert!(5 * trainable < whole, "{trainable} of {whole} bytes train"),
        false => assert_eq!(trainable, whole),
    }
    for (n, ranks) in &per_fsdp {
        for (rank, &(w, params, grads, state)) in ranks.iter().enumerate() {
            assert_eq!(w, (whole, trainable));
            // Each parameter's rows padded to a multiple of n: at most n - 1 rows more (a LoRA
            // A of 4 rows: up to 1.75x at fsdp 4, on a few bytes).
            let (share, trained) = (whole as f64 / *n as f64, trainable as f64 / *n as f64);
            let most = if lora { 1.8 } else { 1.05 };
            for (what, got, want, most) in [
                ("parameters", params, share, 1.05),
                ("gradients", grads, trained, most),
                ("AdamW moments", state, 2.0 * trained, most),
            ] {
                let ratio = got as f64 / want;
                assert!(
                    (1.0..most).contains(&ratio),
                    "LoRA {lora}, fsdp {n} rank {rank}: {what} {got} bytes against the whole's \
                     / {n} = {want}"
                );
            }
        }
    }
}

/// The bytes of the gradients in `grads` of `model`'s parameters.
fn grads_bytes<M: Module>(model: &M, grads: &GradientsParams) -> usize {
    struct Bytes<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor for Bytes<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                self.1 += g.shape().num_elements() * g.dtype().size();
            }
        }
    }
    let mut bytes = Bytes(grads, 0);
    model.visit(&mut bytes);
    bytes.1
}

/// The bytes of `model`'s trainable parameters.
fn trainable_bytes<M: Module>(model: &M) -> usize {
    struct Bytes(usize);
    impl ModuleVisitor for Bytes {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            if t.is_require_grad() {
                self.0 += t.shape().num_elements() * t.dtype().size();
            }
        }
    }
    let mut bytes = Bytes(0);
    model.visit(&mut bytes);
    bytes.0
}

/// The bytes of the AdamW moments `optim` holds for `model`: each state field, as a model of
/// its own, counted as it goes through `move_optimizer_state` (over the trainable parameters:
/// a frozen one has no state, and moves as zeros).
fn moments_bytes<M: Module + Clone>(optim: &burn::optim::ModuleOptimizer, model: &M) -> usize {
    let bytes = std::cell::Cell::new(0);
    move_optimizer_state(optim, model, model, |field| {
        let trained = as_trainable(field.clone(), model);
        bytes.set(bytes.get() + trainable_bytes(&trained));
        Ok(field)
    })
    .unwrap();
    bytes.get()
}

/// `field` (a model of `model`'s shapes and ids) trainable where `model` is.
fn as_trainable<M: Module>(field: M, model: &M) -> M {
    struct Flags(std::collections::HashSet<burn::module::ParamId>);
    impl ModuleVisitor for Flags {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if p.val().is_require_grad() {
                self.0.insert(p.id);
            }
        }
    }
    impl ModuleMapper for Flags {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let trainable = self.0.contains(&p.id);
            p.map(|t| t.detach().set_require_grad(trainable))
        }
    }
    let mut flags = Flags(Default::default());
    model.visit(&mut flags);
    field.map(&mut flags)
}

/// A rank that fails before its gathers ends every other rank's step with an error naming
/// the collective, not a hang, long before the 60 s timeout.
#[test]
fn a_rank_failing_mid_gather_ends_every_rank_with_an_error() {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    let _rng = rng_lock();
    let seen = Arc::new(Mutex::new(Vec::<(usize, String, Duration)>::new()));
    let log = seen.clone();
    device().seed(9);
    let config = GptConfig::new(V, SEQ, 16, 4, 2);
    let out = burn_tp::local::run_ranks(burn_tp::comm::LocalGroup::new(4).unwrap(), move |g| {
        g.set_timeout(Duration::from_secs(60));
        let model = Gpt::init(&config, &solo(), &device()).unwrap();
        let fsdp = Fsdp::new(&model, &g).with_reshard_after_forward(true);
        let model = fsdp.shard(model);
        if g.rank() == 2 {
            std::thread::sleep(Duration::from_millis(200));
            std::panic::resume_unwind(Box::new("rank 2 fails"));
        }
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(token_ids(SEQ * B, V, 7, 3), [SEQ, B]),
            &device(),
        );
        let start = Instant::now();
        let result = fsdp.loss_and_grads(&model, ids.clone(), ids, None);
        let error = result.map(|_| ()).unwrap_err().to_string();
        log.lock().unwrap().push((g.rank(), error, start.elapsed()));
    });
    assert!(out.unwrap_err().contains("rank 2 fails"));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3, "every other rank reports: {seen:?}");
    for (rank, error, elapsed) in seen.iter() {
        assert!(
            error.contains("left the group") && error.contains("all_gather"),
            "rank {rank}: {error}"
        );
        assert!(
            *elapsed < Duration::from_secs(30),
            "rank {rank}: {elapsed:?}"
        );
    }
}

/// `GradClip`'s global norm counts every element of the whole model once: at tp 2 (the key /
/// value head replicated on both ranks, the norms' weights on every rank), with fsdp shards
/// (padded rows) and HSDP replicas, through `DpOptimizer::step`, it is the unsplit model's
/// gradient norm computed here directly; the clipped gradients' norm is the clip.
#[test]
fn the_clipped_global_norm_is_the_unsplit_models_at_every_layout() {
    use burn_tp::dp::{DpOptimizer, GradClip};
    let _rng = rng_lock();
    let config = LlamaConfig::new(V, SEQ, 24, 4, 1, 2, 36);
    let norm_of = |grads: &[Vec<f64>]| grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    // The unsplit model's gradient norm, and its clipped gradients' norm.
    let cfg = config.clone();
    device().seed(13);
    let (want, clipped) = run_local(1, move |g| {
        let model = Llama::init(&cfg, &g, &device()).unwrap();
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(token_ids(SEQ * B, V, 7, 3), [SEQ, B]),
            &device(),
        );
        let loss = LanguageModel::loss(&model, ids.clone(), ids, None).unwrap();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let before = param_values(&as_grads(model.clone(), &grads));
        let norm = GradClip::new(&model, &g, 1e-3)
            .clip(&model, &mut grads)
            .unwrap();
        let after = param_values(&as_grads(model.clone(), &grads));
        (norm_of(&before), norm_of(&after), norm)
    })
    .unwrap()
    .into_iter()
    .map(|(want, after, norm)| {
        assert!((norm - want).abs() <= 1e-6 * want, "tp 1: {norm} vs {want}");
        (want, after)
    })
    .next()
    .unwrap();
    assert!(want > 1e-2, "a gradient to clip: {want}");
    assert!((clipped - 1e-3).abs() <= 1e-6, "clipped to {clipped}");
    for (tp, dp, shard) in [(2, 1, 0), (2, 2, 0), (2, 2, 2), (1, 4, 4), (1, 4, 2)] {
        let config = config.clone();
        device().seed(13);
        let norms = run_local(tp * dp, move |world| {
            let mesh = DeviceMesh::new(world, tp).unwrap();
            let dp_group = mesh.dp_group().clone();
            let model = replicated::<Llama>(&config, &mesh);
            // Every dp rank the same batch: the average is the one rank's gradient.
            let ids = Tensor::<2, Int>::from_data(
                TensorData::new(token_ids(SEQ * B, V, 7, 3), [SEQ, B]),
                &device(),
            );
            let clip = GradClip::new(&model, mesh.tp_group(), 1e-3);
            let optim = DpOptimizer::new(AdamWConfig::new().init());
            let (model, grads, mut optim) = match shard {
                0 => {
                    let loss = LanguageModel::loss(&model, ids.clone(), ids, None).unwrap();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    (model, grads, optim.with_clip(clip))
                }
                n => {
                    let (shard, replicas) = mesh.fsdp_groups(n).unwrap();
                    let fsdp = Fsdp::new(&model, &shard).with_replicas(&replicas);
                    let model = fsdp.shard(model);
                    let (_, grads) = fsdp.loss_and_grads(&model, ids.clone(), ids, None).unwrap();
                    let optim = optim
                        .with_fsdp(fsdp.clone())
                        .with_clip(clip.with_fsdp(fsdp));
                    (model, grads, optim)
                }
            };
            optim
                .step(LR, model.clone(), &model, grads, &dp_group)
                .unwrap();
            optim.last_grad_norm().unwrap()
        })
        .unwrap();
        for (rank, norm) in norms.iter().enumerate() {
            let what = format!("tp {tp} dp {dp} shards of {shard}, rank {rank}");
            assert!(
                (norm - want).abs() <= 1e-5 * want,
                "{what}: {norm} vs {want}"
            );
        }
    }
}

mod checkpoint;
mod train_gpt;
