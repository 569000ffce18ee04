//! The GPU checks of `.ci/gpu-check run`, in one binary so the bundle stays small (it carries
//! `train_gpt` as a library call). Needs the `cuda` feature and a GPU:
//!
//! 1. `layers_tp2`: the burn-tp MLP (column -> GELU -> row) on burn's CUDA backend at tp = 2,
//!    ranks as threads sharing the one GPU over the host transport, both modes: outputs and
//!    gradients against the same computation on the CPU (Flex) at tp = 1.
//! 2. `linear_8192`: tp = 1 `ColumnParallelLinear` / `RowParallelLinear` forward + backward against
//!    burn's plain CUDA `Linear` at 8192 x 8192 (x `[8192, 8192]`), f32 and bf16: median times
//!    and their ratios.
//! 3. `train_gpt`: `train_gpt --device cuda --tp 1` for 50 steps (a launch of one rank set up
//!    in-process): the loss falls; tokens/s.
//!
//! Usage: `gpu_check OUT_DIR`. Prints a log; writes `OUT_DIR/figures.json`. Exits 1 if a check
//! failed (the others still run).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use burn_tp::LocalGroup;
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode,
};
use burn_tp::local::run_local;
use burn_tp::precision::cast_params;

/// Figures by name: numbers, or text for statuses.
type Figures = BTreeMap<String, String>;

/// One check: it records its figures, and says why it failed.
type Check = fn(&mut Figures) -> Result<(), String>;

fn main() {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "gpu-check-out".into());
    std::fs::create_dir_all(&out).expect("creating the output folder");
    let mut figures = Figures::new();
    // Without a driver (or NCCL) every check would fail deep inside cubecl: say why, once.
    if let Err(e) = burn_tp::comm::nccl::probe() {
        println!("no GPU here: {e}");
        figures.insert(
            "gpu_check.status".into(),
            format!("{:?}", format!("no GPU: {e}")),
        );
        std::fs::write(format!("{out}/figures.json"), to_json(&figures))
            .expect("writing figures.json");
        std::process::exit(1);
    }
    let mut failed = false;
    let checks: [(&str, Check); 3] = [
        ("layers_tp2", layers_tp2),
        ("linear_8192", linear_8192),
        ("train_gpt", |f| train_gpt(f, &out_dir())),
    ];
    for (name, check) in checks {
        println!("== {name}");
        let start = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&mut figures)))
            .unwrap_or_else(|p| Err(panic_text(&p)));
        let status = match result {
            Ok(()) => "ok".to_string(),
            Err(e) => {
                failed = true;
                format!("FAILED: {e}")
            }
        };
        println!("{name}: {status} ({:.1} s)", start.elapsed().as_secs_f64());
        figures.insert(format!("{name}.status"), format!("{status:?}"));
    }
    let json = to_json(&figures);
    let path = format!("{out}/figures.json");
    std::fs::write(&path, &json).expect("writing figures.json");
    println!("{json}");
    std::process::exit(i32::from(failed));
}

fn out_dir() -> String {
    std::env::args()
        .nth(1)
        .unwrap_or_else(|| "gpu-check-out".into())
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

fn to_json(f: &Figures) -> String {
    let mut s = String::from("{\n");
    for (i, (k, v)) in f.iter().enumerate() {
        let comma = if i + 1 < f.len() { "," } else { "" };
        // Numbers as they are; statuses are already quoted (Debug of a String).
        let _ = writeln!(s, "  \"{k}\": {v}{comma}");
    }
    s.push('}');
    s
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

fn host(t: Tensor<3>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32")
}

fn host2(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32")
}

/// `||a - b|| / ||b||`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
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

fn layers_tp2(f: &mut Figures) -> Result<(), String> {
    let (s, b, d, h) = (16usize, 4usize, 64usize, 256usize);
    let (w1, b1) = (values(d * h, 1), values(h, 2));
    let (w2, b2) = (values(h * d, 3), values(d, 4));
    let (xv, gv) = (values(s * b * d, 5), values(s * b * d, 6));
    // CPU reference at tp = 1: y = fc2(gelu(fc1(x))), loss = sum(y * g).
    let cpu = Device::flex().autodiff();
    let fc1 = linear(w1.clone(), b1.clone(), d, h, &cpu);
    let fc2 = linear(w2.clone(), b2.clone(), h, d, &cpu);
    let x = Tensor::<3>::from_data(TensorData::new(xv.clone(), [s, b, d]), &cpu).require_grad();
    let g = Tensor::<3>::from_data(TensorData::new(gv.clone(), [s, b, d]), &cpu);
    let y = fc2.forward(gelu(fc1.forward(x.clone())));
    let grads = (y.clone() * g).sum().backward();
    let want_y = host(y.detach());
    let want_dx = host(x.grad(&grads).ok_or("no dx")?);
    let want_dw1 = host2(fc1.weight.val().grad(&grads).ok_or("no dw1")?);
    let mut worst: f64 = 0.0;
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        let (w1, b1, w2, b2, xv, gv) = (
            w1.clone(),
            b1.clone(),
            w2.clone(),
            b2.clone(),
            xv.clone(),
            gv.clone(),
        );
        let out = run_local(2, move |group| {
            let (r, n) = (group.rank(), group.world_size());
            let dev = cuda();
            let col = ColumnParallelLinear::from_full(
                &linear(w1.clone(), b1.clone(), d, h, &dev),
                &group,
                &ColumnParallelLinearConfig::new(d, h).with_mode(mode),
            )
            .unwrap();
            let row = RowParallelLinear::from_full(
                &linear(w2.clone(), b2.clone(), h, d, &dev),
                &group,
                &RowParallelLinearConfig::new(h, d).with_mode(mode),
            )
            .unwrap();
            let full = |v: Vec<f32>| Tensor::<3>::from_data(TensorData::new(v, [s, b, d]), &dev);
            let shard = |t: Tensor<3>| match mode {
                TpMode::AllReduce => t,
                TpMode::ReduceScatter => t.chunk(n, 0).swap_remove(r),
            };
            let x = shard(full(xv.clone())).require_grad();
            let y = row.forward(gelu(col.forward(x.clone())));
            let grads = (y.clone() * shard(full(gv.clone()))).sum().backward();
            let dw1 = col.weight.val().grad(&grads).unwrap();
            (host(y.detach()), host(x.grad(&grads).unwrap()), host2(dw1))
        })
        .map_err(|e| format!("{mode:?}: {e}"))?;
        for (r, (y, dx, dw1)) in out.into_iter().enumerate() {
            let pick = |v: &[f32]| -> Vec<f32> {
                match mode {
                    TpMode::AllReduce => v.to_vec(),
                    TpMode::ReduceScatter => v[r * v.len() / 2..(r + 1) * v.len() / 2].to_vec(),
                }
            };
            // This rank's columns of dW1 ([d, h / 2] of [d, h]).
            let cols: Vec<f32> = (0..d)
                .flat_map(|i| want_dw1[i * h + r * h / 2..i * h + (r + 1) * h / 2].to_vec())
                .collect();
            for (what, err) in [
                ("y", rel(&y, &pick(&want_y))),
                ("dx", rel(&dx, &pick(&want_dx))),
                ("dw1", rel(&dw1, &cols)),
            ] {
                println!("  {mode:?} rank {r} {what}: relative error {err:.2e}");
                worst = worst.max(err);
            }
        }
    }
    f.insert(
        "layers_tp2.worst_relative_error".into(),
        format!("{worst:e}"),
    );
    // TF32 may be used for f32 GEMMs on the GPU: 1e-2 in norm.
    if worst > 1e-2 {
        return Err(format!("relative error {worst:e} > 1e-2"));
    }
    Ok(())
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
    let dev = cuda();
    let group = LocalGroup::new(1).map_err(|e| e.to_string())?.remove(0);
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        let base = linear(values(N * N, 7), values(N, 8), N, N, &dev);
        let base = cast_params(base, dtype);
        let col =
            ColumnParallelLinear::from_full(&base, &group, &ColumnParallelLinearConfig::new(N, N))
                .map_err(|e| e.to_string())?;
        let row = RowParallelLinear::from_full(&base, &group, &RowParallelLinearConfig::new(N, N))
            .map_err(|e| e.to_string())?;
        let x = Tensor::<2>::from_data(TensorData::new(values(N * N, 9), [N, N]), &dev)
            .cast(dtype)
            .require_grad();
        // Forward + backward, then a read of one weight-gradient value: the GPU has finished.
        let step = |forward: &dyn Fn(Tensor<2>) -> Tensor<2>, weight: Tensor<2>| {
            let y = forward(x.clone());
            let grads = y.sum().backward();
            let gw = weight.grad(&grads).expect("a weight gradient");
            let _ = gw.slice([0..1, 0..1]).into_data();
        };
        let t_burn = time(2, 5, || step(&|x| base.forward(x), base.weight.val()));
        let t_col = time(2, 5, || step(&|x| col.forward(x), col.weight.val()));
        let t_row = time(2, 5, || step(&|x| row.forward(x), row.weight.val()));
        let tag = format!("{dtype:?}").to_lowercase();
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
        f.insert(
            format!("linear_8192.{tag}.burn_linear_ms"),
            format!("{:.3}", t_burn * 1e3),
        );
        f.insert(
            format!("linear_8192.{tag}.column_ms"),
            format!("{:.3}", t_col * 1e3),
        );
        f.insert(
            format!("linear_8192.{tag}.row_ms"),
            format!("{:.3}", t_row * 1e3),
        );
        f.insert(
            format!("linear_8192.{tag}.column_over_burn"),
            format!("{:.4}", t_col / t_burn),
        );
        f.insert(
            format!("linear_8192.{tag}.row_over_burn"),
            format!("{:.4}", t_row / t_burn),
        );
        f.insert(
            format!("linear_8192.{tag}.burn_tflops"),
            format!("{:.2}", flops / t_burn / 1e12),
        );
    }
    Ok(())
}

fn train_gpt(f: &mut Figures, out: &str) -> Result<(), String> {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    // A launch of one rank, set up here: the store on a free port of this host.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // Safety: set before any thread of this check reads the environment.
    unsafe {
        std::env::set_var("RANK", "0");
        std::env::set_var("WORLD_SIZE", "1");
        std::env::set_var("LOCAL_RANK", "0");
        std::env::set_var("MASTER_ADDR", "127.0.0.1");
        std::env::set_var("MASTER_PORT", port.to_string());
    }
    let dir = format!("{out}/train_gpt");
    let args = Args::try_parse_from([
        "train_gpt",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--steps",
        "50",
        "--eval-every",
        "25",
        "--sample-len",
        "0",
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
    f.insert("train_gpt.first_loss".into(), format!("{first:.4}"));
    f.insert("train_gpt.last_loss".into(), format!("{last:.4}"));
    f.insert(
        "train_gpt.tokens_per_s".into(),
        format!("{:.0}", report.tokens_per_s),
    );
    if last >= first - 0.5 {
        return Err(format!("the loss did not fall: {first} -> {last}"));
    }
    Ok(())
}
