//! The MPI transport (feature `mpi`) under `mpirun` with 2 and 4 processes: the conformance
//! check and every op and element type against references, splits, ring transfers, overlap,
//! mismatches, timeouts, and a rank that panics or is killed. Each test runs this binary under
//! `mpirun`, where only `mpi_rank_program` does anything (it plays the scenario named in the
//! environment).
#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use burn_tp_comm::mpi::MpiRuntime;
use burn_tp_comm::{CommElement, CommError, ProcessGroup, ReduceOp};
use half::{bf16, f16};

const SCENARIO: &str = "BURN_TP_TEST_MPI_SCENARIO";

/// `mpirun -n n` of this binary playing `scenario`.
fn mpirun(n: usize, scenario: &str, env: &[(&str, &str)]) -> Output {
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-n", &n.to_string()])
        .arg(me)
        .args([
            "--exact",
            "mpi_rank_program",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(SCENARIO, scenario)
        // CI runs as root; Open MPI refuses that without both.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // No InfiniBand or other fabrics here: shared memory and TCP only, without warnings.
        .env("OMPI_MCA_btl", "self,vader,tcp")
        .env("OMPI_MCA_pml", "ob1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output()
        .expect("mpirun (Open MPI) must be installed to test feature `mpi`: see README")
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn every_collective_and_element_type_matches_the_reference_on_2_and_4_processes() {
    for n in [2, 4] {
        let out = mpirun(n, "ops", &[]);
        let all = text(&out);
        assert!(out.status.success(), "{all}");
        for r in 0..n {
            assert!(all.contains(&format!("rank {r} of {n}: ops ok")), "{all}");
        }
    }
}

#[test]
fn ranks_that_disagree_get_a_mismatch_naming_both_calls_on_every_rank() {
    let out = mpirun(2, "mismatch", &[]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    for r in 0..2 {
        assert!(
            all.contains(&format!("rank {r}: mismatch: collective #1 mismatch")),
            "{all}"
        );
    }
    // Both calls are named: the all-gather of 4 and the one of 6 elements; a typed error.
    assert!(all.contains("all_gather of F32 [4]") && all.contains("all_gather of F32 [6]"));
    for r in 0..2 {
        assert!(
            all.contains(&format!("rank {r}: typed Mismatch: true")),
            "{all}"
        );
    }
    // The group still works for nothing after: the next call fails at once.
    assert!(all.contains("then: the group was aborted earlier"), "{all}");
}

#[test]
fn an_all_to_all_whose_counts_disagree_is_the_same_typed_error_on_every_rank() {
    let out = mpirun(2, "counts", &[]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    for r in 0..2 {
        let line = format!(
            "rank {r}: counts: all_to_all on rank {r}: rank 0 sends 1 elements to rank 1, which \
             expects 2 from it (typed: true)"
        );
        assert!(all.contains(&line), "{all}");
        assert!(all.contains(&format!("rank {r}: then [2.0]")), "{all}");
    }
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_on_the_others_and_the_job_ends() {
    let start = Instant::now();
    let out = mpirun(4, "timeout", &[]);
    let all = text(&out);
    for r in [0, 2, 3] {
        assert!(
            all.contains(&format!(
                "rank {r}: timeout: all_reduce(Sum) of F32 [8] #1 on rank {r} timed out after 1s"
            )),
            "{all}"
        );
    }
    assert!(!out.status.success(), "{all}");
    assert!(start.elapsed() < Duration::from_secs(30), "{all}");
}

#[test]
fn a_rank_that_panics_or_is_killed_ends_the_job_with_a_failure_on_every_rank() {
    // kill-ring: killed while the others wait on a ring transfer (a pipeline stage's).
    for how in ["panic", "kill", "kill-ring"] {
        let start = Instant::now();
        // The survivors would wait 120 s in their all-reduce: mpirun ends them first.
        let out = mpirun(4, how, &[("BURN_TP_TIMEOUT_S", "120")]);
        let all = text(&out);
        assert!(!out.status.success(), "{how}: {all}");
        assert!(all.contains("rank 1 leaves"), "{how}: {all}");
        assert!(!all.contains("survived"), "{how}: {all}");
        let took = start.elapsed();
        assert!(took < Duration::from_secs(30), "{how}: {took:?}\n{all}");
    }
}

/// Inputs that differ per rank and position; multiples of 1/2 in [-4, 4) so sums of four are
/// exact in every element type.
fn value(rank: usize, i: usize) -> f64 {
    (((rank * 7 + i * 13) % 16) as f64 - 8.0) * 0.5
}

fn check_ops<T: CommElement + PartialEq>(pg: &ProcessGroup, conv: fn(f64) -> T) {
    let (rank, n) = (pg.rank(), pg.world_size());
    for len in [0, 3 * n, 12 * n, 1024 * n + n] {
        let x: Vec<T> = (0..len).map(|i| conv(value(rank, i))).collect();
        let col = |i: usize| (0..n).map(move |r| value(r, i));
        let each = |f: &dyn Fn(usize) -> f64| (0..len).map(|i| conv(f(i))).collect::<Vec<T>>();
        let gathered: Vec<T> = (0..n)
            .flat_map(|r| (0..len).map(move |i| conv(value(r, i))))
            .collect();
        let chunk = len / n;
        assert_eq!(
            pg.all_gather(x.clone()).unwrap(),
            gathered,
            "all_gather {len}"
        );
        assert_eq!(
            pg.reduce_scatter(x.clone()).unwrap(),
            each(&|i| col(i).sum())[rank * chunk..(rank + 1) * chunk],
            "reduce_scatter {len}"
        );
        let sum = each(&|i| col(i).sum());
        assert_eq!(pg.all_reduce(x.clone(), ReduceOp::Sum).unwrap(), sum);
        let max = each(&|i| col(i).fold(f64::NEG_INFINITY, f64::max));
        assert_eq!(pg.all_reduce(x.clone(), ReduceOp::Max).unwrap(), max);
        let min = each(&|i| col(i).fold(f64::INFINITY, f64::min));
        assert_eq!(pg.all_reduce(x.clone(), ReduceOp::Min).unwrap(), min);
        let avg = each(&|i| col(i).sum::<f64>() / n as f64);
        assert_eq!(pg.all_reduce(x.clone(), ReduceOp::Avg).unwrap(), avg);
        let root = n - 1;
        let last: Vec<T> = (0..len).map(|i| conv(value(root, i))).collect();
        assert_eq!(pg.broadcast(x, root).unwrap(), last, "broadcast {len}");
        // All-to-all with uneven counts, zero included: rank s sends (s + r + len) % 3 * len / n
        // elements to rank r, element i of that slice being value(s, 100 r + i).
        let count = |s: usize, r: usize| (s + r + len) % 3 * len / n.max(1);
        let send: Vec<usize> = (0..n).map(|r| count(rank, r)).collect();
        let recv: Vec<usize> = (0..n).map(|s| count(s, rank)).collect();
        let slices =
            |s: usize, r: usize| (0..count(s, r)).map(move |i| conv(value(s, 100 * r + i)));
        let input: Vec<T> = (0..n).flat_map(|r| slices(rank, r)).collect();
        let want: Vec<T> = (0..n).flat_map(|s| slices(s, rank)).collect();
        let out = vec![conv(0.0); want.len()];
        let got = pg
            .all_to_all_async(input, &send, &recv, out)
            .unwrap()
            .wait();
        assert_eq!(got.unwrap(), want, "all_to_all {len}");
    }
}

fn ops(pg: &ProcessGroup) {
    let (rank, n) = (pg.rank(), pg.world_size());
    common::conformance(pg, |v| v.to_vec(), |v| v);
    check_ops(pg, |x| x as f32);
    check_ops(pg, |x| x);
    check_ops(pg, f16::from_f64);
    check_ops(pg, bf16::from_f64);
    check_ops(pg, |x| (x * 2.0) as i64);
    // 16-bit sums are float sums, not integer sums of the bits: 1.5 + 1.5 = 3.
    let halves = pg
        .all_reduce(vec![bf16::from_f32(1.5); 4], ReduceOp::Sum)
        .unwrap();
    assert_eq!(halves, vec![bf16::from_f32(1.5 * n as f32); 4]);

    // Sums of inexact values are the rank-order sums (the thread transport's bits), the same
    // on every rank: reduce-scatter and all-reduce (of a length the ranks divide).
    let len = 64 * n;
    let noisy = |r: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((r * 7919 + i * 104729) % 1000) as f32 / 7.0 + 0.1)
            .collect()
    };
    let rank_order: Vec<f32> = (0..len)
        .map(|i| (1..n).fold(noisy(0)[i], |acc, r| acc + noisy(r)[i]))
        .collect();
    let summed = pg.all_reduce(noisy(rank), ReduceOp::Sum).unwrap();
    assert!(
        summed
            .iter()
            .zip(&rank_order)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    let chunk = len / n;
    let scattered = pg.reduce_scatter(noisy(rank)).unwrap();
    assert_eq!(scattered, rank_order[rank * chunk..(rank + 1) * chunk]);

    // Several in flight at once, waited out of order, into the caller's buffers.
    let a = pg
        .all_gather_async(vec![rank as f32; 3], vec![0f32; 3 * n])
        .unwrap();
    let b = pg
        .all_reduce_async(vec![1f64; 5], ReduceOp::Sum, vec![0f64; 5])
        .unwrap();
    let c = pg
        .reduce_scatter_async(vec![1f32; 2 * n], vec![0f32; 2])
        .unwrap();
    assert_eq!(c.wait().unwrap(), vec![n as f32; 2]);
    assert_eq!(b.wait().unwrap(), vec![n as f64; 5]);
    // A part of a gather (MPI delivers it whole), then the whole.
    assert_eq!(a.wait_part::<f32>(n - 1).unwrap(), vec![(n - 1) as f32; 3]);
    let want: Vec<f32> = (0..n).flat_map(|r| [r as f32; 3]).collect();
    assert_eq!(a.wait().unwrap(), want);
    // Checks before any communication, as with threads.
    assert!(matches!(
        pg.all_gather_async(vec![0f32; 3], vec![0f32; 4]),
        Err(CommError::BufferSize { op: "all_gather", expected, got: 4 }) if expected == 3 * n
    ));
    assert!(matches!(
        pg.reduce_scatter(vec![0f32; n + 1]),
        Err(CommError::NotDivisible { .. })
    ));

    // The tp x dp split: tp groups of adjacent ranks, dp groups strided.
    let tp = 2;
    let tp_group = pg.split(rank / tp, rank).unwrap();
    let dp_group = pg.split(rank % tp, rank).unwrap();
    assert_eq!((tp_group.rank(), tp_group.world_size()), (rank % tp, tp));
    assert_eq!(
        (dp_group.rank(), dp_group.world_size()),
        (rank / tp, n / tp)
    );
    let tp_ranks = tp_group.all_gather(vec![rank as i64]).unwrap();
    assert_eq!(
        tp_ranks,
        vec![(rank / tp * tp) as i64, (rank / tp * tp + 1) as i64]
    );
    let dp_ranks = dp_group.all_gather(vec![rank as i64]).unwrap();
    let want: Vec<i64> = (0..n / tp).map(|d| (d * tp + rank % tp) as i64).collect();
    assert_eq!(dp_ranks, want);
    // The groups are independent: calls on one do not disturb the other's order.
    let t = tp_group
        .all_reduce_async(vec![1f32], ReduceOp::Sum, vec![0f32])
        .unwrap();
    let d = dp_group.all_reduce(vec![1f32], ReduceOp::Sum).unwrap();
    assert_eq!(
        (t.wait().unwrap(), d),
        (vec![tp as f32], vec![(n / tp) as f32])
    );
    // Ring transfers (pipeline stages): each rank to both neighbours, every one posted first.
    let links = pg.ring_links().unwrap();
    let (prev, next) = ((rank + n - 1) % n, (rank + 1) % n);
    let sent = |by: usize, to: usize| vec![(10 * by + to) as f32; 3];
    let s_next = links.send_next(sent(rank, next)).unwrap();
    let r_prev = links.recv_prev::<f32>(3).unwrap();
    let s_prev = links.send_prev(sent(rank, prev)).unwrap();
    let r_next = links.recv_next::<f32>(3).unwrap();
    assert_eq!(r_prev.wait().unwrap(), sent(prev, rank));
    assert_eq!(r_next.wait().unwrap(), sent(next, rank));
    s_next.wait().unwrap();
    s_prev.wait().unwrap();
    // The paired transfer (1F1B's steady state): out to the next rank and in from it.
    let (s, r) = links
        .send_recv(
            (burn_tp_comm::Neighbour::Next, sent(rank, next)),
            (burn_tp_comm::Neighbour::Next, 2),
        )
        .unwrap();
    let (s2, r2) = links
        .send_recv(
            (burn_tp_comm::Neighbour::Prev, vec![rank as f32; 2]),
            (burn_tp_comm::Neighbour::Prev, 3),
        )
        .unwrap();
    assert_eq!(r.wait().unwrap(), vec![next as f32; 2]);
    assert_eq!(r2.wait().unwrap(), sent(prev, rank));
    s.wait().unwrap();
    s2.wait().unwrap();
    pg.barrier().unwrap();
    println!("\nrank {rank} of {n}: ops ok");
}

/// The rank program the tests above start under `mpirun` (a no-op in a normal test run).
#[test]
fn mpi_rank_program() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let runtime = MpiRuntime::init().unwrap();
    let pg = ProcessGroup::from_mpi(&runtime);
    let rank = pg.rank();
    match scenario.as_str() {
        "ops" => ops(&pg),
        "mismatch" => {
            pg.barrier().unwrap();
            let len = if rank == 1 { 6 } else { 4 };
            let e = pg.all_gather(vec![0f32; len]).unwrap_err();
            println!("\nrank {rank}: mismatch: {e}");
            // The typed error, not MPI's own (a truncated receive would be MPI_ERR_TRUNCATE).
            let typed = matches!(e, burn_tp_comm::CommError::Mismatch { .. });
            println!("\nrank {rank}: typed Mismatch: {typed}");
            let e = pg.barrier().unwrap_err();
            let e = e.to_string();
            let then = &e[e.find("the group").unwrap_or(0)..];
            println!("\nrank {rank}: then: {then}");
            // Every call after a mismatch fails at once, so MPI is left with nothing in flight.
        }
        "counts" => {
            // Rank 1 expects one element more from rank 0 than rank 0 sends it.
            let send = vec![1usize; pg.world_size()];
            let mut recv = send.clone();
            if rank == 1 {
                recv[0] = 2;
            }
            let e = pg
                .all_to_all(vec![0f32; send.len()], &send, &recv)
                .unwrap_err();
            let typed = matches!(
                e,
                CommError::Counts {
                    sender: 0,
                    receiver: 1,
                    ..
                }
            );
            println!("\nrank {rank}: counts: {e} (typed: {typed})");
            // The same call order continues on every rank: the group is still usable.
            let sum = pg.all_reduce(vec![1f32], ReduceOp::Sum).unwrap();
            println!("\nrank {rank}: then {sum:?}");
        }
        "timeout" => {
            pg.barrier().unwrap();
            if rank == 1 {
                // Never arrives; leaves once the others have given up.
                std::thread::sleep(Duration::from_secs(6));
                std::process::exit(0);
            }
            pg.set_timeout(Duration::from_secs(1));
            let e = pg.all_reduce(vec![0f32; 8], ReduceOp::Sum).unwrap_err();
            println!("\nrank {rank}: timeout: {e}");
            // The call is still posted in MPI: end the job, as the docs say to (after the other
            // waiting ranks, which time out within milliseconds of this one, have said so too).
            std::thread::sleep(Duration::from_secs(1));
            runtime.abort(2);
        }
        "panic" | "kill" | "kill-ring" => {
            let links = (scenario == "kill-ring").then(|| pg.ring_links().unwrap());
            pg.barrier().unwrap();
            if rank == 1 {
                eprintln!("rank 1 leaves");
                if scenario == "panic" {
                    panic!("rank 1 fails on purpose");
                }
                kill_self();
            }
            match &links {
                // Every stage waits for its previous one's activation (rank 2 for rank 1's).
                Some(links) => {
                    let r = links.recv_prev::<f32>(8).and_then(|t| t.wait());
                    println!("\nrank {rank} survived: {r:?}");
                }
                None => {
                    let r = pg.all_reduce(vec![0f32; 8], ReduceOp::Sum);
                    println!("\nrank {rank} survived: {r:?}");
                }
            }
        }
        other => panic!("unknown scenario {other}"),
    }
    drop(pg);
    drop(runtime);
    std::process::exit(0);
}

/// SIGKILL to this process (no handler, no unwinding, no MPI_Finalize).
fn kill_self() {
    let _ = Command::new("kill")
        .args(["-9", &std::process::id().to_string()])
        .status();
    std::thread::sleep(Duration::from_secs(60));
}
