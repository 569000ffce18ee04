//! Every dtype end to end: the parallel linears' dtype grid against Burn's `Linear` in the same
//! dtype, shards keeping their dtype, and the whole GPT and Llama in bf16 / f16 against f32.
//!
//! Tolerances (relative): bf16 1e-2 per value where one rounding separates the results (8 bits of
//! mantissa: 2^-8 = 3.9e-3 per rounding), f16 2e-3 (11 bits), f64 1e-12; through a whole model,
//! norms of differences (bf16 5e-2 of the gradient's norm, f16 1e-2).

use crate::common::chunk;
use crate::common::{assert_close, device, f64s, rel_norm, rng_lock, run_linked, tensor, uniform};
use crate::linear::{D_IN, D_OUT, f64_tensor, int_linear};
use crate::loss::ids;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::Linear;
use burn::tensor::{DType, FloatDType, Gradients, Int, Tensor};
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};
use burn_tp::local::run_local;
use burn_tp::precision::cast_params;

/// The gradient of every parameter of `module`, in its visiting order, with its dtype.
fn param_grads<M: Module>(module: &M, grads: &Gradients) -> Vec<(DType, Vec<f64>)> {
    struct Collect<'a>(&'a Gradients, Vec<(DType, Vec<f64>)>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = param
                .val()
                .grad(self.0)
                .expect("every parameter has a gradient");
            self.1.push((grad.dtype(), f64s(grad)));
        }
    }
    let mut collect = Collect(grads, Vec::new());
    module.visit(&mut collect);
    collect.1
}

/// Logits and mean loss of a model on a fixed batch (`[8, 2]` ids below 15).
type Run<M> = fn(&M, Tensor<2, Int>, Tensor<2, Int>) -> (Tensor<3>, Tensor<1>);

/// A model cast to bf16 / f16 (both modes, tp 1 and 2): logits, loss and every gradient stay in
/// that dtype, and agree with the f32 model (loss relative 2e-2 / 5e-3; gradients in norm
/// 5e-2 / 1e-2 of the f32 gradient's norm, parameter by parameter).
fn runs_in_half_precision_close_to_f32<M: Module + 'static>(
    build: fn(TpMode, &burn_tp::comm::ProcessGroup) -> M,
    run: Run<M>,
) {
    let _rng = rng_lock();
    for (dtype, loss_tol, grad_tol) in [(DType::BF16, 2e-2, 5e-2), (DType::F16, 5e-3, 1e-2)] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            for tp in [1usize, 2] {
                device().seed(11);
                let out = run_local(tp, move |g| {
                    let model = build(mode, &g);
                    let x: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 15).collect();
                    let y: Vec<i64> = (0..16).map(|i| (i * 5 + 1) % 15).collect();
                    let grads_of = |m: &M| {
                        let (logits, loss) = run(m, ids(x.clone(), [8, 2]), ids(y.clone(), [8, 2]));
                        let grads = loss.backward();
                        let mut per_param = Vec::new();
                        let mut dtypes = vec![logits.dtype(), loss.dtype()];
                        for (dtype, grad) in param_grads(m, &grads) {
                            dtypes.push(dtype);
                            per_param.push(grad);
                        }
                        (f64s(loss)[0], per_param, dtypes)
                    };
                    let (want_loss, want_grads, _) = grads_of(&model);
                    let half = cast_params(model, FloatDType::from(dtype));
                    let (loss, grads, dtypes) = grads_of(&half);
                    (want_loss, want_grads, loss, grads, dtypes)
                })
                .unwrap();
                for (r, (want_loss, want_grads, loss, grads, dtypes)) in out.into_iter().enumerate()
                {
                    let tag = format!("{dtype:?} {mode:?} tp {tp} rank {r}");
                    assert!(dtypes.iter().all(|&d| d == dtype), "{tag}: {dtypes:?}");
                    assert!(
                        (loss - want_loss).abs() <= loss_tol * want_loss,
                        "{tag}: loss {loss} vs f32 {want_loss}"
                    );
                    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
                        let err = rel_norm(g, w);
                        assert!(err <= grad_tol, "{tag}: parameter {i}: {err:.3e}");
                    }
                }
            }
        }
    }
}

#[test]
fn the_gpt_runs_in_bf16_and_f16_close_to_f32() {
    runs_in_half_precision_close_to_f32(
        |mode, g| {
            GptConfig::new(16, 8, 16, 4, 2)
                .with_settings(TpSettings::new().with_mode(mode))
                .init(g, &device())
                .unwrap()
        },
        |m: &burn_tp::gpt::Gpt, x, y| (m.forward(x.clone()), m.loss(x, y)),
    );
}

/// The Llama (GQA with 2 key / value heads, RoPE, RMSNorm, SwiGLU, a padded vocabulary of 15):
/// the rotary table stays f32 and the rotation comes back in the activations' dtype.
#[test]
fn the_llama_runs_in_bf16_and_f16_close_to_f32() {
    runs_in_half_precision_close_to_f32(
        |mode, g| {
            burn_tp::llama::LlamaConfig::new(15, 8, 16, 4, 2, 2, 16)
                .with_settings(TpSettings::new().with_mode(mode))
                .init(g, &device())
                .unwrap()
        },
        |m: &burn_tp::llama::Llama, x, y| (m.forward(x.clone()), m.loss(x, y)),
    );
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
