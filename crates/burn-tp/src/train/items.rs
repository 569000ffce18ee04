//! What the Learner sees of a step at dp > 1 ([`DpItem`]: one item over every replica's batch)
//! and how a batch crosses processes ([`ProcessBatch`]).

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::{Result, TpError, ops};

/// A batch that a replica's leader can send to its tp peers in other processes (ranks as
/// processes, [`TensorParallel::on_processes`](super::TensorParallel::on_processes)): its tensors' data, and the batch rebuilt from
/// them on the peer's device. Megatron's `broadcast_data`, for the user's batch type.
///
/// ```ignore
/// impl ProcessBatch for MyBatch {
///     fn to_data(&self) -> Vec<TensorData> {
///         vec![self.ids.to_data(), self.targets.to_data()]
///     }
///     fn from_data(mut data: Vec<TensorData>, device: &Device) -> Self {
///         let targets = Tensor::from_data(data.pop().unwrap(), device);
///         let ids = Tensor::from_data(data.pop().unwrap(), device);
///         Self { ids, targets }
///     }
/// }
/// ```
pub trait ProcessBatch: Sized {
    /// The batch's tensors, in an order [`ProcessBatch::from_data`] reads back.
    fn to_data(&self) -> Vec<TensorData>;
    /// The batch from what [`ProcessBatch::to_data`] gave, on `device`.
    fn from_data(data: Vec<TensorData>, device: &Device) -> Self;
}

/// A training step's output item made the item of the whole step, over every replica's batch:
/// the loss averaged over dp, the predictions and targets gathered, so the Learner's metrics,
/// dashboard and logs show what they would without data parallelism. Each replica's leader
/// calls it on its item (collective over the leaders' `dp_group`: every leader calls it once
/// per step); world rank 0 reports the result. burn-train's classification, multi-label and
/// regression outputs have it; a custom output averages its loss with [`mean_over`] and
/// gathers its batch tensors with [`gather_float`] / [`gather_int`] (the replicas' batches may
/// differ in size: a split's last batch).
pub trait DpItem: Sized {
    /// This replica's item as the whole step's (itself when `dp_group` has one rank).
    ///
    /// # Errors
    /// A collective's error.
    fn dp_merge(self, dp_group: &ProcessGroup) -> Result<Self>;
}

/// `x` (detached) averaged over `group`: a replica's loss as the step's.
///
/// # Errors
/// The collective's.
pub fn mean_over(x: Tensor<1>, group: &ProcessGroup) -> Result<Tensor<1>> {
    match group.world_size() {
        1 => Ok(x),
        _ => ops::all_reduce(x.detach(), ReduceOp::Avg, group),
    }
}

/// `x` (detached) of every rank of `group`, concatenated on dim 0 in rank order: a replica's
/// predictions as the step's. The ranks' dim 0 may differ (a split's last batch); the values
/// travel as f32.
///
/// # Errors
/// The collectives', or ranks whose tensors differ past dim 0.
pub fn gather_float<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>> {
    if group.world_size() == 1 {
        return Ok(x);
    }
    let (device, dims) = (x.device(), x.dims());
    let values: Vec<f32> = x.detach().into_data().iter::<f32>().collect();
    let (all, dims) = gather_rows(values, dims, group)?;
    Ok(Tensor::from_data(TensorData::new(all, dims), &device))
}

/// [`gather_float`] for integer tensors (targets, class indices): their values as i64.
///
/// # Errors
/// As [`gather_float`].
pub fn gather_int<const D: usize>(
    x: Tensor<D, Int>,
    group: &ProcessGroup,
) -> Result<Tensor<D, Int>> {
    if group.world_size() == 1 {
        return Ok(x);
    }
    let (device, dims) = (x.device(), x.dims());
    let values: Vec<i64> = x.into_data().iter::<i64>().collect();
    let (all, dims) = gather_rows(values, dims, group)?;
    Ok(Tensor::from_data(TensorData::new(all, dims), &device))
}

/// Every rank's rows (`values`, row-major of `dims`) in rank order, and their dims: each rank's
/// row count first, then the rows padded to the most rows, the padding dropped.
fn gather_rows<E: burn_tp_comm::CommElement + Default, const D: usize>(
    mut values: Vec<E>,
    mut dims: [usize; D],
    group: &ProcessGroup,
) -> Result<(Vec<E>, [usize; D])> {
    let row: usize = dims[1..].iter().product();
    let mine = [dims[0] as i64, row as i64];
    let all = group.all_gather(mine.to_vec())?;
    if let Some(other) = all.chunks(2).find(|c| c[1] != mine[1]) {
        return Err(TpError::Config(format!(
            "DpItem: the replicas' tensors differ past dim 0 ({} values per row here, {} on \
             another)",
            row, other[1]
        )));
    }
    let rows: Vec<usize> = all.chunks(2).map(|c| c[0] as usize).collect();
    let most = rows.iter().copied().max().unwrap_or(0);
    values.resize(most * row, E::default());
    let padded = group.all_gather(values)?;
    let mut out = Vec::with_capacity(rows.iter().sum::<usize>() * row);
    for (r, &n) in rows.iter().enumerate() {
        out.extend_from_slice(&padded[r * most * row..(r * most + n) * row]);
    }
    dims[0] = rows.iter().sum();
    Ok((out, dims))
}

/// [`DpItem`] for burn-train's outputs (`loss`, `output`, `targets`; the targets gathered by
/// `$targets`).
macro_rules! dp_item {
    ($output:ty, $targets:ident) => {
        impl DpItem for $output {
            fn dp_merge(self, dp_group: &ProcessGroup) -> Result<Self> {
                Ok(Self {
                    loss: mean_over(self.loss, dp_group)?,
                    output: gather_float(self.output, dp_group)?,
                    targets: $targets(self.targets, dp_group)?,
                })
            }
        }
    };
}

dp_item!(burn_train::ClassificationOutput, gather_int);
dp_item!(burn_train::MultiLabelClassificationOutput, gather_int);
dp_item!(burn_train::RegressionOutput, gather_float);
