//! The dropout op's body: the keep masks of [`crate::dropout`]'s counter-based RNG, computed on
//! the host for any region of a logical tensor, and the mask applied to a backend tensor (the
//! forward of `TpBackend::tp_dropout` and its backward; the attention kernels draw each block's
//! mask from [`dropout_mask_values`] too).

use std::ops::Range;

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::TensorData;

use crate::rng::{splitmix64, unit_f64};

/// The training step a forward runs (dropout on, with that step's masks), and where this
/// data-parallel rank's batch sits in the global batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutStep {
    /// The training step.
    pub step: u64,
    /// This data-parallel rank's first sequence in the global batch.
    pub batch_offset: usize,
    /// Sequences in the global batch (`None`: this rank's batch is all of it).
    pub batch_total: Option<usize>,
}

impl DropoutStep {
    /// Step `step` of a run without data parallelism.
    pub fn new(step: u64) -> Self {
        Self {
            step,
            batch_offset: 0,
            batch_total: None,
        }
    }

    /// This rank's sequences `offset..` of a global batch of `total`.
    pub fn with_batch(self, offset: usize, total: usize) -> Self {
        Self {
            batch_offset: offset,
            batch_total: Some(total),
            ..self
        }
    }
}

/// Seed and step of the dropout masks; `None` where a forward takes one: no dropout
/// (evaluation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    /// The run's dropout seed.
    pub seed: u64,
    /// The step, and this rank's part of the global batch.
    pub at: DropoutStep,
}

impl DropoutKey {
    /// The batch dim of the logical tensor and this rank's range of it, for a local batch `b`.
    pub fn batch(&self, b: usize) -> (usize, Range<usize>) {
        let total = self.at.batch_total.unwrap_or(b);
        (total, self.at.batch_offset..self.at.batch_offset + b)
    }
}

/// The stream of `site` at `key`: element `index` draws [`uniform`]`(stream, index)`.
fn stream(key: DropoutKey, site: u64) -> u64 {
    splitmix64(splitmix64(splitmix64(key.seed) ^ site) ^ key.at.step)
}

/// Uniform in `[0, 1)` for element `index` of a [`stream`].
fn uniform(stream: u64, index: u64) -> f64 {
    unit_f64(splitmix64(stream ^ index))
}

/// The values of `crate::dropout::dropout_mask`, row-major in the region's shape (the fused attention makes
/// each block's mask from them).
///
/// # Panics
/// As `crate::dropout::dropout_mask`.
pub(crate) fn dropout_mask_values<const D: usize>(
    key: DropoutKey,
    site: u64,
    full: [usize; D],
    region: [Range<usize>; D],
    p: f64,
) -> Vec<f32> {
    assert!(
        (0.0..1.0).contains(&p),
        "dropout probability {p} not in [0, 1)"
    );
    let shape: [usize; D] = std::array::from_fn(|d| region[d].len());
    for d in 0..D {
        assert!(
            region[d].end <= full[d],
            "region {region:?} outside {full:?}"
        );
    }
    let mut strides = [1u64; D];
    for d in (0..D.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * full[d + 1] as u64;
    }
    let n: usize = shape.iter().product();
    let scale = (1.0 / (1.0 - p)) as f32;
    let stream = stream(key, site);
    let mut values = Vec::with_capacity(n);
    let mut idx = [0usize; D];
    for _ in 0..n {
        let global: u64 = (0..D)
            .map(|d| (region[d].start + idx[d]) as u64 * strides[d])
            .sum();
        values.push(if uniform(stream, global) >= p {
            scale
        } else {
            0.0
        });
        for d in (0..D).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    values
}

/// One dropout call: `region` of the logical mask of `site` (shape `full`, padded to rank 4
/// with leading ones) at `key`, dropping with probability `p`.
#[derive(Clone, Debug, PartialEq)]
pub struct DropoutSpec {
    /// Probability of dropping.
    pub p: f64,
    /// The step's key.
    pub key: DropoutKey,
    /// The dropout site.
    pub site: u64,
    /// The logical tensor's shape.
    pub full: [usize; 4],
    /// This call's region of it (the input's shape).
    pub region: [Range<usize>; 4],
}

/// `x` times the scaled keep mask of `spec` (the forward and, for the gradient, the backward of
/// [`TpBackend::tp_dropout`](crate::backend::TpBackend::tp_dropout)).
pub(crate) fn apply_mask<B: Backend>(x: FloatTensor<B>, spec: &DropoutSpec) -> FloatTensor<B> {
    let values = dropout_mask_values(spec.key, spec.site, spec.full, spec.region.clone(), spec.p);
    let mask = B::float_from_data(TensorData::new(values, x.shape()), &x.device());
    let mask = if mask.dtype() == x.dtype() {
        mask
    } else {
        B::float_cast(mask, x.dtype().into())
    };
    B::float_mul(x, mask)
}
