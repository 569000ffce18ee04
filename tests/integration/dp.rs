//! Data parallelism: the plain reduction (`average_gradients`) with SGD against full-batch
//! steps, the gradient reduction overlapped with the backward (`burn_tp::dp::GradReducer`)
//! against the plain one, the distributed optimizer, and the mesh's groups.

use crate::common::{assert_close, device, f64s, rng_lock, token_ids};
use crate::reference::{D, H};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::comm::LocalGroup;
use burn_tp::dp::{DistributedAdamW, GradReducer, average_gradients, broadcast_parameters};
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::{run_local, run_ranks};
use burn_tp::mesh::DeviceMesh;
use burn_tp::reshard::Reshard;

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
    /// `DistributedAdamW` (reduce-scatter, AdamW on this rank's chunk, all-gather).
    Distributed(usize),
}

/// What a run gave, on rank 0.
struct Run {
    losses: Vec<f64>,
    /// The full parameters after the steps.
    params: Vec<Vec<f64>>,
    buckets: usize,
    /// `Distributed`: (AdamW state bytes on this rank, elements of this rank's tp shard).
    state: Option<(usize, usize)>,
}

/// STEPS AdamW steps of the GPT (tied embeddings, sequence parallel) at tp x dp.
fn train(tp: usize, dp: usize, reduce: Reduce) -> Run {
    let config = GptConfig::new(V, S, 16, 4, 2)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter));
    // Every dp divides the batch (4, or 6 at dp 3).
    let batch = BATCH.div_ceil(dp) * dp;
    device().seed(7);
    let out = run_ranks(LocalGroup::new(tp * dp).unwrap(), move |world| {
        let mesh = DeviceMesh::new(world.clone(), tp).unwrap();
        let dp_rank = mesh.dp_rank();
        let (tp_group, dp_group) = (mesh.tp_group().clone(), mesh.dp_group().clone());
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
            Reduce::Overlap(b) | Reduce::Accumulate(b) | Reduce::Distributed(b) => b,
        };
        let reducer = GradReducer::new(&model, &dp_group, bucket_bytes);
        let mut zero = DistributedAdamW::new(&AdamWConfig::new(), &model, &dp_group, bucket_bytes);
        let mut optim = AdamWConfig::new().init();
        let mut losses = Vec::new();
        let per = batch / dp;
        for step in 0..STEPS as i64 {
            let columns = |cols: std::ops::Range<usize>| {
                let all = |k: i64| token_ids(S * batch, V, k, step * 3 + 1);
                let pick = |v: Vec<i64>| -> Tensor<2, Int> {
                    let t = Tensor::<2, Int>::from_data(TensorData::new(v, [S, batch]), &device());
                    t.slice([0..S, cols.clone()])
                };
                (pick(all(7)), pick(all(5)))
            };
            let mine = dp_rank * per..(dp_rank + 1) * per;
            // Rank 0's own loss (its dp slice) is logged: the same in every mode.
            if let Reduce::Distributed(_) = reduce {
                let (x, y) = columns(mine);
                let loss = zero.attach(model.clone(), true).loss(x, y);
                losses.push(f64s(loss.clone())[0]);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = zero.step(1e-2, model, grads).unwrap();
                continue;
            }
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
                Reduce::Distributed(_) => unreachable!("stepped above"),
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
        struct Count(usize);
        impl ModuleVisitor for Count {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0 += p.val().shape().num_elements();
            }
        }
        let mut count = Count(0);
        model.visit(&mut count);
        let state = matches!(reduce, Reduce::Distributed(_)).then(|| (zero.state_bytes(), count.0));
        let buckets = match reduce {
            Reduce::Distributed(_) => zero.buckets(),
            _ => reducer.buckets(),
        };
        let full = model.to_full_module().unwrap();
        struct Collect(Vec<Vec<f64>>);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0.push(f64s(p.val()));
            }
        }
        let mut c = Collect(Vec::new());
        full.visit(&mut c);
        Run {
            losses,
            params: c.0,
            buckets,
            state,
        }
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
        let Run {
            losses: want_losses,
            params: want_params,
            ..
        } = train(tp, dp, Reduce::Plain);
        for bucket in [GradReducer::DEFAULT_BUCKET_BYTES, 2048] {
            let Run {
                losses,
                params,
                buckets,
                ..
            } = train(tp, dp, Reduce::Overlap(bucket));
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
    let want = train(2, 2, Reduce::Plain);
    let (want_losses, want_params) = (want.losses, want.params);
    let got = train(2, 2, Reduce::Accumulate(2048));
    let (losses, params) = (got.losses, got.params);
    assert_close(&losses, &want_losses, 1e-5, "losses");
    for (i, (a, b)) in params.iter().zip(&want_params).enumerate() {
        assert_close(a, b, 1e-4, &format!("parameter {i}"));
    }
}

/// The distributed optimizer (AdamW moments sharded over dp, ZeRO stage 1) at tp 2 x dp 2,
/// tp 1 x dp 4 and tp 1 x dp 3 (padded buckets), one bucket and 2 KiB buckets: the plain run's losses and parameters after 20
/// steps, and each rank holds 1/dp of the moments (two f32 per element of its tp shard, plus at
/// most dp - 1 padding elements per bucket).
#[test]
fn the_distributed_optimizer_gives_the_plain_run_with_1_over_dp_of_the_state() {
    let _rng = rng_lock();
    // At dp 3 no bucket's length divides: each is zero-padded, and rank 2 owns (and steps) a
    // last chunk that ends in padding.
    for (tp, dp) in [(2usize, 2usize), (1, 4), (1, 3)] {
        let want = train(tp, dp, Reduce::Plain);
        for bucket in [GradReducer::DEFAULT_BUCKET_BYTES, 2048] {
            let got = train(tp, dp, Reduce::Distributed(bucket));
            let tag = format!("tp {tp} dp {dp}, {} buckets", got.buckets);
            assert_close(&got.losses, &want.losses, 1e-5, &format!("{tag}: losses"));
            for (i, (a, b)) in got.params.iter().zip(&want.params).enumerate() {
                assert_close(a, b, 1e-5, &format!("{tag}: parameter {i}"));
            }
            let (bytes, elements) = got.state.unwrap();
            if dp == 3 {
                assert!(
                    !elements.is_multiple_of(3),
                    "{tag}: {elements} elements, none padded"
                );
            }
            let floor = 8 * elements / dp;
            let most = 8 * (elements.div_ceil(dp) + got.buckets * (dp - 1));
            assert!(
                bytes >= floor && bytes <= most,
                "{tag}: {bytes} state bytes on rank 0, want {floor}..={most} (8 x {elements} / {dp})"
            );
        }
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

/// The mesh's groups: at world 6 and tp 2, the tp groups are adjacent pairs of world ranks and
/// the dp groups the ranks holding the same shard, each in rank order; tp 4 does not divide 6.
#[test]
fn the_mesh_groups_adjacent_tp_ranks_and_strided_dp_ranks() {
    let out = run_ranks(LocalGroup::new(6).unwrap(), |world| {
        let rank = world.rank() as i64;
        let e = DeviceMesh::new(world.clone(), 4).unwrap_err().to_string();
        assert!(e.contains("tp 4") && e.contains("6 ranks"), "{e}");
        let mesh = DeviceMesh::new(world, 2).unwrap();
        (
            (
                mesh.tp_rank(),
                mesh.dp_rank(),
                mesh.tp_size(),
                mesh.dp_size(),
            ),
            mesh.tp_group().all_gather(vec![rank]).unwrap(),
            mesh.dp_group().all_gather(vec![rank]).unwrap(),
        )
    })
    .unwrap();
    for (r, (ranks, tp, dp)) in out.into_iter().enumerate() {
        assert_eq!(ranks, (r % 2, r / 2, 2, 3), "rank {r}");
        let base = (r / 2 * 2) as i64;
        assert_eq!(tp, vec![base, base + 1], "rank {r}'s tp group");
        let first = (r % 2) as i64;
        assert_eq!(dp, vec![first, first + 2, first + 4], "rank {r}'s dp group");
    }
}

/// Every parameter of a module, in visiting order.
fn params<M: Module>(module: &M) -> Vec<Vec<f64>> {
    struct Collect(Vec<Vec<f64>>);
    impl burn::module::ModuleVisitor for Collect {
        fn visit_float<const R: usize>(&mut self, param: &Param<Tensor<R>>) {
            self.0.push(f64s(param.val()));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// `average_gradients` with SGD, which (unlike Adam) sees the gradient's scale: two SGD steps at
/// tp = 2 x dp = 2, each dp replica on half of the batch, give the parameters of two full-batch
/// steps of the unsharded model (an average that summed would step twice as far).
#[test]
fn average_gradients_with_sgd_equals_full_batch_steps() {
    use burn::optim::{GradientsParams, SgdConfig};
    use burn_tp::comm::LocalGroup;
    use burn_tp::dp::{average_gradients, broadcast_parameters};
    use burn_tp::local::run_ranks;
    const LR: f64 = 0.5;
    const BATCH: usize = 4;
    let _rng = rng_lock();
    let batch = |step: i64, cols: std::ops::Range<usize>| {
        let all = |k: i64| crate::common::token_ids(S * BATCH, V, k, step * 3 + 1);
        let pick = |v: Vec<i64>| -> Tensor<2, Int> {
            let t = Tensor::<2, Int>::from_data(TensorData::new(v, [S, BATCH]), &device());
            t.slice([0..S, cols.clone()])
        };
        (pick(all(7)), pick(all(5)))
    };
    let config = GptConfig::new(V, S, D, H, 2)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter));
    let (c1, c2) = (config.clone(), config);
    device().seed(31);
    let want = run_local(1, move |g| {
        let mut model = c1.init(&g, &device()).unwrap();
        let initial = params(&model);
        let mut optim = SgdConfig::new().init();
        for step in 0..2 {
            let (x, y) = batch(step, 0..BATCH);
            let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
            model = optim.step(LR, model, grads);
        }
        (initial, params(&model))
    })
    .unwrap()
    .remove(0);
    let (initial, want) = want;
    // tp x dp = 2 x 2 and 1 x 4 (every replica a batch of one).
    for (tp, dp) in [(2usize, 2usize), (1, 4)] {
        let c2 = c2.clone();
        device().seed(31);
        let got = run_ranks(LocalGroup::new(tp * dp).unwrap(), move |world| {
            let rank = world.rank();
            let (tp_rank, dp_rank) = (rank % tp, rank / tp);
            let tp_group = world.split(dp_rank, rank).unwrap();
            let dp_group = world.split(tp_rank, rank).unwrap();
            // Replica 0 draws the weights (the same draws as at tp = 1); the others take them.
            if dp_rank != 0 {
                world.barrier().unwrap();
            }
            let model = c2.init(&tp_group, &device()).unwrap();
            if dp_rank == 0 {
                world.barrier().unwrap();
            }
            let mut model = broadcast_parameters(model, &dp_group).unwrap();
            let mut optim = SgdConfig::new().init();
            for step in 0..2 {
                let part = BATCH / dp;
                let (x, y) = batch(step, dp_rank * part..(dp_rank + 1) * part);
                let mut grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                average_gradients(&model, &mut grads, &dp_group).unwrap();
                model = optim.step(LR, model, grads);
            }
            params(&model.to_full_module().unwrap())
        })
        .unwrap();
        for (rank, p) in got.iter().enumerate() {
            assert_eq!(p.len(), want.len());
            for (i, (a, b)) in p.iter().zip(&want).enumerate() {
                let tag = format!("tp {tp} dp {dp} rank {rank} parameter {i}");
                assert_close(a, b, 1e-4, &tag);
                // The update itself, relative to its size: a gradient off by 2x is off by 1.
                let (mut diff, mut size) = (0.0f64, 0.0f64);
                for ((x, y), x0) in a.iter().zip(b).zip(&initial[i]) {
                    diff += ((x - x0) - (y - x0)).powi(2);
                    size += (y - x0).powi(2);
                }
                if size > 1e-12 {
                    let rel = (diff / size).sqrt();
                    assert!(
                        rel < 2e-3,
                        "{tag}: the SGD update is off by {rel:e} of itself"
                    );
                }
            }
        }
    }
    // The steps are large enough that a gradient off by 2x would be far outside the tolerance.
    let moved: f64 = initial
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(moved > 1e-2, "SGD moved the parameters by at most {moved}");
}
