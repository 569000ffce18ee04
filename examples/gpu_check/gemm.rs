//! The GEMM hook: burn-tp's cuBLAS path against burn's matmul.

use super::*;

/// The GEMM hook (cuBLAS on CUDA, `backend/cublas.rs`) against burn's matmul on the same
/// tensors, every layout the layers use and the odd ones (f32 under each one's TF32 policy, and
/// bf16): dense, odd sizes, a transposed view, a slice, a batch with a broadcast operand; then
/// which of the two rounds f32 to TF32 (a probe: (1 + 2^-15) x 1 keeps its 2^-15 in f32 only);
/// then 1,000 rounds of a kernel writing an operand, the hook, a kernel reading its output, the
/// buffers dropped between (the ordering with cubecl's stream and pool), against burn's matmul.
pub(super) fn gemm_hook(f: &mut Figures) -> Result<(), String> {
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
