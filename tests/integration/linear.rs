//! Column/RowParallelLinear: the full grid against an unsharded Burn `Linear`, async vs sync,
//! non-contiguous inputs, gradcheck, a trained Megatron MLP, and size errors.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor, TensorData, activation::gelu};
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, LinearSpec, OverlapSchedule,
    RowParallelLinear, RowParallelLinearConfig, TpMode, column_parallel_linear,
    row_parallel_linear,
};
use burn_tp::local::run_local;
use burn_tp::ops::all_reduce;
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};
use burn_tp::{LocalGroup, ProcessGroup, ReduceOp, TpError};

use crate::common::{assert_close, device, f64s, quarters, rng_lock, tensor, uniform};

const D_IN: usize = 12;
const D_OUT: usize = 12;

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

fn chunk<const D: usize>(t: Tensor<D>, n: usize, dim: usize, r: usize) -> Tensor<D> {
    if n == 1 {
        t
    } else {
        t.chunk(n, dim).swap_remove(r)
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
    let ranks: Vec<RankOut> = run_local(case.tp, move |group| {
        let (r, n) = (group.rank(), group.world_size());
        let dev = device();
        let x_full = full_tensor(x_vals.clone(), &lead2, D_IN);
        let g_full = full_tensor(g_vals.clone(), &lead2, D_OUT);
        let rs = case.mode == TpMode::ReduceScatter;
        let (y, x_local, full) = if column {
            let layer = ColumnParallelLinearConfig::new(D_IN, D_OUT)
                .with_bias(case.bias)
                .with_mode(case.mode)
                .with_async_communication(case.asynch)
                .with_recompute_all_gather(case.recompute)
                .init(&group, &dev)
                .unwrap()
                .with_schedule(case.schedule);
            let x = if rs { chunk(x_full, n, 0, r) } else { x_full }.require_grad();
            let y = if case.one_row {
                layer
                    .forward(x.clone().squeeze_dim::<2>(1))
                    .unwrap()
                    .unsqueeze_dim::<3>(1)
            } else {
                layer.forward(x.clone()).unwrap()
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
                .with_mode(case.mode)
                .with_async_communication(case.asynch)
                .init(&group, &dev)
                .unwrap()
                .with_schedule(case.schedule);
            let x = chunk(x_full, n, 2, r).require_grad();
            let y = if case.one_row {
                layer
                    .forward(x.clone().squeeze_dim::<2>(1))
                    .unwrap()
                    .unsqueeze_dim::<3>(1)
            } else {
                layer.forward(x.clone()).unwrap()
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
                                let case = Case {
                                    tp,
                                    mode,
                                    asynch,
                                    recompute,
                                    bias,
                                    one_row,
                                    schedule,
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
                    .with_async_communication(asynch)
                    .init(&group, &device())
                    .unwrap();
                let x = tensor(x_vals.clone(), [12, 2, D_IN], DType::F32).require_grad();
                let y = layer.forward(x.clone()).unwrap();
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
        dev.seed(1234);
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
}

fn int_linear(seed: u64) -> Linear {
    Linear {
        weight: Param::from_tensor(tensor(
            quarters(D_IN * D_OUT, seed),
            [D_IN, D_OUT],
            DType::F32,
        )),
        bias: Some(Param::from_tensor(tensor(
            quarters(D_OUT, seed + 1),
            [D_OUT],
            DType::F32,
        ))),
    }
}

/// Async (custom backward, overlapped) and sync (composed primitives) agree bitwise on
/// integer-valued data, for every mode and tp.
#[test]
fn async_and_sync_agree_bitwise_on_integer_data() {
    for tp in [1usize, 2, 3, 4] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            let out = run_local(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let mut results = Vec::new();
                for asynch in [true, false] {
                    let c = ColumnParallelLinear::from_full(
                        &int_linear(1),
                        &group,
                        &ColumnParallelLinearConfig::new(D_IN, D_OUT)
                            .with_mode(mode)
                            .with_async_communication(asynch),
                    )
                    .unwrap();
                    let rw = RowParallelLinear::from_full(
                        &int_linear(3),
                        &group,
                        &RowParallelLinearConfig::new(D_OUT, D_IN)
                            .with_mode(mode)
                            .with_async_communication(asynch),
                    )
                    .unwrap();
                    let x_full = tensor(quarters(12 * 2 * D_IN, 7), [12, 2, D_IN], DType::F32);
                    let x = if mode == TpMode::ReduceScatter {
                        chunk(x_full, n, 0, r)
                    } else {
                        x_full
                    }
                    .require_grad();
                    let y = rw.forward(c.forward(x.clone()).unwrap()).unwrap();
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
    let out = run_local(2, |group| {
        let layer = ColumnParallelLinear::from_full(
            &int_linear(1),
            &group,
            &ColumnParallelLinearConfig::new(D_IN, D_OUT),
        )
        .unwrap();
        // A [D_IN, 6] tensor transposed, and a sliced window.
        let base = tensor(quarters(D_IN * 6, 3), [D_IN, 6], DType::F32);
        let xt = base.clone().transpose();
        let contiguous_t = tensor(
            f64s(xt.clone()).iter().map(|v| *v as f32).collect(),
            [6, D_IN],
            DType::F32,
        );
        let wide = tensor(quarters(6 * 2 * D_IN, 4), [6, 2 * D_IN], DType::F32);
        let xs = wide.clone().slice([0..6, 3..3 + D_IN]);
        let contiguous_s = tensor(
            f64s(xs.clone()).iter().map(|v| *v as f32).collect(),
            [6, D_IN],
            DType::F32,
        );
        (
            f64s(layer.forward(xt).unwrap()) == f64s(layer.forward(contiguous_t).unwrap()),
            f64s(layer.forward(xs).unwrap()) == f64s(layer.forward(contiguous_s).unwrap()),
        )
    })
    .unwrap();
    assert!(out.iter().all(|&(a, b)| a && b), "{out:?}");
    // The RS-mode column layer on a transposed sequence shard.
    let out = run_local(2, |group| {
        let cfg = ColumnParallelLinearConfig::new(D_IN, D_OUT).with_mode(TpMode::ReduceScatter);
        let layer = ColumnParallelLinear::from_full(&int_linear(1), &group, &cfg).unwrap();
        let base = tensor(
            quarters(D_IN * 2 * 3, 8 + group.rank() as u64),
            [D_IN, 2, 3],
            DType::F32,
        );
        let x = base.clone().swap_dims(0, 2); // [3, 2, D_IN], strided
        let xc = tensor(
            f64s(x.clone()).iter().map(|v| *v as f32).collect(),
            [3, 2, D_IN],
            DType::F32,
        );
        f64s(layer.forward(x).unwrap()) == f64s(layer.forward(xc).unwrap())
    })
    .unwrap();
    assert!(out.iter().all(|&b| b));
}

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
            run_local(tp, move |group| {
                let (r, n) = (group.rank(), group.world_size());
                let opts = GradcheckOptions {
                    rtol: 1e-4,
                    atol: 1e-6,
                    ..Default::default()
                };
                let spec = LinearSpec {
                    schedule: OverlapSchedule::Split,
                    ..LinearSpec::new(mode)
                };
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
                        .with_mode(mode)
                        .init(&group, &dev)
                        .unwrap(),
                    fc2: RowParallelLinearConfig::new(h, d)
                        .with_mode(mode)
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
                    let y = model
                        .fc2
                        .forward(gelu(model.fc1.forward(x.clone()).unwrap()))
                        .unwrap();
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
        .with_mode(TpMode::ReduceScatter)
        .with_gather_output(true)
        .init(g, &dev);
    assert!(matches!(e, Err(TpError::Config(_))));
    // Errors at the call (tp = 1 group to build layers without peers, then checked shapes).
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let col = ColumnParallelLinearConfig::new(4, 6)
        .init(&solo, &dev)
        .unwrap();
    let e = col
        .forward(tensor(vec![0.0; 10], [2, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { got, .. } if got == &vec![2, 5]),
        "{e}"
    );
    let row = RowParallelLinear::from_full(
        &int_linear(1),
        g,
        &RowParallelLinearConfig::new(D_IN, D_OUT).with_mode(TpMode::ReduceScatter),
    )
    .unwrap();
    let e = row
        .forward(tensor(vec![0.0; 5 * 4], [5, 4], DType::F32))
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
        .forward(tensor(vec![0.0; 6 * 5], [6, 5], DType::F32))
        .unwrap_err();
    assert!(
        matches!(&e, TpError::Shape { expected, .. } if expected.contains('4')),
        "{e}"
    );
}
