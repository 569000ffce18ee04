//! Section 6: the parallel linears at one shape against their compute floor (the same GEMMs
//! alone), and plain Burn `Linear` on one thread and on all cores.

use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_tp::comm::LocalGroupOptions;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, OverlapSchedule, RowParallelLinear,
    RowParallelLinearConfig, TpMode, TpSettings,
};

use super::{device, median, ranks, timed, timed_warm};

/// The shape and rounds of section 6.
pub(crate) fn floor_shape(quick: bool) -> ((usize, usize, usize), usize) {
    if quick {
        ((128, 2, 256), 3)
    } else {
        ((1024, 4, 1024), 15)
    }
}

/// The layer forward + backward at one shape against its compute floor, and plain Burn `Linear`.
pub(crate) fn bench_layer_floor(quick: bool) {
    let ((s, b, d), reps) = floor_shape(quick);
    println!(
        "\n## 6. Layers vs their compute floor: x [{s}, {b}, {d}] -> {d}, tp = 2, REDUCE_SCATTER\n"
    );
    println!("No bias, loss = sum(y), column without recompute_all_gather (as the sync path keeps");
    println!(
        "the gathered input). One thread per rank, both ranks at once. floor = the layer's three"
    );
    println!(
        "GEMMs alone (forward, dgrad, wgrad) on the same shapes and threads. Every case once per"
    );
    println!(
        "round, {reps} rounds interleaved, medians; async / sync is the median of the ratios paired in"
    );
    println!("each round. Targets: layer / floor <= 1.10, async / sync <= 1.02.\n");
    let (times, pairs) = ranks(2, LocalGroupOptions::default(), 1, move |g| {
        layer_floor_rank(&g, (s, b, d), reps)
    })
    .remove(0);
    print_layer_floor(&times, &pairs);
    // What a user would pick instead: one Burn Linear over the whole batch, all cores vs one.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let burn_linear = |threads: usize| {
        ranks(1, LocalGroupOptions::default(), threads, move |g| {
            let dev = device();
            let l = LinearConfig::new(d, d).init(&dev);
            let x = Tensor::<3>::ones([s, b, d], &dev).require_grad();
            timed(&g, reps, || drop(l.forward(x.clone()).sum().backward()))
        })[0]
    };
    let (one, all) = (burn_linear(1), burn_linear(cores));
    println!("\nPlain Burn `Linear` [{s}, {b}, {d}] -> {d}, forward + backward, one process:\n");
    println!("| 1 thread ms | {cores} threads ms | speed-up |");
    println!("|------------:|-------------:|------:|");
    println!("| {:.1} | {:.1} | {:.2} |", one * 1e3, all * 1e3, one / all);
}

/// One rank's part of section 6 (every rank of `g` runs it at once; ranks as threads or MPI
/// processes): the medians `[gemm3 row, gemm3 column, row sync / split / ring, column sync /
/// split / ring]` and the paired async / sync ratios `[row split, row ring, column split,
/// column ring]`.
pub(crate) fn layer_floor_rank(
    g: &burn_tp::comm::ProcessGroup,
    (s, b, d): (usize, usize, usize),
    reps: usize,
) -> (Vec<f64>, [f64; 4]) {
    let g = g.clone();
    let n = g.world_size();
    let dev = device();
    let flex = Device::flex();
    let m = s * b;
    let gemm3 = |a: [usize; 2], w: [usize; 2]| {
        // y = a @ w; dgrad = gy @ w^T; wgrad = a^T @ gy
        let x = Tensor::<2>::ones(a, &flex);
        let w = Tensor::<2>::ones(w, &flex);
        let gy = Tensor::<2>::ones([a[0], w.dims()[1]], &flex);
        // Flex computes eagerly: the three products are done when `matmul` returns.
        timed_warm(&g, || {
            let y = x.clone().matmul(w.clone());
            let dx = gy.clone().matmul(w.clone().transpose());
            let dw = x.clone().transpose().matmul(gy.clone());
            drop((y, dx, dw));
        })
    };
    let linear = Linear {
        weight: Param::from_tensor(Tensor::ones([d, d], &dev) * 0.01),
        bias: None,
    };
    let mode = TpMode::ReduceScatter;
    // One layer per kind, its variants clones with another setting: they share the weight
    // (separate instances measured a few percent apart with the same code).
    let row = RowParallelLinear::from_full(
        &linear,
        &g,
        &RowParallelLinearConfig::new(d, d).with_settings(TpSettings::new().with_mode(mode)),
    )
    .unwrap();
    // Without recompute, as the sync path (which keeps the gathered input).
    let col = ColumnParallelLinear::from_full(
        &linear,
        &g,
        &ColumnParallelLinearConfig::new(d, d).with_settings(
            TpSettings::new()
                .with_recompute_all_gather(false)
                .with_mode(mode),
        ),
    )
    .unwrap();
    let variants = [
        (false, OverlapSchedule::Split),
        (true, OverlapSchedule::Split),
        (true, OverlapSchedule::Ring),
    ];
    let row_layers: Vec<_> = variants
        .iter()
        .map(|&(a, s)| row.clone().with_async_communication(a).with_schedule(s))
        .collect();
    let col_layers: Vec<_> = variants
        .iter()
        .map(|&(a, s)| col.clone().with_async_communication(a).with_schedule(s))
        .collect();
    let x_row = Tensor::<3>::ones([s, b, d / n], &dev).require_grad();
    let x_col = Tensor::<3>::ones([s / n, b, d], &dev).require_grad();
    // Rounds of every case, interleaved so the machine's drift hits all alike; the order
    // of the layer variants rotates each round, so none always runs after the same one.
    let mut t = vec![Vec::new(); 8];
    for round in 0..reps {
        t[0].push(gemm3([m, d / n], [d / n, d]));
        t[1].push(gemm3([m, d], [d, d / n]));
        for k in 0..variants.len() {
            let i = (k + round) % variants.len();
            let l = &row_layers[i];
            t[2 + i].push(timed_warm(&g, || {
                drop(l.forward(x_row.clone()).sum().backward())
            }));
            let l = &col_layers[i];
            t[5 + i].push(timed_warm(&g, || {
                drop(l.forward(x_col.clone()).sum().backward())
            }));
        }
    }
    // async / sync paired within each round: [row split, row ring, col split, col ring]
    let paired = |a: usize, s: usize| median(t[a].iter().zip(&t[s]).map(|(a, s)| a / s).collect());
    let pairs = [paired(3, 2), paired(4, 2), paired(6, 5), paired(7, 5)];
    (t.into_iter().map(median).collect::<Vec<_>>(), pairs)
}

/// Prints section 6's table from [`layer_floor_rank`]'s results.
pub(crate) fn print_layer_floor(times: &[f64], pairs: &[f64; 4]) {
    println!(
        "| layer | floor ms | sync ms | async split ms | async ring ms | sync / floor | split / floor | ring / floor | split / sync | ring / sync |"
    );
    println!(
        "|-------|---------:|--------:|---------------:|--------------:|------:|------:|------:|------:|------:|"
    );
    for (i, name) in ["RowParallelLinear", "ColumnParallelLinear"]
        .iter()
        .enumerate()
    {
        let floor = times[i];
        let (sync, split, ring) = (times[2 + 3 * i], times[3 + 3 * i], times[4 + 3 * i]);
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
            floor * 1e3,
            sync * 1e3,
            split * 1e3,
            ring * 1e3,
            sync / floor,
            split / floor,
            ring / floor,
            pairs[2 * i],
            pairs[2 * i + 1]
        );
    }
}
