//! The fused attention against the materialized path and the CPU (check 4).

use super::*;

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

pub(super) fn attention_check(f: &mut Figures) -> Result<(), String> {
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
