//! The MLP at tp 2 on burn's CUDA backend against the CPU at tp 1 (check 2).

use super::*;

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

pub(super) fn mlp_against_cpu(
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

pub(super) fn layers_tp2(f: &mut Figures) -> Result<(), String> {
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
