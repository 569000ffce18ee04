//! Section 3: the overlap of each layer's communication with its compute, over a simulated
//! link (sync against async, and the floor: the slower of the two alone).

use super::*;

/// Times of one overlap case on `world` ranks, each with one compute thread.
pub(crate) struct Overlap {
    compute: f64,
    comm: f64,
    sync: f64,
    pub(crate) asynch: f64,
}

impl Overlap {
    fn row(&self, name: &str, world: usize) {
        let hidden = (self.sync - self.asynch) / self.comm;
        let floor = self.compute.max(self.comm);
        println!(
            "| {name} | {world} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
            self.compute * 1e3,
            self.comm * 1e3,
            floor * 1e3,
            self.sync * 1e3,
            self.asynch * 1e3,
            self.sync / self.asynch,
            self.asynch / floor,
            hidden
        );
    }
}

/// A link on which an all-gather that delivers `bytes` to each rank takes about `seconds`.
pub(crate) fn link_for(bytes: usize, seconds: f64) -> LocalGroupOptions {
    LocalGroupOptions {
        link: Some(LinkModel {
            latency: Duration::from_micros(5),
            bandwidth: bytes as f64 / seconds,
        }),
        ..Default::default()
    }
}

pub(crate) fn bench_overlap(quick: bool, schedule: OverlapSchedule) -> Vec<(usize, [Overlap; 3])> {
    let (s, d) = if quick {
        (256usize, 256usize)
    } else {
        (2048, 1024)
    };
    let reps = if quick { 3 } else { 7 };
    let mut results = Vec::new();
    for world in [2usize, 4] {
        // 1. compute alone: the matmuls of each case on pre-gathered tensors, all ranks at once.
        let compute = ranks(world, LocalGroupOptions::default(), 1, move |g| {
            let n = g.world_size();
            let dev = Device::flex();
            let full = Tensor::<2>::ones([s, d], &dev);
            let w_row = Tensor::<2>::ones([d / n, d], &dev);
            let x_row = Tensor::<2>::ones([s, d / n], &dev);
            // row backward: dgrad + wgrad
            let row_bw = timed(&g, reps, || {
                let gx = full.clone().matmul(w_row.clone().transpose());
                let gw = x_row.clone().transpose().matmul(full.clone());
                drop((gx.into_data(), gw.into_data()));
            });
            // column forward: X @ W_r
            let w_col = Tensor::<2>::ones([d, d / n], &dev);
            let col_fw = timed(&g, reps, || {
                drop(full.clone().matmul(w_col.clone()).into_data())
            });
            // column backward: dgrad + wgrad
            let g_col = Tensor::<2>::ones([s, d / n], &dev);
            let col_bw = timed(&g, reps, || {
                let gx = g_col.clone().matmul(w_col.clone().transpose());
                let gw = full.clone().transpose().matmul(g_col.clone());
                drop((gx.into_data(), gw.into_data()));
            });
            [row_bw, col_fw, col_bw]
        })[0];
        // Bytes an all-gather of one [s/n, d] shard delivers to each rank.
        let recv = (world - 1) * s / world * d * 4;
        let mut cases = Vec::new();
        for (case, &t_compute) in compute.iter().enumerate() {
            let options = link_for(recv, t_compute);
            let (comm, sync, asynch) = ranks(world, options, 1, move |g| {
                let n = g.world_size();
                let dev = device();
                let shard = Tensor::<2>::ones([s / n, d], &dev);
                let comm = if case == 2 {
                    let full = Tensor::<2>::ones([s, d], &dev);
                    timed(&g, reps, || {
                        drop(burn_tp::ops::reduce_scatter(full.clone(), 0, &g).unwrap())
                    })
                } else {
                    timed(&g, reps, || drop(all_gather(shard.clone(), 0, &g).unwrap()))
                };
                let run = |asynch: bool| -> f64 {
                    let linear = Linear {
                        weight: Param::from_tensor(Tensor::ones([d, d], &dev)),
                        bias: None,
                    };
                    match case {
                        0 => {
                            let cfg = RowParallelLinearConfig::new(d, d)
                                .with_bias(false)
                                .with_settings(
                                    TpSettings::new()
                                        .with_mode(TpMode::ReduceScatter)
                                        .with_async_communication(asynch),
                                );
                            let layer = RowParallelLinear::from_full(&linear, &g, &cfg)
                                .unwrap()
                                .with_schedule(schedule);
                            let x = Tensor::<2>::ones([s, d / n], &dev).require_grad();
                            let mut t = Vec::new();
                            for _ in 0..reps {
                                let loss = loss_of(layer.forward(x.clone()));
                                t.push(timed(&g, 1, || drop(loss.clone().backward())));
                            }
                            median(t)
                        }
                        _ => {
                            // Without recompute, as the sync path keeps the gathered input (a
                            // re-gather is a second collective the sync path does not have).
                            let cfg = ColumnParallelLinearConfig::new(d, d)
                                .with_bias(false)
                                .with_settings(
                                    TpSettings::new()
                                        .with_mode(TpMode::ReduceScatter)
                                        .with_recompute_all_gather(false)
                                        .with_async_communication(asynch),
                                );
                            let layer = ColumnParallelLinear::from_full(&linear, &g, &cfg)
                                .unwrap()
                                .with_schedule(schedule);
                            if case == 1 {
                                // Forward only, so on the inner backend: on Autodiff, a forward
                                // never followed by its backward leaves its graph to Burn's
                                // cleanup, which the timing would include.
                                let layer = layer.valid();
                                let x = Tensor::<2>::ones([s / n, d], &Device::flex());
                                timed(&g, reps, || drop(layer.forward(x.clone()).into_data()))
                            } else {
                                let x = Tensor::<2>::ones([s / n, d], &dev).require_grad();
                                let mut t = Vec::new();
                                for _ in 0..reps {
                                    let loss = loss_of(layer.forward(x.clone()));
                                    t.push(timed(&g, 1, || drop(loss.clone().backward())));
                                }
                                median(t)
                            }
                        }
                    }
                };
                let (mut a, mut b) = (vec![], vec![]);
                for _ in 0..2 {
                    a.push(run(false));
                    b.push(run(true));
                }
                (comm, median(a), median(b))
            })[0];
            cases.push(Overlap {
                compute: t_compute,
                comm,
                sync,
                asynch,
            });
        }
        let cases: [Overlap; 3] = cases.try_into().ok().unwrap();
        results.push((world, cases));
    }
    results
}

pub(crate) fn print_overlap(title: &str, results: &[(usize, [Overlap; 3])]) {
    println!("\n## {title}\n");
    println!(
        "floor = max(t_compute, t_comm), perfect overlap; async/floor = 1 is the best possible."
    );
    println!("Link model set per case so that t_comm ~ t_compute; one compute thread per rank.");
    println!("hidden = (t_sync - t_async) / t_comm (target >= 0.8).\n");
    println!(
        "| case | tp | t_compute ms | t_comm ms | floor ms | t_sync ms | t_async ms | sync/async | async/floor | hidden |"
    );
    println!(
        "|------|---:|-------------:|----------:|---------:|----------:|-----------:|-----------:|------------:|-------:|"
    );
    for (world, cases) in results {
        cases[0].row("row RS backward (the seed)", *world);
        cases[1].row("column RS forward", *world);
        cases[2].row("column RS backward", *world);
    }
}
