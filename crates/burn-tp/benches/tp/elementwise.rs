//! Section 14: the memory-bound passes of a training step against memcpy of the bytes they
//! must touch (issue 48's target: within 1.3x). Each op runs on the whole machine's rayon pool,
//! f32, at the GPT's MLP activation (`[batch 8, seq 1,024, 4 d]`, d = 256: 32 MiB, glibc's
//! largest heap block, so a fresh output is mmap'd and page-faulted) and at half of it (16 MiB,
//! kept on the heap by `keep_freed_memory`). The floor: a parallel copy of the bytes read plus
//! written into a warm buffer, timed in the same run; `no block cache`: the same kernel with
//! the bench's `burn_tp::alloc::BlockCache` off (each output above 32 MiB a fresh mapping);
//! `unfused` is the same op composed of Burn's tensor ops (`set_cpu_kernels(false)`; the layer
//! norm's forward: Burn's own `layer_norm`, one pass).

use burn::backend::Dispatch;
use burn::tensor::{Device, Distribution, Tensor};
use burn_tp::alloc::set_block_cache;
use burn_tp::backend::{Bias, GluActivation, NormSpec, TpBackend, set_cpu_kernels};
use rayon::prelude::*;

use crate::attention::time;

/// A copy of `floats` values into a warm buffer on every core: reads and writes `4 floats`
/// bytes each.
fn copy_time(floats: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; floats];
    let mut dst = vec![0.0f32; floats];
    let chunk = floats.div_ceil(rayon::current_num_threads() * 4).max(1);
    time(reps, || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
    })
}

type Op = Box<dyn Fn()>;

/// The ops at `[rows, width]`: name, values read + written (in units of `rows * width`), op.
fn ops(rows: usize, width: usize) -> Vec<(&'static str, f64, Op)> {
    let device = Device::flex();
    let random =
        |shape: [usize; 2]| Tensor::<2>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let x = random([rows, width]);
    let dy = random([rows, width]);
    let y2 = random([rows, 2 * width]);
    let gamma = Tensor::<1>::ones([width], &device);
    let beta = Tensor::<1>::zeros([width], &device);
    let (x1, x2, dy1, dy2) = (x.clone(), x.clone(), dy.clone(), dy.clone());
    let (y2a, y2b) = (y2.clone(), y2);
    let spec = |rms| NormSpec { rms, epsilon: 1e-5 };
    // The norm's forward (layer norm with beta, RMSNorm without) and its backward.
    let norm = |rms: bool| -> Op {
        let (x, gamma, beta) = (x.clone(), gamma.clone(), beta.clone());
        Box::new(move || {
            std::hint::black_box(<Dispatch as TpBackend>::tp_norm(
                x.clone().into_dispatch(),
                gamma.clone().into_dispatch(),
                match rms {
                    true => Bias::None,
                    false => Bias::Some(beta.clone().into_dispatch()),
                },
                spec(rms),
            ));
        })
    };
    let norm_backward = |rms: bool| -> Op {
        let (x, gamma, dy) = (x.clone(), gamma.clone(), dy.clone());
        Box::new(move || {
            std::hint::black_box(<Dispatch as TpBackend>::tp_norm_backward(
                x.clone().into_dispatch(),
                gamma.clone().into_dispatch(),
                dy.clone().into_dispatch(),
                spec(rms),
            ));
        })
    };
    vec![
        (
            "GELU forward",
            2.0,
            Box::new(move || {
                std::hint::black_box(<Dispatch as TpBackend>::tp_gelu(x1.clone().into_dispatch()));
            }) as Op,
        ),
        (
            "GELU backward",
            3.0,
            Box::new(move || {
                std::hint::black_box(<Dispatch as TpBackend>::tp_gelu_backward(
                    x2.clone().into_dispatch(),
                    dy1.clone().into_dispatch(),
                ));
            }),
        ),
        (
            "SwiGLU forward",
            3.0,
            Box::new(move || {
                std::hint::black_box(<Dispatch as TpBackend>::tp_glu(
                    y2a.clone().into_dispatch(),
                    GluActivation::Silu,
                ));
            }),
        ),
        (
            "SwiGLU backward",
            5.0,
            Box::new(move || {
                std::hint::black_box(<Dispatch as TpBackend>::tp_glu_backward(
                    y2b.clone().into_dispatch(),
                    dy2.clone().into_dispatch(),
                    GluActivation::Silu,
                ));
            }),
        ),
        ("layer norm forward", 2.0, norm(false)),
        ("layer norm backward", 3.0, norm_backward(false)),
        ("RMSNorm forward", 2.0, norm(true)),
        ("RMSNorm backward", 3.0, norm_backward(true)),
    ]
}

pub(crate) fn bench_elementwise(quick: bool) {
    let shapes: &[[usize; 2]] = if quick {
        &[[256, 1024]]
    } else {
        &[[8192, 1024], [8192, 512]]
    };
    let reps = if quick { 3 } else { 15 };
    println!(
        "\n## 14. Memory-bound passes against memcpy of their bytes (f32, {} threads; floor = a \
         parallel warm copy of the bytes read + written; target: fused / floor <= 1.3)\n",
        rayon::current_num_threads()
    );
    println!(
        "| op | shape | MiB touched | floor ms | fused ms | fused, no block cache ms | unfused ms | \
         fused / floor | unfused / fused |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for &[rows, width] in shapes {
        for (name, touched, op) in ops(rows, width) {
            let floats = (touched * (rows * width) as f64 / 2.0) as usize;
            let floor = copy_time(floats, reps);
            set_cpu_kernels(true);
            set_block_cache(false);
            let uncached = time(reps, &op);
            set_block_cache(true);
            let fused = time(reps, &op);
            set_cpu_kernels(false);
            let unfused = time(reps, &op);
            set_cpu_kernels(true);
            println!(
                "| {name} | [{rows}, {width}] | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                floats as f64 * 8.0 / (1 << 20) as f64,
                floor * 1e3,
                fused * 1e3,
                uncached * 1e3,
                unfused * 1e3,
                fused / floor,
                unfused / fused
            );
        }
    }
}
