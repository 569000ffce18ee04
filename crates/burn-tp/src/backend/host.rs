//! The host transport: a collective on backend primitives through `burn-tp-comm`'s host buffers
//! (right for the CPU backends, where a rank is a thread). The trait's default bodies call these;
//! device backends reuse the helpers (dtype, dim-first moves, slicing).

use std::sync::{Arc, Mutex};

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, Element, Shape, Slice, TensorData};
use burn_tp_comm::{CommElement, CommError, DType as CommDType, ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};

use super::types::{Collective, CollectiveOutput, PendingCollective, Posted};

/// A collective in flight on some transport (`Any`: a device backend finds its own work again).
pub(crate) trait InFlight: std::any::Any + Send + Sync {
    /// Waits for the whole result (once), collective dim first.
    fn finish(&self) -> Result<TensorData, CommError>;
    /// For an all-gather: waits for rank `part`'s shard only.
    fn part(&self, part: usize) -> Result<TensorData, CommError>;
}

/// A `burn-tp-comm` work handle with the shapes of its output and of one input shard.
struct HostWork<T> {
    work: Mutex<Option<Work<Vec<T>>>>,
    out_shape: Shape,
    shard_shape: Shape,
}

impl<T: CommElement + Element> InFlight for HostWork<T> {
    fn finish(&self) -> Result<TensorData, CommError> {
        let work = self.work.lock().unwrap_or_else(|e| e.into_inner()).take();
        let work =
            work.ok_or_else(|| CommError::Backend("a collective was resolved twice".into()))?;
        work.wait()
            .map(|v| TensorData::new(v, self.out_shape.clone()))
    }
    fn part(&self, part: usize) -> Result<TensorData, CommError> {
        let guard = self.work.lock().unwrap_or_else(|e| e.into_inner());
        let work = guard
            .as_ref()
            .ok_or_else(|| CommError::Backend("a part of a resolved collective".into()))?;
        work.wait_part(part)
            .map(|v| TensorData::new(v, self.shard_shape.clone()))
    }
}

/// The communication element type of a tensor dtype, where the transports carry it.
pub(crate) fn comm_dtype(dtype: DType) -> Option<CommDType> {
    match dtype {
        DType::F32 => Some(CommDType::F32),
        DType::F64 => Some(CommDType::F64),
        DType::F16 => Some(CommDType::F16),
        DType::BF16 => Some(CommDType::BF16),
        DType::I64 => Some(CommDType::I64),
        _ => None,
    }
}

/// A call on a host buffer of whatever element type the data holds.
pub(crate) trait HostCall {
    /// What the call returns.
    type Output;
    /// Runs on the values.
    fn call<T: CommElement + Element>(self, values: Vec<T>, shape: Shape) -> Self::Output;
}

/// The one dtype switch of the host transport: `call` on `data`'s values, typed.
pub(crate) fn with_host_values<C: HostCall>(
    data: TensorData,
    call: C,
) -> Result<C::Output, CommError> {
    let shape = data.shape().clone();
    let dtype = data.dtype();
    let err = |e| CommError::Backend(format!("reading a {dtype:?} tensor: {e:?}"));
    Ok(match comm_dtype(dtype) {
        Some(CommDType::F32) => call.call(data.try_into_vec::<f32>().map_err(err)?, shape),
        Some(CommDType::F64) => call.call(data.try_into_vec::<f64>().map_err(err)?, shape),
        Some(CommDType::F16) => call.call(data.try_into_vec::<f16>().map_err(err)?, shape),
        Some(CommDType::BF16) => call.call(data.try_into_vec::<bf16>().map_err(err)?, shape),
        Some(CommDType::I64) => call.call(data.try_into_vec::<i64>().map_err(err)?, shape),
        None => {
            return Err(CommError::Backend(format!(
                "unsupported dtype {dtype:?} for a collective"
            )));
        }
    })
}

/// `x` with `dim` moved first (a view): rank-order concatenation (chunking) of the flat buffer is
/// then concatenation (chunking) along `dim`. Its own inverse.
pub(crate) fn dim_first<B: Backend>(x: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    if dim == 0 {
        x
    } else {
        B::float_swap_dims(x, 0, dim)
    }
}

/// Indices `range` of `dim` (a view).
pub(crate) fn slice_dim<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    range: std::ops::Range<usize>,
) -> FloatTensor<B> {
    let mut slices = vec![Slice::full(); x.shape().num_dims()];
    slices[dim] = Slice::new(range.start as isize, Some(range.end as isize), 1);
    B::float_slice(x, &slices)
}

/// Rows `range` of dim 0 (a view).
pub(crate) fn rows<B: Backend>(x: FloatTensor<B>, range: std::ops::Range<usize>) -> FloatTensor<B> {
    slice_dim::<B>(x, 0, range)
}

/// This rank's chunk of `dim` (a view; no copy, no communication).
pub(crate) fn local_chunk<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    group: &ProcessGroup,
) -> FloatTensor<B> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return x;
    }
    let chunk = x.shape()[dim] / world;
    slice_dim::<B>(x, dim, rank * chunk..(rank + 1) * chunk)
}

/// Posts `op` of `x` through the host.
pub(crate) fn host_start<B: Backend>(
    x: FloatTensor<B>,
    op: Collective,
    group: ProcessGroup,
) -> PendingCollective<B> {
    if op.is_local(&group) {
        return PendingCollective::new(x, op, group, Posted::Local);
    }
    let moved = dim_first::<B>(x.clone(), op.dim());
    let posted = burn::tensor::read_sync(B::float_into_data(moved))
        .map_err(|e| CommError::Backend(format!("{op:?}: reading the tensor failed: {e:?}")))
        .and_then(|data| with_host_values(data, PostOnHost { op, group: &group }));
    let posted = match posted {
        Ok(Ok(work)) => Posted::InFlight(work),
        Ok(Err(e)) | Err(e) => Posted::Failed(e),
    };
    PendingCollective::new(x, op, group, posted)
}

struct PostOnHost<'a> {
    op: Collective,
    group: &'a ProcessGroup,
}

impl HostCall for PostOnHost<'_> {
    type Output = Result<Arc<dyn InFlight>, CommError>;

    fn call<T: CommElement + Element>(self, values: Vec<T>, shard_shape: Shape) -> Self::Output {
        let (op, group) = (self.op, self.group);
        let world = group.world_size();
        let mut out_shape = shard_shape.clone();
        let dims = shard_shape.to_vec();
        let work: Work<Vec<T>> = match op {
            Collective::AllGather { .. } | Collective::GatherFromRegion { .. } => {
                out_shape[0] *= world;
                group.all_gather_shaped_async(values, dims)
            }
            Collective::ReduceScatter { .. } => {
                out_shape[0] /= world;
                group.reduce_scatter_shaped_async(values, dims)?
            }
            Collective::AllReduce(r) => group.all_reduce_shaped_async(values, dims, r),
            Collective::ReduceFromRegion => {
                group.all_reduce_shaped_async(values, dims, ReduceOp::Sum)
            }
            Collective::CopyToRegion | Collective::ScatterToRegion { .. } => {
                unreachable!("local forwards post nothing")
            }
        };
        Ok(Arc::new(HostWork {
            work: Mutex::new(Some(work)),
            out_shape,
            shard_shape,
        }))
    }
}

/// Waits for a collective started by [`host_start`] and returns its output.
pub(crate) fn host_resolve<B: Backend>(pending: PendingCollective<B>) -> CollectiveOutput<B> {
    let PendingCollective {
        input,
        op,
        group,
        posted,
    } = pending;
    match posted {
        Posted::Local => CollectiveOutput::Done(match op {
            Collective::ScatterToRegion { dim } => local_chunk::<B>(input, dim, &group),
            _ => input,
        }),
        Posted::Failed(e) => CollectiveOutput::Failed(e),
        Posted::InFlight(inner) => inner
            .finish()
            .map(|data| dim_first::<B>(B::float_from_data(data, &input.device()), op.dim()))
            .into(),
    }
}

/// Rank `part`'s shard of an all-gather started by [`host_start`], as soon as it has arrived.
pub(crate) fn host_resolve_part<B: Backend>(
    pending: PendingCollective<B>,
    part: usize,
) -> CollectiveOutput<B> {
    if let Some(e) = part_unsupported(pending.op) {
        return CollectiveOutput::Failed(e);
    }
    let device = pending.input.device();
    match pending.posted {
        // Nothing in flight: a group of one, whose only part is the input.
        Posted::Local => CollectiveOutput::Done(pending.input),
        Posted::Failed(e) => CollectiveOutput::Failed(e),
        Posted::InFlight(inner) => inner
            .part(part)
            .map(|data| B::float_from_data(data, &device))
            .into(),
    }
}

/// `tp_resolve_part` serves dim-0 all-gathers only (the ring schedule's): the error otherwise.
pub(crate) fn part_unsupported(op: Collective) -> Option<CommError> {
    (op.dim() != 0 || !matches!(op, Collective::AllGather { .. }))
        .then(|| CommError::Backend(format!("tp_resolve_part of {op:?}")))
}
