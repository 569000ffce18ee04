//! Parallel linears, continued: gradcheck of the functional ops, a trained Megatron MLP, and
//! size errors.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Tensor, TensorData, activation::gelu};
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, LinearSpec, OverlapSchedule,
    RowParallelLinear, RowParallelLinearConfig, TpMode, TpSettings, column_parallel_linear,
    row_parallel_linear,
};
use burn_tp::local::run_local;
use burn_tp::ops::all_reduce;
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};
use burn_tp::{LocalGroup, ProcessGroup, ReduceOp, TpError};

use crate::common::{assert_close, device, f64s, rng_lock, run_linked, tensor, uniform};
use crate::linear::{D_IN, D_OUT, chunk, int_linear};

fn f64_tensor<const D: usize>(v: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    Tensor::from_data(
        TensorData::new(v, shape).convert::<f64>(),
        (&device(), DType::F64),
    )
}

#[test]
fn gradcheck_column_and_row_ops() {
    for tp in [1usize, 2] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            run_linked(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let opts = GradcheckOptions {
                    rtol: 1e-4,
                    atol: 1e-6,
                    ..Default::default()
                };
                let spec = LinearSpec::new(
                    TpSettings::new()
                        .with_mode(mode)
                        .with_schedule(OverlapSchedule::Split),
                );
                let rs = mode == TpMode::ReduceScatter;
                let (s, d_in, d_out) = (4usize, 4usize, 4usize);
                // Column: x (sharded on dim 0 in RS mode, else replicated), W_r, b_r as 2-D.
                let xs = if rs { s / n } else { s };
                let x = f64_tensor(
                    uniform(xs * d_in, if rs { 30 + r as u64 } else { 30 }),
                    [xs, d_in],
                );
                let w = f64_tensor(uniform(d_in * d_out / n, 40 + r as u64), [d_in, d_out / n]);
                let b = f64_tensor(uniform(d_out / n, 50 + r as u64), [1, d_out / n]);
                let g = f64_tensor(uniform(s * d_out / n, 60 + r as u64), [s, d_out / n]);
                let column = |xs: &[Tensor<2>]| {
                    let y = column_parallel_linear(
                        xs[0].clone(),
                        xs[1].clone(),
                        Some(xs[2].clone().squeeze_dim(0)),
                        spec,
                        &group,
                    )
                    .unwrap();
                    let y = y.clone() * y * g.clone(); // nonlinear, weighted
                    y.sum()
                };
                // The column input is replicated in AR mode: check it separately from the weights.
                if rs {
                    gradcheck(
                        &group,
                        &[x.clone(), w.clone(), b.clone()],
                        LossKind::Sharded,
                        opts,
                        column,
                    )
                    .unwrap();
                } else {
                    let rep = GradcheckOptions {
                        replicated_inputs: true,
                        ..opts
                    };
                    gradcheck(
                        &group,
                        std::slice::from_ref(&x),
                        LossKind::Sharded,
                        rep,
                        |xs| column(&[xs[0].clone(), w.clone(), b.clone()]),
                    )
                    .unwrap();
                    gradcheck(
                        &group,
                        &[w.clone(), b.clone()],
                        LossKind::Sharded,
                        opts,
                        |ps| column(&[x.clone(), ps[0].clone(), ps[1].clone()]),
                    )
                    .unwrap();
                }
                // Row: x_r [s, d_in/n], W_r [d_in/n, d_out], b replicated [d_out].
                let xr = f64_tensor(uniform(s * d_in / n, 70 + r as u64), [s, d_in / n]);
                let wr = f64_tensor(uniform(d_in / n * d_out, 80 + r as u64), [d_in / n, d_out]);
                let br = f64_tensor(uniform(d_out, 90), [1, d_out]);
                let gs = if rs { s / n } else { s };
                let gr = f64_tensor(
                    uniform(gs * d_out, if rs { 100 + r as u64 } else { 100 }),
                    [gs, d_out],
                );
                let row = |xs: &[Tensor<2>], b: Tensor<2>| {
                    let y = row_parallel_linear(
                        xs[0].clone(),
                        xs[1].clone(),
                        Some(b.squeeze_dim(0)),
                        spec,
                        &group,
                    )
                    .unwrap();
                    (y.clone() * y * gr.clone()).sum()
                };
                let kind = if rs {
                    LossKind::Sharded
                } else {
                    LossKind::Replicated
                };
                gradcheck(&group, &[xr.clone(), wr.clone()], kind, opts, |xs| {
                    row(xs, br.clone())
                })
                .unwrap();
                let rep = GradcheckOptions {
                    replicated_inputs: true,
                    ..opts
                };
                gradcheck(&group, std::slice::from_ref(&br), kind, rep, |bs| {
                    row(&[xr.clone(), wr.clone()], bs[0].clone())
                })
                .unwrap();
            })
            .unwrap();
        }
    }
}

#[derive(Module, Debug)]
struct TpMlp {
    fc1: ColumnParallelLinear,
    fc2: RowParallelLinear,
}

#[derive(Module, Debug)]
struct RefMlp {
    fc1: Linear,
    fc2: Linear,
}

/// A Megatron MLP (column -> gelu -> row) at tp = 2 and 4 trained for 20 Adam steps equals the
/// unsharded MLP trained the same way.
#[test]
fn megatron_mlp_trains_like_the_unsharded_mlp() {
    let _rng = rng_lock();
    let (s, b, d, h) = (8usize, 2usize, 8usize, 16usize);
    let steps = 20;
    let x_vals = uniform(s * b * d, 1);
    let t_vals = uniform(s * b * d, 2);
    let lr = 1e-2;
    // Reference.
    let dev = device();
    dev.seed(7);
    let mut model = RefMlp {
        fc1: LinearConfig::new(d, h).init(&dev),
        fc2: LinearConfig::new(h, d).init(&dev),
    };
    let mut optim = AdamConfig::new().init();
    let x = tensor(x_vals.clone(), [s, b, d], DType::F32);
    let t = tensor(t_vals.clone(), [s, b, d], DType::F32);
    let mut ref_losses = Vec::new();
    for _ in 0..steps {
        let y = model.fc2.forward(gelu(model.fc1.forward(x.clone())));
        let loss = (y - t.clone()).powi_scalar(2).sum() / (s * b * d) as f64;
        ref_losses.push(f64s(loss.clone())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    let ref_params = [
        f64s(model.fc1.weight.val()),
        f64s(model.fc1.bias.unwrap().val()),
        f64s(model.fc2.weight.val()),
        f64s(model.fc2.bias.unwrap().val()),
    ];

    for tp in [2usize, 4] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            dev.seed(7);
            let (xv, tv) = (x_vals.clone(), t_vals.clone());
            let out = run_local(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let dev = device();
                let mut model = TpMlp {
                    fc1: ColumnParallelLinearConfig::new(d, h)
                        .with_settings(TpSettings::new().with_mode(mode))
                        .init(&group, &dev)
                        .unwrap(),
                    fc2: RowParallelLinearConfig::new(h, d)
                        .with_settings(TpSettings::new().with_mode(mode))
                        .init(&group, &dev)
                        .unwrap(),
                };
                let mut optim = AdamConfig::new().init();
                let rs = mode == TpMode::ReduceScatter;
                let x = tensor(xv.clone(), [s, b, d], DType::F32);
                let t = tensor(tv.clone(), [s, b, d], DType::F32);
                let (x, t) = if rs {
                    (chunk(x, n, 0, r), chunk(t, n, 0, r))
                } else {
                    (x, t)
                };
                let mut losses = Vec::new();
                for _ in 0..steps {
                    let y = model.fc2.forward(gelu(model.fc1.forward(x.clone())));
                    let loss = (y - t.clone()).powi_scalar(2).sum() / (s * b * d) as f64;
                    // RS: each rank holds its shard's part of the loss.
                    let total = if rs {
                        all_reduce(loss.clone().detach(), ReduceOp::Sum, &group).unwrap()
                    } else {
                        loss.clone()
                    };
                    losses.push(f64s(total)[0]);
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optim.step(lr, model, grads);
                }
                let (f1, f2) = (model.fc1.to_full().unwrap(), model.fc2.to_full().unwrap());
                (
                    losses,
                    [
                        f64s(f1.weight.val()),
                        f64s(f1.bias.unwrap().val()),
                        f64s(f2.weight.val()),
                        f64s(f2.bias.unwrap().val()),
                    ],
                )
            })
            .unwrap();
            for (r, (losses, params)) in out.iter().enumerate() {
                let tag = format!("tp {tp} {mode:?} rank {r}");
                assert_close(losses, &ref_losses, 1e-5, &format!("losses {tag}"));
                for (p, want) in params.iter().zip(&ref_params) {
                    assert_close(p, want, 1e-5, &format!("params {tag}"));
                }
            }
            assert!(ref_losses[steps - 1] < ref_losses[0], "the MLP learns");
        }
    }
}

#[test]
fn size_errors_are_typed_errors_naming_the_sizes() {
    let _rng = rng_lock();
    let groups = LocalGroup::new(3).unwrap();
    let g: &ProcessGroup = &groups[0];
    let dev = device();
    // Errors before communication: a single rank gets them without the others.
    let e = ColumnParallelLinearConfig::new(4, 8)
        .init(g, &dev)
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "ColumnParallelLinear d_output".into(),
            size: 8,
            tp: 3
        }
    );
    assert!(e.to_string().contains('8') && e.to_string().contains('3'));
    let e = RowParallelLinearConfig::new(10, 6)
        .init(g, &dev)
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "RowParallelLinear d_input".into(),
            size: 10,
            tp: 3
        }
    );
    let e = ColumnParallelLinearConfig::new(4, 6)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
        .with_gather_output(true)
        .init(g, &dev);
    assert!(matches!(e, Err(TpError::Config(_))));
    // Errors at the call (tp = 1 group to build layers without peers, then checked shapes).
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let col = ColumnParallelLinearConfig::new(4, 6)
        .init(&solo, &dev)
        .unwrap();
    let e = col
        .try_forward(tensor(vec![0.0; 10], [2, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { got, .. } if got == &vec![2, 5]),
        "{e}"
    );
    // `forward` (Burn's convention) panics on the caller's thread with the same message.
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        col.forward(tensor(vec![0.0; 10], [2, 5], DType::F32))
    }))
    .unwrap_err();
    assert_eq!(panic.downcast_ref::<String>(), Some(&e.to_string()));
    assert!(
        e.to_string().contains("[2, 5]") && e.to_string().contains("[.., 4]"),
        "{e}"
    );
    let row = RowParallelLinear::from_full(
        &int_linear(1),
        g,
        &RowParallelLinearConfig::new(D_IN, D_OUT)
            .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter)),
    )
    .unwrap();
    let e = row
        .try_forward(tensor(vec![0.0; 5 * 4], [5, 4], DType::F32))
        .unwrap_err();
    assert_eq!(
        e,
        TpError::NotDivisible {
            what: "RowParallelLinear: dim 0 (sequence) of the input".into(),
            size: 5,
            tp: 3
        }
    );
    let e = row
        .try_forward(tensor(vec![0.0; 6 * 5], [6, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { expected, .. } if expected.contains('4')),
        "{e}"
    );
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

/// Whether a rank's input needs a gradient does not change which collectives it posts: rank 0's
/// input requires grad and rank 1's does not, the backward completes, and the gradients are the
/// right values: rank 0's input gradient is `ones @ W^T` (the sum over both ranks' shards, of its
/// rows in REDUCE_SCATTER mode), each rank's weight gradient the column sums of the (gathered)
/// input, `loss = sum(y)` on each rank. Written out in plain loops.
#[test]
fn ranks_with_different_requires_grad_post_the_same_collectives() {
    let w = f64s(int_linear(2).weight.val()); // [D_IN, D_OUT]
    // d sum(X W) / dX = ones @ W^T: every row is W's row sums.
    let w_row_sums: Vec<f64> = (0..D_IN)
        .map(|k| w[k * D_OUT..(k + 1) * D_OUT].iter().sum())
        .collect();
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        let rows = if mode == TpMode::ReduceScatter { 2 } else { 4 };
        let x_vals = uniform(rows * D_IN, 9);
        // Both ranks hold the same rows; in REDUCE_SCATTER mode the gathered input is them twice.
        let copies = if mode == TpMode::ReduceScatter {
            2.0
        } else {
            1.0
        };
        let col_sums: Vec<f64> = (0..D_IN)
            .map(|k| {
                copies
                    * (0..rows)
                        .map(|i| f64::from(x_vals[i * D_IN + k]))
                        .sum::<f64>()
            })
            .collect();
        let want_dx: Vec<f64> = (0..rows).flat_map(|_| w_row_sums.clone()).collect();
        let want_dw: Vec<f64> = (0..D_IN)
            .flat_map(|k| std::iter::repeat_n(col_sums[k], D_OUT / 2))
            .collect();
        for linked in [false, true] {
            let run = if linked { run_linked } else { run_local };
            let xv = x_vals.clone();
            let out = run(2, move |group: ProcessGroup| {
                let r = group.rank();
                group.set_timeout(std::time::Duration::from_secs(5));
                let col = ColumnParallelLinear::from_full(
                    &int_linear(2),
                    &group,
                    &ColumnParallelLinearConfig::new(D_IN, D_OUT)
                        .with_settings(TpSettings::new().with_mode(mode)),
                )
                .unwrap();
                let x = tensor(xv.clone(), [rows, D_IN], DType::F32);
                let x = if r == 0 { x.require_grad() } else { x };
                let y = col.try_forward(x.clone()).unwrap();
                let grads = y.sum().backward();
                let wgrad = col.weight.grad(&grads).map(f64s);
                (x.grad(&grads).map(f64s), wgrad)
            })
            .unwrap();
            let tag = format!("{mode:?} linked {linked}");
            assert!(
                out[1].0.is_none(),
                "{tag}: rank 1's input needs no gradient"
            );
            let dx = out[0].0.as_ref().expect("rank 0's input gradient");
            assert_close(dx, &want_dx, 1e-6, &format!("{tag}: rank 0 dx"));
            for (r, (_, dw)) in out.iter().enumerate() {
                let dw = dw.as_ref().expect("a weight gradient");
                assert_close(dw, &want_dw, 1e-6, &format!("{tag}: rank {r} dW"));
            }
        }
    }
}

/// Sharding keeps the dtype: an f64 `Linear` gives f64 shards, and the layers run in f64 and
/// match Burn's `Linear` in f64 (before, the shards were silently f32 and the forward panicked).
#[test]
fn sharding_keeps_the_dtype() {
    let x_vals = uniform(4 * D_IN, 81);
    for tp in [1usize, 2] {
        let xs = x_vals.clone();
        let out = run_local(tp, move |group| {
            let (r, n) = (group.rank(), group.world_size());
            let f = int_linear(7);
            let to64 = |t: Tensor<2>| {
                f64_tensor(
                    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
                    [D_IN, D_OUT],
                )
            };
            let full = Linear {
                weight: burn::module::Param::from_tensor(to64(f.weight.val())),
                bias: f.bias.as_ref().map(|b| {
                    burn::module::Param::from_tensor(f64_tensor(
                        b.val()
                            .into_data()
                            .convert::<f32>()
                            .try_to_vec::<f32>()
                            .unwrap(),
                        [D_OUT],
                    ))
                }),
            };
            let col = ColumnParallelLinear::from_full(
                &full,
                &group,
                &ColumnParallelLinearConfig::new(D_IN, D_OUT).with_gather_output(true),
            )
            .unwrap();
            let row = RowParallelLinear::from_full(
                &full,
                &group,
                &RowParallelLinearConfig::new(D_IN, D_OUT),
            )
            .unwrap();
            assert_eq!(col.weight.val().dtype(), DType::F64);
            assert_eq!(row.weight.val().dtype(), DType::F64);
            assert_eq!(col.to_full().unwrap().weight.val().dtype(), DType::F64);
            let x = f64_tensor(xs.clone(), [4, D_IN]);
            let want = f64s(full.forward(x.clone()));
            let y_col = col.forward(x.clone());
            let y_row = row.forward(chunk(x, n, 1, r));
            assert_eq!((y_col.dtype(), y_row.dtype()), (DType::F64, DType::F64));
            (f64s(y_col), f64s(y_row), want)
        })
        .unwrap();
        for (c, rw, want) in out {
            assert_close(&c, &want, 1e-12, "column f64");
            assert_close(&rw, &want, 1e-12, "row f64");
        }
    }
}

/// Both layers in bf16 and f16 (what large models train in): shards, outputs, input and weight
/// gradients keep the dtype and match Burn's `Linear` in the same dtype, in both modes, async and
/// sync.
/// Tolerance: relative 2e-2 (bf16 has 8 bits of mantissa; sums of 12 products round differently
/// in a different order).
#[test]
fn half_precision_layers_match_burns_linear() {
    for dtype in [DType::BF16, DType::F16] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for asynch in [true, false] {
                let out = run_linked(2, move |group| {
                    let (r, n) = (group.rank(), group.world_size());
                    let f = int_linear(3);
                    let cast = |t: Tensor<2>| {
                        Tensor::<2>::from_data(
                            t.into_data().convert_dtype(dtype),
                            (&device(), dtype),
                        )
                    };
                    let full = Linear {
                        weight: burn::module::Param::from_tensor(cast(f.weight.val()) * 0.125),
                        bias: None,
                    };
                    let col = ColumnParallelLinear::from_full(
                        &full,
                        &group,
                        &ColumnParallelLinearConfig::new(D_IN, D_OUT).with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        ),
                    )
                    .unwrap();
                    assert_eq!(col.weight.val().dtype(), dtype);
                    let x_full = cast(tensor(uniform(4 * D_IN, 17), [4, D_IN], DType::F32));
                    let x = if mode == TpMode::ReduceScatter {
                        chunk(x_full.clone(), n, 0, r)
                    } else {
                        x_full.clone()
                    };
                    let x = x.require_grad();
                    let y = col.forward(x.clone());
                    assert_eq!(y.dtype(), dtype);
                    let grads = y.clone().sum().backward();
                    let gx = x.grad(&grads).unwrap();
                    assert_eq!(gx.dtype(), dtype);
                    let gw_col = col.weight.val().grad(&grads).unwrap();
                    assert_eq!(gw_col.dtype(), dtype);
                    // Reference: Burn's Linear in the same dtype; this rank's columns. The
                    // logical loss is the sum over ranks of sum(y_r) = sum(full y), so the input
                    // gradient is that of sum(full y): all of it (ALL_REDUCE), or this rank's
                    // rows (REDUCE_SCATTER).
                    let xr = x_full.clone().require_grad();
                    let yr = full.forward(xr.clone());
                    let cols = D_OUT / n;
                    let yr_mine = yr.clone().slice([0..4, r * cols..(r + 1) * cols]);
                    let ref_grads = yr.clone().sum().backward();
                    let gxr_full = xr.grad(&ref_grads).unwrap();
                    // The reference weight gradient `[d_in, d_out]`: the column shard is this
                    // rank's columns, the row shard its rows (the same in both modes: the logical
                    // loss is the full output's sum).
                    let gw_full = full.weight.val().grad(&ref_grads).unwrap();
                    let gxr = if mode == TpMode::ReduceScatter {
                        chunk(gxr_full.clone(), n, 0, r)
                    } else {
                        gxr_full.clone()
                    };
                    // The row layer: input sharded on features, output reduced.
                    let row = RowParallelLinear::from_full(
                        &full,
                        &group,
                        &RowParallelLinearConfig::new(D_IN, D_OUT).with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        ),
                    )
                    .unwrap();
                    let xw = chunk(x_full.clone(), n, 1, r).require_grad();
                    let yw = row.forward(xw.clone());
                    assert_eq!(yw.dtype(), dtype);
                    let row_grads = yw.clone().sum().backward();
                    let gw = xw.grad(&row_grads).unwrap();
                    let gw_row = row.weight.val().grad(&row_grads).unwrap();
                    assert_eq!(gw_row.dtype(), dtype);
                    let yw_ref = if mode == TpMode::ReduceScatter {
                        chunk(yr.clone(), n, 0, r)
                    } else {
                        yr.clone()
                    };
                    let gw_ref = chunk(gxr_full.clone(), n, 1, r);
                    let mut got = f64s(y);
                    got.extend(f64s(yw));
                    let mut want = f64s(yr_mine);
                    want.extend(f64s(yw_ref));
                    let mut g_got = f64s(gx);
                    g_got.extend(f64s(gw));
                    let mut g_want = f64s(gxr);
                    g_want.extend(f64s(gw_ref));
                    g_got.extend(f64s(gw_col));
                    g_want.extend(f64s(chunk(gw_full.clone(), n, 1, r)));
                    g_got.extend(f64s(gw_row));
                    g_want.extend(f64s(chunk(gw_full, n, 0, r)));
                    (got, want, g_got, g_want)
                })
                .unwrap();
                for (y, yr, gx, gxr) in out {
                    let tag = format!("{dtype:?} {mode:?} async {asynch}");
                    assert_close(&y, &yr, 2e-2, &format!("{tag}: output"));
                    assert_close(
                        &gx,
                        &gxr,
                        2e-2,
                        &format!("{tag}: input and weight gradients"),
                    );
                }
            }
        }
    }
}

/// A fused column layer with contiguous chunks (q: 4 heads, k and v: 2 heads each, heads of 2):
/// every rank holds its piece of each chunk (tp 1, 2) or, at tp 4, the k / v head its q heads
/// use, replicated on 2 ranks. Outputs equal the full `Linear`'s columns of that placement; the
/// weight gradient of each rank's columns equals the full gradient's (replicas: summed over the
/// ranks holding the block); `to_full` gives the original back; both modes, async and sync.
#[test]
fn contiguous_chunks_shard_each_part_and_sum_replica_gradients() {
    use burn_tp::linear::ColumnChunk;
    let (d_in, n) = (4usize, 8usize);
    let chunks = vec![
        ColumnChunk::new(8).with_blocks(Some(4)),
        ColumnChunk::new(4).with_blocks(Some(2)),
        ColumnChunk::new(4).with_blocks(Some(2)),
    ];
    let d_out = 16;
    let w_vals = uniform(d_in * d_out, 71);
    let b_vals = uniform(d_out, 72);
    let x_vals = uniform(n * d_in, 73);
    let v_vals = uniform(n * d_out, 74);
    // The full columns of each chunk rank r holds, as the layout says: q heads r*4/tp.., and the
    // k / v heads r*2/tp.. (tp <= 2) or head r / 2 (tp = 4).
    let columns = |tp: usize, r: usize| -> Vec<usize> {
        let q = (r * 8 / tp..(r + 1) * 8 / tp).collect::<Vec<_>>();
        let kv = |at: usize| -> Vec<usize> {
            if tp <= 2 {
                (at + r * 4 / tp..at + (r + 1) * 4 / tp).collect()
            } else {
                (at + (r / 2) * 2..at + (r / 2) * 2 + 2).collect()
            }
        };
        [q, kv(8), kv(12)].concat()
    };
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for asynch in [true, false] {
            for tp in [1usize, 2, 4] {
                let (wv, bv, xv, vv, ch) = (
                    w_vals.clone(),
                    b_vals.clone(),
                    x_vals.clone(),
                    v_vals.clone(),
                    chunks.clone(),
                );
                let out = run_local(tp, move |g| {
                    let (r, tp) = (g.rank(), g.world_size());
                    let full = Linear {
                        weight: burn::module::Param::from_tensor(tensor(
                            wv.clone(),
                            [d_in, d_out],
                            DType::F32,
                        )),
                        bias: Some(burn::module::Param::from_tensor(tensor(
                            bv.clone(),
                            [d_out],
                            DType::F32,
                        ))),
                    };
                    let config = ColumnParallelLinearConfig::new(d_in, d_out)
                        .with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        )
                        .with_chunks(ch.clone());
                    let layer = ColumnParallelLinear::from_full(&full, &g, &config).unwrap();
                    let x_full = tensor(xv.clone(), [n, d_in], DType::F32);
                    let x = if mode == TpMode::ReduceScatter {
                        chunk(x_full.clone(), tp, 0, r)
                    } else {
                        x_full.clone()
                    };
                    let y = layer.forward(x);
                    // This rank's share of the logical loss sum(y_full * v): replicated columns
                    // count 1 / (ranks holding them) on each.
                    let cols = columns(tp, r);
                    let share: Vec<f32> = cols
                        .iter()
                        .map(|&c| if c >= 8 && tp == 4 { 0.5 } else { 1.0 })
                        .collect();
                    let idx = Tensor::<1, burn::tensor::Int>::from_data(
                        TensorData::new(
                            cols.iter().map(|&c| c as i64).collect::<Vec<_>>(),
                            [cols.len()],
                        ),
                        &device(),
                    );
                    let v = tensor(vv.clone(), [n, d_out], DType::F32).select(1, idx.clone());
                    let scale = tensor(share, [cols.len()], DType::F32).unsqueeze::<2>();
                    let grads = (y.clone() * v * scale).sum().backward();
                    let gw = layer.weight.val().grad(&grads).unwrap();
                    let back = layer.to_full().unwrap();
                    let y_want = full.forward(x_full).select(1, idx.clone());
                    (
                        f64s(y),
                        f64s(y_want),
                        f64s(gw),
                        cols,
                        f64s(back.weight.val()),
                        f64s(back.bias.unwrap().val()),
                    )
                })
                .unwrap();
                // The full weight gradient of sum(y * v): x^T v.
                let gw_full = tensor(x_vals.clone(), [n, d_in], DType::F32)
                    .transpose()
                    .matmul(tensor(v_vals.clone(), [n, d_out], DType::F32));
                let gw_full = f64s(gw_full);
                for (r, (y, y_want, gw, cols, w_back, b_back)) in out.into_iter().enumerate() {
                    let tag = format!("{mode:?} async {asynch} tp {tp} rank {r}");
                    assert_close(&y, &y_want, 1e-6, &format!("{tag}: output"));
                    let want: Vec<f64> = (0..d_in)
                        .flat_map(|i| cols.iter().map(move |&c| (i, c)))
                        .map(|(i, c)| gw_full[i * d_out + c])
                        .collect();
                    assert_close(&gw, &want, 1e-5, &format!("{tag}: weight gradient"));
                    let w_orig: Vec<f64> = w_vals.iter().map(|&v| v as f64).collect();
                    let b_orig: Vec<f64> = b_vals.iter().map(|&v| v as f64).collect();
                    assert_eq!(w_back, w_orig, "{tag}: to_full weight");
                    assert_eq!(b_back, b_orig, "{tag}: to_full bias");
                }
            }
        }
    }
}
