//! The collectives over MPI (feature `mpi`) against memcpy and against ranks as threads, and
//! how much of an all-gather the MPI thread hides behind compute. Run under mpirun:
//!
//! ```text
//! cargo bench -p burn-tp-comm --features mpi --bench mpi --no-run
//! mpirun --oversubscribe -n 2 target/release/deps/mpi-<hash>    # and -n 4
//! ```
//!
//! `MiB` is the whole buffer: the all-gather's output, the reduce-scatter's input, the
//! all-reduce's buffer. Every figure is the median of 5 timed calls after 2 warm ones, each the
//! slowest rank's time, with every output buffer reused (the layers' steady state).

use std::time::{Duration, Instant};

use burn_tp_comm::mpi::MpiRuntime;
use burn_tp_comm::{LocalGroup, ProcessGroup, ReduceOp};

const REPS: usize = 5;
const WARM: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

/// (input length, output length) per rank for a whole buffer of `len`.
fn lens(op: Op, len: usize, n: usize) -> (usize, usize) {
    match op {
        Op::AllGather => (len / n, len),
        Op::ReduceScatter => (len, len / n),
        Op::AllReduce => (len, len),
    }
}

/// Median of the slowest rank's time of `op` over `len` f32s.
fn time(pg: &ProcessGroup, op: Op, len: usize) -> Duration {
    let n = pg.world_size();
    let (i, o) = lens(op, len, n);
    let input: Vec<f32> = (0..i).map(|k| (k % 7) as f32).collect();
    let mut out = vec![0f32; o];
    let mut times = Vec::new();
    for rep in 0..WARM + REPS {
        // The input is sent in place; its copy is made before the clock starts.
        let owned = input.clone();
        pg.barrier().unwrap();
        let start = Instant::now();
        out = match op {
            Op::AllGather => pg.all_gather_async(owned, out).unwrap().wait().unwrap(),
            Op::ReduceScatter => pg.reduce_scatter_async(owned, out).unwrap().wait().unwrap(),
            Op::AllReduce => pg
                .all_reduce_async(owned, ReduceOp::Sum, out)
                .unwrap()
                .wait()
                .unwrap(),
        };
        let mine = start.elapsed().as_secs_f64();
        let slowest = pg.all_reduce(vec![mine], ReduceOp::Max).unwrap()[0];
        if rep >= WARM {
            times.push(slowest);
        }
    }
    median(times)
}

fn median(mut v: Vec<f64>) -> Duration {
    v.sort_by(f64::total_cmp);
    Duration::from_secs_f64(v[v.len() / 2])
}

/// One memcpy of `len` f32s on this rank (median), with every rank copying at once when `all`.
fn memcpy(pg: &ProcessGroup, len: usize, all: bool) -> Duration {
    let src: Vec<f32> = (0..len).map(|k| k as f32).collect();
    let mut dst = vec![0f32; len];
    let mut times = Vec::new();
    for rep in 0..WARM + REPS {
        pg.barrier().unwrap();
        let mine = if all || pg.rank() == 0 {
            let start = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            start.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let slowest = pg.all_reduce(vec![mine], ReduceOp::Max).unwrap()[0];
        if rep >= WARM {
            times.push(slowest);
        }
    }
    median(times)
}

/// The same call with the ranks as threads of this process (rank 0's process only).
fn threads(n: usize, op: Op, len: usize) -> Duration {
    let groups = LocalGroup::new(n).unwrap();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| std::thread::spawn(move || time(&pg, op, len)))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .max()
        .unwrap()
}

/// Dense arithmetic for about `iters` passes over a 256 KiB buffer (cache-resident: no memory
/// traffic to compete with the transfer's).
fn compute(iters: usize) -> f32 {
    let mut v: Vec<f32> = (0..65536).map(|k| k as f32 * 1e-6).collect();
    for _ in 0..iters {
        v.iter_mut().for_each(|x| *x = *x * 0.999 + 1e-3);
    }
    std::hint::black_box(v.iter().sum())
}

/// How much of a `len`-element all-gather the MPI thread hides behind compute: comm alone `c`,
/// compute alone `p`, both `t`; hidden = (c + p - t) / c. With `sleep`, the caller sleeps
/// instead of computing: whether the transfer progresses with no MPI call on the caller's
/// thread at all (Open MPI moves a large message only inside MPI calls), cores aside.
/// Also returns the time left in the wait after the compute or sleep (slowest rank): near zero
/// when the transfer went on meanwhile.
fn overlap(
    pg: &ProcessGroup,
    len: usize,
    sleep: bool,
) -> (Duration, Duration, Duration, Duration, f64) {
    let n = pg.world_size();
    let shard: Vec<f32> = vec![1.0; len / n];
    let c = time(pg, Op::AllGather, len);
    // Size the compute to the communication: calibrate on this rank, agree on the count.
    let start = Instant::now();
    compute(50);
    let per_iter = start.elapsed().as_secs_f64() / 50.0;
    let iters = (c.as_secs_f64() / per_iter).ceil() as usize;
    let iters = pg.all_reduce(vec![iters as f64], ReduceOp::Max).unwrap()[0] as usize;
    let work = |iters: usize| {
        if sleep {
            std::thread::sleep(c);
        } else {
            compute(iters);
        }
    };
    let (mut ps, mut ts, mut ws) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = vec![0f32; len];
    for rep in 0..WARM + REPS {
        pg.barrier().unwrap();
        let start = Instant::now();
        work(iters);
        let p = pg
            .all_reduce(vec![start.elapsed().as_secs_f64()], ReduceOp::Max)
            .unwrap()[0];
        let owned = shard.clone();
        pg.barrier().unwrap();
        let start = Instant::now();
        let pending = pg.all_gather_async(owned, out).unwrap();
        work(iters);
        let before_wait = start.elapsed();
        out = pending.wait().unwrap();
        let in_wait = (start.elapsed() - before_wait).as_secs_f64();
        let in_wait = pg.all_reduce(vec![in_wait], ReduceOp::Max).unwrap()[0];
        let t = pg
            .all_reduce(vec![start.elapsed().as_secs_f64()], ReduceOp::Max)
            .unwrap()[0];
        if rep >= WARM {
            ps.push(p);
            ts.push(t);
            ws.push(in_wait);
        }
    }
    let (p, t, w) = (median(ps), median(ts), median(ws));
    let hidden = (c + p).saturating_sub(t).as_secs_f64() / c.as_secs_f64();
    (c, p, t, w, hidden.clamp(0.0, 1.0))
}

/// Median time of a blocking all-reduce of 8 floats over `reps` calls (the latency a step's
/// many small collectives pay), slowest rank.
fn small_latency(pg: &ProcessGroup, reps: usize, gap: Duration) -> Duration {
    let mut times = Vec::with_capacity(reps);
    pg.barrier().unwrap();
    for _ in 0..reps {
        std::thread::sleep(gap);
        let start = Instant::now();
        let _ = pg.all_reduce(vec![1f32; 8], ReduceOp::Sum).unwrap();
        times.push(start.elapsed().as_secs_f64());
    }
    let m = median(times).as_secs_f64();
    Duration::from_secs_f64(pg.all_reduce(vec![m], ReduceOp::Max).unwrap()[0])
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

fn main() {
    let runtime = MpiRuntime::init().expect("run under mpirun");
    let pg = ProcessGroup::from_mpi(&runtime);
    let (rank, n) = (pg.rank(), pg.world_size());
    if rank == 0 {
        println!(
            "| op | processes | MiB | MPI ms | threads ms | memcpy ms | memcpy x ranks ms | MPI x memcpy | MPI x memcpy x ranks | MPI / threads |"
        );
        println!("|----|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    for mib in [16usize, 64] {
        let len = mib << 18; // f32s
        let one = memcpy(&pg, len, false);
        let all = memcpy(&pg, len, true);
        for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
            let mpi = time(&pg, op, len);
            pg.barrier().unwrap();
            let thr = if rank == 0 {
                threads(n, op, len)
            } else {
                Duration::ZERO
            };
            pg.barrier().unwrap();
            if rank == 0 {
                let name = format!("{op:?}");
                println!(
                    "| {name} | {n} | {mib} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} |",
                    ms(mpi),
                    ms(thr),
                    ms(one),
                    ms(all),
                    one.as_secs_f64() / mpi.as_secs_f64(),
                    all.as_secs_f64() / mpi.as_secs_f64(),
                    thr.as_secs_f64() / mpi.as_secs_f64(),
                );
            }
        }
    }
    for (sleep, what) in [(false, "compute"), (true, "a sleeping caller")] {
        let (c, p, t, w, hidden) = overlap(&pg, 16 << 18, sleep);
        if rank == 0 {
            println!(
                "\noverlap, 16 MiB all-gather at {n} processes behind {what}: comm alone {} ms, \
                 {what} alone {} ms, both {} ms, left to wait after it {} ms: hidden {hidden:.2}",
                ms(c),
                ms(p),
                ms(t),
                ms(w)
            );
        }
    }
    // Back to back, and after 1 ms idle each (as between a step's layers).
    for gap in [Duration::ZERO, Duration::from_millis(1)] {
        let mpi = small_latency(&pg, 300, gap);
        pg.barrier().unwrap();
        let thr = if rank == 0 {
            let groups = LocalGroup::new(n).unwrap();
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| std::thread::spawn(move || small_latency(&g, 300, gap)))
                .collect();
            let each = handles.into_iter().map(|h| h.join().unwrap());
            each.max().unwrap()
        } else {
            Duration::ZERO
        };
        pg.barrier().unwrap();
        if rank == 0 {
            println!(
                "\nlatency of an all-reduce of 8 floats at {n} processes, {gap:?} idle before \
                 each (median of 300): MPI {:.1} us, threads {:.1} us",
                mpi.as_secs_f64() * 1e6,
                thr.as_secs_f64() * 1e6
            );
        }
    }
    drop(pg);
    drop(runtime);
}
