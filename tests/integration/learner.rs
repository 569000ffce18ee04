//! Training through Burn's Learner (`burn_tp::train::TensorParallel`): `SupervisedTraining` with
//! its loss metric and metric logs, at tp x dp, against a plain loop of the same model, data
//! order and optimizer.

use std::path::Path;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::split::split_dataloader;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor};
use burn_tp::dropout::DropoutStep;
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::model::LanguageModel;
use burn_tp::train::TensorParallel;
use burn_tp_comm::LocalGroup;
use burn_tp_examples::learner::{LmBatch, LmBatcher, LmLearner, Windows};
use burn_train::metric::LossMetric;
use burn_train::renderer::CliMetricsRenderer;
use burn_train::{Learner, SupervisedTraining};

use crate::common::{assert_close, device, f64s, rng_lock};

const SEQ: usize = 8;
const BATCH: usize = 2;
const LR: f64 = 1e-2;

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
fn logged(dir: &Path, split: &str, epoch: usize, name: &str) -> Vec<f64> {
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

/// The Learner at tp x dp for one epoch: its logged per-step losses (the dp replicas' items
/// averaged, as a step's loss is their mean) and the trained model it returns.
fn learner_run(full: &Llama, tp: usize, dp: usize, dir: &Path) -> (Vec<f64>, Llama) {
    let _ = std::fs::remove_dir_all(dir);
    let loader = |windows: Windows| {
        DataLoaderBuilder::new(LmBatcher)
            .batch_size(BATCH)
            .build(windows)
    };
    let strategy = TensorParallel::new(tp, dp, || AdamWConfig::new().init());
    let result = SupervisedTraining::new(
        dir,
        loader(Windows::new(text(), SEQ, SEQ)),
        loader(Windows::new(text()[..SEQ * 6].to_vec(), SEQ, SEQ)),
    )
    .metrics((LossMetric::new(),))
    .renderer(Box::new(CliMetricsRenderer::new()))
    .with_training_strategy(strategy.into_strategy())
    .num_epochs(1)
    .launch(Learner::new(
        LmLearner::new(full.clone()),
        AdamWConfig::new().init(),
        LR,
    ));
    assert!(result.error.is_none(), "{:?}", result.error);
    let items = logged(dir, "train", 1, "Loss");
    let steps: Vec<f64> = items
        .chunks(dp)
        .map(|c| c.iter().sum::<f64>() / c.len() as f64)
        .collect();
    (steps, result.model.model)
}

/// At tp 1, tp 2 and tp 2 x dp 2 the Learner's logged losses are the plain loop's, step by step
/// (f32, 1e-5), and the model it returns (gathered to tp 1) is the plain loop's trained model.
#[test]
fn the_learner_at_tp_and_dp_gives_the_plain_loops_losses() {
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let root = std::env::temp_dir().join(format!("burn-tp-learner-{}", std::process::id()));
    for (tp, dp) in [(1, 1), (2, 1), (2, 2)] {
        device().seed(3);
        let full = config().init(&solo, &device()).unwrap();
        let (want, want_model) = plain_loop(&full, dp);
        assert!(want.len() >= 8, "{} steps", want.len());
        let (got, got_model) = learner_run(&full, tp, dp, &root.join(format!("tp{tp}dp{dp}")));
        let tag = format!("tp {tp} dp {dp}");
        assert_close(&got, &want, 1e-5, &format!("{tag}: losses"));
        assert!(want.last() < want.first(), "{tag}: {want:?}");
        assert_close(
            &values(&got_model),
            &values(&want_model),
            1e-5,
            &format!("{tag}: the trained model"),
        );
    }
    std::fs::remove_dir_all(&root).ok();
}
