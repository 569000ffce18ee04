//! The collectives' backward: adjoint identities, gradients against the unsharded ones,
//! finite differences, ties, and the backward on every rank.

use super::*;

/// The per-rank inner product sum_r <a_r, b_r>.
fn dot(a: &Tensor<3>, b: &Tensor<3>) -> f64 {
    f64s(a.clone())
        .iter()
        .zip(f64s(b.clone()))
        .map(|(x, y)| x * y)
        .sum()
}

/// For each op f with backward f^T (computed by autodiff of <f(x), y>):
/// sum over ranks <f(x), y> == sum over ranks <x, f^T(y)>, with replicated tensors counted once.
#[test]
fn adjoint_identities_hold_for_every_pair() {
    #[derive(Clone, Copy, Debug)]
    enum Op {
        AllGather(usize),
        ReduceScatter(usize),
        AllReduce,
        CopyTo,
        ReduceFrom,
        GatherFrom(usize),
        ScatterTo(usize),
    }
    for world in [1usize, 2, 3, 4] {
        for op in [
            Op::AllGather(0),
            Op::AllGather(2),
            Op::ReduceScatter(0),
            Op::ReduceScatter(2),
            Op::AllReduce,
            Op::CopyTo,
            Op::ReduceFrom,
            Op::GatherFrom(2),
            Op::ScatterTo(0),
        ] {
            let sums = run_local(world, move |g| {
                let r = g.rank();
                let n = g.world_size();
                // Inputs: replicated ones (same seed on every rank) where the op's domain is replicated.
                let replicated_in = matches!(op, Op::CopyTo | Op::ScatterTo(_));
                let replicated_out = matches!(op, Op::ReduceFrom | Op::GatherFrom(_));
                let in_shape = match op {
                    Op::ReduceScatter(d) | Op::ScatterTo(d) => {
                        let mut s = SHAPE;
                        s[d] *= n;
                        s
                    }
                    _ => SHAPE,
                };
                let x_seed = if replicated_in { 100 } else { 100 + r as u64 };
                let x = tensor(
                    uniform(in_shape.iter().product(), x_seed),
                    in_shape,
                    DType::F32,
                )
                .require_grad();
                let y_fwd = match op {
                    Op::AllGather(d) => all_gather(x.clone(), d, &g).unwrap(),
                    Op::ReduceScatter(d) => reduce_scatter(x.clone(), d, &g).unwrap(),
                    Op::AllReduce => all_reduce(x.clone(), ReduceOp::Sum, &g).unwrap(),
                    Op::CopyTo => copy_to_tp_region(x.clone(), &g),
                    Op::ReduceFrom => reduce_from_tp_region(x.clone(), &g).unwrap(),
                    Op::GatherFrom(d) => gather_from_tp_region(x.clone(), d, &g).unwrap(),
                    Op::ScatterTo(d) => scatter_to_tp_region(x.clone(), d, &g).unwrap(),
                };
                let out_shape = y_fwd.dims();
                let y_seed = if replicated_out { 200 } else { 200 + r as u64 };
                let y = tensor(
                    uniform(out_shape.iter().product(), y_seed),
                    out_shape,
                    DType::F32,
                );
                let grads = (y_fwd.clone() * y.clone()).sum().backward();
                let xt = x.grad(&grads).expect("x has a gradient");
                let lhs = dot(&y_fwd.detach(), &y);
                let rhs = dot(&x.detach(), &xt);
                // Replicated sides count once: only rank 0 reports them.
                let lhs = if replicated_out && r != 0 { 0.0 } else { lhs };
                let rhs = if replicated_in && r != 0 { 0.0 } else { rhs };
                (lhs, rhs)
            })
            .unwrap();
            let lhs: f64 = sums.iter().map(|s| s.0).sum();
            let rhs: f64 = sums.iter().map(|s| s.1).sum();
            assert!(
                (lhs - rhs).abs() <= 1e-4 * (1.0 + lhs.abs()),
                "{op:?} world {world}: {lhs} vs {rhs}"
            );
        }
    }
}

/// Sequence-parallel column -> row block built by hand from the primitives; gradients equal the
/// unsharded computation's.
#[test]
fn gradients_of_a_sharded_computation_equal_the_unsharded_ones() {
    let (s, h, f) = (4usize, 3usize, 8usize);
    for world in [1usize, 2, 4] {
        let x_full = uniform(s * h, 1);
        let w_full = uniform(h * f, 2);
        let v_full = uniform(f * h, 3);
        let gw_full = uniform(s * h, 4);
        // Unsharded reference: loss = sum((X W V) * G).
        let x = tensor(x_full.clone(), [s, h], DType::F32).require_grad();
        let w = tensor(w_full.clone(), [h, f], DType::F32).require_grad();
        let v = tensor(v_full.clone(), [f, h], DType::F32).require_grad();
        let g_t = tensor(gw_full.clone(), [s, h], DType::F32);
        let grads = (x.clone().matmul(w.clone()).matmul(v.clone()) * g_t)
            .sum()
            .backward();
        let dx = f64s(x.grad(&grads).unwrap());
        let dw = x_full.len();
        let _ = dw;
        let dw = w.grad(&grads).unwrap();
        let dv = v.grad(&grads).unwrap();
        let ranks = run_local(world, move |g| {
            let (r, n) = (g.rank(), g.world_size());
            let full = |v: &Vec<f32>, shape: [usize; 2]| tensor(v.clone(), shape, DType::F32);
            let x_r = full(&x_full, [s, h]).chunk(n, 0)[r]
                .clone()
                .detach()
                .require_grad();
            let w_r = full(&w_full, [h, f]).chunk(n, 1)[r]
                .clone()
                .detach()
                .require_grad();
            let v_r = full(&v_full, [f, h]).chunk(n, 0)[r]
                .clone()
                .detach()
                .require_grad();
            let g_r = full(&gw_full, [s, h]).chunk(n, 0)[r].clone();
            let z = all_gather(x_r.clone(), 0, &g).unwrap();
            let out = reduce_scatter(z.matmul(w_r.clone()).matmul(v_r.clone()), 0, &g).unwrap();
            let grads = (out * g_r).sum().backward();
            (
                f64s(x_r.grad(&grads).unwrap()),
                f64s(w_r.grad(&grads).unwrap()),
                f64s(v_r.grad(&grads).unwrap()),
            )
        })
        .unwrap();
        let dx_parts: Vec<f64> = ranks.iter().flat_map(|r| r.0.clone()).collect();
        assert_close(&dx_parts, &dx, 1e-5, &format!("dX world {world}"));
        for (r, (_, dw_r, dv_r)) in ranks.iter().enumerate() {
            assert_close(
                dw_r,
                &f64s(dw.clone().chunk(world, 1)[r].clone()),
                1e-5,
                "dW",
            );
            assert_close(
                dv_r,
                &f64s(dv.clone().chunk(world, 0)[r].clone()),
                1e-5,
                "dV",
            );
        }
    }
}

#[test]
fn gradcheck_passes_on_every_primitive() {
    for world in [1usize, 2] {
        run_local(world, |g| {
            let r = g.rank() as u64;
            let x = || tensor(uniform(2 * 2 * 2, 10 + r), [2, 2, 2], DType::F64);
            let xrep = || tensor(uniform(2 * 2 * 2, 10), [2, 2, 2], DType::F64);
            let w = tensor(uniform(2 * 2 * 2 * 2, 20 + r), [2, 2, 4], DType::F64);
            let opts = GradcheckOptions::default();
            // Nonlinear losses so the check sees more than a linear map.
            let sq = |t: Tensor<3>| (t.clone() * t).sum();
            gradcheck(&g, &[x()], LossKind::Sharded, opts, |xs| {
                sq(all_gather(xs[0].clone(), 0, &g).unwrap() * 1.5)
            })
            .unwrap();
            gradcheck(&g, &[x()], LossKind::Sharded, opts, |xs| {
                sq(all_gather(xs[0].clone(), 2, &g).unwrap())
            })
            .unwrap();
            gradcheck(
                &g,
                std::slice::from_ref(&w),
                LossKind::Sharded,
                opts,
                |xs| sq(reduce_scatter(xs[0].clone(), 2, &g).unwrap()),
            )
            .unwrap();
            gradcheck(&g, &[x()], LossKind::Sharded, opts, |xs| {
                sq(all_reduce(xs[0].clone(), ReduceOp::Sum, &g).unwrap())
            })
            .unwrap();
            gradcheck(&g, &[x()], LossKind::Replicated, opts, |xs| {
                sq(reduce_from_tp_region(xs[0].clone(), &g).unwrap())
            })
            .unwrap();
            // The all-to-all with uneven counts (rank 1 sends rank 0 a row, rank 0 sends rank
            // 1 none): its adjoint is the reverse exchange.
            let n = g.world_size();
            let send = |s: usize| {
                if n == 1 {
                    vec![2]
                } else {
                    [vec![2, 0], vec![1, 1]][s].clone()
                }
            };
            let sends: Vec<Vec<usize>> = (0..n).map(send).collect();
            let recv: Vec<usize> = (0..n).map(|p| sends[p][g.rank()]).collect();
            gradcheck(&g, &[x()], LossKind::Sharded, opts, |xs| {
                let y = all_to_all(xs[0].clone(), &sends[g.rank()], &recv, &g).unwrap();
                sq(y) + (xs[0].clone() * 0.5).sum()
            })
            .unwrap();
            let rep = GradcheckOptions {
                replicated_inputs: true,
                ..opts
            };
            gradcheck(&g, &[xrep()], LossKind::Replicated, rep, |xs| {
                // copy_to: replicated in, rank-specific compute, replicated out.
                let y = copy_to_tp_region(xs[0].clone(), &g) * (r as f64 + 1.0);
                sq(reduce_from_tp_region(y, &g).unwrap())
            })
            .unwrap();
            gradcheck(&g, &[x()], LossKind::Replicated, opts, |xs| {
                sq(gather_from_tp_region(xs[0].clone(), 1, &g).unwrap())
            })
            .unwrap();
        })
        .unwrap();
    }
}

/// Max / min all-reduce backward: the gradient of each element goes to one rank, the lowest of
/// those whose input equals the result (as a single max gives it to one element).
#[test]
fn max_and_min_backward_give_ties_to_the_lowest_rank() {
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let out = run_local(3, move |g| {
            let dev = crate::common::device();
            // Element 0: all three tie. Element 1: ranks 1 and 2 tie. Element 2: rank 2 alone.
            let v = match (g.rank(), op) {
                (0, ReduceOp::Max) => [5.0f32, 1.0, 0.0],
                (1, ReduceOp::Max) => [5.0, 7.0, 0.0],
                (_, ReduceOp::Max) => [5.0, 7.0, 9.0],
                (0, _) => [5.0, 9.0, 9.0],
                (1, _) => [5.0, 1.0, 9.0],
                (_, _) => [5.0, 1.0, 0.0],
            };
            let x = Tensor::<1>::from_floats(v, &dev).require_grad();
            let y = all_reduce(x.clone(), op, &g).unwrap();
            // Each rank's loss weighs the elements differently; the upstream gradients sum.
            let w = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &dev) * (g.rank() as f32 + 1.0);
            let grads = (y * w).sum().backward();
            f64s(x.grad(&grads).unwrap())
        })
        .unwrap();
        // Sum of the upstream gradients over 3 ranks: [1, 2, 3] * (1 + 2 + 3).
        let total = [6.0, 12.0, 18.0];
        assert_eq!(out[0], vec![total[0], 0.0, 0.0], "{op:?}");
        assert_eq!(out[1], vec![0.0, total[1], 0.0], "{op:?}");
        assert_eq!(out[2], vec![0.0, 0.0, total[2]], "{op:?}");
    }
}

/// Every rank posts the same collectives in the backward whatever its own requires-grad state.
/// Rank 0's input requires grad; on rank 1 nothing on the op's input side does (its loss is
/// tracked only through a weight applied after the op). Rank 1 still runs each adjoint, so rank 0
/// gets its full gradient instead of waiting for rank 1's part until the timeout.
#[test]
fn adjoints_run_on_every_rank_whatever_its_requires_grad() {
    #[derive(Clone, Copy, Debug)]
    enum Op {
        AllGather,
        ReduceScatter,
        AllReduce,
        CopyTo,
        ScatterTo,
    }
    const N: usize = 2;
    let ops = [
        Op::AllGather,
        Op::ReduceScatter,
        Op::AllReduce,
        Op::CopyTo,
        Op::ScatterTo,
    ];
    for op in ops {
        let in_shape = match op {
            Op::ReduceScatter | Op::ScatterTo => [SHAPE[0] * N, SHAPE[1], SHAPE[2]],
            _ => SHAPE,
        };
        let out_shape = match op {
            Op::AllGather => [SHAPE[0] * N, SHAPE[1], SHAPE[2]],
            _ => SHAPE,
        };
        let numel = |s: [usize; 3]| s.iter().product::<usize>();
        let w = move |r: usize| {
            tensor(
                uniform(numel(out_shape), 300 + r as u64),
                out_shape,
                DType::F32,
            )
        };
        let out = run_local(N, move |g| {
            g.set_timeout(Duration::from_secs(5));
            let r = g.rank();
            let x = tensor(uniform(numel(in_shape), 7), in_shape, DType::F32);
            let x = if r == 0 { x.require_grad() } else { x };
            let y = match op {
                Op::AllGather => all_gather(x.clone(), 0, &g).unwrap(),
                Op::ReduceScatter => reduce_scatter(x.clone(), 0, &g).unwrap(),
                Op::AllReduce => all_reduce(x.clone(), ReduceOp::Sum, &g).unwrap(),
                Op::CopyTo => copy_to_tp_region(x.clone(), &g),
                Op::ScatterTo => scatter_to_tp_region(x.clone(), 0, &g).unwrap(),
            };
            let weight = w(r).require_grad();
            let grads = (y * weight).sum().backward();
            x.grad(&grads).map(f64s)
        })
        .unwrap();
        assert!(out[1].is_none(), "{op:?}: rank 1's input has no gradient");
        let got = out[0].clone().expect("rank 0's input has a gradient");
        // d(sum_r <y_r, w_r>) / d x_0, from the op's definition.
        let expected = match op {
            Op::AllGather => (w(0) + w(1)).slice(0..SHAPE[0]),
            Op::ReduceScatter | Op::ScatterTo => Tensor::cat(vec![w(0), w(1)], 0),
            Op::AllReduce | Op::CopyTo => w(0) + w(1),
        };
        assert_close(&got, &f64s(expected), 1e-6, &format!("{op:?}"));
    }
}

/// The same for the parallel linears (functional form, both modes, async and sync): rank 1's
/// input and weight require no grad, so nothing on rank 1 is tracked before the layer; rank 0's
/// input gradient still sums both ranks' contributions, `sum_r v_r W_r^T`.
#[test]
fn linear_backward_runs_on_every_rank_whatever_its_requires_grad() {
    use burn_tp::linear::{
        LinearSpec, TpMode, TpSettings, column_parallel_linear, row_parallel_linear,
    };
    const N: usize = 2;
    let (s, d_in, d_out) = (4usize, 4usize, 6usize);
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for asynch in [true, false] {
            for column in [true, false] {
                // Column: W_r [d_in, d_out / N]; row: W_r [d_in / N, d_out].
                let w_shape = if column {
                    [d_in, d_out / N]
                } else {
                    [d_in / N, d_out]
                };
                let w = move |r: usize| {
                    tensor(
                        uniform(w_shape[0] * w_shape[1], 40 + r as u64),
                        w_shape,
                        DType::F32,
                    )
                };
                let rs = mode == TpMode::ReduceScatter;
                let x_rows = if column && rs { s / N } else { s };
                let y_rows = if !column && rs { s / N } else { s };
                let y_cols = w_shape[1];
                let v = move |r: usize| {
                    tensor(
                        uniform(y_rows * y_cols, 60 + r as u64),
                        [y_rows, y_cols],
                        DType::F32,
                    )
                };
                let out = run_local(N, move |g| {
                    g.set_timeout(Duration::from_secs(5));
                    let r = g.rank();
                    let x = tensor(
                        uniform(x_rows * w_shape[0], 80 + r as u64),
                        [x_rows, w_shape[0]],
                        DType::F32,
                    );
                    let x = if r == 0 { x.require_grad() } else { x };
                    let spec = LinearSpec::new(
                        TpSettings::new()
                            .with_mode(mode)
                            .with_async_communication(asynch),
                    );
                    let y = if column {
                        column_parallel_linear(x.clone(), w(r), None, spec, &g)
                    } else {
                        row_parallel_linear(x.clone(), w(r), None, spec, &g)
                    }
                    .unwrap();
                    // Rank 1's loss is tracked only through `k`, after the layer.
                    let k = Tensor::<2>::ones(y.dims(), &crate::common::device()).require_grad();
                    let grads = (y * k * v(r)).sum().backward();
                    x.grad(&grads).map(f64s)
                })
                .unwrap();
                let tag = format!("{mode:?} async {asynch} column {column}");
                assert!(out[1].is_none(), "{tag}");
                let got = out[0]
                    .clone()
                    .unwrap_or_else(|| panic!("{tag}: no gradient"));
                let expected = if column {
                    // dX = sum_r v_r W_r^T over the full sequence; rank 0 holds rows 0..s/N in RS.
                    let dx = v(0).matmul(w(0).transpose()) + v(1).matmul(w(1).transpose());
                    dx.slice(0..x_rows)
                } else {
                    // Rank 0's own input: its gradient is v (all of it: gathered in RS) times W_0^T.
                    let v_full = if rs {
                        Tensor::cat(vec![v(0), v(1)], 0)
                    } else {
                        v(0)
                    };
                    v_full.matmul(w(0).transpose())
                };
                assert_close(&got, &f64s(expected), 1e-5, &tag);
            }
        }
    }
}
