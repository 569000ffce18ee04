//! Failures of the differentiable collectives reach every rank as errors, never hangs: an
//! indivisible reduce-scatter before any communication, ranks that disagree, a rank that never
//! arrives, panics or leaves, a start error on one rank.

use crate::collectives::input;
use crate::common::tensor;
use burn::tensor::{DType, Tensor};
use burn_tp::TpError;
use burn_tp::comm::{LocalGroup, LocalGroupOptions, ReduceOp};
use burn_tp::local::{run_local, run_ranks};
use burn_tp::ops::{all_gather, all_reduce, reduce_scatter, scatter_to_tp_region};
use std::time::{Duration, Instant};

#[test]
fn indivisible_reduce_scatter_is_a_typed_error_before_communication() {
    let groups = LocalGroup::new(3).unwrap();
    // Only rank 0 calls: an error before communication cannot hang.
    let err = reduce_scatter(input(0, DType::F32), 0, &groups[0]).unwrap_err();
    assert_eq!(
        err,
        TpError::NotDivisible {
            what: "reduce_scatter: dim 0 of the input".into(),
            size: 4,
            tp: 3
        }
    );
    assert!(err.to_string().contains("4") && err.to_string().contains("3"));
    let err = all_gather(input(0, DType::F32), 3, &groups[0]).unwrap_err();
    assert!(matches!(
        err,
        TpError::DimOutOfRange {
            dim: 3,
            rank: 3,
            ..
        }
    ));
    let err = scatter_to_tp_region(input(0, DType::F32), 2, &groups[0]).unwrap_err();
    assert!(
        matches!(err, TpError::NotDivisible { size: 4, tp: 3, .. }),
        "{err}"
    );
}

#[test]
fn mismatched_shapes_fail_on_every_rank_naming_both() {
    let start = Instant::now();
    let opts = LocalGroupOptions {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let results = run_ranks(LocalGroup::with_options(2, opts).unwrap(), |g| {
        let x = tensor(vec![0.0; 6 + 2 * g.rank()], [2, 3 + g.rank()], DType::F32);
        all_gather(x, 0, &g).map(|_| ())
    })
    .unwrap();
    for r in results {
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("[2, 3]") && msg.contains("[2, 4]"), "{msg}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_rank_that_never_arrives_times_out_and_a_panicking_rank_is_peer_gone() {
    let start = Instant::now();
    let opts = LocalGroupOptions {
        timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let results = run_ranks(LocalGroup::with_options(2, opts.clone()).unwrap(), |g| {
        if g.rank() == 1 {
            // Alive but never calls: the others must time out, not see it gone.
            std::thread::sleep(Duration::from_millis(600));
            return Ok(());
        }
        all_reduce(input(0, DType::F32), ReduceOp::Sum, &g).map(|_| ())
    })
    .unwrap();
    let msg = results[0].as_ref().unwrap_err().to_string();
    assert!(msg.contains("timed out") && msg.contains("[1]"), "{msg}");

    // A rank that panics before the backward: the other's backward collective panics in its own
    // thread with the reason, instead of hanging. The long timeout shows it is PeerGone, not a
    // timeout (the panic hook may take a while to print a backtrace before the rank unwinds).
    let opts = LocalGroupOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let results = run_ranks(LocalGroup::with_options(2, opts).unwrap(), |g| {
        let x = input(g.rank(), DType::F32).require_grad();
        let y = all_gather(x.clone(), 0, &g).unwrap();
        if g.rank() == 1 {
            panic!("rank 1 fails before backward");
        }
        let _ = (y * 2.0).sum().backward();
    });
    let msg = results.unwrap_err();
    assert!(msg.contains("rank(s) [1] left the group"), "{msg}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

/// A collective that fails on one rank before it is posted aborts the group: the peer's pending
/// call fails at once, naming that rank, long before its timeout.
#[test]
fn a_start_error_on_one_rank_reaches_every_rank_at_once() {
    use burn::backend::Dispatch;
    use burn_tp::backend::{Collective, TpBackend};
    let out = run_local(2, |g| {
        g.set_timeout(Duration::from_secs(60));
        let dev = crate::common::device();
        let start = Instant::now();
        // Rank 0 asks the backend directly for a reduce-scatter of 3 rows over 2 ranks: it fails
        // before posting. Rank 1 posts a valid one and waits.
        let rows = if g.rank() == 0 { 3 } else { 4 };
        let x = Tensor::<2>::ones([rows, 2], &dev);
        let pending = <Dispatch as TpBackend>::tp_start(
            x.into_dispatch(),
            Collective::ReduceScatter { dim: 0 },
            g.clone(),
        );
        let result = <Dispatch as TpBackend>::tp_resolve(pending).into_result();
        (result.err().map(|e| e.to_string()), start.elapsed())
    })
    .unwrap();
    for (rank, (error, elapsed)) in out.into_iter().enumerate() {
        let error = error.unwrap_or_else(|| panic!("rank {rank} succeeded"));
        assert!(error.contains("reduce_scatter"), "rank {rank}: {error}");
        if rank == 1 {
            assert!(error.contains("rank 0"), "{error}");
        }
        // Event driven (no timer on the path): here in microseconds; bounded at half the
        // 60 s timeout so a loaded machine cannot fail it, while a wait for the timeout would.
        eprintln!("rank {rank} heard after {elapsed:?}");
        assert!(!error.contains("timed out"), "rank {rank}: {error}");
        assert!(
            elapsed < Duration::from_secs(30),
            "rank {rank} waited {elapsed:?}"
        );
    }
}

/// A rank that fails without posting (it panics, or it drops its group handle while its thread
/// lives on) reaches every peer as soon as it fails: the peer's pending collective and its next one
/// fail naming the failed rank, long before the 60 s timeout. The panic unwinds with
/// `resume_unwind`, which skips the panic hook: the test times burn-tp, not the printing of a
/// backtrace.
#[test]
fn a_panicking_or_departing_rank_reaches_every_peer_before_any_timeout() {
    use std::sync::{Arc, Mutex};
    type Seen = (usize, String, String, Instant);
    for panics in [true, false] {
        let failed_at = Arc::new(Mutex::new(None::<Instant>));
        let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
        let (at, log) = (failed_at.clone(), seen.clone());
        let result = run_ranks(LocalGroup::new(3).unwrap(), move |g| {
            g.set_timeout(Duration::from_secs(60));
            if g.rank() == 1 {
                std::thread::sleep(Duration::from_millis(200));
                *at.lock().unwrap() = Some(Instant::now());
                if panics {
                    std::panic::resume_unwind(Box::new("rank 1 fails"));
                }
                drop(g);
                std::thread::sleep(Duration::from_secs(2));
                return;
            }
            let pending = all_reduce(input(g.rank(), DType::F32), ReduceOp::Sum, &g);
            let heard = Instant::now();
            let next = all_gather(input(g.rank(), DType::F32), 0, &g);
            let err = |r: Result<Tensor<3>, TpError>| r.map(|_| ()).unwrap_err().to_string();
            log.lock()
                .unwrap()
                .push((g.rank(), err(pending), err(next), heard));
        });
        assert_eq!(result.is_err(), panics, "{result:?}");
        let failed_at = failed_at.lock().unwrap().expect("rank 1 ran");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2, "panics {panics}: both peers report");
        for (rank, pending, next, heard) in seen.iter() {
            let tag = format!("panics {panics}, rank {rank}");
            assert!(pending.contains("[1]"), "{tag}: {pending}");
            assert!(
                next.contains("[1]") || next.contains("rank 1"),
                "{tag}: {next}"
            );
            // Event driven: milliseconds here; bounded at half the 60 s timeout so a loaded
            // machine cannot fail it, while a wait for the timeout would.
            let delay = heard.saturating_duration_since(failed_at);
            eprintln!("{tag}: heard after {delay:?}");
            assert!(!pending.contains("timed out"), "{tag}: {pending}");
            assert!(
                delay < Duration::from_secs(30),
                "{tag}: heard after {delay:?}"
            );
        }
    }
}
