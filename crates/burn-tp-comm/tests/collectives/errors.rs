//! Misuse and failures: an error on every rank, never a hang.

use super::*;

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

/// A group of rank threads used from the one thread that made it (forgetting a thread per
/// rank): rank 0's first collective fails with `SameThread`, naming the fix, after the short
/// grace for a late rank thread rather than the group's 30 s timeout; and a thread that posted
/// for rank 1 then waits as rank 0 on rank 1's next call fails at once.
#[test]
fn a_group_used_from_one_thread_fails_at_once_naming_the_fix() {
    let options = LocalGroupOptions {
        timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let start = Instant::now();
    let groups = LocalGroup::with_options(2, options.clone()).unwrap();
    let err = groups[0].all_reduce(vec![1f32], ReduceOp::Sum).unwrap_err();
    assert!(
        matches!(&err, CommError::SameThread { missing, .. } if missing == &vec![1]),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("run_local") && msg.contains("never used"),
        "{msg}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );

    let groups = LocalGroup::with_options(2, options).unwrap();
    // Both ranks' first call posted from this thread: it completes.
    let one = groups[1]
        .all_reduce_async(vec![1f32], ReduceOp::Sum, vec![0f32])
        .unwrap();
    assert_eq!(
        groups[0].all_reduce(vec![2f32], ReduceOp::Sum).unwrap(),
        vec![3f32]
    );
    assert_eq!(one.wait().unwrap(), vec![3f32]);
    // Rank 0's next call waits on rank 1, which this very thread serves.
    let start = Instant::now();
    let err = groups[0].all_reduce(vec![2f32], ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, CommError::SameThread { .. }), "{err}");
    assert!(!err.to_string().contains("never used"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );

    // Rank threads (one each) are unaffected, even when one starts late.
    let results = run(2, options_short(), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1_500));
        }
        pg.all_reduce(vec![1f32], ReduceOp::Sum)
    });
    for r in results {
        assert_eq!(r.unwrap().unwrap(), vec![2f32]);
    }
}

fn options_short() -> LocalGroupOptions {
    short(10_000)
}
