//! The differentiable collectives against single-thread references, their async forms and
//! buffers (here); their backward (`autodiff.rs`): adjoint identities, gradients of a small
//! sharded computation, finite differences, every rank's backward.

mod autodiff;

use crate::common::{assert_close, f64s, quarters, tensor, uniform};
use burn::tensor::{DType, Tensor};
use burn_tp::comm::{LocalGroup, LocalGroupOptions, ReduceOp};
use burn_tp::local::{run_local, run_ranks};
use burn_tp::ops::{
    all_gather, all_gather_async, all_reduce, all_to_all, copy_to_tp_region, gather_from_tp_region,
    reduce_from_tp_region, reduce_scatter, reduce_scatter_async, scatter_to_tp_region,
};
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};
use std::time::{Duration, Instant};

const SHAPE: [usize; 3] = [4, 3, 4];

pub(crate) fn input(rank: usize, dtype: DType) -> Tensor<3> {
    tensor(quarters(48, rank as u64 + 1), SHAPE, dtype)
}

#[test]
fn primitives_match_single_thread_reference() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for world in 1..=4usize {
            for dim in [0usize, 2] {
                let inputs: Vec<Tensor<3>> = (0..world).map(|r| input(r, dtype)).collect();
                let gathered = f64s(Tensor::cat(inputs.clone(), dim));
                let mut sum = inputs[0].clone();
                for x in &inputs[1..] {
                    sum = sum + x.clone();
                }
                let chunks: Vec<Vec<f64>> = if SHAPE[dim].is_multiple_of(world) {
                    sum.clone()
                        .chunk(world, dim)
                        .into_iter()
                        .map(f64s)
                        .collect()
                } else {
                    vec![]
                };
                let sum = f64s(sum);
                let results = run_local(world, move |g| {
                    let x = input(g.rank(), dtype);
                    let rs = SHAPE[dim]
                        .is_multiple_of(g.world_size())
                        .then(|| f64s(reduce_scatter(x.clone(), dim, &g).unwrap()));
                    (
                        f64s(all_gather(x.clone(), dim, &g).unwrap()),
                        rs,
                        f64s(all_reduce(x.clone(), ReduceOp::Sum, &g).unwrap()),
                        f64s(reduce_from_tp_region(x.clone(), &g).unwrap()),
                        f64s(gather_from_tp_region(x, dim, &g).unwrap()),
                    )
                })
                .unwrap();
                for (r, (ag, rs, ar, rf, gf)) in results.into_iter().enumerate() {
                    let tag = format!("{dtype:?} world {world} dim {dim} rank {r}");
                    assert_eq!(ag, gathered, "all_gather {tag}");
                    assert_eq!(gf, gathered, "gather_from_tp_region {tag}");
                    assert_eq!(ar, sum, "all_reduce {tag}");
                    assert_eq!(rf, sum, "reduce_from_tp_region {tag}");
                    if let Some(rs) = rs {
                        assert_eq!(rs, chunks[r], "reduce_scatter {tag}");
                    }
                }
            }
        }
    }
}

#[test]
fn non_contiguous_inputs_are_read_in_logical_order() {
    let world = 2;
    let results = run_local(world, |g| {
        let base = input(g.rank(), DType::F32);
        // Transposed: [3, 4, 4] view of a [4, 3, 4] tensor; sliced: a strided window.
        let transposed = base.clone().swap_dims(0, 1);
        let sliced = base.clone().slice([0..4, 1..3, 0..4]);
        (
            f64s(all_gather(transposed.clone(), 0, &g).unwrap()),
            f64s(all_gather(sliced.clone(), 2, &g).unwrap()),
            f64s(reduce_scatter(transposed, 2, &g).unwrap()),
            f64s(all_reduce(sliced, ReduceOp::Max, &g).unwrap()),
        )
    })
    .unwrap();
    let t: Vec<Tensor<3>> = (0..world)
        .map(|r| input(r, DType::F32).swap_dims(0, 1))
        .collect();
    let s: Vec<Tensor<3>> = (0..world)
        .map(|r| input(r, DType::F32).slice([0..4, 1..3, 0..4]))
        .collect();
    let sum_t = t[0].clone() + t[1].clone();
    for (r, (ag_t, ag_s, rs_t, max_s)) in results.into_iter().enumerate() {
        assert_eq!(ag_t, f64s(Tensor::cat(t.clone(), 0)));
        assert_eq!(ag_s, f64s(Tensor::cat(s.clone(), 2)));
        assert_eq!(rs_t, f64s(sum_t.clone().chunk(2, 2)[r].clone()));
        assert_eq!(max_s, f64s(s[0].clone().max_pair(s[1].clone())));
    }
}

/// Collectives started before compute and waited on after it give the right results over a
/// link with 50 ms of latency, and nothing hangs. How long each wait takes is a timing (a peer's
/// shard arrives `latency` after the peer's post, which a loaded machine can put well before this
/// rank's own start), so how much of the latency the compute hides is measured by the bench
/// (`cargo bench -p burn-tp --bench tp -- --only=overlap`), not asserted here.
#[test]
fn collectives_waited_after_compute_give_the_right_results() {
    let options = LocalGroupOptions {
        link: Some(burn_tp::comm::LinkModel::new(100.0, 50_000.0)),
        ..Default::default()
    };
    let groups = LocalGroup::with_options(2, options).unwrap();
    let results = run_ranks(groups, |g| {
        let x = input(g.rank(), DType::F32);
        // Waiting at once: the link's latency.
        let t = Instant::now();
        let direct = f64s(all_gather(x.clone(), 0, &g).unwrap());
        let direct_wait = t.elapsed();
        // Starting, computing, then waiting.
        let pending = all_gather_async(x.clone(), 0, &g).unwrap();
        let rs = reduce_scatter_async(x.clone(), 0, &g).unwrap();
        std::thread::sleep(Duration::from_millis(150)); // the compute
        let t = Instant::now();
        let (ag, rs) = (f64s(pending.wait().unwrap()), f64s(rs.wait().unwrap()));
        (direct, ag, rs, direct_wait, t.elapsed())
    })
    .unwrap();
    let inputs: Vec<Tensor<3>> = (0..2).map(|r| input(r, DType::F32)).collect();
    let sum = inputs[0].clone() + inputs[1].clone();
    for (r, (direct, ag, rs, direct_wait, overlapped_wait)) in results.into_iter().enumerate() {
        assert_eq!(ag, f64s(Tensor::cat(inputs.clone(), 0)));
        assert_eq!(direct, ag);
        assert_eq!(rs, f64s(sum.clone().chunk(2, 0)[r].clone()));
        // Only a hang is an error here.
        for wait in [direct_wait, overlapped_wait] {
            assert!(wait < Duration::from_secs(30), "rank {r} waited {wait:?}");
        }
    }
}

/// Outputs come from a pool and inputs are read in place: a pooled buffer is never written while
/// a tensor still refers to it, an input read in place is never changed under a pending read,
/// and buffers are reused once their tensors are gone.
#[test]
fn pooled_outputs_are_never_aliased_and_inputs_are_read_in_place() {
    // An odd shape, so no other test's buffers share the pool's size class.
    const ROWS: usize = 37;
    let out = run_local(2, |g| {
        let r = g.rank() as f32;
        let dev = crate::common::device();
        let x = |v: f32| Tensor::<2>::full([ROWS, 3], v + r, &dev);
        let first = all_gather(x(10.0), 0, &g).unwrap();
        let kept = f64s(first.clone());
        // More gathers of other values while `first` lives: none may land in its storage.
        for k in 0..5 {
            let y = all_gather(x(k as f32), 0, &g).unwrap();
            assert_eq!(f64s(y)[0], k as f64);
        }
        assert_eq!(f64s(first.clone()), kept);
        // In place on a pooled output (its only owner) is fine and stays private to it.
        let bumped = first + 1.0;
        assert_eq!(f64s(bumped)[0], kept[0] + 1.0);
        // An input read in place: writing to it while the gather is pending copies first.
        let input = x(100.0);
        let pending = all_gather_async(input.clone(), 0, &g).unwrap();
        let changed = input + 5.0;
        let got = f64s(pending.wait().unwrap());
        assert_eq!(got[0], 100.0);
        assert_eq!(got[ROWS * 3], 101.0);
        assert_eq!(f64s(changed)[0], 105.0 + r as f64);
        // Steady state: each output's buffer comes back for the next one.
        let (_, reused_before) = burn_tp::backend::pool_stats();
        for k in 0..10 {
            drop(all_gather(x(k as f32), 0, &g).unwrap());
        }
        let (_, reused_after) = burn_tp::backend::pool_stats();
        reused_after - reused_before
    })
    .unwrap();
    // Two ranks each reused (at least) most of their ten buffers; the counter is global.
    assert!(out.iter().all(|&reused| reused >= 8), "{out:?}");
}
