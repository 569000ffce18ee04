//! Vocab-parallel cross-entropy: the logits stay sharded over the vocabulary.

use burn::backend::Dispatch;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::backend::TpBackend;
use crate::ops::all_reduce;
use crate::{Result, TpError};

/// Options of [`sharded_cross_entropy_with`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropyOptions {
    /// z-loss coefficient: adds `z_loss * logsumexp^2` per token.
    pub z_loss: f64,
    /// Label smoothing in `[0, 1]` (Burn's `CrossEntropyLoss` `smoothing`), over the real
    /// vocabulary.
    pub label_smoothing: f64,
    /// The real vocabulary when the logits are padded (`V_padded = tp * V_padded/tp`): logit
    /// columns at or past it are masked out of the softmax and get no gradient. `None`: every
    /// column is a real token.
    pub n_vocab: Option<usize>,
    /// Targets equal to this id count for nothing (no loss, no gradient, not in the mean), like
    /// PyTorch's `ignore_index`.
    pub ignore_index: Option<i64>,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        Self {
            z_loss: 0.0,
            label_smoothing: 0.0,
            n_vocab: None,
            ignore_index: None,
        }
    }
}

/// What [`sharded_cross_entropy_with`] returns (replicated on every rank, in the logits' dtype).
#[derive(Clone, Debug)]
pub struct CrossEntropyOutput {
    /// `[n]`: the loss of every token, 0 for the masked and ignored ones.
    pub per_token: Tensor<1>,
    /// `[1]`: the mean over the kept tokens (0 when none is kept).
    pub mean: Tensor<1>,
}

/// Mean cross-entropy of vocab-sharded logits, equal to Burn's `CrossEntropyLoss` on the gathered
/// logits (with `label_smoothing` as its `smoothing`), plus an optional z-loss
/// `z_loss_coef * logsumexp^2` per token. The result is replicated on every rank.
/// [`sharded_cross_entropy_with`] adds padded vocabularies, an ignore index and a loss mask.
///
/// # Shapes
/// - `sharded_logits`: `[n, V / tp]`, rank `r` holding vocab ids `r * V/tp .. (r+1) * V/tp`
/// - `targets`: `[n]`, ids in `0..V` (the same on every rank)
/// - output: `[1]`
///
/// # Errors
/// As [`sharded_cross_entropy_with`].
pub fn sharded_cross_entropy(
    sharded_logits: Tensor<2>,
    targets: Tensor<1, Int>,
    group: &ProcessGroup,
    z_loss_coef: f64,
    label_smoothing: f64,
) -> Result<Tensor<1>> {
    let options = CrossEntropyOptions {
        z_loss: z_loss_coef,
        label_smoothing,
        ..Default::default()
    };
    Ok(sharded_cross_entropy_with(sharded_logits, targets, None, group, &options)?.mean)
}

/// The sharded cross-entropy with per-token losses, a loss mask, an ignore index and a padded
/// vocabulary (see [`CrossEntropyOptions`]); the mean is over the kept tokens only.
///
/// Forward: the max, the target logit and the sum of exponentials (and, for smoothing, the sum of
/// logits) are all-reduced over `group`: two all-reduces of `[n]` / `[n, 3]`, never the logits.
/// Backward: `softmax * (1 + 2 z lse) - (1 - eps) one_hot - eps / V` on the kept rows, computed
/// locally on each shard, no communication. Computed in f32 for f32 / bf16 / f16 logits (as
/// Megatron does), in f64 for f64; the results come back in the logits' dtype.
///
/// # Shapes
/// - `sharded_logits`: `[n, V_padded / tp]`, rank `r` holding vocab ids
///   `r * V_padded/tp .. (r+1) * V_padded/tp`
/// - `targets`: `[n]`, ids in `0..V` or the ignore index (the same on every rank)
/// - `loss_mask`: `[n]`, 1 to keep a token, 0 to drop it (the same on every rank); `None`: all
///
/// # Errors
/// [`TpError::Shape`] if the shapes disagree; [`TpError::Config`] for a smoothing outside
/// `[0, 1]` or an `n_vocab` larger than the logits; [`TpError::OutOfRange`] for a target outside
/// the vocabulary (other than the ignore index); a communication error.
pub fn sharded_cross_entropy_with(
    sharded_logits: Tensor<2>,
    targets: Tensor<1, Int>,
    loss_mask: Option<Tensor<1>>,
    group: &ProcessGroup,
    options: &CrossEntropyOptions,
) -> Result<CrossEntropyOutput> {
    const OP: &str = "sharded_cross_entropy";
    let _scope = burn_tp_comm::profile::scope(OP);
    let [n, v_local] = sharded_logits.dims();
    let [n_t] = targets.dims();
    if n != n_t {
        return Err(TpError::Shape {
            op: OP,
            expected: format!("targets [{n}]"),
            got: vec![n_t],
        });
    }
    if let Some(m) = &loss_mask
        && m.dims() != [n]
    {
        return Err(TpError::Shape {
            op: OP,
            expected: format!("loss_mask [{n}]"),
            got: m.dims().to_vec(),
        });
    }
    let eps = options.label_smoothing;
    if !(0.0..=1.0).contains(&eps) {
        return Err(TpError::Config(format!(
            "label_smoothing must be in [0, 1], got {eps}"
        )));
    }
    let (tp, rank) = (group.world_size(), group.rank());
    let padded = v_local * tp;
    let vocab = options.n_vocab.unwrap_or(padded);
    if vocab > padded || vocab == 0 {
        return Err(TpError::Config(format!(
            "{OP}: n_vocab = {vocab} with logits of {padded} columns over tp = {tp}"
        )));
    }

    // Statistics and jacobian in f32 for half-precision logits (as Megatron does): a bf16 sum
    // of exponentials over the vocabulary loses the target's share. f64 stays f64.
    let dtype = sharded_logits.dtype();
    let compute = if dtype == DType::F64 {
        FloatDType::F64
    } else {
        FloatDType::F32
    };
    let device = sharded_logits.device();

    // Ignored targets look up id 0 (any real id) and are dropped by the keep mask.
    let ignored: Tensor<1, Bool> = match options.ignore_index {
        Some(id) => targets.clone().equal_elem(id),
        None => Tensor::<1, Int>::zeros([n], &device).equal_elem(1),
    };
    let targets = targets.mask_fill(ignored.clone(), 0);
    crate::embedding::check_ids(&targets.clone().unsqueeze::<2>(), vocab)?;
    let mut keep = ignored.bool_not().cast(compute);
    if let Some(m) = loss_mask {
        keep = keep * m.detach().cast(compute);
    }

    let mut logits = sharded_logits.clone().detach().cast(compute);
    // This rank's padded columns (ids >= vocab), masked out of the softmax.
    let first_padded = vocab.saturating_sub(rank * v_local).min(v_local);
    let padding = (first_padded < v_local).then(|| {
        Tensor::<1, Int>::arange(0..v_local as i64, &device)
            .greater_equal_elem(first_padded as i64)
            .unsqueeze::<2>() // [1, v_local]
    });
    if let Some(p) = &padding {
        logits = logits.mask_fill(p.clone().expand([n, v_local]), f64::NEG_INFINITY);
    }
    let m = all_reduce(logits.clone().max_dim(1), ReduceOp::Max, group)?; // [n, 1]
    let shifted = logits - m.clone();
    let exp = shifted.clone().exp();
    let (idx, mine) = crate::embedding::local_ids(targets, v_local, group);
    let mine_2d = mine.unsqueeze_dim::<2>(1); // [n, 1]
    // mask_fill, not a product: a padded column's -inf times 0 would be NaN.
    let picked = shifted
        .clone()
        .gather(1, idx.clone().unsqueeze_dim(1))
        .mask_fill(mine_2d.clone().bool_not(), 0.0);
    let shifted_sum = match &padding {
        Some(p) => shifted.mask_fill(p.clone().expand([n, v_local]), 0.0),
        None => shifted,
    }
    .sum_dim(1);
    let stats = Tensor::cat(vec![picked, exp.clone().sum_dim(1), shifted_sum], 1);
    let stats = all_reduce(stats, ReduceOp::Sum, group)?; // [n, 3]
    let target = stats.clone().slice([0..n, 0..1]);
    let sum_exp = stats.clone().slice([0..n, 1..2]);
    let sum_shifted = stats.slice([0..n, 2..3]);
    let lse = sum_exp.clone().log(); // of the shifted logits
    let mut loss =
        (lse.clone() - target) * (1.0 - eps) + (lse.clone() - sum_shifted / vocab as f64) * eps;
    let lse_full = lse + m;
    let mut softmax_scale = lse_full.ones_like();
    if options.z_loss != 0.0 {
        loss = loss + lse_full.clone().powi_scalar(2) * options.z_loss;
        softmax_scale = softmax_scale + lse_full * (2.0 * options.z_loss);
    }
    let one_hot: Tensor<2> = idx.one_hot::<2>(v_local).cast(compute) * mine_2d.cast(compute);
    let mut uniform = Tensor::<2>::full(
        [1, v_local],
        eps / vocab as f64,
        (&device, DType::from(compute)),
    );
    if let Some(p) = padding {
        uniform = uniform.mask_fill(p, 0.0);
    }
    let jacobian = exp / sum_exp * softmax_scale - one_hot * (1.0 - eps) - uniform;
    let keep_2d = keep.clone().unsqueeze_dim::<2>(1);
    let per_token = rowwise_loss(
        sharded_logits,
        (loss * keep_2d.clone()).reshape([n]).cast(dtype),
        (jacobian * keep_2d).cast(dtype),
    );
    // The mean over the kept tokens: 1 / count flows into the gradient.
    let count = keep.sum().clamp_min(1.0).cast(dtype);
    let mean = per_token.clone().sum() / count;
    Ok(CrossEntropyOutput { per_token, mean })
}

/// [`sharded_cross_entropy_with`] of a language model's vocab-sharded logits
/// `[seq, batch, V_p / tp]` against `targets` (and `loss_mask`) `[seq, batch]`: the models' loss
/// of their logits, each with its own options.
///
/// # Errors
/// As [`sharded_cross_entropy_with`].
pub(crate) fn sequence_cross_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    loss_mask: Option<Tensor<2>>,
    group: &ProcessGroup,
    options: &CrossEntropyOptions,
) -> Result<CrossEntropyOutput> {
    let [s, b, v] = logits.dims();
    sharded_cross_entropy_with(
        logits.reshape([s * b, v]),
        targets.reshape([s * b]),
        loss_mask.map(|m| m.reshape([s * b])),
        group,
        options,
    )
}

/// Attaches `jacobian` as the gradient of `value` with respect to `input` (a custom backward).
fn rowwise_loss(input: Tensor<2>, value: Tensor<1>, jacobian: Tensor<2>) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_rowwise_loss(
        input.into_dispatch(),
        value.detach().into_dispatch(),
        jacobian.detach().into_dispatch(),
    ))
}
