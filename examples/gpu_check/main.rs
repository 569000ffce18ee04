//! Over 600 lines on purpose, for now: it builds only with `cuda` and runs only on a lent GPU,
//! and no GPU was lent to the session that split the rest of the code, so a split of it would
//! have shipped unrun; each check is a function of its own, in the order the script runs them.
//!
//! The GPU checks of `.ci/gpu-check run`, in one binary so the bundle stays small (it carries
//! `train_gpt` as a library call). Needs the `cuda` feature and a GPU:
//!
//! 1. `device_path`: the NCCL device path of `backend/cuda.rs` on one GPU (an NCCL group of one
//!    rank that posts anyway, `NcclGroup::with_posts_at_world_one`): every collective on shapes
//!    whose rows cubecl pads (last dim 96 in f32, 100 in bf16), from kernel outputs and from a
//!    transposed view, sync and async with a matmul in flight, and their autodiff backward; then
//!    the column -> GELU -> row MLP at tp = 1 over that group in both modes. Against the CPU.
//! 2. `layers_tp2`: the MLP on burn's CUDA backend at tp = 2, ranks as threads sharing the GPU
//!    over the host transport, both modes: outputs and gradients against the CPU at tp = 1.
//! 3. `linear_8192`: tp = 1 `ColumnParallelLinear` / `RowParallelLinear` forward + backward
//!    against burn's CUDA `Linear` at 8192 x 8192 (x `[8192, 8192]`), f32 and bf16: median times,
//!    their ratios, and the bf16 outputs and gradients against f32's.
//! 4. `attention`: the fused attention (`backend/flash.rs` on cubecl's ops) against the
//!    materialized path on the GPU and against the CPU, `[2, 8, 1024, 64]` causal with 2 key /
//!    value heads, f32 and bf16: outputs and dq / dk / dv; forward + backward times of both.
//! 5. `train_gpt`: `train_gpt --device cuda --tp 1` for 30 steps, 60 s group timeout: the loss
//!    falls; tokens/s.
//! 6. `llama_step`: the Llama (d 2048, 8 blocks, seq 2048, bf16) trained at tp 1 by
//!    `train_gpt`: tokens/s, model TFLOP/s. `llama_step_tp2`: the same model at tp 1 and at
//!    tp 2 with ranks as threads sharing the GPU (`checks::llama_steps_on_threads`).
//!
//! Usage: `gpu_check OUT_DIR [SCRATCH_DIR]`. Prints a log; `OUT_DIR/figures.json` is rewritten
//! after every figure (a run killed by its bound still reports what it did); everything else
//! (train_gpt's files) goes under SCRATCH_DIR (default: the system's temporary folder). Exits 1
//! if a check failed (the others still run).
//!
//! Longer than 600 lines on purpose: it is the one prepared script a lent GPU runs once, its four
//! checks share its helpers and read top to bottom in the order they run, and it is
//! compiled only with the `cuda` feature (a split would be checked by CI's link build alone).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use burn_tp::comm::LocalGroup;
use burn_tp::comm::nccl::{NcclGroup, probe};
use burn_tp::comm::store::{LaunchEnv, StoreClient, StoreServer};
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};
use burn_tp::local::run_local;
use burn_tp::ops;
use burn_tp::precision::cast_params;
use burn_tp_examples::checks::{Figures, Worst, rel_error, within};

/// The group timeout of every check: a hang is an error well inside the script's bound.
const TIMEOUT: Duration = Duration::from_secs(60);

/// One check: it records its figures, and says why it failed.
type Check = fn(&mut Figures) -> Result<(), String>;

fn main() {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().unwrap_or_else(|| "gpu-check-out".into()));
    let scratch = args
        .next()
        .map_or_else(|| std::env::temp_dir().join("gpu-check"), PathBuf::from);
    std::fs::create_dir_all(&out).expect("creating the output folder");
    std::fs::create_dir_all(&scratch).expect("creating the scratch folder");
    let mut figures = Figures::new(out.join("figures.json"));
    // Without a driver, NCCL or NVRTC every check would fail deep inside cubecl: say why, once.
    let problem = match probe() {
        Err(e) => Some(format!("no GPU: {e}")),
        Ok(p) => {
            println!("probe: {p:?}");
            let v = |v: Option<(i32, i32)>| v.map_or("?".into(), |(a, b)| format!("{a}.{b}"));
            figures.text("probe.driver_cuda", &v(p.driver));
            figures.text("probe.nvrtc", &v(p.nvrtc));
            p.kernel_problem()
        }
    };
    if let Some(problem) = problem {
        println!("gpu_check cannot run: {problem}");
        figures.text("gpu_check.status", &format!("did not run: {problem}"));
        std::process::exit(1);
    }
    // SAFETY: set before any thread of this program starts.
    unsafe { std::env::set_var("GPU_CHECK_SCRATCH", &scratch) };
    let mut failed = false;
    let checks: [(&str, Check); 8] = [
        ("device_path", device_path),
        ("gemm_hook", gemm_hook),
        ("layers_tp2", layers_tp2),
        ("linear_8192", linear_8192),
        ("attention", attention_check),
        ("train_gpt", train_gpt),
        ("llama_step", llama_step),
        ("llama_step_tp2", llama_step_tp2),
    ];
    for (name, check) in checks {
        println!("== {name}");
        figures.text(format!("{name}.status"), "running");
        let start = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&mut figures)))
            .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&p))));
        let secs = start.elapsed().as_secs_f64();
        let status = match result {
            Ok(()) => "ok".to_string(),
            Err(e) => {
                failed = true;
                format!("FAILED: {e}")
            }
        };
        println!("{name}: {status} ({secs:.1} s)");
        figures.num(format!("{name}.seconds"), (secs * 10.0).round() / 10.0);
        figures.text(format!("{name}.status"), &status);
    }
    println!("{}", figures.to_json());
    std::process::exit(i32::from(failed));
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

fn cuda() -> Device {
    Device::cuda(0).autodiff()
}

/// Seeded values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut z = seed;
    (0..n)
        .map(|_| {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((x ^ (x >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32")
}

fn linear(w: Vec<f32>, b: Vec<f32>, d_in: usize, d_out: usize, device: &Device) -> Linear {
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [d_in, d_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(b, [d_out]),
            device,
        ))),
    }
}

/// The materialized attention (the path before the fused kernel): keys and values repeated per
/// group, the `[s, s]` scores, the causal mask, softmax, `@ v`.
fn materialized_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [b, hq, s, hd] = q.dims();
    let hkv = k.dims()[1];
    let expand = |x: Tensor<4>| {
        x.unsqueeze_dim::<5>(2)
            .expand([b, hkv, hq / hkv, s, hd])
            .reshape([b, hq, s, hd])
    };
    let scores = q.matmul(expand(k).swap_dims(2, 3)) / (hd as f64).sqrt();
    let future =
        burn::tensor::Tensor::<2, burn::tensor::Bool>::tril_mask([s, s], 0, &scores.device())
            .unsqueeze::<4>();
    burn::tensor::activation::softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3)
        .matmul(expand(v))
}

/// Output and dq, dk, dv (of `sum(out * w)`) of attention `f` on `device` in `dtype`, and the
/// median seconds of its forward + backward.
#[allow(clippy::type_complexity)]
fn attention_run(device: &Device, dtype: burn::tensor::DType, fused: bool) -> ([Vec<f32>; 4], f64) {
    let (b, hq, hkv, s, hd) = (2, 8, 2, 1024, 64);
    let t = |n: usize, shape: [usize; 4], seed: u64| {
        Tensor::<4>::from_data(TensorData::new(values(n, seed), shape), device)
            .cast(dtype)
            .require_grad()
    };
    let run = || {
        let q = t(b * hq * s * hd, [b, hq, s, hd], 1);
        let k = t(b * hkv * s * hd, [b, hkv, s, hd], 2);
        let v = t(b * hkv * s * hd, [b, hkv, s, hd], 3);
        let w = t(b * hq * s * hd, [b, hq, s, hd], 4).detach();
        let out = if fused {
            burn_tp::attention::fused_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                burn_tp::backend::AttentionSpec::causal(0),
            )
            .expect("shapes fit")
        } else {
            materialized_attention(q.clone(), k.clone(), v.clone())
        };
        let grads = (out.clone() * w).sum().backward();
        [
            host(out),
            host(q.grad(&grads).expect("q")),
            host(k.grad(&grads).expect("k")),
            host(v.grad(&grads).expect("v")),
        ]
    };
    let first = run();
    let mut times = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let _ = run(); // reading the values back syncs the device
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    (first, times[1])
}

fn attention_check(f: &mut Figures) -> Result<(), String> {
    use burn::tensor::DType;
    let (cpu, _) = attention_run(&Device::flex().autodiff(), DType::F32, false);
    for (dtype, tol) in [(DType::F32, 1e-3), (DType::BF16, 3e-2)] {
        let name = format!("{dtype:?}").to_lowercase();
        let (fused, t_fused) = attention_run(&cuda(), dtype, true);
        let (mat, t_mat) = attention_run(&cuda(), dtype, false);
        for (i, what) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let err = rel_error(&fused[i], &mat[i]);
            expect_close(
                f,
                &format!("attention.{name}.{what}_vs_materialized"),
                err,
                tol,
            )?;
            let err = rel_error(&fused[i], &cpu[i]);
            expect_close(f, &format!("attention.{name}.{what}_vs_cpu_f32"), err, tol)?;
        }
        println!(
            "  {name}: fused fwd+bwd {:.1} ms, materialized {:.1} ms",
            t_fused * 1e3,
            t_mat * 1e3
        );
        f.num(format!("attention.{name}.fused_ms"), t_fused * 1e3);
        f.num(format!("attention.{name}.materialized_ms"), t_mat * 1e3);
    }
    Ok(())
}

/// Records `err` under `key`, prints it, and fails if it is not within `tol` (NaN included).
fn expect_close(f: &mut Figures, key: &str, err: f64, tol: f64) -> Result<(), String> {
    println!("  {key}: relative error {err:.2e} (tolerance {tol:.0e})");
    f.num(key, err);
    if within(err, tol) {
        Ok(())
    } else {
        Err(format!("{key}: relative error {err:e} > {tol:e}"))
    }
}

/// The GEMM hook (cuBLAS on CUDA, `backend/cublas.rs`) against burn's matmul on the same
/// tensors, every layout the layers use and the odd ones (f32 under each one's TF32 policy, and
/// bf16): dense, odd sizes, a transposed view, a slice, a batch with a broadcast operand; then
/// which of the two rounds f32 to TF32 (a probe: (1 + 2^-15) x 1 keeps its 2^-15 in f32 only);
/// then 1,000 rounds of a kernel writing an operand, the hook, a kernel reading its output, the
/// buffers dropped between (the ordering with cubecl's stream and pool), against burn's matmul.
fn gemm_hook(f: &mut Figures) -> Result<(), String> {
    let dev = cuda();
    let t = |rows: usize, cols: usize, seed: u64| {
        Tensor::<2>::from_data(
            TensorData::new(values(rows * cols, seed), [rows, cols]),
            &dev,
        )
    };
    let cases: Vec<(&str, Tensor<3>, Tensor<3>)> = vec![
        (
            "dense 512x768x1024",
            t(512, 768, 1).unsqueeze(),
            t(768, 1024, 2).unsqueeze(),
        ),
        (
            "odd 8191x100x1",
            t(8191, 100, 3).unsqueeze(),
            t(100, 1, 4).unsqueeze(),
        ),
        (
            "odd 77x33x65",
            t(77, 33, 5).unsqueeze(),
            t(33, 65, 6).unsqueeze(),
        ),
        (
            "transposed b",
            t(256, 384, 7).unsqueeze(),
            t(512, 384, 8).transpose().unsqueeze(),
        ),
        (
            "transposed a",
            t(384, 256, 9).transpose().unsqueeze(),
            t(384, 512, 10).unsqueeze(),
        ),
        (
            "sliced a",
            t(300, 260, 11).narrow(1, 3, 200).unsqueeze(),
            t(200, 128, 12).unsqueeze(),
        ),
        (
            "batch, b broadcast",
            Tensor::<3>::from_data(TensorData::new(values(4 * 64 * 96, 13), [4, 64, 96]), &dev),
            t(96, 80, 14).unsqueeze(),
        ),
        (
            "batch of both",
            Tensor::<3>::from_data(TensorData::new(values(3 * 50 * 70, 15), [3, 50, 70]), &dev),
            Tensor::<3>::from_data(TensorData::new(values(3 * 70 * 40, 16), [3, 70, 40]), &dev),
        ),
    ];
    let mut failed = Vec::new();
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        // TF32 (10-bit mantissa) and bf16 (8) round each product; the sums of K of them differ
        // by about K^0.5 roundings between two orders.
        let tol = match dtype {
            FloatDType::F32 => 4e-3,
            _ => 3e-2,
        };
        for (name, a, b) in &cases {
            let (a, b) = (a.clone().cast(dtype), b.clone().cast(dtype));
            let [_, _, n] = b.dims();
            let b = if a.dims()[0] > 1 && b.dims()[0] == 1 {
                b.expand([a.dims()[0] as i64, -1, n as i64])
            } else {
                b
            };
            let want = host(a.clone().matmul(b.clone()));
            let got = host(ops::matmul(a, b));
            let key = format!("gemm_hook.{}.{}", dtype_tag(dtype), name.replace(' ', "_"));
            if let Err(e) = expect_close(f, &key, rel_error(&got, &want), tol) {
                failed.push(e);
            }
        }
    }
    // The TF32 probe: a row of (1 + 2^-15, 0, ...) times a column of ones.
    let probe = |hook: bool| {
        let mut a = vec![0.0f32; 32];
        a[0] = 1.0 + 2f32.powi(-15);
        let a = Tensor::<2>::from_data(TensorData::new(a, [1, 32]), &dev);
        let b = Tensor::<2>::ones([32, 1], &dev);
        let y = if hook { ops::matmul(a, b) } else { a.matmul(b) };
        host(y)[0]
    };
    for (who, hook) in [("hook", true), ("burn", false)] {
        let y = probe(hook);
        let tf32 = y == 1.0;
        println!(
            "  TF32 probe, {who}: {y:.9} ({})",
            if tf32 { "TF32" } else { "f32" }
        );
        f.text(
            format!("gemm_hook.tf32.{who}"),
            if tf32 { "tf32" } else { "f32" },
        );
    }
    // The race stress: every round's buffers are fresh from cubecl's pool, written by a kernel
    // right before the hook reads them, read by a kernel right after it writes.
    let (w, x0) = (t(256, 256, 17), t(64, 256, 18));
    let mut worst = 0f64;
    for round in 0..1000 {
        let x = x0.clone() * (1.0 + round as f64 * 1e-3) + 0.5;
        let y = ops::matmul(x.clone(), w.clone()).tanh().sum_dim(1);
        let want = x.matmul(w.clone()).tanh().sum_dim(1);
        if round % 100 == 99 || round < 3 {
            worst = worst.max(rel_error(&host(y), &host(want)));
        } else {
            drop((y, want));
        }
    }
    if let Err(e) = expect_close(f, "gemm_hook.race_stress", worst, 4e-3) {
        failed.push(e);
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

fn dtype_tag(dtype: FloatDType) -> String {
    format!("{dtype:?}").to_lowercase()
}

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
fn device_path(f: &mut Figures) -> Result<(), String> {
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

/// `(what, relative error)` of y, dx and dW1 of `fc2(gelu(fc1(x)))` with the loss
/// `sum(y * g)`, the layers on the GPU over `group` at tp = world size, against burn-nn on the
/// CPU in f32. Shapes `(s, b, d, h)`; ranks as threads when `group` is a local group.
fn mlp_on_group(
    group: &ProcessGroup,
    mode: TpMode,
    dtype: FloatDType,
    (s, b, d, h): (usize, usize, usize, usize),
    weights: &Weights,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (r, n) = (group.rank(), group.world_size());
    let dev = cuda();
    let col = ColumnParallelLinear::from_full(
        &cast_params(
            linear(weights.w1.clone(), weights.b1.clone(), d, h, &dev),
            dtype,
        ),
        group,
        &ColumnParallelLinearConfig::new(d, h).with_settings(TpSettings::new().with_mode(mode)),
    )
    .expect("column layer");
    let row = RowParallelLinear::from_full(
        &cast_params(
            linear(weights.w2.clone(), weights.b2.clone(), h, d, &dev),
            dtype,
        ),
        group,
        &RowParallelLinearConfig::new(h, d).with_settings(TpSettings::new().with_mode(mode)),
    )
    .expect("row layer");
    let full =
        |v: Vec<f32>| Tensor::<3>::from_data(TensorData::new(v, [s, b, d]), &dev).cast(dtype);
    let shard = |t: Tensor<3>| match mode {
        TpMode::AllReduce => t,
        TpMode::ReduceScatter => t.chunk(n, 0).swap_remove(r),
    };
    let x = shard(full(weights.x.clone())).require_grad();
    let y = row.forward(gelu(col.forward(x.clone())));
    let grads = (y.clone() * shard(full(weights.g.clone())))
        .sum()
        .backward();
    let dw1 = col.weight.val().grad(&grads).expect("a dW1");
    (
        host(y.detach()),
        host(x.grad(&grads).expect("a dx")),
        host(dw1),
    )
}

/// The MLP's weights and data, shared by every rank and the reference.
#[derive(Clone)]
struct Weights {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
    x: Vec<f32>,
    g: Vec<f32>,
}

impl Weights {
    fn new((s, b, d, h): (usize, usize, usize, usize)) -> Self {
        Self {
            w1: values(d * h, 1),
            b1: values(h, 2),
            w2: values(h * d, 3),
            b2: values(d, 4),
            x: values(s * b * d, 5),
            g: values(s * b * d, 6),
        }
    }

    /// y, dx and dW1 on the CPU (burn-nn, f32, tp = 1).
    fn reference(&self, (s, b, d, h): (usize, usize, usize, usize)) -> [Vec<f32>; 3] {
        let cpu = Device::flex().autodiff();
        let fc1 = linear(self.w1.clone(), self.b1.clone(), d, h, &cpu);
        let fc2 = linear(self.w2.clone(), self.b2.clone(), h, d, &cpu);
        let x =
            Tensor::<3>::from_data(TensorData::new(self.x.clone(), [s, b, d]), &cpu).require_grad();
        let g = Tensor::<3>::from_data(TensorData::new(self.g.clone(), [s, b, d]), &cpu);
        let y = fc2.forward(gelu(fc1.forward(x.clone())));
        let grads = (y.clone() * g).sum().backward();
        [
            host(y.detach()),
            host(x.grad(&grads).expect("dx")),
            host(fc1.weight.val().grad(&grads).expect("dW1")),
        ]
    }
}

/// Rank `r` of `n`'s part of the reference: its rows of y and dx in sequence-parallel mode, its
/// columns of dW1 (`[d, h / n]` of `[d, h]`).
fn rank_part(
    reference: &[Vec<f32>; 3],
    mode: TpMode,
    (r, n): (usize, usize),
    (d, h): (usize, usize),
) -> [Vec<f32>; 3] {
    let rows = |v: &[f32]| match mode {
        TpMode::AllReduce => v.to_vec(),
        TpMode::ReduceScatter => v[r * v.len() / n..(r + 1) * v.len() / n].to_vec(),
    };
    let cols: Vec<f32> = (0..d)
        .flat_map(|i| reference[2][i * h + r * h / n..i * h + (r + 1) * h / n].to_vec())
        .collect();
    [rows(&reference[0]), rows(&reference[1]), cols]
}

fn mlp_against_cpu(
    group: &ProcessGroup,
    mode: TpMode,
    dtype: FloatDType,
    shape: (usize, usize, usize, usize),
) -> Result<Vec<(&'static str, f64)>, String> {
    let weights = Weights::new(shape);
    let reference = weights.reference(shape);
    let (y, dx, dw1) = mlp_on_group(group, mode, dtype, shape, &weights);
    let want = rank_part(&reference, mode, (0, 1), (shape.2, shape.3));
    Ok(vec![
        ("y", rel_error(&y, &want[0])),
        ("dx", rel_error(&dx, &want[1])),
        ("dw1", rel_error(&dw1, &want[2])),
    ])
}

fn layers_tp2(f: &mut Figures) -> Result<(), String> {
    let shape = (16usize, 4usize, 64usize, 256usize);
    let weights = Weights::new(shape);
    let reference = weights.reference(shape);
    let mut worst = Worst::default();
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        let w = weights.clone();
        let out = run_local(2, move |group| {
            group.set_timeout(TIMEOUT);
            mlp_on_group(&group, mode, FloatDType::F32, shape, &w)
        })
        .map_err(|e| format!("{mode:?}: {e}"))?;
        for (r, (y, dx, dw1)) in out.into_iter().enumerate() {
            let want = rank_part(&reference, mode, (r, 2), (shape.2, shape.3));
            for (what, got, want) in [
                ("y", y, &want[0]),
                ("dx", dx, &want[1]),
                ("dw1", dw1, &want[2]),
            ] {
                let err = rel_error(&got, want);
                println!("  {mode:?} rank {r} {what}: relative error {err:.2e}");
                worst.add(err);
            }
        }
    }
    // TF32 may be used for f32 GEMMs on the GPU: 1e-2 in norm.
    expect_close(f, "layers_tp2.worst_relative_error", worst.get(), 1e-2)
}

/// Median of `runs` timings of `f` (after `warmup` untimed ones), in seconds.
fn time(warmup: usize, runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn linear_8192(f: &mut Figures) -> Result<(), String> {
    const N: usize = 8192;
    // Compared on the first rows only: the whole output is 256 MiB a copy.
    const ROWS: usize = 64;
    let dev = cuda();
    let group = LocalGroup::new(1).map_err(|e| e.to_string())?.remove(0);
    let base32 = linear(values(N * N, 7), values(N, 8), N, N, &dev);
    let x32 = Tensor::<2>::from_data(TensorData::new(values(N * N, 9), [N, N]), &dev);
    let g32 = Tensor::<2>::from_data(TensorData::new(values(N * N, 10), [N, N]), &dev);
    // f32's y rows and dW rows, for bf16 to be compared against.
    let mut f32_outputs: Option<(Vec<f32>, Vec<f32>)> = None;
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        let tag = format!("{dtype:?}").to_lowercase();
        let base = cast_params(base32.clone(), dtype);
        let col =
            ColumnParallelLinear::from_full(&base, &group, &ColumnParallelLinearConfig::new(N, N))
                .map_err(|e| e.to_string())?;
        let row = RowParallelLinear::from_full(&base, &group, &RowParallelLinearConfig::new(N, N))
            .map_err(|e| e.to_string())?;
        let x = x32.clone().cast(dtype).require_grad();
        let g = g32.clone().cast(dtype);
        // Forward + backward with a dense upstream gradient `g` (loss `sum(y * g)`): three GEMMs.
        let step = |forward: &dyn Fn(Tensor<2>) -> Tensor<2>, weight: Tensor<2>| {
            let y = forward(x.clone());
            let grads = (y.clone() * g.clone()).sum().backward();
            let gw = weight.grad(&grads).expect("a weight gradient");
            let gx = x.grad(&grads).expect("an input gradient");
            (y, gw, gx)
        };
        // Timed up to the device's sync: every kernel queued has run (a read of one value
        // measured 0.48 ms for 3.3 TFLOP, 7x the H200's peak: it did not wait for them all).
        let timed = |forward: &dyn Fn(Tensor<2>) -> Tensor<2>, weight: Tensor<2>| {
            time(1, 5, || {
                let out = step(forward, weight.clone());
                dev.sync().expect("device sync");
                drop(out);
            })
        };
        let rows = |t: Tensor<2>| host(t.slice([0..ROWS, 0..N]));
        let t_burn = timed(&|x| base.forward(x), base.weight.val());
        let t_col = timed(&|x| col.forward(x), col.weight.val());
        let t_row = timed(&|x| row.forward(x), row.weight.val());
        let flops = 3.0 * 2.0 * (N as f64).powi(3);
        println!(
            "  {tag}: burn Linear {:.2} ms ({:.1} TFLOP/s), column {:.2} ms (x{:.3}), row {:.2} ms (x{:.3})",
            t_burn * 1e3,
            flops / t_burn / 1e12,
            t_col * 1e3,
            t_col / t_burn,
            t_row * 1e3,
            t_row / t_burn
        );
        f.num(format!("linear_8192.{tag}.burn_linear_ms"), t_burn * 1e3);
        f.num(format!("linear_8192.{tag}.column_ms"), t_col * 1e3);
        f.num(format!("linear_8192.{tag}.row_ms"), t_row * 1e3);
        f.num(
            format!("linear_8192.{tag}.column_over_burn"),
            t_col / t_burn,
        );
        f.num(format!("linear_8192.{tag}.row_over_burn"), t_row / t_burn);
        f.num(
            format!("linear_8192.{tag}.burn_tflops"),
            flops / t_burn / 1e12,
        );
        // No timing may beat the H200's dense bf16 peak (989 TFLOP/s): one that does did not
        // wait for the GPU, and its ratios mean nothing.
        let fastest = t_burn.min(t_col).min(t_row);
        if flops / fastest / 1e12 > 989.0 {
            return Err(format!(
                "{tag}: {:.0} TFLOP/s is above the H200's peak: the timing is not the GPU's",
                flops / fastest / 1e12
            ));
        }

        // Values: the layers against burn's Linear in the same dtype, and bf16 against f32.
        let (y_burn, gw_burn, gx_burn) = step(&|x| base.forward(x), base.weight.val());
        let (y_burn, gw_burn, gx_burn) = (rows(y_burn), rows(gw_burn), rows(gx_burn));
        for (name, (y, gw, gx)) in [
            ("column", step(&|x| col.forward(x), col.weight.val())),
            ("row", step(&|x| row.forward(x), row.weight.val())),
        ] {
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_dx_vs_burn"),
                rel_error(&rows(gx), &gx_burn),
                1e-3,
            )?;
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_y_vs_burn"),
                rel_error(&rows(y), &y_burn),
                1e-3,
            )?;
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_dw_vs_burn"),
                rel_error(&rows(gw), &gw_burn),
                1e-3,
            )?;
        }
        match &f32_outputs {
            None => f32_outputs = Some((y_burn, gw_burn)),
            Some((y32, gw32)) => {
                expect_close(
                    f,
                    &format!("linear_8192.{tag}.y_vs_f32"),
                    rel_error(&y_burn, y32),
                    2e-2,
                )?;
                expect_close(
                    f,
                    &format!("linear_8192.{tag}.dw_vs_f32"),
                    rel_error(&gw_burn, gw32),
                    2e-2,
                )?;
            }
        }
    }
    Ok(())
}

/// A whole training step of the Llama (d 2048, 16 heads, 8 kv heads, 8 blocks, d_ff
/// 5632, seq 2048, batch 2, bf16 on f32 master weights, AdamW) at tp 1: tokens/s of the steps
/// after the first, and the model's TFLOP/s (Megatron's count: 6 N per token plus the causal
/// attention's 6 L s d). PyTorch's figure for the same model is `gpu_torch.py`'s, in the same
/// run. Uses the launch `train_gpt` set up (it runs after that check).
fn llama_step(f: &mut Figures) -> Result<(), String> {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let scratch = std::env::var("GPU_CHECK_SCRATCH").unwrap_or_else(|_| "/tmp/gpu-check".into());
    let dir = format!("{scratch}/llama_step");
    let (d, layers, seq, d_ff) = (2048usize, 8usize, 2048usize, 5632usize);
    let args = Args::try_parse_from([
        "train_gpt",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--arch",
        "llama",
        "--dtype",
        "bf16",
        "--d-model",
        "2048",
        "--heads",
        "16",
        "--kv-heads",
        "8",
        "--layers",
        "8",
        "--d-ff",
        "5632",
        "--seq",
        "2048",
        "--batch",
        "2",
        "--dropout",
        "0",
        "--steps",
        "3",
        "--eval-every",
        "1000",
        "--sample-len",
        "0",
        "--timeout",
        "120",
        "--quiet",
        "--out",
        &dir,
    ])
    .map_err(|e| e.to_string())?;
    let report = run(&args)?;
    // The vocabulary: about the corpus's characters, padded (a rounding of N here).
    let (n, flops) = llama_flops(128, d, layers, seq, d_ff);
    let tokens = report.step_tokens_per_s;
    println!(
        "  {tokens:.0} tokens/s, {:.1} model TFLOP/s (N about {:.0}M)",
        tokens * flops / 1e12,
        n / 1e6
    );
    f.num("llama_step.tokens_per_s", tokens.round());
    f.num(
        "llama_step.model_tflops",
        (tokens * flops / 1e10).round() / 100.0,
    );
    if !report.losses.iter().all(|l| l.is_finite()) {
        return Err(format!("losses {:?}", report.losses));
    }
    Ok(())
}

/// The check's Llama (8 kv heads of 16: k and v a quarter of q's width each): its parameters
/// N and its training FLOPs per token (Megatron's count: 6 N plus the causal attention's
/// 6 L s d).
fn llama_flops(vocab: usize, d: usize, layers: usize, seq: usize, d_ff: usize) -> (f64, f64) {
    let n = layers as f64 * (4.0 * (d * d) as f64 * 0.75 + 3.0 * (d * d_ff) as f64)
        + 2.0 * vocab as f64 * d as f64;
    (n, 6.0 * n + 6.0 * (layers * seq * d) as f64)
}

/// The Llama step at tp 2, ranks as threads sharing the GPU (the collectives through
/// the host: what one GPU can show of tp), and at tp 1 by the same code, bf16: tokens/s and
/// model TFLOP/s of each (`checks::llama_steps_on_threads`, 3 steps, the first a warm-up).
fn llama_step_tp2(f: &mut Figures) -> Result<(), String> {
    use burn_tp::llama::LlamaConfig;
    use burn_tp_examples::checks::llama_steps_on_threads;
    let (vocab, d, layers, seq, d_ff, batch) = (128usize, 2048usize, 8usize, 2048, 5632, 2);
    let config = LlamaConfig::new(vocab, seq, d, 16, 8, layers, d_ff);
    let (_, flops) = llama_flops(vocab, d, layers, seq, d_ff);
    let device = Device::cuda(0);
    for tp in [1, 2] {
        let out = llama_steps_on_threads(&config, tp, &device, (batch, 3), FloatDType::BF16)?;
        if !out.losses.iter().all(|l| l.is_finite()) {
            return Err(format!("tp {tp}: losses {:?}", out.losses));
        }
        let tokens = (batch * seq) as f64 / out.step_s;
        println!(
            "  tp {tp} (threads on one GPU): {tokens:.0} tokens/s, {:.1} model TFLOP/s, \
             losses {:?}",
            tokens * flops / 1e12,
            out.losses
        );
        f.num(
            format!("llama_step_threads.tp{tp}.tokens_per_s"),
            tokens.round(),
        );
        f.num(
            format!("llama_step_threads.tp{tp}.model_tflops"),
            (tokens * flops / 1e10).round() / 100.0,
        );
    }
    Ok(())
}

fn train_gpt(f: &mut Figures) -> Result<(), String> {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    // A launch of one rank, set up here: the store on a free port of this host.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // SAFETY: no other thread reads the environment while this check runs (the earlier checks'
    // threads have ended).
    unsafe {
        std::env::set_var("RANK", "0");
        std::env::set_var("WORLD_SIZE", "1");
        std::env::set_var("LOCAL_RANK", "0");
        std::env::set_var("MASTER_ADDR", "127.0.0.1");
        std::env::set_var("MASTER_PORT", port.to_string());
    }
    let scratch = std::env::var("GPU_CHECK_SCRATCH").unwrap_or_else(|_| "/tmp/gpu-check".into());
    let dir = format!("{scratch}/train_gpt");
    let args = Args::try_parse_from([
        "train_gpt",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--steps",
        "30",
        "--eval-every",
        "15",
        "--sample-len",
        "0",
        "--timeout",
        "60",
        "--quiet",
        "--out",
        &dir,
    ])
    .map_err(|e| e.to_string())?;
    let report = run(&args)?;
    let (first, last) = (report.losses[0], report.losses[report.losses.len() - 1]);
    println!(
        "  loss {first:.4} -> {last:.4} over {} steps, {:.0} tokens/s",
        report.losses.len(),
        report.tokens_per_s
    );
    f.num("train_gpt.first_loss", first);
    f.num("train_gpt.last_loss", last);
    f.num("train_gpt.tokens_per_s", report.tokens_per_s.round());
    if !(last < first - 0.5) {
        return Err(format!("the loss did not fall: {first} -> {last}"));
    }
    Ok(())
}
