//! The parallel linears against an unsharded Burn `Linear`: every mode, layer and schedule.

use super::*;

#[derive(Clone, Copy, Debug)]
struct Case {
    tp: usize,
    mode: TpMode,
    asynch: bool,
    recompute: bool,
    bias: bool,
    /// `false`: 3-D `[12, 2, D]`; `true`: 2-D `[tp, D]`, one row per rank in RS mode.
    one_row: bool,
    schedule: OverlapSchedule,
    /// Over a simulated link, so the async path runs its overlap schedule.
    linked: bool,
}

impl Case {
    fn lead(&self) -> Vec<usize> {
        if self.one_row {
            vec![self.tp]
        } else {
            vec![12, 2]
        }
    }
}

fn full_tensor(values: Vec<f32>, lead: &[usize], d: usize) -> Tensor<3> {
    // Always 3-D internally: 2-D cases use a unit middle dim and are squeezed at the call.
    let shape = if lead.len() == 1 {
        [lead[0], 1, d]
    } else {
        [lead[0], lead[1], d]
    };
    tensor(values, shape, DType::F32)
}

/// Reference results of the unsharded Linear: Y, dX, dW, db for loss = sum(Y * G).
struct Reference {
    y: Tensor<3>,
    dx: Tensor<3>,
    dw: Tensor<2>,
    db: Option<Tensor<1>>,
}

fn reference(linear: &Linear, x: Tensor<3>, g: Tensor<3>) -> Reference {
    let weight = linear.weight.val().detach().require_grad();
    let bias = linear
        .bias
        .as_ref()
        .map(|b| b.val().detach().require_grad());
    let x = x.require_grad();
    let y = burn::tensor::module::linear(x.clone(), weight.clone(), bias.clone());
    let grads = (y.clone() * g).sum().backward();
    Reference {
        y: y.detach(),
        dx: x.grad(&grads).unwrap(),
        dw: weight.grad(&grads).unwrap(),
        db: bias.map(|b| b.grad(&grads).unwrap()),
    }
}

/// One rank of a grid case: output, dX, dW, db, plus the full Linear gathered by `to_full`.
type RankOut = (
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Option<Vec<f64>>,
    Vec<f64>,
    Option<Vec<f64>>,
);

fn run_case(case: Case, column: bool) {
    let lead = case.lead();
    let n_lead: usize = lead.iter().product();
    let x_vals = uniform(n_lead * D_IN, 11);
    let g_vals = uniform(n_lead * D_OUT, 12);
    let lead2 = lead.clone();
    let run = if case.linked { run_linked } else { run_local };
    let ranks: Vec<RankOut> = run(case.tp, move |group: burn_tp::comm::ProcessGroup| {
        let (r, n) = (group.rank(), group.world_size());
        let dev = device();
        let x_full = full_tensor(x_vals.clone(), &lead2, D_IN);
        let g_full = full_tensor(g_vals.clone(), &lead2, D_OUT);
        let rs = case.mode == TpMode::ReduceScatter;
        let (y, x_local, full) = if column {
            let layer = ColumnParallelLinearConfig::new(D_IN, D_OUT)
                .with_bias(case.bias)
                .with_settings(
                    TpSettings::new()
                        .with_mode(case.mode)
                        .with_async_communication(case.asynch)
                        .with_recompute_all_gather(case.recompute),
                )
                .init(&group, &dev)
                .unwrap()
                .with_schedule(case.schedule);
            let x = if rs { chunk(x_full, n, 0, r) } else { x_full }.require_grad();
            let y = if case.one_row {
                layer
                    .forward(x.clone().squeeze_dim::<2>(1))
                    .unsqueeze_dim::<3>(1)
            } else {
                layer.forward(x.clone())
            };
            (
                y,
                x,
                (
                    layer.to_full().unwrap(),
                    Box::new(layer) as Box<dyn std::any::Any>,
                ),
            )
        } else {
            let layer = RowParallelLinearConfig::new(D_IN, D_OUT)
                .with_bias(case.bias)
                .with_settings(
                    TpSettings::new()
                        .with_mode(case.mode)
                        .with_async_communication(case.asynch),
                )
                .init(&group, &dev)
                .unwrap()
                .with_schedule(case.schedule);
            let x = chunk(x_full, n, 2, r).require_grad();
            let y = if case.one_row {
                layer
                    .forward(x.clone().squeeze_dim::<2>(1))
                    .unsqueeze_dim::<3>(1)
            } else {
                layer.forward(x.clone())
            };
            (
                y,
                x,
                (
                    layer.to_full().unwrap(),
                    Box::new(layer) as Box<dyn std::any::Any>,
                ),
            )
        };
        // The upstream gradient matching this rank's output block: a weighted, non-uniform loss.
        let g = match (column, rs) {
            (true, _) => chunk(g_full, n, 2, r),
            (false, true) => chunk(g_full, n, 0, r),
            (false, false) => g_full,
        };
        let grads = (y.clone() * g).sum().backward();
        let (weight, bias) = match full.1.downcast_ref::<ColumnParallelLinear>() {
            Some(l) => (l.weight.val(), l.bias.as_ref().map(|b| b.val())),
            None => {
                let l = full.1.downcast_ref::<RowParallelLinear>().unwrap();
                (l.weight.val(), l.bias.as_ref().map(|b| b.val()))
            }
        };
        (
            f64s(y),
            f64s(x_local.grad(&grads).unwrap()),
            f64s(weight.grad(&grads).unwrap()),
            bias.map(|b| f64s(b.grad(&grads).unwrap())),
            f64s(full.0.weight.val()),
            full.0.bias.as_ref().map(|b| f64s(b.val())),
        )
    })
    .unwrap();

    // The unsharded Burn Linear with the gathered weights.
    let dev = device();
    let w_full = &ranks[0].4;
    let linear = Linear {
        weight: Param::from_tensor(tensor(
            w_full.iter().map(|v| *v as f32).collect(),
            [D_IN, D_OUT],
            DType::F32,
        )),
        bias: ranks[0].5.as_ref().map(|b| {
            Param::from_tensor(tensor(
                b.iter().map(|v| *v as f32).collect(),
                [D_OUT],
                DType::F32,
            ))
        }),
    };
    let _ = dev;
    let reference = reference(
        &linear,
        full_tensor(uniform(n_lead * D_IN, 11), &lead, D_IN),
        full_tensor(uniform(n_lead * D_OUT, 12), &lead, D_OUT),
    );
    let (n, rs) = (case.tp, case.mode == TpMode::ReduceScatter);
    let tag = |what: &str, r: usize| {
        format!(
            "{what} {} rank {r} {case:?}",
            if column { "column" } else { "row" }
        )
    };
    let tol = 2e-5;
    for (r, (y, dx, dw, db, w_gathered, _)) in ranks.iter().enumerate() {
        assert_eq!(
            w_gathered,
            w_full,
            "{}",
            tag("to_full agrees across ranks", r)
        );
        let (want_y, want_dx, want_dw, want_db) = if column {
            (
                chunk(reference.y.clone(), n, 2, r),
                if rs {
                    chunk(reference.dx.clone(), n, 0, r)
                } else {
                    reference.dx.clone()
                },
                chunk(reference.dw.clone(), n, 1, r),
                reference.db.clone().map(|b| chunk(b, n, 0, r)),
            )
        } else {
            (
                if rs {
                    chunk(reference.y.clone(), n, 0, r)
                } else {
                    reference.y.clone()
                },
                chunk(reference.dx.clone(), n, 2, r),
                chunk(reference.dw.clone(), n, 0, r),
                reference.db.clone(),
            )
        };
        assert_close(y, &f64s(want_y), tol, &tag("output", r));
        assert_close(dx, &f64s(want_dx), tol, &tag("dX", r));
        assert_close(dw, &f64s(want_dw), tol, &tag("dW", r));
        assert_eq!(db.is_some(), case.bias);
        if let (Some(db), Some(want)) = (db, want_db) {
            assert_close(db, &f64s(want), tol, &tag("db", r));
        }
    }
}

#[test]
fn full_grid_matches_unsharded_linear() {
    let _rng = rng_lock();
    for tp in 1..=4 {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for asynch in [true, false] {
                for recompute in [true, false] {
                    for bias in [true, false] {
                        for one_row in [false, true] {
                            for schedule in [OverlapSchedule::Split, OverlapSchedule::Ring] {
                                for linked in [true, false] {
                                    let case = Case {
                                        tp,
                                        mode,
                                        asynch,
                                        recompute,
                                        bias,
                                        one_row,
                                        schedule,
                                        linked,
                                    };
                                    run_case(case, true);
                                    run_case(case, false);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn column_gather_output_matches_unsharded_linear() {
    let _rng = rng_lock();
    for tp in 1..=4 {
        for asynch in [true, false] {
            let x_vals = uniform(12 * 2 * D_IN, 5);
            let g_vals = uniform(12 * 2 * D_OUT, 6);
            let out = run_local(tp, move |group| {
                let layer = ColumnParallelLinearConfig::new(D_IN, D_OUT)
                    .with_gather_output(true)
                    .with_settings(TpSettings::new().with_async_communication(asynch))
                    .init(&group, &device())
                    .unwrap();
                let x = tensor(x_vals.clone(), [12, 2, D_IN], DType::F32).require_grad();
                let y = layer.forward(x.clone());
                // Replicated output, replicated loss.
                let grads = (y.clone() * tensor(g_vals.clone(), [12, 2, D_OUT], DType::F32))
                    .sum()
                    .backward();
                let full = layer.to_full().unwrap();
                (
                    f64s(y),
                    f64s(x.grad(&grads).unwrap()),
                    f64s(layer.weight.val().grad(&grads).unwrap()),
                    full,
                )
            })
            .unwrap();
            let full = &out[0].3;
            let reference = reference(
                full,
                tensor(uniform(12 * 2 * D_IN, 5), [12, 2, D_IN], DType::F32),
                tensor(uniform(12 * 2 * D_OUT, 6), [12, 2, D_OUT], DType::F32),
            );
            for (r, (y, dx, dw, _)) in out.iter().enumerate() {
                assert_close(y, &f64s(reference.y.clone()), 2e-5, "gathered output");
                assert_close(dx, &f64s(reference.dx.clone()), 2e-5, "dX");
                assert_close(dw, &f64s(chunk(reference.dw.clone(), tp, 1, r)), 2e-5, "dW");
            }
        }
    }
}

/// Burn's `LinearConfig::init` at tp = 1 and the shards at tp = n start from the same weights.
#[test]
fn init_shards_are_slices_of_burns_linear_init() {
    let _rng = rng_lock();
    let dev = Device::flex().autodiff();
    for tp in [1usize, 2, 4] {
        dev.seed(1234);
        let want = LinearConfig::new(D_IN, D_OUT).init(&dev);
        let want_w = f64s(want.weight.val());
        let want_b = f64s(want.bias.unwrap().val());
        // The rank threads start from this thread's stream: burn-nn's draws after `seed(1234)`.
        burn_tp::local::set_init_seed(1234);
        let out = run_local(tp, move |group| {
            let c = ColumnParallelLinearConfig::new(D_IN, D_OUT)
                .init(&group, &device())
                .unwrap();
            let full = c.to_full().unwrap();
            (
                f64s(full.weight.val()),
                f64s(full.bias.unwrap().val()),
                f64s(c.weight.val()),
            )
        })
        .unwrap();
        for (r, (w, b, shard)) in out.iter().enumerate() {
            assert_eq!(w, &want_w, "tp {tp} rank {r}");
            assert_eq!(b, &want_b);
            let want_shard = f64s(chunk(
                tensor(
                    want_w.iter().map(|v| *v as f32).collect(),
                    [D_IN, D_OUT],
                    DType::F32,
                ),
                tp,
                1,
                r,
            ));
            assert_eq!(shard, &want_shard);
        }
    }
    burn_tp::local::clear_init_seed();
}

/// Async (custom backward, overlapped) and sync (composed primitives) agree bitwise on
/// integer-valued data, for every mode and tp.
#[test]
fn async_and_sync_agree_bitwise_on_integer_data() {
    for tp in [1usize, 2, 3, 4] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            let out = run_linked(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let mut results = Vec::new();
                for asynch in [true, false] {
                    let c = ColumnParallelLinear::from_full(
                        &int_linear(1),
                        &group,
                        &ColumnParallelLinearConfig::new(D_IN, D_OUT).with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        ),
                    )
                    .unwrap();
                    let rw = RowParallelLinear::from_full(
                        &int_linear(3),
                        &group,
                        &RowParallelLinearConfig::new(D_OUT, D_IN).with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        ),
                    )
                    .unwrap();
                    let x_full = tensor(quarters(12 * 2 * D_IN, 7), [12, 2, D_IN], DType::F32);
                    let x = if mode == TpMode::ReduceScatter {
                        chunk(x_full, n, 0, r)
                    } else {
                        x_full
                    }
                    .require_grad();
                    let y = rw.forward(c.forward(x.clone()));
                    // Replicated output (AR) gets the same upstream gradient on every rank.
                    let seed = if mode == TpMode::ReduceScatter {
                        9 + r as u64
                    } else {
                        9
                    };
                    let g = tensor(
                        quarters(y.shape().num_elements(), seed),
                        y.dims(),
                        DType::F32,
                    );
                    let grads = (y.clone() * g).sum().backward();
                    let bits =
                        |t: Tensor<3>| f64s(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let bits2 =
                        |t: Tensor<2>| f64s(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let bits1 =
                        |t: Tensor<1>| f64s(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    results.push((
                        bits(y),
                        bits(x.grad(&grads).unwrap()),
                        bits2(c.weight.val().grad(&grads).unwrap()),
                        bits1(c.bias.as_ref().unwrap().val().grad(&grads).unwrap()),
                        bits2(rw.weight.val().grad(&grads).unwrap()),
                        bits1(rw.bias.as_ref().unwrap().val().grad(&grads).unwrap()),
                    ));
                }
                results
            })
            .unwrap();
            for (r, res) in out.iter().enumerate() {
                assert!(
                    res[0] == res[1],
                    "async vs sync differ: tp {tp} {mode:?} rank {r}"
                );
            }
            // The replicated row bias gradient is bitwise identical on every rank.
            for res in &out {
                assert_eq!(
                    res[0].5, out[0][0].5,
                    "row bias grad differs across ranks: tp {tp} {mode:?}"
                );
            }
        }
    }
}

#[test]
fn non_contiguous_inputs_give_correct_results() {
    // Against Burn's `Linear` on contiguous copies: outputs and input gradients.
    let out = run_local(2, |group| {
        let full = int_linear(1);
        let layer = ColumnParallelLinear::from_full(
            &full,
            &group,
            &ColumnParallelLinearConfig::new(D_IN, D_OUT).with_gather_output(true),
        )
        .unwrap();
        let weights = tensor(quarters(6 * D_OUT, 5), [6, D_OUT], DType::F32);
        // A [D_IN, 6] tensor transposed, and a sliced window.
        let base = tensor(quarters(D_IN * 6, 3), [D_IN, 6], DType::F32);
        let wide = tensor(quarters(6 * 2 * D_IN, 4), [6, 2 * D_IN], DType::F32);
        let mut checks = Vec::new();
        for strided in [base.transpose(), wide.slice([0..6, 3..3 + D_IN])] {
            let contiguous = tensor(
                f64s(strided.clone()).iter().map(|v| *v as f32).collect(),
                [6, D_IN],
                DType::F32,
            );
            let x = strided.require_grad();
            let y = layer.forward(x.clone());
            let g = (y.clone() * weights.clone()).sum().backward();
            let xr = contiguous.require_grad();
            let yr = full.forward(xr.clone());
            let gr = (yr.clone() * weights.clone()).sum().backward();
            checks.push((
                f64s(y),
                f64s(yr),
                f64s(x.grad(&g).unwrap()),
                f64s(xr.grad(&gr).unwrap()),
            ));
        }
        checks
    })
    .unwrap();
    for checks in out {
        for (y, yr, gx, gxr) in checks {
            assert_close(&y, &yr, 1e-6, "strided input: output");
            assert_close(&gx, &gxr, 1e-6, "strided input: input gradient");
        }
    }
    // The RS-mode column layer on transposed sequence shards, against the full sequence.
    let shard = |r: usize| {
        tensor(
            quarters(D_IN * 2 * 3, 8 + r as u64),
            [D_IN, 2, 3],
            DType::F32,
        )
        .swap_dims(0, 2)
    };
    let full_x = Tensor::cat(vec![shard(0), shard(1)], 0); // [6, 2, D_IN]
    let want = f64s(int_linear(1).forward(full_x));
    let out = run_local(2, move |group| {
        let cfg = ColumnParallelLinearConfig::new(D_IN, D_OUT)
            .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter));
        let layer = ColumnParallelLinear::from_full(&int_linear(1), &group, &cfg).unwrap();
        let x = shard(group.rank()); // [3, 2, D_IN], strided
        f64s(layer.forward(x)) // [6, 2, D_OUT / 2]
    })
    .unwrap();
    for (r, y) in out.iter().enumerate() {
        // This rank's columns of the full output.
        let mine: Vec<f64> = want
            .chunks(D_OUT)
            .flat_map(|row| row[r * D_OUT / 2..(r + 1) * D_OUT / 2].to_vec())
            .collect();
        assert_close(y, &mine, 1e-6, "RS strided shard");
    }
}

/// 1-D inputs, as Burn's `Linear` takes them, in ALL_REDUCE mode, async and sync.
#[test]
fn one_dimensional_inputs_match_burns_linear() {
    let _rng = rng_lock();
    let x_vals = uniform(D_IN, 71);
    let xs = x_vals.clone();
    let reference = {
        let l = int_linear(5);
        let y = l.forward(tensor(xs.clone(), [D_IN], DType::F32));
        f64s(y)
    };
    for tp in [1usize, 2, 3] {
        for asynch in [true, false] {
            let xs = x_vals.clone();
            let out = run_local(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let full = int_linear(5);
                let col = ColumnParallelLinear::from_full(
                    &full,
                    &group,
                    &ColumnParallelLinearConfig::new(D_IN, D_OUT)
                        .with_settings(TpSettings::new().with_async_communication(asynch))
                        .with_gather_output(true),
                )
                .unwrap();
                let row = RowParallelLinear::from_full(
                    &full,
                    &group,
                    &RowParallelLinearConfig::new(D_IN, D_OUT)
                        .with_settings(TpSettings::new().with_async_communication(asynch)),
                )
                .unwrap();
                let x = tensor(xs.clone(), [D_IN], DType::F32);
                let y_col = col.forward(x.clone());
                let x_r = chunk(x, n, 0, r);
                let y_row = row.forward(x_r);
                (f64s(y_col), f64s(y_row))
            })
            .unwrap();
            for (y_col, y_row) in out {
                assert_close(&y_col, &reference, 1e-5, "column, 1-D");
                assert_close(&y_row, &reference, 1e-5, "row, 1-D");
            }
        }
    }
}
