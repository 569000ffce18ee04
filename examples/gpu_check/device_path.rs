//! The NCCL device path on one GPU (check 1).

use super::layers::mlp_against_cpu;
use super::*;

/// An NCCL group of this process alone on GPU 0, posting its collectives even at world size 1
/// (the device path of `backend/cuda.rs`, not the shortcut). The store server is kept alive.
fn nccl_world_of_one() -> Result<(StoreServer, ProcessGroup), String> {
    let server = StoreServer::start("127.0.0.1:0", "").map_err(|e| e.to_string())?;
    let env = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        master: server.addr().to_string(),
        token: String::new(),
    };
    let store = StoreClient::connect(&env.master, 0, "", TIMEOUT).map_err(|e| e.to_string())?;
    let nccl = NcclGroup::new(&env, &store, TIMEOUT).map_err(|e| e.to_string())?;
    Ok((
        server,
        ProcessGroup::from_nccl(nccl.with_posts_at_world_one(true)),
    ))
}

/// The device path at world size 1: at one rank every collective's output is its input (or
/// the input's own sum / max), so a padded output buffer, a wrong dim permutation or a stream
/// race shows up as values that differ from the CPU's.
pub(super) fn device_path(f: &mut Figures) -> Result<(), String> {
    let (_server, group) = nccl_world_of_one()?;
    let dev = cuda();
    let cpu = Device::flex();
    let mut worst = Worst::default();
    for (dtype, dims) in [
        (FloatDType::F32, [3usize, 5, 96]),
        (FloatDType::BF16, [2usize, 3, 100]),
    ] {
        let n: usize = dims.iter().product();
        let v = values(n, 11);
        // Each input is a kernel's output (cubecl's own allocation, rows padded where it pads).
        let make = |d: &Device| {
            Tensor::<3>::from_data(TensorData::new(v.clone(), dims), d).cast(dtype) * 1.5 + 0.25
        };
        // The expected values: the input as the GPU reads it back (a collective of one rank
        // returns it unchanged, bit for bit), itself checked against the CPU.
        let want = host(make(&dev));
        let want_t = host(make(&dev).swap_dims(1, 2));
        let tag = format!("{dtype:?}").to_lowercase();
        let sane = rel_error(&want, &host(make(&cpu)));
        if !within(sane, 1e-2) {
            return Err(format!(
                "{tag}: the GPU's input is off the CPU's by {sane:e}"
            ));
        }
        let cases: Vec<(&str, burn_tp::Result<Tensor<3>>, &Vec<f32>)> = vec![
            (
                "all_gather_dim2",
                ops::all_gather(make(&dev), 2, &group),
                &want,
            ),
            (
                "all_gather_dim0",
                ops::all_gather(make(&dev), 0, &group),
                &want,
            ),
            (
                "reduce_scatter_dim1",
                ops::reduce_scatter(make(&dev), 1, &group),
                &want,
            ),
            (
                "all_reduce_sum",
                ops::all_reduce(make(&dev), ReduceOp::Sum, &group),
                &want,
            ),
            (
                "all_reduce_max",
                ops::all_reduce(make(&dev), ReduceOp::Max, &group),
                &want,
            ),
            (
                "reduce_from_tp_region",
                ops::reduce_from_tp_region(make(&dev), &group),
                &want,
            ),
            (
                "gather_from_tp_region_dim2",
                ops::gather_from_tp_region(make(&dev), 2, &group),
                &want,
            ),
            (
                "all_gather_transposed_view",
                ops::all_gather(make(&dev).swap_dims(1, 2), 1, &group),
                &want_t,
            ),
            (
                "all_gather_async_beside_a_matmul",
                ops::all_gather_async(make(&dev), 2, &group).and_then(|p| {
                    let m = make(&dev).swap_dims(1, 2);
                    let busy: f32 = make(&dev).matmul(m).sum().into_scalar();
                    let out = p.wait()?;
                    if busy.is_finite() {
                        Ok(out)
                    } else {
                        Ok(out * f32::NAN)
                    }
                }),
                &want,
            ),
            (
                // `NcclWork`'s Drop waits for NCCL before the buffers go back to the pool.
                "all_gather_after_a_dropped_one",
                ops::all_gather_async(make(&dev), 2, &group)
                    .map(drop)
                    .and_then(|()| ops::all_gather(make(&dev), 2, &group)),
                &want,
            ),
        ];
        for (name, got, want) in cases {
            let got = got.map_err(|e| format!("{tag} {name}: {e}"))?;
            let err = rel_error(&host(got), want);
            println!("  {tag} {name}: relative error {err:.2e}");
            worst.add(err);
            if !within(err, 0.0) {
                return Err(format!("{tag} {name}: relative error {err:e}, want exact"));
            }
        }
        // Backward through the device path: d/dx sum(all_gather(x) * w) = w (world size 1),
        // and reduce_scatter's backward (an all-gather) likewise.
        let w = Tensor::<3>::from_data(TensorData::new(values(n, 12), dims), &dev).cast(dtype);
        let want_w = host(w.clone());
        for (name, y) in [
            ("all_gather_backward", {
                let x = make(&dev).require_grad();
                (x.clone(), ops::all_gather(x, 2, &group))
            }),
            ("reduce_scatter_backward", {
                let x = make(&dev).require_grad();
                (x.clone(), ops::reduce_scatter(x, 1, &group))
            }),
        ] {
            let (x, y) = y;
            let y = y.map_err(|e| format!("{tag} {name}: {e}"))?;
            let grads = (y * w.clone()).sum().backward();
            let dx = x.grad(&grads).ok_or(format!("{tag} {name}: no gradient"))?;
            let err = rel_error(&host(dx), &want_w);
            println!("  {tag} {name}: relative error {err:.2e}");
            worst.add(err);
            if !within(err, 0.0) {
                return Err(format!("{tag} {name}: relative error {err:e}, want exact"));
            }
        }
    }
    f.num("device_path.collectives_worst_relative_error", worst.get());

    // The MLP at tp = 1 over the posting group: its all-gathers and reduce-scatters take the
    // device path. f32 with d = 96, h = 200 (rows cubecl pads), then bf16 with d = 100.
    for (dtype, d, h, tol) in [
        (FloatDType::F32, 96usize, 200usize, 1e-2),
        (FloatDType::BF16, 100, 200, 3e-2),
    ] {
        let tag = format!("{dtype:?}").to_lowercase();
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            let errs = mlp_against_cpu(&group, mode, dtype, (8, 4, d, h))?;
            for (what, err) in errs {
                expect_close(
                    f,
                    &format!("device_path.mlp.{tag}.{mode:?}.{what}"),
                    err,
                    tol,
                )?;
            }
        }
    }
    Ok(())
}
