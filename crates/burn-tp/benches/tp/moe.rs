//! Section 11: the mixture-of-experts layer (`burn_tp::moe`, Mixtral's routing: 8 experts, 2
//! per token) forward + backward at ep 1, 2, 4, ranks as threads sharing this machine's cores
//! (each rank its own tokens, as data-parallel replicas), against its floor: the expert GEMMs
//! alone (gate / up and down forward, their dgrad and wgrad) on each local expert's rows of a
//! balanced load, on the same ranks and threads. Then the all-to-all against memcpy of the
//! bytes it moves, and over a simulated link against the link's own time for them. PyTorch's side of the same layer is `benches/pytorch_moe/run.sh`.

use burn::tensor::{Distribution, Tensor};
use burn_tp::comm::{LinkModel, LocalGroup, LocalGroupOptions};
use burn_tp::moe::MoeConfig;
use burn_tp::ops::all_to_all;

use super::{device, memcpy_time, ranks, timed};

/// Tokens per rank, width, expert width, experts, top-k and rounds.
pub(crate) fn moe_shape(quick: bool) -> (usize, usize, usize, usize, usize, usize) {
    if quick {
        (256, 64, 128, 8, 2, 3)
    } else {
        (2048, 512, 1024, 8, 2, 7)
    }
}

pub(crate) fn bench_moe(quick: bool) {
    let (t, d, f, e, k, reps) = moe_shape(quick);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    println!(
        "\n## 11. Mixture of experts: {t} tokens x d {d} per rank, {e} experts of width {f}, top \
         {k}; forward + backward, ranks as threads sharing {cores} cores\n"
    );
    println!(
        "floor = the expert GEMMs alone (6 per expert: forward, dgrad, wgrad of gate / up and"
    );
    println!(
        "down) on a balanced load of the same rows, same ranks and threads; medians of {reps}.\n"
    );
    println!("| ep | threads / rank | layer ms | floor ms | layer / floor |");
    println!("|---:|---:|---:|---:|---:|");
    let mut unfused_ep1 = None;
    for ep in [1usize, 2, 4] {
        let threads = (cores / ep).max(1);
        let (layer, floor, unfused) = ranks(ep, LocalGroupOptions::default(), threads, move |g| {
            let dev = device();
            let solo = LocalGroup::new(1).unwrap().remove(0);
            let moe = MoeConfig::new(d, e, k, f).init(&solo, &g, &dev).unwrap();
            let normal = Distribution::Normal(0.0, 1.0);
            let x = Tensor::<3>::random([t, 1, d], normal, &dev).require_grad();
            let run = || {
                timed(&g, reps, || {
                    let (y, _) = moe.forward(x.clone());
                    drop(y.sum().backward());
                })
            };
            let layer = run();
            // The same layer on Burn's tensor ops for the experts' gate (the unfused path).
            let unfused = (ep == 1).then(|| {
                burn_tp::backend::set_cpu_kernels(false);
                let t = run();
                burn_tp::backend::set_cpu_kernels(true);
                t
            });
            // Each local expert's rows when the router spreads the ep ranks' tokens evenly.
            let rows = ep * t * k / e;
            let xs: Vec<Tensor<2>> = moe
                .experts
                .iter()
                .map(|_| Tensor::<2>::random([rows, d], normal, &dev).require_grad())
                .collect();
            let floor = timed(&g, reps, || {
                let loss = moe
                    .experts
                    .iter()
                    .zip(&xs)
                    .map(|(ex, x)| {
                        let h = x.clone().matmul(ex.gate_up.weight.val()).narrow(1, 0, f);
                        h.matmul(ex.down.weight.val()).sum()
                    })
                    .reduce(|a, b| a + b)
                    .unwrap();
                drop(loss.backward());
            });
            (layer, floor, unfused)
        })
        .remove(0);
        println!(
            "| {ep} | {threads} | {:.1} | {:.1} | {:.2} |",
            layer * 1e3,
            floor * 1e3,
            layer / floor
        );
        if let Some(unfused) = unfused {
            unfused_ep1 = Some((unfused, floor));
        }
    }
    if let Some((unfused, floor)) = unfused_ep1 {
        println!(
            "\nep 1 with the experts' gate on Burn's tensor ops (`set_cpu_kernels(false)`, the \
             unfused path): {:.1} ms, {:.2} x the floor",
            unfused * 1e3,
            unfused / floor
        );
    }
    println!(
        "\nThe all-to-all of a rank's [{}, {d}] f32 rows in equal parts, against memcpy of",
        t * k
    );
    println!("the bytes it sends to its peers (threads: one copy each):\n");
    println!("| ep | all-to-all ms | memcpy ms | ratio |");
    println!("|---:|---:|---:|---:|");
    for ep in [2usize, 4] {
        let rows = t * k;
        let a2a = ranks(ep, LocalGroupOptions::default(), 1, move |g| {
            let x = Tensor::<2>::ones([rows, d], &device());
            let parts = vec![rows / ep; ep];
            timed(&g, reps, || {
                drop(all_to_all(x.clone(), &parts, &parts, &g).unwrap());
            })
        })[0];
        let bytes = rows * d * 4;
        let copy = memcpy_time(bytes, reps);
        println!(
            "| {ep} | {:.2} | {:.2} | {:.2} |",
            a2a * 1e3,
            copy * 1e3,
            a2a / copy
        );
    }
    // An inter-node link, as the pipeline section's: the floor is its delivery time for the
    // bytes a rank receives from its peers (`latency + bytes / bandwidth`).
    let link = LinkModel::new(25.0, 5.0);
    println!(
        "\nThe same all-to-all over a simulated link of 25 GB/s and 5 us, against the link's \
         time for the bytes a rank receives from its peers:\n"
    );
    println!("| ep | all-to-all ms | link floor ms | ratio |");
    println!("|---:|---:|---:|---:|");
    for ep in [2usize, 4] {
        let rows = t * k;
        let options = LocalGroupOptions {
            link: Some(link),
            ..LocalGroupOptions::default()
        };
        let a2a = ranks(ep, options, 1, move |g| {
            let x = Tensor::<2>::ones([rows, d], &device());
            let parts = vec![rows / ep; ep];
            timed(&g, reps, || {
                drop(all_to_all(x.clone(), &parts, &parts, &g).unwrap());
            })
        })[0];
        let from_peers = rows / ep * (ep - 1) * d * 4;
        let floor = link.latency.as_secs_f64() + from_peers as f64 / link.bandwidth;
        println!(
            "| {ep} | {:.2} | {:.2} | {:.2} |",
            a2a * 1e3,
            floor * 1e3,
            a2a / floor
        );
    }
}
