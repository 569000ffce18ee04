//! The micro-batches a step is given, checked the same on every stage.

use burn::tensor::{Int, Tensor};

use super::Pipeline;
use crate::{Result, TpError};

/// One micro-batch's ids and targets, `[seq, batch]` each.
pub type MicroBatch = (Tensor<2, Int>, Tensor<2, Int>);

/// Checks the micro-batches: at least one, all of one shape, and the same on every stage
/// (one small all-gather, so a mismatch is an error naming every stage's, not a transfer that
/// never comes). Returns their `[seq, batch]`.
pub(super) fn check_micro_batches(
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
) -> Result<[usize; 2]> {
    let m = micro_batches.len();
    let Some(first) = micro_batches.first() else {
        return Err(TpError::Config("pipeline: no micro-batch".into()));
    };
    let dims = first.0.dims();
    if let Some(i) = micro_batches
        .iter()
        .position(|(ids, t)| ids.dims() != dims || t.dims() != dims)
    {
        return Err(TpError::Config(format!(
            "pipeline: micro-batch {i} is {:?} / {:?}, micro-batch 0 {dims:?}",
            micro_batches[i].0.dims(),
            micro_batches[i].1.dims()
        )));
    }
    let mine = [m as i64, dims[0] as i64, dims[1] as i64];
    let all = pipe.group.all_gather(mine.to_vec())?;
    if all.chunks(3).any(|c| c != mine) {
        let each: Vec<String> = all
            .chunks(3)
            .enumerate()
            .map(|(s, c)| format!("stage {s}: {} of [{}, {}]", c[0], c[1], c[2]))
            .collect();
        return Err(TpError::Config(format!(
            "pipeline: the stages' micro-batches differ ({})",
            each.join("; ")
        )));
    }
    Ok(dims)
}
