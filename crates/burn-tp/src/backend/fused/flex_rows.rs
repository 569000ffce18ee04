//! What the CPU kernels on Flex's storage share: f32 views of the inputs, the output written in
//! parallel (rows grouped into tasks, each loop compiled for the vector unit by
//! [`simd`](super::cpu_math::simd)), and the cast back to the input's dtype.

use burn::backend::Flex;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;
use std::mem::MaybeUninit;

use super::cpu_math::simd;

/// Elements a task handles at least (rows are grouped up to it): enough to amortize the task.
pub(crate) const TASK_ELEMS: usize = 1 << 14;

/// `t` as contiguous f32 values, and its dtype before.
pub(crate) fn f32_contiguous(t: FlexTensor) -> (FlexTensor, DType) {
    let dtype = t.dtype();
    let t = match dtype {
        DType::F32 => t,
        _ => Flex::float_cast(t, FloatDType::F32),
    };
    match t.is_contiguous() {
        true => (t, dtype),
        false => (t.to_contiguous(), dtype),
    }
}

/// `values` (f32, `shape`) as a Flex tensor of `dtype`.
pub(crate) fn output(values: Vec<f32>, shape: Vec<usize>, dtype: DType) -> FlexTensor {
    let t = FlexTensor::from_data(TensorData::new(values, shape));
    match dtype {
        DType::F32 => t,
        other => Flex::float_cast(t, other.into()),
    }
}

/// `n` values written in parallel, `chunk` at a time: `fill(start, dst)` writes every element
/// of `dst`, values `start..start + dst.len()`. No zero-fill before.
///
/// `fill` must be `#[inline(always)]` (as must anything it calls per element): only code
/// inlined into [`simd`]'s target-feature function is compiled for the wide unit, and LLVM
/// declined to inline the kernels' closures on its own (measured: the GELU's loop ran at the
/// baseline's SSE2 width, 2.4 ns a value on an AVX2 core).
pub(crate) fn par_fill(
    n: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(c, dst)| {
            simd(
                #[inline(always)]
                || fill(c * chunk.max(1), dst),
            )
        });
    // Safety: the chunks cover `0..n` and `fill` writes every element of each.
    unsafe { out.set_len(n) };
    out
}

/// `rows` rows of `width` values, written in parallel by `row(i, dst)` for row `i` (every
/// element of `dst`), grouped so that a task has at least [`TASK_ELEMS`] values.
pub(crate) fn rows_of(
    rows: usize,
    width: usize,
    row: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    if width == 0 {
        return Vec::new();
    }
    let per_task = TASK_ELEMS.div_ceil(width).max(1);
    par_fill(
        rows * width,
        per_task * width,
        #[inline(always)]
        |start, dst| {
            for (r, dst) in dst.chunks_mut(width).enumerate() {
                row(start / width + r, dst);
            }
        },
    )
}

/// `y`'s shape, its rows (all dims but the last) and the last dim's size.
pub(crate) fn rows_and_width(y: &FlexTensor) -> (Vec<usize>, usize, usize) {
    let shape = y.layout().shape().to_vec();
    let width = *shape
        .last()
        .expect("a row-wise kernel's input has a last dim");
    let rows = shape
        .iter()
        .product::<usize>()
        .checked_div(width)
        .unwrap_or(0);
    (shape, rows, width)
}

/// Inputs and readouts the kernels' tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// `values` of `shape` as a Flex tensor of `dtype` (rounded to it).
    pub(crate) fn flex(values: Vec<f32>, shape: Vec<usize>, dtype: DType) -> FlexTensor {
        let t = FlexTensor::from_data(TensorData::new(values, shape));
        match dtype {
            DType::F32 => t,
            other => Flex::float_cast(t, other.into()),
        }
    }

    /// `t`'s values as f64.
    pub(crate) fn f64s(t: FlexTensor) -> Vec<f64> {
        t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
    }

    /// Values in [-8, 8) (both tails of the activations), from a fixed sequence.
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                ((h >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
            })
            .collect()
    }
}
