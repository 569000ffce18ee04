//! Section 9: the attention op alone, `[1, 8 heads, s, 64]` causal, f32, one rank on the whole
//! machine: the fused kernel (`fused_attention`, FlashAttention-2 on the backend's ops) against
//! Flex's own `attention` (forward only: burn-autodiff's backward of it materializes) and the
//! materialized path (scores, mask, softmax, `@ v`), forward and forward + backward. The floor:
//! the forward's GEMM flops (`q k^T` and `p v`, half of each under the causal mask:
//! `2 * s^2 * 64 * 8`) at the rate of a compute-bound batched GEMM (`[8, 512, 512]^2`) timed in
//! the same run.

use std::time::Instant;

use burn::tensor::activation::softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Tensor};
use burn_tp::attention::fused_attention;
use burn_tp::backend::AttentionSpec;

use crate::median;

fn materialized(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [_, _, s, hd] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
    let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>();
    softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3).matmul(v)
}

/// The median of `reps` runs of `f`, after an untimed one.
pub(crate) fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

pub(crate) fn bench_attention(quick: bool) {
    let (h, hd) = (8usize, 64usize);
    let seqs: &[usize] = if quick {
        &[256]
    } else {
        &[256, 1024, 2048, 4096, 8192]
    };
    println!(
        "\n## 9. Attention alone: [1, {h}, s, {hd}] causal, f32 (ms; floor = the forward's causal GEMM flops at a square GEMM's rate)\n"
    );
    println!(
        "| s | floor | fused fwd | Flex attention fwd | materialized fwd | fused fwd+bwd | materialized fwd+bwd | fused fwd / floor |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &s in seqs {
        let reps = if s >= 4096 { 2 } else { 5 };
        let plain = Device::flex();
        let make = |d: &Device, seed: f64| Tensor::<4>::ones([1, h, s, hd], d) * seed;
        let (q, k, v) = (make(&plain, 0.01), make(&plain, 0.02), make(&plain, 0.03));
        let square = Tensor::<3>::ones([h, 512, 512], &plain);
        let gemm = time(reps, || {
            let _ = square.clone().matmul(square.clone()).into_data();
        });
        let rate = 2.0 * (h * 512 * 512 * 512) as f64 / gemm;
        let floor = 2.0 * (s * s * hd * h) as f64 / rate;
        let fused_fwd = time(reps, || {
            let _ = fused_attention(q.clone(), k.clone(), v.clone(), AttentionSpec::causal(0))
                .unwrap()
                .into_data();
        });
        let flex_fwd = time(reps, || {
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            let _ = attention(q.clone(), k.clone(), v.clone(), None, None, options).into_data();
        });
        let big = s > 4096;
        let mat_fwd = if big {
            f64::NAN
        } else {
            time(reps, || {
                let _ = materialized(q.clone(), k.clone(), v.clone()).into_data();
            })
        };
        let ad = plain.clone().autodiff();
        let grad = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
            time(reps, || {
                let [q, k, v] = [0.01, 0.02, 0.03].map(|x| make(&ad, x).require_grad());
                let _ = f(q, k, v).sum().backward();
            })
        };
        let fused_bwd =
            grad(&|q, k, v| fused_attention(q, k, v, AttentionSpec::causal(0)).unwrap());
        let mat_bwd = if big { f64::NAN } else { grad(&materialized) };
        println!(
            "| {s} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            floor * 1e3,
            fused_fwd * 1e3,
            flex_fwd * 1e3,
            mat_fwd * 1e3,
            fused_bwd * 1e3,
            mat_bwd * 1e3,
            fused_fwd / floor
        );
    }
}
