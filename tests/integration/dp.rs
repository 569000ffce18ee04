//! Data parallelism with the gradient reduction overlapped with the backward
//! (`burn_tp::dp::GradReducer`) against the plain reduction after it (`average_gradients`).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::LocalGroup;
use burn_tp::dp::{GradReducer, average_gradients, broadcast_parameters};
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_ranks;
use burn_tp::reshard::Reshard;

use crate::common::{assert_close, device, f64s, rng_lock, token_ids};

const V: usize = 16;
const S: usize = 8;
const BATCH: usize = 4;
const STEPS: usize = 20;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Reduce {
    /// `average_gradients` after the backward.
    Plain,
    /// `GradReducer` with buckets of this many bytes.
    Overlap(usize),
    /// `GradReducer`, each replica's batch in two micro-batches of half the size.
    Accumulate(usize),
}

/// `(losses, full parameters after STEPS AdamW steps, buckets)` of the GPT (tied embeddings,
/// sequence parallel) at tp x dp, on rank 0.
fn train(tp: usize, dp: usize, reduce: Reduce) -> (Vec<f64>, Vec<Vec<f64>>, usize) {
    let config = GptConfig::new(V, S, 16, 4, 2)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter));
    device().seed(7);
    let out = run_ranks(LocalGroup::new(tp * dp).unwrap(), move |world| {
        let rank = world.rank();
        let (tp_rank, dp_rank) = (rank % tp, rank / tp);
        let tp_group = world.split(dp_rank, rank).unwrap();
        let dp_group = world.split(tp_rank, rank).unwrap();
        if dp_rank != 0 {
            world.barrier().unwrap();
        }
        let model = config.init(&tp_group, &device()).unwrap();
        if dp_rank == 0 {
            world.barrier().unwrap();
        }
        let mut model = broadcast_parameters(model, &dp_group).unwrap();
        let bucket_bytes = match reduce {
            Reduce::Plain => GradReducer::DEFAULT_BUCKET_BYTES,
            Reduce::Overlap(b) | Reduce::Accumulate(b) => b,
        };
        let reducer = GradReducer::new(&model, &dp_group, bucket_bytes);
        let mut optim = AdamWConfig::new().init();
        let mut losses = Vec::new();
        let per = BATCH / dp;
        for step in 0..STEPS as i64 {
            let columns = |cols: std::ops::Range<usize>| {
                let all = |k: i64| token_ids(S * BATCH, V, k, step * 3 + 1);
                let pick = |v: Vec<i64>| -> Tensor<2, Int> {
                    let t = Tensor::<2, Int>::from_data(TensorData::new(v, [S, BATCH]), &device());
                    t.slice([0..S, cols.clone()])
                };
                (pick(all(7)), pick(all(5)))
            };
            let mine = dp_rank * per..(dp_rank + 1) * per;
            // Rank 0's own loss (its dp slice) is logged: the same in every mode.
            let grads = match reduce {
                Reduce::Plain => {
                    let (x, y) = columns(mine);
                    let loss = model.loss(x, y);
                    losses.push(f64s(loss.clone())[0]);
                    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
                    average_gradients(&model, &mut grads, &dp_group).unwrap();
                    grads
                }
                Reduce::Overlap(_) => {
                    let (x, y) = columns(mine);
                    let view = reducer.attach(model.clone(), true);
                    let loss = view.loss(x, y);
                    losses.push(f64s(loss.clone())[0]);
                    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
                    reducer.finish(&model, &mut grads).unwrap();
                    grads
                }
                Reduce::Accumulate(_) => {
                    let half = per / 2;
                    let mut total = 0.0;
                    let mut grads = None;
                    for micro in 0..2 {
                        let start = mine.start + micro * half;
                        let (x, y) = columns(start..start + half);
                        let view = reducer.attach(model.clone(), micro == 1);
                        // The mean over the whole batch: each half's mean, halved.
                        let loss = view.loss(x, y).div_scalar(2.0);
                        total += f64s(loss.clone())[0];
                        grads = Some(GradientsParams::from_grads(loss.backward(), &model));
                    }
                    losses.push(total);
                    let mut grads = grads.unwrap();
                    reducer.finish(&model, &mut grads).unwrap();
                    grads
                }
            };
            model = optim.step(1e-2, model, grads);
        }
        let full = model.to_full_module().unwrap();
        struct Collect(Vec<Vec<f64>>);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0.push(f64s(p.val()));
            }
        }
        let mut c = Collect(Vec::new());
        full.visit(&mut c);
        (losses, c.0, reducer.buckets())
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// 20 AdamW steps of a sequence-parallel GPT with tied embeddings at tp 2 x dp 2 and tp 1 x dp 4:
/// with the reduction overlapped in buckets (one bucket, and buckets of 2 KiB), the losses and
/// the parameters are those of the plain reduction after the backward.
#[test]
fn overlapped_reduction_gives_the_plain_runs_losses_and_parameters() {
    let _rng = rng_lock();
    for (tp, dp) in [(2usize, 2usize), (1, 4)] {
        let (want_losses, want_params, _) = train(tp, dp, Reduce::Plain);
        for bucket in [GradReducer::DEFAULT_BUCKET_BYTES, 2048] {
            let (losses, params, buckets) = train(tp, dp, Reduce::Overlap(bucket));
            let tag = format!("tp {tp} dp {dp}, {buckets} buckets");
            if bucket == 2048 {
                assert!(buckets > 3, "{tag}: small buckets");
            } else {
                assert_eq!(buckets, 1, "{tag}");
            }
            assert_close(&losses, &want_losses, 1e-6, &format!("{tag}: losses"));
            for (i, (a, b)) in params.iter().zip(&want_params).enumerate() {
                assert_close(a, b, 1e-6, &format!("{tag}: parameter {i}"));
            }
        }
        // The run trained: the parameters moved and the loss fell.
        assert!(
            want_losses[STEPS - 1] < want_losses[0] - 0.1,
            "{want_losses:?}"
        );
    }
}

/// Two micro-batches of half the size, accumulated inside the reducer (only the second
/// backward communicates), give the steps of one batch twice the size.
#[test]
fn accumulated_micro_batches_give_the_full_batch_step() {
    let _rng = rng_lock();
    let (want_losses, want_params, _) = train(2, 2, Reduce::Plain);
    let (losses, params, _) = train(2, 2, Reduce::Accumulate(2048));
    assert_close(&losses, &want_losses, 1e-5, "losses");
    for (i, (a, b)) in params.iter().zip(&want_params).enumerate() {
        assert_close(a, b, 1e-4, &format!("parameter {i}"));
    }
}

/// A step whose backward never completes the buckets (the view attached as an early
/// micro-batch, so nothing starts) is an error at `finish` on every rank, not a hang.
#[test]
fn finish_without_the_last_micro_batch_is_an_error_on_every_rank() {
    let _rng = rng_lock();
    let config = GptConfig::new(V, S, 16, 4, 1);
    device().seed(3);
    let errors = run_ranks(LocalGroup::new(2).unwrap(), move |dp_group| {
        let model = config
            .init(&dp_group.split(dp_group.rank(), 0).unwrap(), &device())
            .unwrap();
        let reducer = GradReducer::new(&model, &dp_group, 2048);
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(token_ids(S * 2, V, 3, 1), [S, 2]),
            &device(),
        );
        let view = reducer.attach(model.clone(), false);
        let loss = view.loss(ids.clone(), ids);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        reducer.finish(&model, &mut grads).unwrap_err().to_string()
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("never completed") && e.contains("buckets"),
            "{e}"
        );
    }
}
