//! The routers' loss through pipeline stages. transformers' load-balancing loss multiplies the
//! experts' assignments summed over every MoE layer by their probabilities summed over every
//! layer, so a stage's part of its gradient needs the other stages' counts (and the z-loss the
//! tokens of all). They travel beside the activations as one running total of fixed size, and
//! the whole micro-batch's total comes back beside the gradients:
//!
//! ```text
//!  forward:   stage 0 --x, T0--> stage 1 --x, T0+T1--> last: head loss + routers' loss of
//!                                                          (its own, tracked; T0+T1, held)
//!  backward:  stage 0 <--dx, T-- stage 1 <--dx, T------ last         (T: every stage's total)
//!             a stage adds the routers' loss of (its own, tracked; T - its own, held) to the
//!             seeded backward: its part of the whole loss's gradient, as `crate::recompute`
//!             takes a block's
//! ```
//!
//! A total is `[assignments (experts) | probability sums (experts) | tokens | z sum]` in f32
//! (counts exact below 2^24 a micro-batch).

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::moe::RouterStats;
use crate::{Result, TpError};

/// The values of a total for `experts` experts (0 without a routers' loss).
pub(super) fn width(experts: usize) -> usize {
    match experts {
        0 => 0,
        e => 2 * e + 2,
    }
}

/// `total` plus (`sign` 1.0) or minus (-1.0) `stats`' values.
pub(super) fn add(total: &[f32], stats: &[RouterStats], sign: f32) -> Result<Vec<f32>> {
    let mut out = total.to_vec();
    let e = (out.len().saturating_sub(2)) / 2;
    for s in stats {
        if s.counts.len() != e {
            return Err(TpError::Config(format!(
                "pipeline: a MoE layer routed over {} experts, the routers' loss expects {e}",
                s.counts.len()
            )));
        }
        let probs = host(s.prob_sum.clone())?;
        let z = host(s.z_sum.clone())?;
        for k in 0..e {
            out[k] += sign * s.counts[k] as f32;
            out[e + k] += sign * probs[k];
        }
        out[2 * e] += sign * s.tokens as f32;
        out[2 * e + 1] += sign * z[0];
    }
    Ok(out)
}

/// A total as statistics without gradient, on `device` in `dtype` (the tracked ones' dtype).
pub(super) fn held(total: &[f32], device: &Device, dtype: DType) -> RouterStats {
    let e = (total.len() - 2) / 2;
    let tensor = |v: &[f32]| {
        Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device).cast(dtype)
    };
    RouterStats {
        counts: total[..e]
            .iter()
            .map(|&c| c.round().max(0.0) as usize)
            .collect(),
        prob_sum: tensor(&total[e..2 * e]),
        z_sum: tensor(&total[2 * e + 1..]),
        tokens: total[2 * e].round().max(0.0) as usize,
        dropped: 0,
    }
}

/// `own` (tracked) and the held total `others` as one list, for the model's routers' loss.
pub(super) fn with_held(
    own: Vec<RouterStats>,
    others: &[f32],
    device: &Device,
) -> Vec<RouterStats> {
    let dtype = own.first().map_or(DType::F32, |s| s.prob_sum.dtype());
    let mut all = own;
    all.push(held(others, device, dtype));
    all
}

fn host(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| TpError::Config(format!("pipeline: reading a router statistic: {e:?}")))
}
