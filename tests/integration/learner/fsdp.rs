//! Fully sharded data parallelism through the Learner (`TensorParallel::with_fsdp`,
//! `with_hsdp`): the plain loop's losses and trained model; its checkpoint (each rank's rows)
//! resumes without fsdp on the uninterrupted curve.

use burn::optim::AdamWConfig;
use burn_tp::train::TensorParallel;
use burn_tp_examples::learner::Windows;
use burn_train::checkpoint::KeepLastNCheckpoints;

use super::{SEQ, against_plain, config, fixture, launch, resumed_on_the_curve, text};
use crate::common::device;

/// At tp 1 x fsdp 2, tp 2 x fsdp 2 and HSDP (groups of 2 at dp 4), the Learner's logged
/// losses are the plain loop's, step by step (f32, 1e-5), and so is the model it returns
/// (gathered from the rows, then to tp 1).
#[test]
fn the_learner_fully_sharded_gives_the_plain_loops_losses() {
    let (_rng, solo, root) = fixture("fsdp");
    type Sync = fn(TensorParallel) -> TensorParallel;
    let runs: [(usize, usize, &str, Sync); 3] = [
        (1, 2, "fsdp", |t| t.with_fsdp()),
        (2, 2, "fsdp", |t| t.with_fsdp()),
        (1, 4, "hsdp 2", |t| t.with_hsdp(2)),
    ];
    for (tp, dp, how, sync) in runs {
        device().seed(3);
        let full = config().init(&solo, &device()).unwrap();
        let dir = root.join(format!("tp{tp}dp{dp}"));
        against_plain(
            &full,
            (tp, dp),
            &dir,
            sync,
            &format!("tp {tp} dp {dp} {how}"),
        );
    }
    // HSDP groups that do not divide dp: an error naming both.
    let full = config().init(&solo, &device()).unwrap();
    let strategy = TensorParallel::new(1, 4, || AdamWConfig::new().init()).with_hsdp(3);
    let dir = root.join("bad");
    let result = launch(&full, strategy, &dir, Windows::new(text(), SEQ, SEQ), |t| {
        t.num_epochs(1)
    });
    let e = result.error.expect("3 does not divide 4").to_string();
    assert!(e.contains("shard size 3 does not divide dp 4"), "{e}");
    std::fs::remove_dir_all(&root).ok();
}

/// A checkpoint the Learner writes fully sharded at tp 1 x fsdp 2 after epoch 2 resumes at
/// tp 2 x dp 2 without fsdp: epoch 3 on the uninterrupted curve.
#[test]
fn a_fully_sharded_learner_checkpoint_resumes_without_fsdp() {
    let (_rng, solo, root) = fixture("fsdpc");
    let _ = std::fs::remove_dir_all(&root);
    device().seed(4);
    let full = config().init(&solo, &device()).unwrap();
    let ckpt = root.join("checkpoints");
    let first = TensorParallel::new(1, 2, || AdamWConfig::new().init())
        .with_fsdp()
        .with_checkpoints(&ckpt, KeepLastNCheckpoints::new(2));
    let second = TensorParallel::new(2, 2, || AdamWConfig::new().init())
        .with_checkpoints(&ckpt, KeepLastNCheckpoints::new(2));
    resumed_on_the_curve(&full, &root, (first, second), "resumed at tp 2 x dp 2");
    std::fs::remove_dir_all(&root).ok();
}
