//! Section 13: ring attention (context parallelism, `burn_tp::context`) alone: `[1, 8 heads,
//! 2 kv heads, s, 64]` causal, f32, forward + backward, the sequence split over cp rank threads
//! sharing the machine's cores, against the unsplit kernel on all of them (cp 1: the floor of
//! the ring's work, the same flops). Per rank: the seconds in the kernel (its share of the
//! attention: balanced or not), the seconds it waited for a block (what the compute did not
//! hide), and what it sent. Over a simulated link the hidden fraction is `1 - (wait over the
//! link - wait without it) / the link's time for what the rank received`.

use std::time::Instant;

use burn::tensor::{Device, Tensor};
use burn_tp::attention::fused_attention;
use burn_tp::backend::{AttentionSpec, reset_ring_stats, ring_stats};
use burn_tp::comm::{LinkModel, LocalGroupOptions};
use burn_tp::context::{ContextParallel, CpLayout};

use crate::{device, median, ranks};

/// (q, k, v) of the whole sequence, on `dev`.
fn qkv(s: usize, dev: &Device) -> [Tensor<4>; 3] {
    let (h, kv, hd) = (8, 2, 64);
    [
        Tensor::<4>::ones([1, h, s, hd], dev) * 0.01,
        Tensor::<4>::ones([1, kv, s, hd], dev) * 0.02,
        Tensor::<4>::ones([1, kv, s, hd], dev) * 0.03,
    ]
}

/// One rank's figures: step seconds (the slowest rank's), kernel and waiting seconds per step,
/// transfers and bytes sent per step.
type Figures = (f64, f64, f64, usize, usize);

fn ring(
    s: usize,
    cp: usize,
    layout: CpLayout,
    link: Option<LinkModel>,
    reps: usize,
) -> Vec<Figures> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = LocalGroupOptions {
        link,
        ..LocalGroupOptions::default()
    };
    ranks(cp, options, (cores / cp).max(1), move |g| {
        let ctx = ContextParallel::new(g.clone(), layout).unwrap();
        let dev = device();
        let parts = qkv(s, &dev).map(|t| ctx.split(t, 2).unwrap());
        let step = || {
            let [q, k, v] = parts.clone().map(|t| t.require_grad());
            let out = ctx
                .attention(q.clone(), k, v, AttentionSpec::causal(0))
                .unwrap();
            drop(out.sum().backward());
        };
        step();
        let mut times = Vec::new();
        reset_ring_stats();
        for _ in 0..reps {
            g.barrier().unwrap();
            let t = Instant::now();
            step();
            times.push(t.elapsed().as_secs_f64());
        }
        let stats = ring_stats();
        let n = reps as f64;
        let time = g
            .all_reduce(vec![median(times)], burn_tp::comm::ReduceOp::Max)
            .unwrap()[0];
        (
            time,
            stats.compute_s / n,
            stats.wait_s / n,
            stats.transfers / reps,
            stats.bytes / reps,
        )
    })
}

pub(crate) fn bench_context(quick: bool) {
    let (s, reps) = if quick { (512, 1) } else { (8192, 3) };
    println!(
        "\n## 13. Ring attention (context parallelism): [1, 8 heads, 2 kv heads, {s}, 64] causal, \
         f32, forward + backward; cp rank threads sharing the cores (ms)\n"
    );
    let whole = {
        let dev = Device::flex().autodiff();
        let [q, k, v] = qkv(s, &dev);
        let step = || {
            let q = q.clone().require_grad();
            let out = fused_attention(q, k.clone(), v.clone(), AttentionSpec::causal(0)).unwrap();
            drop(out.sum().backward());
        };
        step();
        median(
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    step();
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        )
    };
    println!(
        "cp 1 (the unsplit kernel on every core): {:.1} ms\n",
        whole * 1e3
    );
    println!(
        "| cp | layout | link | step | / cp 1 | kernel per rank, min - max | max / min | waiting \
         (most, a rank) | sent per rank | link time for it | hidden |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let links = [
        ("none", None),
        ("12.5 GB/s, 5 us", Some(LinkModel::new(12.5, 5.0))),
        ("1 GB/s, 20 us", Some(LinkModel::new(1.0, 20.0))),
    ];
    for cp in [2usize, 4] {
        for layout in [CpLayout::LoadBalanced, CpLayout::Contiguous] {
            let mut unlinked_wait = 0.0;
            for (name, link) in links {
                if layout == CpLayout::Contiguous && link.is_some() {
                    continue;
                }
                let out = ring(s, cp, layout, link, reps);
                let step = out[0].0;
                let kernel = out.iter().map(|f| f.1);
                let (lo, hi) = (
                    kernel.clone().fold(f64::MAX, f64::min),
                    kernel.fold(0.0, f64::max),
                );
                let wait = out.iter().map(|f| f.2).fold(0.0, f64::max);
                let (transfers, bytes) = (out[0].3, out[0].4);
                let (link_time, hidden) = match link {
                    None => {
                        unlinked_wait = wait;
                        ("-".to_string(), "-".to_string())
                    }
                    Some(l) => {
                        let t =
                            transfers as f64 * l.latency.as_secs_f64() + bytes as f64 / l.bandwidth;
                        let hidden = (1.0 - (wait - unlinked_wait) / t).clamp(0.0, 1.0);
                        (
                            format!("{:.1}", t * 1e3),
                            format!("{:.0} %", hidden * 100.0),
                        )
                    }
                };
                println!(
                    "| {cp} | {layout:?} | {name} | {:.1} | {:.2} | {:.1} - {:.1} | {:.2} | {:.1} | \
                     {:.1} MB ({transfers} transfers) | {link_time} | {hidden} |",
                    step * 1e3,
                    step / whole,
                    lo * 1e3,
                    hi * 1e3,
                    hi / lo,
                    wait * 1e3,
                    bytes as f64 / 1e6,
                );
            }
        }
    }
}
