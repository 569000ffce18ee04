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

use burn::backend::Dispatch;
use burn::tensor::{Device, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;

use crate::context::ContextParallel;
use crate::linear::TpMode;

use crate::backend::TpBackend;
use crate::backend::fused::dropout::dropout_mask_values;
pub use crate::backend::fused::dropout::{DropoutKey, DropoutSpec, DropoutStep};

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

/// Dropout of a residual branch `[s(/tp), b, d]`: replicated in ALL_REDUCE mode (the same mask on
/// every rank), this rank's sequence shard of the logical mask in REDUCE_SCATTER mode; the
/// batch dim is this data-parallel rank's part of the global batch. With a context-parallel
/// ring, the rows are this rank's chunks of the whole sequence's mask.
pub(crate) fn residual_dropout(
    x: Tensor<3>,
    p: f64,
    key: Option<DropoutKey>,
    site: u64,
    (group, mode): (&ProcessGroup, TpMode),
    context: Option<&ContextParallel>,
) -> crate::Result<Tensor<3>> {
    let [s, b, d] = x.dims();
    let (local_s, rows) = match mode {
        TpMode::AllReduce => (s, 0..s),
        TpMode::ReduceScatter => (
            s * group.world_size(),
            group.rank() * s..(group.rank() + 1) * s,
        ),
    };
    let (b_total, batch) = key.map_or((b, 0..b), |k| k.batch(b));
    let (seq, positions) = match (context, key) {
        (Some(c), Some(_)) if p > 0.0 => {
            let seq = local_s * c.size();
            (seq, c.positions(seq)?[rows].to_vec())
        }
        _ => {
            let region = [rows, batch, 0..d];
            return Ok(tp_dropout(x, p, key, site, [local_s, b_total, d], region));
        }
    };
    // Each run of consecutive positions is a region of the whole sequence's mask.
    let mut parts = Vec::new();
    let mut first = 0;
    for i in 1..=positions.len() {
        if i == positions.len() || positions[i] != positions[i - 1] + 1 {
            let at = positions[first]..positions[i - 1] + 1;
            let part = x.clone().narrow(0, first, i - first);
            parts.push(tp_dropout(
                part,
                p,
                key,
                site,
                [seq, b_total, d],
                [at, batch.clone(), 0..d],
            ));
            first = i;
        }
    }
    Ok(Tensor::cat(parts, 0))
}

/// A model's residual `dropout` and its `attention_dropout` (where it differs) each in [0, 1).
///
/// # Errors
/// [`TpError::Config`](crate::TpError::Config) naming `model`, the field and the value.
pub(crate) fn check_rates(
    model: &str,
    dropout: f64,
    attention_dropout: Option<f64>,
) -> crate::Result<()> {
    for (name, p) in [
        ("dropout", Some(dropout)),
        ("attention_dropout", attention_dropout),
    ] {
        if let Some(p) = p.filter(|p| !(0.0..1.0).contains(p)) {
            return Err(crate::TpError::Config(format!(
                "{model}: {name} must be in [0, 1), got {p}"
            )));
        }
    }
    Ok(())
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
