//! Pipeline parallelism (`burn_tp::pipeline`) against the unpipelined model: at 2 and 4 stages
//! (x tp 1 and 2, x dp 1 and 2 on a `DeviceMesh`), GPipe, 1F1B and interleaved 1F1B (2 virtual
//! stages), 4 and 8 micro-batches, the
//! loss and every parameter's gradient equal the whole batch's through the whole model, for the
//! GPT (tied and untied) and the Llama with dropout (the micro-batches' masks being the batch's
//! rows), and the same with each block recomputed in its backward; the activations each stage
//! holds; a stage that fails ends every stage with an error.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::dp::average_gradients;
use burn_tp::dropout::DropoutStep;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::pipeline::{
    Pipeline, PipelineSchedule, drop_unused_ends, forward_loss, loss_and_grads,
    loss_and_grads_recomputed, stage_layers, virtual_stage_layers,
};
use burn_tp::reshard::Reshard;
use burn_tp_comm::{LocalGroup, ReduceOp};

mod train_gpt;

use crate::common::{assert_close, device, f64s, rng_lock};

pub(crate) const SEQ: usize = 8;
pub(crate) const MICRO: usize = 2;

pub(crate) fn ids(batch: usize, seed: i64) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..(SEQ * batch) as i64)
        .map(|i| (i * 7 + seed) % 23)
        .collect();
    Tensor::from_data(TensorData::new(v, [SEQ, batch]), &device())
}

/// `m` micro-batches of `MICRO` sequences of `x`, `y` from sequence `first` on (a replica's rows
/// of the batch).
pub(crate) fn micro_batches(
    x: &Tensor<2, Int>,
    y: &Tensor<2, Int>,
    first: usize,
    m: usize,
) -> Vec<(Tensor<2, Int>, Tensor<2, Int>)> {
    let cut = |t: &Tensor<2, Int>, i: usize| t.clone().narrow(1, first + i * MICRO, MICRO);
    (0..m).map(|i| (cut(x, i), cut(y, i))).collect()
}

/// The model with each parameter replaced by its gradient in `grads` (zeros where there is
/// none), gathered to tp 1, and which parameters had one.
fn gathered<M: Module + Reshard>(model: &M, grads: &GradientsParams) -> (M, Vec<bool>) {
    struct Has<'a>(&'a GradientsParams, Vec<bool>);
    impl ModuleVisitor for Has<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.1.push(self.0.get::<D>(p.id).is_some());
        }
    }
    struct ToGrad<'a>(&'a GradientsParams);
    impl ModuleMapper for ToGrad<'_> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let g = self.0.get::<D>(p.id);
            p.map(|t| match g {
                Some(g) => Tensor::from_inner(g),
                None => t.zeros_like(),
            })
        }
    }
    let mut has = Has(grads, Vec::new());
    model.visit(&mut has);
    let full = model
        .clone()
        .map(&mut ToGrad(grads))
        .to_full_module()
        .unwrap();
    (full, has.1)
}

fn values<M: Module>(m: &M) -> Vec<Vec<f64>> {
    struct Collect(Vec<Vec<f64>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(f64s(p.val()));
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}

/// Runs `full` (a tp 1 model) on a tp x dp x pp mesh, `m` micro-batches of `MICRO` sequences
/// per replica (the gradients then averaged over dp), and checks the loss and every stage's
/// gradients against the whole batch through `full` on this thread.
#[allow(clippy::too_many_arguments)]
fn check<M: LanguageModel + Send + Sync + 'static>(
    what: &str,
    full: M,
    [tp, dp, pp]: [usize; 3],
    m: usize,
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
) {
    let tag = format!("{what} tp {tp} dp {dp} pp {pp} m {m} {schedule:?}");
    let rows = m * MICRO;
    let (x, y) = (ids(dp * rows, 1), ids(dp * rows, 5));
    // The reference: the whole model, the mean of every micro-batch's loss (the batch's mean
    // loss for a dense model; a MoE model's routers' loss is each micro-batch's own, as with
    // gradient accumulation).
    let n = dp * m;
    let mean = |model: &M, eval: bool| {
        micro_batches(&x, &y, 0, n)
            .into_iter()
            .enumerate()
            .map(|(j, (a, b))| {
                let loss = match eval {
                    false => {
                        let step = step.map(|s| s.with_batch(j * MICRO, dp * rows));
                        model.loss(a, b, step).unwrap()
                    }
                    true => {
                        Tensor::from_inner(model.valid().loss(a.inner(), b.inner(), None).unwrap())
                    }
                };
                loss.div_scalar(n as f64)
            })
            .reduce(|a, b| a + b)
            .unwrap()
    };
    let loss = mean(&full, false);
    let grads = GradientsParams::from_grads(loss.backward(), &full);
    let want_loss = f64s(loss)[0];
    let want_eval = f64s(mean(&full, true))[0];
    // Each stage's blocks (an interleaved stage's several ranges).
    let layers: Vec<Vec<usize>> = (0..pp)
        .map(|s| {
            let chunks = virtual_stage_layers(full.num_layers(), pp, schedule, s).unwrap();
            chunks.into_iter().flatten().collect()
        })
        .collect();
    let ranges = layers.clone();
    let want_full = gathered(&full, &grads).0;
    let out = run_local(tp * dp * pp, move |world| {
        let mesh = DeviceMesh::with_pipeline(world, tp, pp).unwrap();
        let (stage, replica) = (mesh.pp_rank(), mesh.dp_rank());
        assert_eq!(mesh.pp_group().rank(), stage);
        let model = M::shard_module(&full, mesh.tp_group())
            .unwrap()
            .keep_layers(&ranges[stage]);
        let model = drop_unused_ends(model, stage, pp).unwrap();
        let pipe = Pipeline::new(mesh.pp_group()).unwrap();
        let micro = micro_batches(&x, &y, replica * rows, m);
        // Evaluation: the forwards only, no dropout.
        let eval = pipe
            .from_last(forward_loss(&model, &pipe, &micro, schedule).unwrap())
            .unwrap();
        let step = step.map(|s| s.with_batch(replica * rows, dp * rows));
        let mut out = loss_and_grads(&model, &pipe, &micro, schedule, step).unwrap();
        average_gradients(&model, &mut out.grads, mesh.dp_group()).unwrap();
        // Each block recomputed in its backward: the same loss and gradients.
        let mut re = loss_and_grads_recomputed(&model, &pipe, &micro, schedule, step).unwrap();
        average_gradients(&model, &mut re.grads, mesh.dp_group()).unwrap();
        let re_loss = re
            .loss
            .map(|l| mesh.dp_group().all_reduce(vec![l], ReduceOp::Avg).unwrap()[0]);
        let re = (
            values(&gathered(&model, &re.grads).0),
            re_loss,
            re.peak_in_flight,
        );
        let loss = out
            .loss
            .map(|l| mesh.dp_group().all_reduce(vec![l], ReduceOp::Avg).unwrap()[0]);
        let elements: usize = values(&model).iter().map(Vec::len).sum();
        let empty = values(&model).iter().filter(|v| v.is_empty()).count();
        let (g, has) = gathered(&model, &out.grads);
        let eval = mesh
            .dp_group()
            .all_reduce(vec![eval], ReduceOp::Avg)
            .unwrap()[0];
        (
            stage,
            loss,
            values(&g),
            has,
            out.peak_in_flight,
            eval,
            (elements, empty),
            re,
        )
    })
    .unwrap();
    // The elements of one block (at tp 1), and of the embedding and head around them.
    let count = |m: &M| values(m).iter().map(Vec::len).sum::<usize>();
    let ends = count(&want_full.clone().keep_layers(&[]));
    let per_block = (count(&want_full) - ends) / want_full.num_layers();
    // The reference's gradients, cut as each stage's model.
    let [pre, _, post] = want_full.param_sections();
    let tied = want_full.tied_head();
    for (stage, loss, got, has, peak, eval, (elements, empty), re) in out {
        let (re_got, re_loss, re_peak) = re;
        assert_eq!(re_peak, peak, "{tag}: stage {stage}: recomputed, held");
        assert_eq!(re_loss.is_some(), loss.is_some(), "{tag}: stage {stage}");
        if let (Some(a), Some(b)) = (re_loss, loss) {
            assert_close(
                &[a as f64],
                &[b as f64],
                1e-6,
                &format!("{tag}: recomputed loss"),
            );
        }
        // A middle stage holds its blocks only (all of it at tp 1); the first stage no final
        // norm or head, the last no embedding (but a tied head's table).
        if stage > 0 && stage + 1 < pp && tp == 1 {
            let blocks = per_block * layers[stage].len();
            assert_eq!(elements, blocks, "{tag}: stage {stage}'s elements");
        }
        let want_empty = match stage {
            0 => post,
            s if s + 1 == pp => pre - usize::from(tied),
            _ => pre + post,
        };
        assert_eq!(empty, want_empty, "{tag}: stage {stage}'s empty parameters");
        assert_close(
            &[eval as f64],
            &[want_eval],
            1e-5,
            &format!("{tag}: stage {stage}: eval"),
        );
        // Activations held: 1F1B at most the stages from here on, GPipe every micro-batch.
        let want_peak = match schedule {
            PipelineSchedule::OneFOneB => (pp - stage).min(m),
            PipelineSchedule::GPipe => m,
            // Megatron's warm-up, then one more.
            PipelineSchedule::Interleaved { virtual_stages: v } if m == pp => m * v,
            PipelineSchedule::Interleaved { virtual_stages: v } => {
                ((pp - stage - 1) * 2 + (v - 1) * pp + 1).min(m * v)
            }
        };
        assert_eq!(
            peak, want_peak,
            "{tag}: stage {stage}: micro-batches held at once"
        );
        let want_model =
            drop_unused_ends(want_full.clone().keep_layers(&layers[stage]), stage, pp).unwrap();
        let want = values(&want_model);
        assert_eq!(got.len(), want.len(), "{tag}");
        if stage == pp - 1 {
            assert_close(
                &[loss.unwrap() as f64],
                &[want_loss],
                1e-5,
                &format!("{tag}: loss"),
            );
        } else {
            assert!(loss.is_none(), "{tag}: stage {stage} has a loss");
        }
        let mut compared = 0;
        for (i, ((g, w), h)) in got.iter().zip(&want).zip(&has).enumerate() {
            if *h {
                assert_close(g, w, 1e-5, &format!("{tag}: stage {stage} param {i}"));
                let r = &re_got[i];
                assert_close(
                    r,
                    w,
                    1e-5,
                    &format!("{tag}: stage {stage} param {i} recomputed"),
                );
                compared += 1;
            }
        }
        // Every block held has its gradients, the first stage the embedding's, the last the
        // head's and the final norm's.
        assert!(compared >= 4, "{tag}: stage {stage} compared {compared}");
    }
}

#[test]
fn pipelined_losses_and_gradients_equal_the_whole_model() {
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    for mesh in [[1, 1, 2], [1, 1, 4], [2, 1, 2], [1, 2, 2], [2, 2, 2]] {
        for schedule in [
            PipelineSchedule::GPipe,
            PipelineSchedule::OneFOneB,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ] {
            for m in [4, 8] {
                for tied in [false, true] {
                    device().seed(7);
                    let gpt = GptConfig::new(23, SEQ, 16, 4, 8)
                        .with_tie_embeddings(tied)
                        .init(&solo, &device())
                        .unwrap();
                    check(&format!("gpt tied {tied}"), gpt, mesh, m, schedule, None);
                }
                device().seed(8);
                let mode = if mesh[0] == 2 {
                    TpMode::ReduceScatter
                } else {
                    TpMode::AllReduce
                };
                let llama = LlamaConfig::new(23, SEQ, 16, 4, 2, 8, 32)
                    .with_dropout(0.2)
                    .with_settings(TpSettings::new().with_mode(mode))
                    .init(&solo, &device())
                    .unwrap();
                let step = Some(DropoutStep::new(3));
                check("llama dropout", llama, mesh, m, schedule, step);
            }
        }
    }
}

/// A MoE Llama (dense and MoE blocks alternating, a shared expert, the load-balancing and
/// z-losses on) through pipeline stages gives the whole model's loss and gradients: the
/// routers' loss spans every stage's MoE layers (their counts travel with the activations),
/// with and without recompute, in evaluation too.
#[test]
fn a_pipelined_moe_llama_gives_the_whole_models_loss_with_the_routers_loss() {
    use burn_tp::moe::ExpertsConfig;
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    for (mesh, schedule) in [
        ([1, 1, 2], PipelineSchedule::OneFOneB),
        ([1, 1, 4], PipelineSchedule::GPipe),
        (
            [1, 2, 2],
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ),
        ([2, 1, 2], PipelineSchedule::OneFOneB),
    ] {
        device().seed(9);
        let mode = if mesh[0] == 2 {
            TpMode::ReduceScatter
        } else {
            TpMode::AllReduce
        };
        let experts = ExpertsConfig::new(4, 2, 16)
            .with_shared_expert(Some(16))
            .with_sparse_step(2)
            .with_aux_loss_coef(0.5)
            .with_z_loss_coef(0.1);
        let llama = LlamaConfig::new(23, SEQ, 16, 4, 2, 8, 32)
            .with_experts(Some(experts))
            .with_settings(TpSettings::new().with_mode(mode))
            .init(&solo, &device())
            .unwrap();
        check("moe llama", llama, mesh, 4, schedule, None);
    }
}

/// Under a pipeline the data-parallel reduction overlapped in buckets (each bucket started by
/// its parameters' last micro-batch's backward, a tied embedding summed over the first and last
/// stages in a bucket of its own) gives the gradients of the plain reduction after the step, and
/// the distributed optimizer's step (the tied table's chunk summed over the ends) the
/// parameters of Burn's AdamW on them: tp 1 and 2 x dp 2 x pp 2, 1F1B and interleaved, the GPT
/// tied and untied and the Llama with dropout, buckets of every size.
#[test]
fn overlapped_buckets_and_the_distributed_optimizer_run_under_a_pipeline() {
    use burn::optim::AdamWConfig;
    use burn_tp::dp::{DistributedAdamW, GradReducer, ReduceGroups};
    use burn_tp::pipeline::loss_and_grads_overlapped;
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    fn run<M: LanguageModel + Send + Sync + 'static>(
        tag: &str,
        full: M,
        tp: usize,
        schedule: PipelineSchedule,
        step: Option<DropoutStep>,
    ) {
        let (dp, pp, m) = (2, 2, 4);
        let rows = m * MICRO;
        let (x, y) = (ids(dp * rows, 2), ids(dp * rows, 6));
        let n = full.num_layers();
        let tag = format!("{tag} tp {tp} {schedule:?}");
        let out = run_local(tp * dp * pp, move |world| {
            let mesh = DeviceMesh::with_pipeline(world, tp, pp).unwrap();
            let (stage, replica) = (mesh.pp_rank(), mesh.dp_rank());
            let layers: Vec<usize> = virtual_stage_layers(n, pp, schedule, stage)
                .unwrap()
                .into_iter()
                .flatten()
                .collect();
            let model = M::shard_module(&full, mesh.tp_group())
                .unwrap()
                .keep_layers(&layers);
            let model = drop_unused_ends(model, stage, pp).unwrap();
            let pipe = Pipeline::new(mesh.pp_group()).unwrap();
            let micro = micro_batches(&x, &y, replica * rows, m);
            let step = step.map(|s| s.with_batch(replica * rows, dp * rows));
            let dp_group = mesh.dp_group();
            // The plain reduction after the step, and one AdamW step on it.
            let mut plain = loss_and_grads(&model, &pipe, &micro, schedule, step).unwrap();
            average_gradients(&model, &mut plain.grads, dp_group).unwrap();
            let want = values(&gathered(&model, &plain.grads).0);
            // A large epsilon makes the step follow the gradient's size, not only its sign.
            let config = AdamWConfig::new().with_epsilon(1.0);
            let mut adamw = config.init();
            let stepped = adamw.step(1.0, model.clone(), plain.grads);
            let want_step = values(&stepped.to_full_module().unwrap());
            let summed = pipe.tied_embedding(&model);
            let mut got = Vec::new();
            // Buckets of one parameter each, and of everything at once.
            for bytes in [1, 1 << 30] {
                let groups = ReduceGroups {
                    summed: summed.clone(),
                    experts: None,
                };
                let r = GradReducer::with_groups(&model, dp_group, bytes, groups);
                let out =
                    loss_and_grads_overlapped(&model, &pipe, &micro, schedule, step, &r).unwrap();
                let mut grads = out.grads;
                r.finish(&model, &mut grads).unwrap();
                got.push(values(&gathered(&model, &grads).0));
            }
            let groups = ReduceGroups {
                summed: summed.clone(),
                experts: None,
            };
            let mut zero = DistributedAdamW::with_groups(&config, &model, dp_group, 64, groups);
            let out =
                loss_and_grads_overlapped(&model, &pipe, &micro, schedule, step, zero.reducer())
                    .unwrap();
            let zeroed = zero.step(1.0, model.clone(), out.grads).unwrap();
            let got_step = values(&zeroed.to_full_module().unwrap());
            (stage, want, got, want_step, got_step, summed.is_some())
        })
        .unwrap();
        let mut tied_stages = 0;
        for (stage, want, got, want_step, got_step, summed) in out {
            tied_stages += usize::from(summed);
            for (k, got) in got.iter().enumerate() {
                assert_eq!(got.len(), want.len(), "{tag}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(
                        g,
                        w,
                        1e-6,
                        &format!("{tag}: stage {stage} buckets {k} param {i}"),
                    );
                }
            }
            for (i, (g, w)) in got_step.iter().zip(&want_step).enumerate() {
                assert_close(
                    g,
                    w,
                    1e-6,
                    &format!("{tag}: stage {stage} zero step param {i}"),
                );
            }
        }
        assert_eq!(
            tied_stages,
            if tag.contains("tied true") {
                tp * dp * pp
            } else {
                0
            },
            "{tag}"
        );
    }
    for tp in [1, 2] {
        for schedule in [
            PipelineSchedule::OneFOneB,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ] {
            for tied in [false, true] {
                device().seed(11);
                let gpt = GptConfig::new(23, SEQ, 16, 4, 4)
                    .with_tie_embeddings(tied)
                    .init(&solo, &device())
                    .unwrap();
                run(&format!("gpt tied {tied}"), gpt, tp, schedule, None);
            }
            device().seed(12);
            let llama = LlamaConfig::new(23, SEQ, 16, 4, 2, 4, 32)
                .with_dropout(0.2)
                .init(&solo, &device())
                .unwrap();
            run(
                "llama dropout",
                llama,
                tp,
                schedule,
                Some(DropoutStep::new(4)),
            );
        }
    }
}

/// A stage that fails ends every stage with an error within the timeout, and stages that pass
/// different numbers of micro-batches get an error naming each stage's.
#[test]
fn a_failing_stage_or_mismatched_micro_batches_end_every_stage_with_an_error() {
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    device().seed(9);
    let full = LlamaConfig::new(23, SEQ, 16, 4, 2, 3, 32)
        .init(&solo, &device())
        .unwrap();
    let run = |counts: [usize; 3], fail: Option<usize>| {
        let full = full.clone();
        let start = std::time::Instant::now();
        let out = run_local(3, move |g| {
            g.set_timeout(std::time::Duration::from_secs(20));
            let stage = g.rank();
            let solo = LocalGroup::new(1).unwrap().remove(0);
            let layers = stage_layers(3, 3, None).unwrap();
            let model = full.clone().into_stage(layers[stage].clone());
            let model = burn_tp::llama::Llama::shard_module(&model, &solo).unwrap();
            let pipe = Pipeline::new(&g).unwrap();
            if fail == Some(stage) {
                return Err("stage failed on purpose".to_string());
            }
            let micro: Vec<_> = (0..counts[stage])
                .map(|i| (ids(MICRO, i as i64), ids(MICRO, 9)))
                .collect();
            loss_and_grads(&model, &pipe, &micro, PipelineSchedule::OneFOneB, None)
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .unwrap();
        (out, start.elapsed())
    };
    let (out, took) = run([4, 4, 4], Some(1));
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
    for (stage, r) in out.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        assert!(
            stage == 1 || e.contains("left") || e.contains("aborted"),
            "stage {stage}: {e}"
        );
    }
    let (out, _) = run([4, 3, 4], None);
    for (stage, r) in out.iter().enumerate() {
        let e = r.as_ref().unwrap_err();
        assert!(
            e.contains("stage 0: 4 of [8, 2]") && e.contains("stage 1: 3 of [8, 2]"),
            "stage {stage}: {e}"
        );
    }
    // A stage that is not one of the pipeline's is an error naming both.
    let e = drop_unused_ends(full.clone(), 3, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stage 3 of 3 stages"), "{e}");
    let e = burn_tp::pipeline::stage_map(&full, 3, 4, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stage_map: stage 4 of 3 stages"), "{e}");
}

/// A stage built with only its blocks (`init_layers`: the others drawn and dropped at once)
/// holds the whole model's weights for them, bit for bit, and only them; a block the model does
/// not have is an error naming it.
#[test]
fn a_stage_built_alone_has_the_whole_models_weights() {
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let bits = |m: Vec<Vec<f64>>| -> Vec<Vec<u64>> {
        m.into_iter()
            .map(|v| v.into_iter().map(f64::to_bits).collect())
            .collect()
    };
    let layers = [1usize, 3];
    let llama = LlamaConfig::new(23, SEQ, 16, 4, 2, 4, 32);
    device().seed(5);
    let whole = llama.init(&solo, &device()).unwrap().keep_layers(&layers);
    device().seed(5);
    let alone = llama.init_layers(&solo, &device(), &layers).unwrap();
    assert_eq!(alone.held_layers(), layers);
    assert_eq!(bits(values(&alone)), bits(values(&whole)));
    let gpt = GptConfig::new(23, SEQ, 16, 4, 4).with_tie_embeddings(true);
    device().seed(6);
    let whole = gpt.init(&solo, &device()).unwrap().keep_layers(&layers);
    device().seed(6);
    let alone = gpt.init_layers(&solo, &device(), &layers).unwrap();
    assert_eq!(bits(values(&alone)), bits(values(&whole)));
    // The embedding, the positions, 2 blocks of 12, the final norm's 2: no other block.
    assert_eq!(values(&alone).len(), 1 + 1 + 2 * 12 + 2);
    let e = llama
        .init_layers(&solo, &device(), &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("block 4") && e.contains("4 blocks"), "{e}");
}
