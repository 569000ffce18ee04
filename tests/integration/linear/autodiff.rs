//! The parallel linears' autodiff: gradcheck of the functional ops, ranks that differ in
//! `requires_grad`, and a Megatron MLP trained like the unsharded one.

use super::*;

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
            // The rank threads start from this thread's stream: burn-nn's draws after `seed(7)`.
            burn_tp::local::set_init_seed(7);
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
    burn_tp::local::clear_init_seed();
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
