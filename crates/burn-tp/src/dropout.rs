//! Dropout with a tensor-parallel RNG tracker (Megatron's `CudaRNGStatesTracker`), counter-based:
//! the keep decision of element `i` of a *logical* (unsharded) tensor at dropout site `site` and
//! training step `step` is a hash of `(seed, site, step, i)`. So a replicated activation gets the
//! same mask on every rank, a sharded one (a sequence shard, a rank's heads) its own part of the
//! logical mask, and the masks are the same at every tp: a run is reproducible from its seed
//! whatever the parallelism, and an unsharded reference can apply the very same masks
//! ([`dropout_mask`] of the full region).
//!
//! Each rank computes only its own region's mask (no communication), on the host: one hash per
//! element.

use std::ops::Range;

use burn::backend::{Backend, Dispatch, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Device, Tensor, TensorData};

use crate::backend::TpBackend;

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

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream of `site` at `key`: element `index` draws [`uniform`]`(stream, index)`.
fn stream(key: DropoutKey, site: u64) -> u64 {
    splitmix64(splitmix64(splitmix64(key.seed) ^ site) ^ key.at.step)
}

/// Uniform in `[0, 1)` for element `index` of a [`stream`].
fn uniform(stream: u64, index: u64) -> f64 {
    (splitmix64(stream ^ index) >> 11) as f64 / (1u64 << 53) as f64
}

/// The scaled keep mask (`0` or `1 / (1 - p)`) of `region` of a logical tensor of shape `full`,
/// in the region's shape, on `device` in the device's default float type.
///
/// # Panics
/// If `region` does not fit in `full`, or `p` is not in `[0, 1)`.
pub fn dropout_mask<const D: usize>(
    key: DropoutKey,
    site: u64,
    full: [usize; D],
    region: [Range<usize>; D],
    p: f64,
    device: &Device,
) -> Tensor<D> {
    let shape: [usize; D] = std::array::from_fn(|d| region[d].len());
    let values = dropout_mask_values(key, site, full, region, p);
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The values of [`dropout_mask`], row-major in the region's shape (the fused attention makes
/// each block's mask from them).
///
/// # Panics
/// As [`dropout_mask`].
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

/// Dropout of `x`, the `region` of a logical tensor of shape `full`, at `site`: `x` times its
/// part of the logical mask, or `x` itself when `key` is `None` or `p == 0`. One op whose
/// backward regenerates the mask from the counter-based RNG: nothing is kept for it.
///
/// # Panics
/// If `D > 4`, the region does not fit in `full`, or `p` is not in `[0, 1)`.
pub fn tp_dropout<const D: usize>(
    x: Tensor<D>,
    p: f64,
    key: Option<DropoutKey>,
    site: u64,
    full: [usize; D],
    region: [Range<usize>; D],
) -> Tensor<D> {
    match key {
        Some(key) if p > 0.0 => {
            assert!(D <= 4, "tp_dropout: rank {D} > 4");
            // Leading dims of one element leave every global index as it is.
            let lead = 4 - D;
            let spec = DropoutSpec {
                p,
                key,
                site,
                full: std::array::from_fn(|d| if d < lead { 1 } else { full[d - lead] }),
                region: std::array::from_fn(|d| {
                    if d < lead {
                        0..1
                    } else {
                        region[d - lead].clone()
                    }
                }),
            };
            Tensor::from_dispatch(<Dispatch as TpBackend>::tp_dropout(x.into_dispatch(), spec))
        }
        _ => x,
    }
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
/// [`TpBackend::tp_dropout`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_its_part_of_the_full_mask_and_the_rate_is_p() {
        let device = Device::flex();
        let key = DropoutKey {
            seed: 7,
            at: DropoutStep::new(3),
        };
        let full = dropout_mask(key, 1, [4, 3, 50], [0..4, 0..3, 0..50], 0.25, &device);
        let part = dropout_mask(key, 1, [4, 3, 50], [2..4, 0..3, 10..30], 0.25, &device);
        let want = full.clone().slice([2..4, 0..3, 10..30]);
        assert_eq!(part.into_data(), want.into_data());
        let kept = full
            .clone()
            .greater_elem(0.0)
            .int()
            .sum()
            .into_scalar::<i64>() as f64;
        let rate = 1.0 - kept / 600.0;
        assert!((rate - 0.25).abs() < 0.06, "dropped {rate}");
        let other = dropout_mask(
            DropoutKey {
                at: DropoutStep::new(4),
                ..key
            },
            1,
            [4, 3, 50],
            [0..4, 0..3, 0..50],
            0.25,
            &device,
        );
        assert_ne!(
            full.into_data(),
            other.into_data(),
            "a new step, a new mask"
        );
    }
}
