//! Training through Burn's Learner (`burn_tp::train::TensorParallel`): `SupervisedTraining` with
//! its loss metric and metric logs, at tp x dp, against a plain loop of the same model, data
//! order and optimizer.

use std::path::{Path, PathBuf};
use std::sync::MutexGuard;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::split::split_dataloader;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor};
use burn_tp::checkpoint;
use burn_tp::dropout::DropoutStep;
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::model::LanguageModel;
use burn_tp::train::TensorParallel;
use burn_tp_comm::{LocalGroup, ProcessGroup};
use burn_tp_examples::learner::{LmBatch, LmBatcher, LmLearner, Windows};
use burn_train::checkpoint::KeepLastNCheckpoints;
use burn_train::metric::LossMetric;
use burn_train::metric::store::{Aggregate, Direction, Split};
use burn_train::renderer::CliMetricsRenderer;
use burn_train::{
    Learner, LearningResult, MetricEarlyStoppingStrategy, StoppingCondition, SupervisedTraining,
    TrainingStrategy,
};

use crate::common::{assert_close, device, f64s, rng_lock};

const SEQ: usize = 8;
const BATCH: usize = 2;
const LR: f64 = 1e-2;

/// What a Learner test starts with: the RNG lock, held while the test runs; the one-rank group
/// the full model is built on; and a scratch folder `burn-tp-learner-{name}-{pid}`.
fn fixture(name: &str) -> (MutexGuard<'static, ()>, ProcessGroup, PathBuf) {
    let rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let dir = std::env::temp_dir().join(format!("burn-tp-learner-{name}-{}", std::process::id()));
    (rng, solo, dir)
}

fn text() -> Vec<i64> {
    // 40 windows: whole batches on every replica.
    (0..(SEQ * 40 + 1) as i64)
        .map(|i| (i * 7 + i * i % 5) % 23)
        .collect()
}

fn config() -> LlamaConfig {
    LlamaConfig::new(23, SEQ, 16, 4, 2, 2, 32)
}

/// The per-item values of metric `name` in a Learner's metric log of `split` and `epoch`.
pub(crate) fn logged(dir: &Path, split: &str, epoch: usize, name: &str) -> Vec<f64> {
    let path = dir
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join(format!("{name}.log"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    // Each item's value and count; the epoch's summary ("value,final") last.
    text.lines()
        .filter(|l| !l.ends_with(",final"))
        .map(|l| l.split(',').next().unwrap().parse::<f64>().unwrap())
        .collect()
}

fn values<M: Module>(m: &M) -> Vec<f64> {
    struct Collect(Vec<f64>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.extend(f64s(p.val()));
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}

/// The batches each of `dp` replicas reads in an epoch (Burn's DDP split of the loader).
fn replica_batches(dp: usize) -> Vec<Vec<LmBatch>> {
    let loader = DataLoaderBuilder::new(LmBatcher)
        .batch_size(BATCH)
        .build(Windows::new(text(), SEQ, SEQ));
    split_dataloader(loader, &vec![device(); dp])
        .into_iter()
        .map(|l| l.iter().map(Result::unwrap).collect())
        .collect()
}

/// The plain loop: step k on every replica's k-th batch at once (their mean loss), AdamW.
fn plain_loop(full: &Llama, dp: usize) -> (Vec<f64>, Llama) {
    let batches = replica_batches(dp);
    let steps = batches.iter().map(Vec::len).min().unwrap();
    let mut model = full.clone();
    let mut optim = AdamWConfig::new().init();
    let mut losses = Vec::new();
    for k in 0..steps {
        let cat = |f: fn(&LmBatch) -> Tensor<2, Int>| {
            Tensor::cat(batches.iter().map(|b| f(&b[k])).collect(), 1)
        };
        let (ids, targets) = (cat(|b| b.ids.clone()), cat(|b| b.targets.clone()));
        let loss =
            LanguageModel::loss(&model, ids, targets, Some(DropoutStep::new(k as u64))).unwrap();
        losses.push(f64s(loss.clone())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, model)
}

type Training = SupervisedTraining<LmLearner<Llama>>;

/// `SupervisedTraining` of `full` in `dir` through `strategy` on `train` (the held-out windows
/// validate), its loss metric logged, the plain renderer, set up further by `setup`.
fn launch(
    full: &Llama,
    strategy: TensorParallel,
    dir: &Path,
    train: impl Dataset<Vec<i64>> + 'static,
    setup: impl FnOnce(Training) -> Training,
) -> LearningResult<LmLearner<Llama>> {
    launch_with(full, strategy.into_strategy(), dir, train, setup)
}

/// [`launch`] with a training strategy made by the caller.
fn launch_with(
    full: &Llama,
    strategy: TrainingStrategy<LmLearner<Llama>>,
    dir: &Path,
    train: impl Dataset<Vec<i64>> + 'static,
    setup: impl FnOnce(Training) -> Training,
) -> LearningResult<LmLearner<Llama>> {
    // Another text: memorizing the training text stops helping on it at some epoch.
    let other = (0..(SEQ * 6 + 1) as i64)
        .map(|i| (i * 5 + i * i % 7) % 23)
        .collect();
    let valid = Windows::new(other, SEQ, SEQ);
    let training = SupervisedTraining::new(
        dir,
        DataLoaderBuilder::new(LmBatcher)
            .batch_size(BATCH)
            .build(train),
        DataLoaderBuilder::new(LmBatcher)
            .batch_size(BATCH)
            .build(valid),
    )
    .metrics((LossMetric::new(),))
    .renderer(Box::new(CliMetricsRenderer::new()))
    .with_training_strategy(strategy);
    setup(training).launch(Learner::new(
        LmLearner::new(full.clone()),
        AdamWConfig::new().init(),
        LR,
    ))
}

/// The per-step losses logged for `epoch`: one item per step, the replicas' losses averaged
/// (`DpItem`).
fn step_losses(dir: &Path, epoch: usize) -> Vec<f64> {
    logged(dir, "train", epoch, "Loss")
}

/// The Learner at tp x dp for one epoch: its logged per-step losses and the trained model it
/// returns.
fn learner_run(
    full: &Llama,
    (tp, dp): (usize, usize),
    dir: &Path,
    sync: impl FnOnce(TensorParallel) -> TensorParallel,
) -> (Vec<f64>, Llama) {
    let _ = std::fs::remove_dir_all(dir);
    let strategy = sync(TensorParallel::new(tp, dp, || AdamWConfig::new().init()));
    let train = Windows::new(text(), SEQ, SEQ);
    let result = launch(full, strategy, dir, train, |t| t.num_epochs(1));
    assert!(result.error.is_none(), "{:?}", result.error);
    (step_losses(dir, 1), result.model.model)
}

/// The Learner at tp x dp, set up by `sync`, against the plain loop of `full`: its logged
/// losses step by step and the trained model it returns (1e-5). Returns that model.
fn against_plain(
    full: &Llama,
    (tp, dp): (usize, usize),
    dir: &Path,
    sync: impl FnOnce(TensorParallel) -> TensorParallel,
    tag: &str,
) -> Llama {
    let (want, want_model) = plain_loop(full, dp);
    assert!(want.len() >= 4, "{tag}: {} steps", want.len());
    let (got, got_model) = learner_run(full, (tp, dp), dir, sync);
    assert_close(&got, &want, 1e-5, &format!("{tag}: losses"));
    assert!(want.last() < want.first(), "{tag}: {want:?}");
    let (got, want) = (values(&got_model), values(&want_model));
    assert_close(&got, &want, 1e-5, &format!("{tag}: the trained model"));
    got_model
}

/// Three epochs through `first` (checkpointing into `ckpt`), then the run resumed after
/// epoch 2 through `second`: its epoch 3 on the uninterrupted curve (1e-5). Returns the two
/// runs' folders.
fn resumed_on_the_curve(
    full: &Llama,
    root: &Path,
    (first, second): (TensorParallel, TensorParallel),
    tag: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let train = || Windows::new(text(), SEQ, SEQ);
    let dirs = (root.join("first"), root.join("second"));
    let result = launch(full, first, &dirs.0, train(), |t| t.num_epochs(3));
    assert!(result.error.is_none(), "{tag}: {:?}", result.error);
    let resumed = launch(full, second, &dirs.1, train(), |t| {
        t.num_epochs(3).checkpoint(2)
    });
    assert!(resumed.error.is_none(), "{tag}: {:?}", resumed.error);
    let want = step_losses(&dirs.0, 3);
    assert!(want.len() >= 4, "{tag}: {want:?}");
    assert_close(&step_losses(&dirs.1, 3), &want, 1e-5, tag);
    dirs
}

/// At tp 1, tp 2 and tp 2 x dp 2 (the dp average after the backward, overlapped in buckets, or
/// the distributed optimizer) the Learner's logged losses are the plain loop's, step by step
/// (f32, 1e-5), and the model it returns (gathered to tp 1) is the plain loop's trained model.
#[test]
fn the_learner_at_tp_and_dp_gives_the_plain_loops_losses() {
    let (_rng, solo, root) = fixture("plain");
    type Sync = fn(TensorParallel) -> TensorParallel;
    let runs: [(usize, usize, &str, Sync); 6] = [
        (1, 1, "", |t| t),
        (2, 1, "", |t| t),
        (2, 2, "", |t| t),
        (1, 2, "buckets", |t| t.with_overlapped_grad_reduce(2048)),
        (2, 2, "buckets", |t| t.with_overlapped_grad_reduce(2048)),
        (2, 2, "distributed optimizer", |t| {
            t.with_distributed_optimizer(AdamWConfig::new(), 2048)
        }),
    ];
    for (tp, dp, how, sync) in runs {
        device().seed(3);
        let full = config().init(&solo, &device()).unwrap();
        let dir = root.join(format!("tp{tp}dp{dp}{}", how.len()));
        against_plain(
            &full,
            (tp, dp),
            &dir,
            sync,
            &format!("tp {tp} dp {dp} {how}"),
        );
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Checkpoints through the Learner: Burn's `KeepLastNCheckpoints` drives burn-tp's sharded
/// checkpoints (each rank its shard of the model and of AdamW's state); one written at tp 2
/// after epoch 2 resumes at tp 4 (`SupervisedTraining::checkpoint(2)`) on the uninterrupted
/// curve of epoch 3; the strategy deletes all but the last 2.
#[test]
fn a_learner_checkpoint_written_at_tp_2_resumes_at_tp_4_on_the_curve() {
    let (_rng, solo, root) = fixture("ckpt");
    let _ = std::fs::remove_dir_all(&root);
    device().seed(4);
    let full = config().init(&solo, &device()).unwrap();
    let ckpt = root.join("checkpoints");
    let at = |tp| {
        TensorParallel::new(tp, 1, || AdamWConfig::new().init())
            .with_checkpoints(&ckpt, KeepLastNCheckpoints::new(2))
    };
    // Resumed after epoch 2 at tp 4: epoch 3 on the uninterrupted curve.
    let (_, second) = resumed_on_the_curve(&full, &root, (at(2), at(4)), "resumed at tp 4");
    // Epochs 2 and 3 kept, epoch 1 deleted by the strategy.
    let kept: Vec<bool> = (1..=3)
        .map(|e| {
            TensorParallel::checkpoint_dir(&ckpt, e)
                .join(checkpoint::INDEX)
                .exists()
        })
        .collect();
    assert_eq!(kept, [false, true, true]);
    assert!(!second.join("train").join("epoch-2").exists());
    std::fs::remove_dir_all(&root).ok();
}

/// Burn's early stopping through the Learner: a run whose validation loss stops improving
/// (a learning rate too large) stops at the first epoch without an improvement, as the
/// strategy reads the flushed metrics.
#[test]
fn early_stopping_stops_the_tensor_parallel_run_at_the_right_epoch() {
    let (_rng, solo, dir) = fixture("stop");
    let _ = std::fs::remove_dir_all(&dir);
    device().seed(5);
    let full = config().init(&solo, &device()).unwrap();
    let strategy = TensorParallel::new(2, 1, || AdamWConfig::new().init());
    let stopping = MetricEarlyStoppingStrategy::new(
        &LossMetric::new(),
        Aggregate::Mean,
        Direction::Lowest,
        Split::Valid,
        StoppingCondition::NoImprovementSince { n_epochs: 1 },
    );
    let epochs = 12;
    let result = launch(&full, strategy, &dir, Windows::new(text(), SEQ, SEQ), |t| {
        t.num_epochs(epochs).early_stopping(stopping)
    });
    assert!(result.error.is_none(), "{:?}", result.error);
    // The epochs that ran and their mean validation loss.
    let valid: Vec<f64> = (1..=epochs)
        .take_while(|e| dir.join("valid").join(format!("epoch-{e}")).exists())
        .map(|e| {
            let v = logged(&dir, "valid", e, "Loss");
            v.iter().sum::<f64>() / v.len() as f64
        })
        .collect();
    let ran = valid.len();
    assert!(ran >= 2 && ran < epochs, "ran {ran} epochs: {valid:?}");
    // Every epoch before the last improved on the best so far; the last did not (more than
    // n_epochs = 1 since the best).
    let best_before = valid[..ran - 1].iter().copied().fold(f64::MAX, f64::min);
    for e in 1..ran - 1 {
        assert!(
            valid[e] < valid[..e].iter().copied().fold(f64::MAX, f64::min),
            "{valid:?}"
        );
    }
    assert!(valid[ran - 1] >= best_before, "{valid:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A dataset whose item `bad` fails to load.
struct Failing {
    windows: Windows,
    bad: usize,
}

impl Dataset<Vec<i64>> for Failing {
    fn get(&self, index: usize) -> Result<Vec<i64>, DatasetError> {
        if index == self.bad {
            return Err(DatasetError::new(std::io::Error::other(format!(
                "item {index} is unreadable on purpose"
            ))));
        }
        self.windows.get(index)
    }
    fn len(&self) -> usize {
        self.windows.len()
    }
}

/// A rank that fails (its replica's loader errs, at tp 2 x dp 2) ends `fit` with the error in
/// `LearningResult::error`, within the timeout, not a hang; the strategy keeps its checkpointing
/// strategy for a later `fit`.
#[test]
fn a_failing_rank_ends_the_learner_with_its_error() {
    let (_rng, solo, dir) = fixture("fail");
    let _ = std::fs::remove_dir_all(&dir);
    device().seed(6);
    let full = config().init(&solo, &device()).unwrap();
    let strategy = TensorParallel::new(2, 2, || AdamWConfig::new().init())
        .with_timeout(std::time::Duration::from_secs(20));
    let train = Failing {
        windows: Windows::new(text(), SEQ, SEQ),
        bad: 9,
    };
    let start = std::time::Instant::now();
    let result = launch(&full, strategy, &dir, train, |t| t.num_epochs(2));
    let took = start.elapsed();
    let e = result
        .error
        .expect("the failure is the run's error")
        .to_string();
    assert!(e.contains("unreadable on purpose"), "{e}");
    assert!(took < std::time::Duration::from_secs(15), "{took:?}: {e}");
    // A layout of no ranks is an error naming it, before any thread starts.
    let strategy = TensorParallel::new(0, 2, || AdamWConfig::new().init());
    let result = launch(&full, strategy, &dir, Windows::new(text(), SEQ, SEQ), |t| {
        t.num_epochs(1)
    });
    let e = result.error.expect("tp 0 is an error").to_string();
    assert!(e.contains("tp (0)") && e.contains("dp (2)"), "{e}");
    // The checkpointing strategy survives a failed fit: the same strategy, run again on a good
    // loader, still saves.
    let ckpt = dir.join("checkpoints");
    let shared = std::sync::Arc::new(
        TensorParallel::new(2, 1, || AdamWConfig::new().init())
            .with_timeout(std::time::Duration::from_secs(20))
            .with_checkpoints(&ckpt, KeepLastNCheckpoints::new(3)),
    );
    let bad = Failing {
        windows: Windows::new(text(), SEQ, SEQ),
        bad: 3,
    };
    let custom = || TrainingStrategy::Custom(shared.clone());
    let failed = launch_with(&full, custom(), &dir.join("a"), bad, |t| t.num_epochs(1));
    assert!(failed.error.is_some());
    let good = Windows::new(text(), SEQ, SEQ);
    let again = launch_with(&full, custom(), &dir.join("b"), good, |t| t.num_epochs(1));
    assert!(again.error.is_none(), "{:?}", again.error);
    let saved = TensorParallel::checkpoint_dir(&ckpt, 1).join(checkpoint::INDEX);
    assert!(saved.exists(), "{saved:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `learner_llama` (the example) runs to completion with the plain renderer: two short epochs
/// at tp 2, the validation loss falling, its checkpoints kept; resumed after epoch 1 at tp 1 it
/// gives epoch 2's training loss again.
#[test]
fn learner_llama_runs_to_completion_and_resumes_at_another_tp() {
    use burn_tp_examples::learner_llama::{LearnerArgs, run};
    use clap::Parser;
    let _rng = rng_lock();
    let out = std::env::temp_dir().join(format!("burn-tp-learner-llama-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let args = |extra: &[&str]| {
        let mut argv = vec![
            "learner_llama",
            "--plain",
            "--max-sequences",
            "32",
            "--seq",
            "32",
            "--epochs",
            "2",
            "--out",
            out.to_str().unwrap(),
        ];
        argv.extend_from_slice(extra);
        LearnerArgs::try_parse_from(argv).unwrap()
    };
    device().seed(7);
    let first = run(&args(&[])).unwrap();
    assert_eq!(first.sequences, 32);
    assert_eq!(first.train_loss.len(), 2);
    assert!(first.valid_loss[1] < first.valid_loss[0], "{first:?}");
    for e in [1, 2] {
        let dir = TensorParallel::checkpoint_dir(&out.join("checkpoints"), e);
        assert!(dir.join(checkpoint::INDEX).exists(), "{dir:?}");
    }
    device().seed(7);
    let resumed = run(&args(&["--tp", "1", "--resume", "1"])).unwrap();
    assert_close(
        &resumed.train_loss,
        &first.train_loss[1..],
        1e-5,
        "epoch 2 resumed at tp 1",
    );
    // LoRA through the Learner: only the adapters train; the validation loss falls, and a
    // resume at tp 1 gives epoch 2's training loss again.
    let lora = ["--lora-rank", "4", "--lr", "1e-2"];
    device().seed(7);
    let tuned = run(&args(&lora)).unwrap();
    assert!(tuned.valid_loss[1] < tuned.valid_loss[0], "{tuned:?}");
    assert!(
        tuned.train_loss != first.train_loss,
        "LoRA trains other parameters"
    );
    // Its checkpoint: the adapters (and their moments) alone, fewer than the model's parameters.
    let dir = TensorParallel::checkpoint_dir(&out.join("checkpoints"), 1);
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(checkpoint::INDEX)).unwrap())
            .unwrap();
    assert_eq!(
        index["info"]["frozen_base"], "the model the Learner was given",
        "{dir:?}"
    );
    let stored = index["tensors"].as_object().unwrap();
    let params = stored.keys().filter(|k| !k.contains('.')).count();
    assert!(
        params > 0
            && 3 * params == stored.len()
            && (params as u64) < index["params"].as_u64().unwrap(),
        "{params} of {} stored",
        index["params"]
    );
    device().seed(7);
    let resumed = run(&args(
        &[&lora[..], &["--tp", "1", "--resume", "1"]].concat(),
    ))
    .unwrap();
    assert_close(
        &resumed.train_loss,
        &tuned.train_loss[1..],
        1e-5,
        "LoRA: epoch 2 resumed at tp 1",
    );
    let e = run(&args(&["--lora-rank", "4", "--lora-targets", "wq"])).unwrap_err();
    assert!(e.contains("`wq`"), "{e}");
    let e = run(&args(&["--batch", "64"])).unwrap_err();
    assert!(
        e.contains("32 training sequences") && e.contains("--batch 64"),
        "{e}"
    );
    let e = run(&args(&["--device", "cuda", "--transport", "mpi"])).unwrap_err();
    assert!(e.contains("--transport mpi runs CPU ranks"), "{e}");
    #[cfg(not(feature = "cuda"))]
    {
        let e = run(&args(&["--device", "cuda"])).unwrap_err();
        assert!(e.contains("needs the `cuda` feature"), "{e}");
    }
    std::fs::remove_dir_all(&out).ok();
}

/// `DpItem` on burn-train's outputs at dp 3: the loss is the replicas' mean, the predictions
/// and targets every replica's batch in rank order (what the metrics would see without data
/// parallelism), also when the replicas' batches differ in size.
#[test]
fn dp_items_are_the_whole_steps() {
    use burn::tensor::TensorData;
    use burn_tp::train::DpItem;
    use burn_train::{ClassificationOutput, RegressionOutput};
    let results = burn_tp::local::run_ranks(LocalGroup::new(3).unwrap(), |g| {
        let r = g.rank() as f32;
        let dev = device();
        let loss = Tensor::<1>::from_data(TensorData::new(vec![r + 1.0], [1]), &dev);
        let output = Tensor::<2>::from_data(TensorData::new(vec![r, 10.0 + r], [1, 2]), &dev);
        // A split's last batch: rank r has r + 1 rows.
        let rows = g.rank() + 1;
        let ragged: Vec<f32> = (0..rows).flat_map(|i| [r, i as f32]).collect();
        let ragged = Tensor::<2>::from_data(TensorData::new(ragged, [rows, 2]), &dev);
        let ragged = burn_tp::train::gather_float(ragged, &g).unwrap();
        let targets =
            Tensor::<1, Int>::from_data(TensorData::new(vec![7 * g.rank() as i64, 1], [2]), &dev);
        let class = ClassificationOutput::new(loss.clone(), output.clone(), targets)
            .dp_merge(&g)
            .unwrap();
        let regression = RegressionOutput::new(loss, output.clone(), output.clone() * 2.0)
            .dp_merge(&g)
            .unwrap();
        (
            f64s(class.loss),
            f64s(class.output),
            class.targets.into_data().iter::<i64>().collect::<Vec<_>>(),
            f64s(regression.targets),
            f64s(ragged),
        )
    })
    .unwrap();
    for (loss, output, targets, regression_targets, ragged) in results {
        assert_close(&loss, &[2.0], 1e-6, "the mean loss");
        assert_close(&output, &[0.0, 10.0, 1.0, 11.0, 2.0, 12.0], 0.0, "outputs");
        assert_eq!(targets, vec![0, 1, 7, 1, 14, 1]);
        assert_close(
            &regression_targets,
            &[0.0, 20.0, 2.0, 22.0, 4.0, 24.0],
            0.0,
            "regression targets",
        );
        let want = [0., 0., 1., 0., 1., 1., 2., 0., 2., 1., 2., 2.];
        assert_close(&ragged, &want, 0.0, "ragged rows");
    }
}

mod built;
mod fsdp;
mod lora;
