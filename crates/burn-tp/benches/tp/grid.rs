//! Section 7: async against sync over the whole grid (row / column, ALL_REDUCE /
//! REDUCE_SCATTER, split / ring, tp 2 and 4, with and without the link model), as ratios paired
//! round by round.

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::Tensor;
use burn_tp::comm::LocalGroupOptions;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, LinearSpec, OverlapSchedule,
    RowParallelLinear, RowParallelLinearConfig, TpMode, TpSettings, column_parallel_linear,
    row_parallel_linear,
};

use super::{device, link_for, median, ranks, timed_warm};

const MODES: [TpMode; 2] = [TpMode::AllReduce, TpMode::ReduceScatter];
/// (async, schedule): sync first, the reference of the others; the last is a second sync
/// layer, whose ratio to the first (an A/A test: the same code) is the measurement's own spread.
const VARIANTS: [(bool, OverlapSchedule); 4] = [
    (false, OverlapSchedule::Ring),
    (true, OverlapSchedule::Split),
    (true, OverlapSchedule::Ring),
    (false, OverlapSchedule::Ring),
];

/// Per (layer, mode): the median sync time and, for split, ring and the second sync layer, the
/// median over rounds of `t / t_sync` taken in the same round (the drift of this shared machine
/// cancels in each pair).
type GridRow = (&'static str, TpMode, f64, [f64; 3]);

fn run_grid(
    world: usize,
    options: LocalGroupOptions,
    s: usize,
    b: usize,
    d: usize,
    rounds: usize,
) -> Vec<GridRow> {
    ranks(world, options, 1, move |g| {
        let n = g.world_size();
        let dev = device();
        let linear = Linear {
            weight: Param::from_tensor(Tensor::ones([d, d], &dev) * 0.01),
            bias: None,
        };
        let mut rows = Vec::new();
        for mode in MODES {
            // Sequence-parallel inputs are sharded on dim 0; all-reduce inputs are replicated.
            let s_col = if mode == TpMode::ReduceScatter {
                s / n
            } else {
                s
            };
            let x_row = Tensor::<3>::ones([s, b, d / n], &dev).require_grad();
            let x_col = Tensor::<3>::ones([s_col, b, d], &dev).require_grad();
            // One weight per layer kind, shared by every variant (only the spec differs): a
            // layer instance of its own per variant measured a few percent apart from another
            // with the same code (where its buffers fall in memory).
            let row_cfg = RowParallelLinearConfig::new(d, d).with_bias(false);
            let w_row = RowParallelLinear::from_full(&linear, &g, &row_cfg)
                .unwrap()
                .weight
                .val();
            let col_cfg = ColumnParallelLinearConfig::new(d, d).with_bias(false);
            let w_col = ColumnParallelLinear::from_full(&linear, &g, &col_cfg)
                .unwrap()
                .weight
                .val();
            let spec = |(asynch, schedule): (bool, OverlapSchedule)| {
                LinearSpec::new(
                    TpSettings::new()
                        .with_mode(mode)
                        .with_async_communication(asynch)
                        .with_recompute_all_gather(false)
                        .with_schedule(schedule),
                )
            };
            let mut t: [[Vec<f64>; 4]; 2] = Default::default();
            for round in 0..=rounds {
                // The order rotates each round, so no variant always runs after the same one.
                for k in 0..VARIANTS.len() {
                    let v = (k + round) % VARIANTS.len();
                    let sp = spec(VARIANTS[v]);
                    let dt = timed_warm(&g, || {
                        let y = row_parallel_linear(x_row.clone(), w_row.clone(), None, sp, &g);
                        drop(y.unwrap().sum().backward())
                    });
                    let dc = timed_warm(&g, || {
                        let y = column_parallel_linear(x_col.clone(), w_col.clone(), None, sp, &g);
                        drop(y.unwrap().sum().backward())
                    });
                    if round > 0 {
                        // round 0 warms up
                        t[0][v].push(dt);
                        t[1][v].push(dc);
                    }
                }
            }
            for (i, name) in ["row", "column"].into_iter().enumerate() {
                let [sync, split, ring, again] = &t[i];
                let paired = |a: &Vec<f64>| {
                    median(a.iter().zip(sync).map(|(a, s)| a / s).collect::<Vec<_>>())
                };
                rows.push((
                    name,
                    mode,
                    median(sync.clone()),
                    [paired(split), paired(ring), paired(again)],
                ));
            }
        }
        rows
    })
    .remove(0)
}

/// Async / sync over the grid, without and with the link model.
pub(crate) fn bench_async_grid(quick: bool) {
    let (s, b, d) = if quick { (64, 2, 128) } else { (512, 4, 1024) };
    let rounds = if quick { 2 } else { 15 };
    println!("\n## 7. Async / sync over the grid: x [{s}, {b}, {d}] -> {d}, forward + backward\n");
    println!(
        "No bias, loss = sum(y), column without recompute_all_gather; one thread per rank. Each"
    );
    println!(
        "ratio is the median over {rounds} rounds of t_async / t_sync timed in the same round. The"
    );
    println!(
        "link: latency 5 us, bandwidth set so that one all-gather of the activation takes about"
    );
    println!("as long as one of the layer's GEMMs. Target: async / sync <= 1.02 everywhere.");
    println!(
        "sync' / sync: a second sync layer against the first, the same code (an A/A test): how far"
    );
    println!("a ratio strays from 1 by this machine's noise alone.\n");
    println!("| tp | link | layer | mode | sync ms | split / sync | ring / sync | sync' / sync |");
    println!("|---:|------|-------|------|--------:|------:|------:|------:|");
    for world in [2usize, 4] {
        let plain = run_grid(world, LocalGroupOptions::default(), s, b, d, rounds);
        // The sequence-parallel column sync time is ~3 GEMMs plus its two collectives.
        let t_gemm = plain
            .iter()
            .find(|r| r.0 == "column" && r.1 == TpMode::ReduceScatter)
            .map_or(1e-3, |r| r.2 / 4.0);
        let recv = (world - 1) * s / world * b * d * 4;
        let linked = run_grid(world, link_for(recv, t_gemm), s, b, d, rounds);
        for (link, rows) in [("none", plain), ("on", linked)] {
            for (name, mode, sync, [split, ring, again]) in rows {
                println!(
                    "| {world} | {link} | {name} | {mode:?} | {:.1} | {split:.3} | {ring:.3} | {again:.3} |",
                    sync * 1e3
                );
            }
        }
    }
}
