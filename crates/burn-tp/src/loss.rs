//! Vocab-parallel cross-entropy: the logits stay sharded over the vocabulary.

use burn::backend::Dispatch;
use burn::tensor::{DType, FloatDType, Int, Tensor};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::backend::TpBackend;
use crate::ops::all_reduce;
use crate::{Result, TpError};

/// Mean cross-entropy of vocab-sharded logits, equal to Burn's `CrossEntropyLoss` on the gathered
/// logits (with `label_smoothing` as its `smoothing`), plus an optional z-loss
/// `z_loss_coef * logsumexp^2` per token. The result is replicated on every rank.
///
/// Forward: the max, the target logit and the sum of exponentials (and, for smoothing, the sum of
/// logits) are all-reduced over `group`: two all-reduces of `[n]` / `[n, 3]`, never the logits.
/// Backward: `softmax * (1 + 2 z lse) - (1 - eps) one_hot - eps / V`, computed locally on each
/// shard, no communication.
///
/// Computed in f32 for f32 / bf16 / f16 logits (as Megatron does), in f64 for f64; the loss and the logits'
/// gradient come back in the logits' dtype.
///
/// # Shapes
/// - `sharded_logits`: `[n, V / tp]`, rank `r` holding vocab ids `r * V/tp .. (r+1) * V/tp`
/// - `targets`: `[n]`, ids in `0..V` (the same on every rank)
/// - output: `[1]`
///
/// # Errors
/// [`TpError::Shape`] if the shapes disagree; [`TpError::Config`] for a smoothing outside
/// `[0, 1]`; [`TpError::OutOfRange`] for a target outside the vocabulary; a communication error.
pub fn sharded_cross_entropy(
    sharded_logits: Tensor<2>,
    targets: Tensor<1, Int>,
    group: &ProcessGroup,
    z_loss_coef: f64,
    label_smoothing: f64,
) -> Result<Tensor<1>> {
    let _scope = burn_tp_comm::profile::scope("sharded_cross_entropy");
    let [n, v_local] = sharded_logits.dims();
    let [n_t] = targets.dims();
    if n != n_t {
        return Err(TpError::Shape {
            op: "sharded_cross_entropy",
            expected: format!("targets [{n}]"),
            got: vec![n_t],
        });
    }
    if !(0.0..=1.0).contains(&label_smoothing) {
        return Err(TpError::Config(format!(
            "label_smoothing must be in [0, 1], got {label_smoothing}"
        )));
    }
    let tp = group.world_size();
    let vocab = v_local * tp;
    crate::embedding::check_ids(&targets.clone().unsqueeze::<2>(), vocab)?;

    // Statistics and jacobian in f32 for half-precision logits (as Megatron does): a bf16 sum
    // of exponentials over the vocabulary loses the target's share. f64 stays f64.
    let dtype = sharded_logits.dtype();
    let compute = if dtype == DType::F64 {
        FloatDType::F64
    } else {
        FloatDType::F32
    };
    let logits = sharded_logits.clone().detach().cast(compute);
    let m = all_reduce(logits.clone().max_dim(1), ReduceOp::Max, group)?; // [n, 1]
    let shifted = logits - m.clone();
    let exp = shifted.clone().exp();
    let (idx, mine) = crate::embedding::local_ids(targets, v_local, group);
    let mine_f = mine.cast(compute).unsqueeze_dim::<2>(1); // [n, 1]
    let picked = shifted.clone().gather(1, idx.clone().unsqueeze_dim(1)) * mine_f.clone();
    let stats = Tensor::cat(vec![picked, exp.clone().sum_dim(1), shifted.sum_dim(1)], 1);
    let stats = all_reduce(stats, ReduceOp::Sum, group)?; // [n, 3]
    let target = stats.clone().slice([0..n, 0..1]);
    let sum_exp = stats.clone().slice([0..n, 1..2]);
    let sum_shifted = stats.slice([0..n, 2..3]);
    let lse = sum_exp.clone().log(); // of the shifted logits
    let eps = label_smoothing;
    let mut loss =
        (lse.clone() - target) * (1.0 - eps) + (lse.clone() - sum_shifted / vocab as f64) * eps;
    let lse_full = lse + m;
    let mut softmax_scale = lse_full.ones_like();
    if z_loss_coef != 0.0 {
        loss = loss + lse_full.clone().powi_scalar(2) * z_loss_coef;
        softmax_scale = softmax_scale + lse_full * (2.0 * z_loss_coef);
    }
    let one_hot: Tensor<2> = idx.one_hot::<2>(v_local).cast(compute) * mine_f;
    let jacobian = exp / sum_exp * softmax_scale - one_hot * (1.0 - eps) - eps / vocab as f64;
    // Mean over tokens: the 1/n is applied to the per-token losses (and flows into the gradient).
    let per_token = rowwise_loss(
        sharded_logits,
        loss.reshape([n]).cast(dtype),
        jacobian.cast(dtype),
    );
    Ok(per_token.mean())
}

/// Attaches `jacobian` as the gradient of `value` with respect to `input` (a custom backward).
fn rowwise_loss(input: Tensor<2>, value: Tensor<1>, jacobian: Tensor<2>) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_rowwise_loss(
        input.into_dispatch(),
        value.detach().into_dispatch(),
        jacobian.detach().into_dispatch(),
    ))
}
