//! burn-tp-comm against single-thread references, misuse, and a soak.
//!
//! Over 600 lines in one file on purpose: each file of `tests/` is a test binary of its own,
//! and this crate's collective checks share one (CI links few binaries).

mod common;

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

#[test]
fn reduce_scatter_of_indivisible_length_is_an_error_before_communication() {
    let groups = LocalGroup::new(3).unwrap();
    let err = groups[0].reduce_scatter(vec![1.0f32; 10]).unwrap_err();
    assert_eq!(
        err,
        CommError::NotDivisible {
            op: "reduce_scatter",
            len: 10,
            world_size: 3
        }
    );
    assert!(err.to_string().contains("10") && err.to_string().contains('3'));
    assert!(matches!(
        LocalGroup::new(0),
        Err(CommError::InvalidWorldSize(0))
    ));
    assert!(matches!(
        groups[1].broadcast(vec![0f32], 3),
        Err(CommError::InvalidRoot { root: 3, .. })
    ));
}

#[test]
fn mismatched_shapes_fail_on_every_rank() {
    let start = Instant::now();
    let results = run(2, short(5_000), |pg| {
        pg.all_gather(vec![0f32; 3 + pg.rank()])
    });
    for r in results {
        let err = r.unwrap().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CommError::Mismatch { seq: 0, .. }), "{msg}");
        assert!(
            msg.contains("[3]") && msg.contains("[4]") && msg.contains("all_gather"),
            "{msg}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn misordered_ops_fail_on_every_rank() {
    let results = run(2, short(5_000), |pg| {
        if pg.rank() == 0 {
            pg.all_reduce(vec![1f32; 4], ReduceOp::Sum).map(|_| ())
        } else {
            pg.reduce_scatter(vec![1f32; 4]).map(|_| ())
        }
    });
    for r in results {
        let msg = r.unwrap().unwrap_err().to_string();
        assert!(
            msg.contains("reduce_scatter") && msg.contains("all_reduce") && msg.contains("#0"),
            "{msg}"
        );
    }
}

#[test]
fn mismatched_dtype_fails_on_every_rank() {
    let results = run(2, short(5_000), |pg| {
        if pg.rank() == 0 {
            pg.all_gather(vec![1f32; 4]).map(|_| ())
        } else {
            pg.all_gather(vec![1f64; 4]).map(|_| ())
        }
    });
    for r in results {
        let msg = r.unwrap().unwrap_err().to_string();
        assert!(msg.contains("F32") && msg.contains("F64"), "{msg}");
    }
}

#[test]
fn a_panicking_rank_makes_the_others_fail_with_peer_gone() {
    let start = Instant::now();
    let results = run(3, short(20_000), |pg| {
        pg.barrier().unwrap();
        if pg.rank() == 1 {
            panic!("rank 1 fails on purpose");
        }
        pg.all_gather(vec![0f32; 2])
    });
    assert!(results[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        let err = results[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(
            matches!(err, CommError::PeerGone { gone, .. } if gone == &vec![1]),
            "{err}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "PeerGone must not wait for the timeout"
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_on_every_rank() {
    let start = Instant::now();
    let results = run(3, short(300), |pg| {
        if pg.rank() == 2 {
            // Arrives long after the others gave up: the group is aborted by then.
            std::thread::sleep(Duration::from_millis(800));
        }
        pg.all_reduce(vec![1f32; 8], ReduceOp::Sum)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.unwrap().unwrap_err();
        let msg = err.to_string();
        if rank == 2 {
            assert!(matches!(err, CommError::Aborted { .. }), "{msg}");
            assert!(
                msg.contains("timed out"),
                "the abort reason names the timeout: {msg}"
            );
        } else {
            // The first rank to time out aborts the group; either way the message names rank 2.
            assert!(
                matches!(&err, CommError::Timeout { .. } | CommError::Aborted { .. }),
                "{msg}"
            );
            assert!(msg.contains("rank(s) [2] had not arrived"), "{msg}");
        }
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn per_group_timeout_setter_and_wait_timeout() {
    let results = run(2, LocalGroupOptions::default(), |pg| {
        if pg.rank() == 0 {
            pg.set_timeout(Duration::from_millis(100));
            assert_eq!(pg.timeout(), Duration::from_millis(100));
            let e = pg.barrier().unwrap_err();
            assert!(matches!(e, CommError::Timeout { .. }));
            Ok(())
        } else {
            std::thread::sleep(Duration::from_millis(400));
            pg.barrier_async().wait_timeout(Duration::from_millis(50))
        }
    });
    assert!(results[0].as_ref().unwrap().is_ok());
    // Rank 0 timed out on the barrier and aborted the group before rank 1 arrived.
    let r1 = results[1].as_ref().unwrap();
    assert!(matches!(r1, Err(CommError::Aborted { .. })), "{r1:?}");
}

#[test]
fn dropped_work_does_not_block_later_calls() {
    let results = run_ok(2, |pg| {
        drop(pg.all_gather_async(vec![1f32; 4], vec![0.0; 8]));
        pg.all_reduce(vec![pg.rank() as f32], ReduceOp::Sum)
            .unwrap()
    });
    assert_eq!(results, vec![vec![1.0], vec![1.0]]);
}

/// 10,000 mixed async collectives with random per-rank delays and random wait orders, bit-identical
/// to a sequential reference.
#[test]
fn soak_ten_thousand_mixed_async_collectives() {
    const CALLS: usize = 10_000;
    const WORLD: usize = 4;
    fn value(rank: usize, call: usize, i: usize) -> f32 {
        // Non-integer values so that a reordered sum would show in the bits.
        ((rank * 131 + call * 17 + i * 7) % 97) as f32 * 0.013 + 0.1
    }
    fn reference(call: usize) -> Vec<f32> {
        let len = 8;
        let inputs: Vec<Vec<f32>> = (0..WORLD)
            .map(|r| (0..len).map(|i| value(r, call, i)).collect())
            .collect();
        match call % 3 {
            0 => inputs.concat(),
            // The sum in rank order, in f32, as a plain loop (the transport's guarantee).
            _ => (0..len)
                .map(|i| inputs[1..].iter().fold(inputs[0][i], |acc, x| acc + x[i]))
                .collect(),
        }
    }
    let results = run_ok(WORLD, |pg| {
        let mut rng = StdRng::seed_from_u64(pg.rank() as u64);
        let mut pending = Vec::new();
        let mut out = vec![Vec::new(); CALLS];
        for call in 0..CALLS {
            let x: Vec<f32> = (0..8).map(|i| value(pg.rank(), call, i)).collect();
            let work = match call % 3 {
                0 => pg.all_gather_async(x, vec![0.0; 8 * WORLD]),
                1 => pg.all_reduce_async(x, ReduceOp::Sum, vec![0.0; 8]),
                _ => {
                    // reduce-scatter result is the rank's chunk of the sum; gather it back to compare.
                    let rs = pg.reduce_scatter(x).unwrap();
                    pg.all_gather_async(rs, vec![0.0; 8])
                }
            }
            .unwrap();
            pending.push((call, work));
            if rng.random_bool(0.02) {
                std::thread::sleep(Duration::from_micros(rng.random_range(0..200)));
            }
            // Keep up to 4 in flight, completing a random one.
            while pending.len() > rng.random_range(0..4) {
                let i = rng.random_range(0..pending.len());
                let (c, w) = pending.swap_remove(i);
                out[c] = w.wait().unwrap();
            }
        }
        for (c, w) in pending {
            out[c] = w.wait().unwrap();
        }
        out
    });
    for call in 0..CALLS {
        let want: Vec<u32> = reference(call).iter().map(|v| v.to_bits()).collect();
        for r in &results {
            assert_eq!(
                r[call].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "call {call}"
            );
        }
    }
}

#[test]
fn all_gather_parts_arrive_one_by_one_in_ring_order() {
    use burn_tp_comm::LinkModel;
    for link in [None, Some(LinkModel::new(1.0, 50.0))] {
        let results = run(
            4,
            LocalGroupOptions {
                link,
                ..Default::default()
            },
            |pg| {
                let r = pg.rank();
                let work = pg
                    .all_gather_async(vec![r as f32; 3], vec![0.0; 12])
                    .unwrap();
                let mut parts = vec![Vec::new(); 4];
                for k in 0..4 {
                    let p = (r + 4 - k) % 4;
                    parts[p] = work.wait_part(p).unwrap();
                }
                let full = work.wait().unwrap();
                (parts.concat(), full)
            },
        );
        for r in results {
            let (parts, full) = r.unwrap();
            let want: Vec<f32> = (0..4).flat_map(|p| vec![p as f32; 3]).collect();
            assert_eq!(parts, want);
            assert_eq!(full, want);
        }
    }
    // Parts exist only for all-gathers.
    let results = run(2, LocalGroupOptions::default(), |pg| {
        let w = pg
            .all_reduce_async(vec![1f32], ReduceOp::Sum, vec![0.0])
            .unwrap();
        let e = w.wait_part(0).unwrap_err();
        w.wait().unwrap();
        e
    });
    for r in results {
        assert!(r.unwrap().to_string().contains("only all-gathers"));
    }
}

#[test]
fn all_gather_into_reuses_the_callers_buffer() {
    let results = run_ok(3, |pg| {
        let mut buf = vec![0f32; 6];
        for round in 0..3 {
            let x = vec![(pg.rank() * 10 + round) as f32; 2];
            let ptr = buf.as_ptr();
            buf = pg.all_gather_async(x, buf).unwrap().wait().unwrap();
            assert_eq!(buf.as_ptr(), ptr, "filled in place");
        }
        let err = pg
            .all_gather_async(vec![0f32; 2], vec![0f32; 5])
            .unwrap_err();
        (buf, err)
    });
    for (buf, err) in results {
        assert_eq!(buf, vec![2.0, 2.0, 12.0, 12.0, 22.0, 22.0]);
        assert_eq!(
            err,
            CommError::BufferSize {
                op: "all_gather",
                expected: 6,
                got: 5
            }
        );
    }
}

#[test]
fn local_groups_pass_the_communicator_conformance_check() {
    for world in 1..=3 {
        run_ok(world, |pg| {
            common::conformance(&pg, |v| v.to_vec(), |b| b);
        });
    }
}

/// Every async form checks the caller's output length before any communication, naming the op.
#[test]
fn every_async_form_checks_the_output_length() {
    let results = run_ok(2, |pg| {
        let x = || vec![1f32; 4];
        let short = || vec![0f32; 3];
        [
            pg.all_gather_async(x(), short()).map(|_| ()).unwrap_err(),
            pg.reduce_scatter_async(x(), short())
                .map(|_| ())
                .unwrap_err(),
            pg.all_reduce_async(x(), ReduceOp::Sum, short())
                .map(|_| ())
                .unwrap_err(),
            pg.broadcast_async(x(), 1, short()).map(|_| ()).unwrap_err(),
        ]
    });
    for errors in results {
        let want = [
            ("all_gather", 8),
            ("reduce_scatter", 2),
            ("all_reduce", 4),
            ("broadcast", 4),
        ];
        for (e, (op, expected)) in errors.into_iter().zip(want) {
            assert_eq!(
                e,
                CommError::BufferSize {
                    op,
                    expected,
                    got: 3
                }
            );
        }
    }
}

/// Ring transfers (pipeline stages' point-to-point): at 2 to 5 ranks every rank sends its values
/// to both neighbours, all transfers posted before any wait, the two directions in different
/// orders on neighbouring ranks, and receives each neighbour's; one rank has no neighbour (an
/// error naming it).
#[test]
fn ring_transfers_reach_both_neighbours() {
    for world in 2..=5 {
        let got = run_ok(world, move |pg| {
            let links = pg.ring_links().unwrap();
            let r = pg.rank();
            let mine = |to: usize| -> Vec<f32> {
                (0..3).map(|i| (100 * r + 10 * to + i) as f32).collect()
            };
            // Even ranks post the forward direction first, odd ones the backward: each
            // direction is matched on its own (as a 1F1B schedule needs).
            let forward = || {
                (
                    links.send_next(mine((r + 1) % world)).unwrap(),
                    links.recv_prev::<f32>(3).unwrap(),
                )
            };
            let backward = || {
                (
                    links.send_prev(mine((r + world - 1) % world)).unwrap(),
                    links.recv_next::<f32>(3).unwrap(),
                )
            };
            let ((s_next, r_prev), (s_prev, r_next)) = if r % 2 == 0 {
                let f = forward();
                (f, backward())
            } else {
                let b = backward();
                (forward(), b)
            };
            let from_prev = r_prev.wait().unwrap();
            let from_next = r_next.wait().unwrap();
            s_next.wait().unwrap();
            s_prev.wait().unwrap();
            (from_prev, from_next)
        });
        for (r, (from_prev, from_next)) in got.into_iter().enumerate() {
            let (p, n) = ((r + world - 1) % world, (r + 1) % world);
            let sent = |by: usize, to: usize| -> Vec<f32> {
                (0..3).map(|i| (100 * by + 10 * to + i) as f32).collect()
            };
            assert_eq!(from_prev, sent(p, r), "world {world} rank {r}: from {p}");
            assert_eq!(from_next, sent(n, r), "world {world} rank {r}: from {n}");
        }
    }
    let alone = run_ok(1, |pg| {
        pg.ring_links()
            .unwrap()
            .send_next(vec![1.0f32])
            .unwrap_err()
            .to_string()
    });
    assert!(alone[0].contains("no neighbour"), "{}", alone[0]);
}

/// The paired transfer: at 2, 3 and 4 ranks each rank sends to its next neighbour and receives
/// from it in one call (1F1B's steady state: an activation out, a gradient in; both posted
/// before either is waited on, every rank at once), then the mirror image with the previous
/// neighbour; each receives what its neighbour sent.
#[test]
fn paired_transfers_exchange_with_either_neighbour() {
    use burn_tp_comm::Neighbour::{Next, Prev};
    for world in 2..=4 {
        let got = run_ok(world, move |pg| {
            let links = pg.ring_links().unwrap();
            let r = pg.rank() as f32;
            // Activations forward, gradients back: from the next rank.
            let (s1, from_next) = links.send_recv((Next, vec![r; 2]), (Next, 3)).unwrap();
            // Gradients back, activations forward: from the previous rank.
            let (s2, from_prev) = links.send_recv((Prev, vec![-r; 3]), (Prev, 2)).unwrap();
            let out = (from_next.wait().unwrap(), from_prev.wait().unwrap());
            s1.wait().unwrap();
            s2.wait().unwrap();
            out
        });
        for (r, (from_next, from_prev)) in got.into_iter().enumerate() {
            let (p, n) = ((r + world - 1) % world, (r + 1) % world);
            assert_eq!(from_next, vec![-(n as f32); 3], "world {world} rank {r}");
            assert_eq!(from_prev, vec![p as f32; 2], "world {world} rank {r}");
        }
    }
}

/// A transfer that cannot complete fails on both sides, naming it: lengths that differ, a
/// receiver that left, one that never comes (the timeout).
#[test]
fn failed_transfers_are_errors_on_both_sides() {
    // 4 elements sent, 5 expected.
    let out = run(3, short(5_000), |pg| {
        let links = pg.ring_links().unwrap();
        match pg.rank() {
            0 => Some(links.send_next(vec![1.0f32; 4]).unwrap().wait()),
            1 => Some(links.recv_prev::<f32>(5).unwrap().wait()),
            _ => None,
        }
    });
    let e0 = out[0]
        .as_ref()
        .unwrap()
        .clone()
        .unwrap()
        .unwrap_err()
        .to_string();
    let e1 = out[1]
        .as_ref()
        .unwrap()
        .clone()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        e0.contains("send 0 -> 1 of 4") && e0.contains("mismatch"),
        "{e0}"
    );
    assert!(
        e1.contains("recv 1 <- 0 of 5") && e1.contains("mismatch"),
        "{e1}"
    );
    // The receiver's thread ends without receiving: the sender fails at once, not at the timeout.
    let start = Instant::now();
    let out = run(2, short(20_000), |pg| {
        let links = pg.ring_links().unwrap();
        (pg.rank() == 0).then(|| links.send_next(vec![1.0f32; 4]).unwrap().wait())
    });
    let e = out[0]
        .as_ref()
        .unwrap()
        .clone()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(e.contains("send 0 -> 1") && e.contains("left"), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    // A receiver that is there but never receives: the timeout, naming the transfer.
    let out = run(2, short(300), |pg| {
        let links = pg.ring_links().unwrap();
        if pg.rank() == 0 {
            Some(links.send_next(vec![1.0f32; 4]).unwrap().wait())
        } else {
            std::thread::sleep(Duration::from_millis(1_000));
            None
        }
    });
    let e = out[0]
        .as_ref()
        .unwrap()
        .clone()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(e.contains("send 0 -> 1") && e.contains("timed out"), "{e}");
}
