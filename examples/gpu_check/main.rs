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
//! Each check is a file of its own (`device_path.rs`, `gemm.rs`, `layers.rs`, `linear.rs`,
//! `attention.rs`, `steps.rs`); this one runs them in order and holds what they share. The
//! split moved code alone (2026-12-07 (c), with no GPU lent): it is compiled only with the
//! `cuda` feature, by CI's `cuda-check` build.

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

mod attention;
mod device_path;
mod gemm;
mod layers;
mod linear;
mod steps;

use attention::attention_check;
use device_path::device_path;
use gemm::gemm_hook;
use layers::layers_tp2;
use linear::linear_8192;
use steps::{llama_step, llama_step_tp2, train_gpt};

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

fn dtype_tag(dtype: FloatDType) -> String {
    format!("{dtype:?}").to_lowercase()
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
