//! NCCL at world size 1 on the GPU when there is one; a printed skip (and a pass) otherwise.
#![cfg(feature = "nccl")]

use std::time::Duration;

mod common;

use burn_tp_comm::nccl::{NcclGroup, RawOp, probe};
use burn_tp_comm::store::{LaunchEnv, StoreServer};
use burn_tp_comm::{CommError, ProcessGroup};

/// An NCCL world of one rank on GPU 0 (with its store, kept alive), or `None` after printing
/// why the GPU tests skip here.
fn world_of_one() -> Option<(StoreServer, NcclGroup)> {
    if let Err(e) = probe() {
        println!("SKIPPED (no GPU / NCCL on this machine): {e}");
        return None;
    }
    let server = StoreServer::start("127.0.0.1:0", "").unwrap();
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master: server.addr().to_string(),
        token: String::new(),
    };
    let store =
        burn_tp_comm::store::StoreClient::connect(&env.master, 0, "", Duration::from_secs(5))
            .unwrap();
    let group = NcclGroup::new(&env, &store, Duration::from_secs(30)).unwrap();
    Some((server, group))
}

#[test]
fn probe_reports_missing_libraries_as_errors_not_panics() {
    match probe() {
        Ok(p) => println!("NCCL libraries found: {p:?}"),
        Err(CommError::Backend(msg)) => {
            assert!(msg.starts_with("NCCL:"), "{msg}");
            println!("no NCCL here ({msg}); the GPU tests below skip");
        }
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

#[test]
fn collectives_at_world_size_one_on_the_gpu() {
    let Some((_server, group)) = world_of_one() else {
        return;
    };
    let stream = group.compute_stream().clone();

    // The trait, on device buffers.
    common::conformance(
        &group,
        |v| stream.clone_htod(v).unwrap(),
        |b| stream.clone_dtoh(&b).unwrap(),
    );

    // Explicit output buffers, and their size check before any communication.
    let x = stream.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
    let mut out = stream.alloc_zeros::<f32>(3).unwrap();
    group
        .post_into(RawOp::AllGather, &x, &mut out)
        .unwrap()
        .wait_host()
        .unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![1.0, 2.0, 3.0]);
    let mut wrong = stream.alloc_zeros::<f32>(2).unwrap();
    assert!(matches!(
        group.post_into(RawOp::AllGather, &x, &mut wrong),
        Err(CommError::BufferSize {
            expected: 3,
            got: 2,
            ..
        })
    ));

    // A ProcessGroup over NCCL: host buffers staged through the GPU.
    let pg = ProcessGroup::from_nccl(group);
    assert!(pg.nccl().is_some());
    common::conformance(&pg, |v| v.to_vec(), |b| b);

    // The all-to-all with per-rank counts (expert parallelism's dispatch) over NCCL's grouped
    // send / receive, to this rank itself; an empty one (no token for the experts here); and
    // counts that do not add up to the input, refused before any communication.
    assert_eq!(
        pg.all_to_all(vec![1.0f32, 2.0, 3.0], &[3], &[3]).unwrap(),
        vec![1.0, 2.0, 3.0]
    );
    assert!(
        pg.all_to_all(Vec::<f32>::new(), &[0], &[0])
            .unwrap()
            .is_empty()
    );
    assert!(matches!(
        pg.all_to_all(vec![1.0f32, 2.0, 3.0], &[2], &[2]),
        Err(CommError::BufferSize { .. })
    ));

    // A split: a new communicator of the ranks of one colour (here, this one), which runs the
    // same conformance on its own stream.
    let sub = pg.split(0, 0).unwrap();
    assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    assert!(sub.nccl().is_some());
    common::conformance(&sub, |v| v.to_vec(), |b| b);
    let again = sub.nccl().unwrap().split(7, 3).unwrap();
    assert_eq!((again.rank(), again.world_size()), (0, 1));
}

/// The stream-overlap check: an all-gather posted before a long stretch of compute-stream work
/// finishes before that work does (it runs on the communication stream, not queued behind it).
#[test]
fn an_all_gather_posted_before_long_compute_finishes_first() {
    let Some((_server, group)) = world_of_one() else {
        return;
    };
    let stream = group.compute_stream().clone();

    // 256 MiB moved 400 times on the compute stream: tens of ms on any current GPU.
    let n = 64 << 20;
    let src = stream.alloc_zeros::<f32>(n).unwrap();
    let mut dst = stream.alloc_zeros::<f32>(n).unwrap();
    let x = stream.clone_htod(&[1.0f32; 1024]).unwrap();
    let mut out = stream.alloc_zeros::<f32>(1024).unwrap();
    stream.synchronize().unwrap();

    let t0 = std::time::Instant::now();
    let work = group.post_into(RawOp::AllGather, &x, &mut out).unwrap();
    for _ in 0..400 {
        stream.memcpy_dtod(&src, &mut dst).unwrap();
    }
    let compute_done = stream.record_event(None).unwrap();
    let (mut t_comm, mut t_compute) = (None, None);
    while t_comm.is_none() || t_compute.is_none() {
        if t_comm.is_none() && work.is_completed() {
            t_comm = Some(t0.elapsed());
        }
        if t_compute.is_none() && compute_done.is_complete() {
            t_compute = Some(t0.elapsed());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the GPU work never finished"
        );
    }
    let (t_comm, t_compute) = (t_comm.unwrap(), t_compute.unwrap());
    println!(
        "overlap: all-gather done after {t_comm:?}, the compute-stream work after {t_compute:?}"
    );
    assert!(
        t_comm < t_compute,
        "the all-gather ({t_comm:?}) waited for compute posted after it ({t_compute:?})"
    );
    work.wait_host().unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![1.0; 1024]);
}
