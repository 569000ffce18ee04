//! A soak of mixed async collectives; the all-gather's parts and the ring's transfers in order.

use super::*;

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
