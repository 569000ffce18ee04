//! burn-tp benchmarks: every figure is a ratio of two timings taken side by side in this run (the
//! machine is shared and noisy; absolute times drift). `-- --quick` is the CI smoke test.
//!
//! ```text
//! cargo bench -p burn-tp --bench tp            # full suite
//! cargo bench -p burn-tp --bench tp -- --quick # < 1 minute, smaller sizes
//! ```

use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_tp::attention::ParallelAttentionConfig;
use burn_tp::comm::{LinkModel, LocalGroup, LocalGroupOptions, ProcessGroup, ReduceOp};
use burn_tp::gpt::Block;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, OverlapSchedule, RowParallelLinear,
    RowParallelLinearConfig, TpMode, TpSettings,
};
use burn_tp::local::{RunOptions, run_ranks_with};
use burn_tp::norm::TpLayerNorm;
use burn_tp::ops::all_gather;
use burn_tp::transformer::ParallelMlpConfig;

// As the example: blocks above glibc's 32 MiB reused (section 14 times it off and on).
#[global_allocator]
static ALLOC: burn_tp::alloc::BlockCache = burn_tp::alloc::BlockCache::new(16 << 20, 512 << 20);

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub(crate) fn device() -> Device {
    Device::flex().autodiff()
}

/// Runs `f` on every rank of a group with `options`, each rank inside its own rayon pool of
/// `threads` threads (Flex's GEMMs run on the current rayon pool).
pub(crate) fn ranks<T: Send + 'static>(
    world: usize,
    options: LocalGroupOptions,
    threads: usize,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    run_ranks_with(
        LocalGroup::with_options(world, options).unwrap(),
        RunOptions {
            threads_per_rank: Some(threads),
            ..Default::default()
        },
        f,
    )
    .unwrap()
}

/// Median over `reps` of `f`, every rank starting together; the slowest rank's median.
pub(crate) fn timed(g: &ProcessGroup, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        g.barrier().unwrap();
        let t0 = Instant::now();
        f();
        times.push(t0.elapsed().as_secs_f64());
    }
    let m = median(times);
    g.all_reduce(vec![m], ReduceOp::Max).unwrap()[0]
}

/// One run of `f` on every rank, timed after an untimed one. Where cases alternate run by run,
/// a case's first run pays for what the previous case left behind (measured: the sync and async
/// row layers alternated read 1.03-1.07 apart, each alone 1.00); the second run does not.
pub(crate) fn timed_warm(g: &ProcessGroup, mut f: impl FnMut()) -> f64 {
    f();
    timed(g, 1, f)
}

fn memcpy_time(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    let mut times = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        times.push(t0.elapsed().as_secs_f64());
    }
    median(times)
}

fn alloc_copy_time(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut keep = Vec::with_capacity(reps);
    let mut times = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        keep.push(src.to_vec());
        times.push(t0.elapsed().as_secs_f64());
    }
    median(times)
}

fn bench_collectives(quick: bool) {
    println!("\n## 1. Collectives vs memcpy (f32, LocalGroup, ranks = threads)");
    println!(
        "ratio = memcpy time of the bytes one rank writes (all-gather) or reads (reduce-scatter,"
    );
    println!("all-reduce) / collective time; >= 1 means as fast as one memcpy of them.\n");
    println!(
        "alloc+copy = a fresh Vec of the bytes (what a collective returning a new buffer pays)."
    );
    println!(
        "memcpy x ranks = every rank thread copying the same bytes at once, in the same pools: the"
    );
    println!("floor when there are more ranks than cores.\n");
    println!(
        "| op | ranks | MiB | collective ms | memcpy ms | alloc+copy ms | memcpy x ranks ms | x memcpy | x alloc+copy | x memcpy x ranks |"
    );
    println!(
        "|----|------:|----:|--------------:|----------:|--------------:|------------------:|---------:|-------------:|-----------------:|"
    );
    let sizes: &[usize] = if quick { &[1, 4] } else { &[1, 4, 16, 64] };
    let reps = if quick { 3 } else { 7 };
    for &world in &[2usize, 4] {
        for &mib in sizes {
            let bytes = mib << 20;
            let t_mem = memcpy_time(bytes, reps);
            let t_alloc = alloc_copy_time(bytes, reps);
            let times = ranks(world, LocalGroupOptions::default(), 1, move |g| {
                let n = g.world_size();
                let shard = vec![1.0f32; bytes / 4 / n];
                let full = vec![1.0f32; bytes / 4];
                let mut warm = vec![0f32; bytes / 4];
                let mem_all = timed(&g, reps, || {
                    warm.copy_from_slice(&full);
                    std::hint::black_box(&warm);
                });
                drop(warm);
                // Inputs are made, and outputs freed, outside the timed region.
                let mut outputs = Vec::with_capacity(reps);
                let mut inputs: Vec<Vec<f32>> = (0..reps).map(|_| shard.clone()).collect();
                let ag = timed(&g, reps, || {
                    outputs.push(g.all_gather(inputs.pop().unwrap()).unwrap())
                });
                // Into one warm buffer, reused (no allocation, no page faults).
                let mut buf = vec![0f32; bytes / 4];
                let mut inputs: Vec<Vec<f32>> = (0..reps).map(|_| shard.clone()).collect();
                let agi = timed(&g, reps, || {
                    let out = std::mem::take(&mut buf);
                    buf = g
                        .all_gather_async(inputs.pop().unwrap(), out)
                        .unwrap()
                        .wait()
                        .unwrap();
                });
                outputs.clear();
                let mut inputs: Vec<Vec<f32>> = (0..reps).map(|_| full.clone()).collect();
                let rs = timed(&g, reps, || {
                    outputs.push(g.reduce_scatter(inputs.pop().unwrap()).unwrap())
                });
                outputs.clear();
                let mut inputs: Vec<Vec<f32>> = (0..reps).map(|_| full.clone()).collect();
                let ar = timed(&g, reps, || {
                    outputs.push(g.all_reduce(inputs.pop().unwrap(), ReduceOp::Sum).unwrap())
                });
                // What the layers use: the ops on Flex tensors (inputs read in place, outputs in
                // pooled buffers that become the tensors' storage), steady state: each output is
                // dropped before the next call, so its buffer is reused.
                let dev = Device::flex();
                let t_shard = Tensor::<1>::ones([bytes / 4 / n], &dev);
                let t_full = Tensor::<1>::ones([bytes / 4], &dev);
                drop(all_gather(t_shard.clone(), 0, &g).unwrap());
                let tag = timed(&g, reps, || {
                    drop(all_gather(t_shard.clone(), 0, &g).unwrap())
                });
                drop(burn_tp::ops::reduce_scatter(t_full.clone(), 0, &g).unwrap());
                let trs = timed(&g, reps, || {
                    drop(burn_tp::ops::reduce_scatter(t_full.clone(), 0, &g).unwrap())
                });
                drop(burn_tp::ops::all_reduce(t_full.clone(), ReduceOp::Sum, &g).unwrap());
                let tar = timed(&g, reps, || {
                    drop(burn_tp::ops::all_reduce(t_full.clone(), ReduceOp::Sum, &g).unwrap())
                });
                (ag, agi, rs, ar, tag, trs, tar, mem_all)
            });
            let (ag, agi, rs, ar, tag, trs, tar, t_all) = times[0];
            for (op, t) in [
                ("all_gather", ag),
                ("all_gather_async (warm out)", agi),
                ("reduce_scatter", rs),
                ("all_reduce", ar),
                ("tensor all_gather (pooled)", tag),
                ("tensor reduce_scatter (pooled)", trs),
                ("tensor all_reduce (pooled)", tar),
            ] {
                println!(
                    "| {op} | {world} | {mib} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    t * 1e3,
                    t_mem * 1e3,
                    t_alloc * 1e3,
                    t_all * 1e3,
                    t_mem / t,
                    t_alloc / t,
                    t_all / t
                );
            }
        }
    }
}

fn loss_of<const D: usize>(y: Tensor<D>) -> Tensor<1> {
    let g = y.ones_like() * 0.5 + y.clone().detach() * 0.0;
    (y * g).sum()
}

fn bench_zero_cost(quick: bool) {
    println!("\n## 2. Zero cost at tp = 1: forward + backward vs Burn's Linear (same shapes)\n");
    let (m, d_in, d_out) = if quick {
        (256, 256, 256)
    } else {
        (2048, 512, 1024)
    };
    let reps = if quick { 5 } else { 15 };
    let out = ranks(1, LocalGroupOptions::default(), 2, move |g| {
        let dev = device();
        let linear = LinearConfig::new(d_in, d_out).init(&dev);
        let col = ColumnParallelLinear::from_full(
            &linear,
            &g,
            &ColumnParallelLinearConfig::new(d_in, d_out),
        )
        .unwrap();
        let linear_t = LinearConfig::new(d_out, d_in).init(&dev);
        let row =
            RowParallelLinear::from_full(&linear_t, &g, &RowParallelLinearConfig::new(d_out, d_in))
                .unwrap();
        let x = Tensor::<2>::random([m, d_in], burn::tensor::Distribution::Default, &dev);
        let xt = Tensor::<2>::random([m, d_out], burn::tensor::Distribution::Default, &dev);
        let step_burn = |l: &Linear, x: &Tensor<2>| {
            drop(loss_of(l.forward(x.clone().require_grad())).backward())
        };
        let (mut a, mut b, mut c, mut d) = (vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            // Interleaved, so drift hits both sides alike.
            a.push(timed(&g, 1, || step_burn(&linear, &x)));
            b.push(timed(&g, 1, || {
                drop(loss_of(col.forward(x.clone().require_grad())).backward())
            }));
            c.push(timed(&g, 1, || step_burn(&linear_t, &xt)));
            d.push(timed(&g, 1, || {
                drop(loss_of(row.forward(xt.clone().require_grad())).backward())
            }));
        }
        (median(a), median(b), median(c), median(d))
    });
    let (lin, col, lin_t, row) = out[0];
    println!("| layer | shape | Burn Linear ms | parallel ms | ratio (target <= 1.05) |");
    println!("|-------|-------|---------------:|------------:|------:|");
    println!(
        "| ColumnParallelLinear | [{m}, {d_in}] -> {d_out} | {:.2} | {:.2} | {:.3} |",
        lin * 1e3,
        col * 1e3,
        col / lin
    );
    println!(
        "| RowParallelLinear | [{m}, {d_out}] -> {d_in} | {:.2} | {:.2} | {:.3} |",
        lin_t * 1e3,
        row * 1e3,
        row / lin_t
    );
}

fn block_step(world: usize, quick: bool) -> f64 {
    let (s, b, d, heads) = if quick {
        (64usize, 2usize, 128usize, 4usize)
    } else {
        (256, 4, 256, 8)
    };
    let reps = if quick { 3 } else { 5 };
    ranks(world, LocalGroupOptions::default(), 1, move |g| {
        let dev = device();
        let mode = TpMode::AllReduce;
        let block = Block {
            ln1: TpLayerNorm::new(d, mode, &g, &dev),
            attn: ParallelAttentionConfig::new(d, heads)
                .with_qkv_bias(true)
                .with_out_bias(true)
                .init(&g, &dev)
                .unwrap(),
            ln2: TpLayerNorm::new(d, mode, &g, &dev),
            mlp: ParallelMlpConfig::new(d, 4 * d).init(&g, &dev).unwrap(),
        };
        let x = Tensor::<3>::ones([s, b, d], &dev) * 0.1;
        timed(&g, reps, || {
            let h = x.clone() + block.attn.forward(block.ln1.forward(x.clone()));
            let y = h.clone() + block.mlp.forward(block.ln2.forward(h));
            drop(loss_of(y).backward());
        })
    })[0]
}

fn bench_scaling(quick: bool) {
    println!("\n## 4. Strong scaling: transformer block (attention + MLP) forward + backward\n");
    println!("Each rank has its own single-threaded compute pool; 2 cores.\n");
    let (mut t1, mut t2) = (vec![], vec![]);
    for _ in 0..if quick { 1 } else { 3 } {
        t1.push(block_step(1, quick));
        t2.push(block_step(2, quick));
    }
    let (t1, t2) = (median(t1), median(t2));
    println!("| tp=1 step ms | tp=2 step ms | tp2 / tp1 (target <= 0.6) |");
    println!("|-------------:|-------------:|------:|");
    println!("| {:.1} | {:.1} | {:.3} |", t1 * 1e3, t2 * 1e3, t2 / t1);
}

mod attention;
mod context;
mod elementwise;
mod floor;
mod grid;
mod lora;
mod moe;
mod overlap;
mod pipeline;

use overlap::{bench_overlap, link_for, print_overlap};

use attention::bench_attention;
use context::bench_context;
use elementwise::bench_elementwise;
use floor::bench_layer_floor;
use grid::bench_async_grid;
use lora::bench_lora;
use moe::bench_moe;
use pipeline::bench_pipeline;

fn main() {
    // As a training program would (README): freed buffers stay mapped between steps.
    burn_tp::local::keep_freed_memory_unless_disabled();
    let quick = std::env::args().any(|a| a == "--quick");
    let start = Instant::now();
    println!(
        "# burn-tp benchmarks{}",
        if quick { " (--quick)" } else { "" }
    );
    println!(
        "machine: {} logical cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let only = std::env::args().find_map(|a| a.strip_prefix("--only=").map(str::to_string));
    if std::env::args().any(|a| a == "--mpi") {
        return bench_layer_floor_mpi(quick);
    }
    match only.as_deref() {
        Some("floor") => return bench_layer_floor(quick),
        Some("attention") => return bench_attention(quick),
        Some("collectives") => return bench_collectives(quick),
        Some("grid") => return bench_async_grid(quick),
        Some("pipeline") => return bench_pipeline(quick),
        Some("moe") => return bench_moe(quick),
        Some("lora") => return bench_lora(quick),
        Some("context") => return bench_context(quick),
        Some("elementwise") => return bench_elementwise(quick),
        Some("split") => {
            let split = bench_overlap(quick, OverlapSchedule::Split);
            return print_overlap("3. Overlap: async vs sync (split schedule)", &split);
        }
        Some("overlap") => {
            let ring = bench_overlap(quick, OverlapSchedule::Ring);
            return print_overlap("5a. Overlap with the chunked ring schedule", &ring);
        }
        _ => {}
    }
    bench_collectives(quick);
    bench_zero_cost(quick);
    let split = bench_overlap(quick, OverlapSchedule::Split);
    print_overlap(
        "3. Overlap: async vs sync, REDUCE_SCATTER mode (split schedule)",
        &split,
    );
    bench_scaling(quick);
    let ring = bench_overlap(quick, OverlapSchedule::Ring);
    print_overlap("5a. Overlap with the chunked ring schedule", &ring);
    println!(
        "\n## 5b. Ring vs split: t_async(split) / t_async(ring), same link (> 1: ring faster)\n"
    );
    println!("| case | tp | split ms | ring ms | split / ring |");
    println!("|------|---:|---------:|--------:|------:|");
    for ((world, s), (_, r)) in split.iter().zip(&ring) {
        for (i, name) in ["row RS backward", "column RS forward", "column RS backward"]
            .iter()
            .enumerate()
        {
            println!(
                "| {name} | {world} | {:.1} | {:.1} | {:.2} |",
                s[i].asynch * 1e3,
                r[i].asynch * 1e3,
                s[i].asynch / r[i].asynch
            );
        }
    }
    bench_layer_floor(quick);
    bench_async_grid(quick);
    bench_attention(quick);
    bench_pipeline(quick);
    bench_moe(quick);
    bench_lora(quick);
    bench_context(quick);
    bench_elementwise(quick);
    println!("\ntotal {:.0} s", start.elapsed().as_secs_f64());
}

/// Section 6 with the ranks as MPI processes (feature `mpi`), one rank per process under
/// `RAYON_NUM_THREADS=1 mpirun -n 2 tp-<hash> --mpi` (one thread per rank, as section 6).
#[cfg(feature = "mpi")]
fn bench_layer_floor_mpi(quick: bool) {
    use floor::{floor_shape, layer_floor_rank, print_layer_floor};
    let runtime = burn_tp::comm::mpi::MpiRuntime::init().expect("run under mpirun");
    let g = ProcessGroup::from_mpi(&runtime);
    let ((s, b, d), reps) = floor_shape(quick);
    if g.rank() == 0 {
        println!(
            "\n## 6 over MPI: x [{s}, {b}, {d}] -> {d}, tp = {}, REDUCE_SCATTER, one process per \
             rank\n",
            g.world_size()
        );
    }
    let (times, pairs) = layer_floor_rank(&g, (s, b, d), reps);
    if g.rank() == 0 {
        print_layer_floor(&times, &pairs);
    }
    g.barrier().unwrap();
}

#[cfg(not(feature = "mpi"))]
fn bench_layer_floor_mpi(_: bool) {
    eprintln!("--mpi needs the bench built with --features mpi (and run under mpirun)");
    std::process::exit(2);
}
