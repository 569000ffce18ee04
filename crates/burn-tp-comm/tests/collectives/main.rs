//! burn-tp-comm against single-thread references (here), misuse and failures (`errors.rs`),
//! a soak and the transfers' orders (`transfers.rs`): one test binary (CI links few).

#[path = "../common/mod.rs"]
mod common;
mod errors;
mod transfers;

use common::{run, run_ok};

use std::time::{Duration, Instant};

use burn_tp_comm::{CommElement, CommError, LocalGroup, LocalGroupOptions, ReduceOp};
use half::{bf16, f16};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn short(timeout_ms: u64) -> LocalGroupOptions {
    LocalGroupOptions {
        timeout: Duration::from_millis(timeout_ms),
        ..Default::default()
    }
}

/// Rank `r`'s input values: deterministic multiples of 1/2 in [-4, 4), so every sum of up to
/// four of them is exact in every element type.
fn input_f64(rank: usize, len: usize) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(rank as u64 * 7919 + len as u64);
    (0..len)
        .map(|_| rng.random_range(-8i32..8) as f64 * 0.5)
        .collect()
}

/// Rank `r`'s input as `T`.
fn input<T: CommElement>(rank: usize, len: usize, conv: fn(f64) -> T) -> Vec<T> {
    input_f64(rank, len).into_iter().map(conv).collect()
}

fn check_all_ops<T: CommElement + PartialEq>(conv: fn(f64) -> T) {
    for world in 1..=4 {
        let len = 12 * world;
        // References computed here in plain f64 loops, independently of the transport's own
        // reduction functions, then converted to `T` once (exact for the sums, max and min; the
        // average rounds the exact quotient once).
        let inputs: Vec<Vec<f64>> = (0..world).map(|r| input_f64(r, len)).collect();
        let column = |i: usize| inputs.iter().map(move |x| x[i]);
        let each = |f: &dyn Fn(usize) -> f64| (0..len).map(|i| conv(f(i))).collect::<Vec<T>>();
        let gathered: Vec<T> = inputs.concat().into_iter().map(conv).collect();
        let summed = each(&|i| column(i).sum());
        let maxed = each(&|i| column(i).fold(f64::NEG_INFINITY, f64::max));
        let mined = each(&|i| column(i).fold(f64::INFINITY, f64::min));
        let avg = each(&|i| column(i).sum::<f64>() / world as f64);
        let last: Vec<T> = inputs[world - 1].iter().copied().map(conv).collect();
        let chunk = len / world;

        let results = run_ok(world, move |pg| {
            let x = input(pg.rank(), len, conv);
            (
                pg.all_gather(x.clone()).unwrap(),
                pg.reduce_scatter(x.clone()).unwrap(),
                pg.all_reduce(x.clone(), ReduceOp::Sum).unwrap(),
                pg.all_reduce(x.clone(), ReduceOp::Max).unwrap(),
                pg.all_reduce(x.clone(), ReduceOp::Min).unwrap(),
                pg.all_reduce(x.clone(), ReduceOp::Avg).unwrap(),
                pg.broadcast(x, world - 1).unwrap(),
                pg.barrier().unwrap(),
            )
        });
        for (rank, (ag, rs, sum, max, min, avgr, bc, ())) in results.into_iter().enumerate() {
            assert_eq!(ag, gathered, "all_gather world {world} rank {rank}");
            assert_eq!(
                rs,
                summed[rank * chunk..(rank + 1) * chunk],
                "reduce_scatter world {world} rank {rank}"
            );
            assert_eq!(sum, summed, "all_reduce sum world {world}");
            assert_eq!(max, maxed, "all_reduce max world {world}");
            assert_eq!(min, mined, "all_reduce min world {world}");
            assert_eq!(avgr, avg, "all_reduce avg world {world}");
            assert_eq!(bc, last, "broadcast world {world}");
        }
    }
}

#[test]
fn every_op_matches_single_thread_reference_f32() {
    check_all_ops::<f32>(|v| v as f32);
}

#[test]
fn every_op_matches_single_thread_reference_f64() {
    check_all_ops::<f64>(|v| v);
}

#[test]
fn every_op_matches_single_thread_reference_f16() {
    check_all_ops::<f16>(f16::from_f64);
}

#[test]
fn every_op_matches_single_thread_reference_bf16() {
    check_all_ops::<bf16>(bf16::from_f64);
}

#[test]
fn every_op_matches_single_thread_reference_i64() {
    check_all_ops::<i64>(|v| (v * 2.0) as i64);
}

#[test]
fn sums_are_bit_identical_across_ranks_on_non_integer_data() {
    let results = run_ok(3, |pg| {
        let mut rng = StdRng::seed_from_u64(pg.rank() as u64);
        let x: Vec<f32> = (0..999).map(|_| rng.random::<f32>() * 1e3).collect();
        pg.all_reduce(x, ReduceOp::Sum).unwrap()
    });
    let bits = |v: &Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&results[0]), bits(&results[1]));
    assert_eq!(bits(&results[0]), bits(&results[2]));
}

#[test]
fn async_handles_overlap_and_complete_out_of_order() {
    let results = run_ok(2, |pg| {
        let a = pg
            .all_gather_async(vec![pg.rank() as f32], vec![0.0; 2])
            .unwrap();
        let b = pg
            .all_reduce_async(vec![1.0f32 + pg.rank() as f32], ReduceOp::Sum, vec![0.0])
            .unwrap();
        // Both are in flight; wait for the later one first.
        let b = b.wait().unwrap();
        assert!(a.is_completed());
        (a.wait().unwrap(), b)
    });
    for r in results {
        assert_eq!(r, (vec![0.0, 1.0], vec![3.0]));
    }
}

#[test]
fn split_gives_mpi_comm_split_groups() {
    let results = run_ok(4, |pg| {
        let tp = pg.split(pg.rank() / 2, pg.rank()).unwrap();
        let dp = pg.split(pg.rank() % 2, pg.rank()).unwrap();
        let tp_ids = tp.all_gather(vec![pg.rank() as i64]).unwrap();
        let dp_ids = dp.all_gather(vec![pg.rank() as i64]).unwrap();
        // A reversed key reverses the order.
        let rev = pg.split(0, 10 - pg.rank()).unwrap();
        (tp.rank(), tp.world_size(), tp_ids, dp_ids, rev.rank())
    });
    assert_eq!(results[0], (0, 2, vec![0, 1], vec![0, 2], 3));
    assert_eq!(results[1], (1, 2, vec![0, 1], vec![1, 3], 2));
    assert_eq!(results[2], (0, 2, vec![2, 3], vec![0, 2], 1));
    assert_eq!(results[3], (1, 2, vec![2, 3], vec![1, 3], 0));
}
