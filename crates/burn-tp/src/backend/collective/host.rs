//! The host transport: a collective on backend primitives through `burn-tp-comm`'s host buffers
//! (right for the CPU backends, where a rank is a thread). The trait's default bodies call these;
//! device backends reuse the helpers (dtype, dim-first moves, slicing).

use std::sync::{Arc, Mutex};

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, Element, Shape, Slice, TensorData};
use burn_tp_comm::{
    CommElement, CommError, DType as CommDType, ProcessGroup, RecvBuf, ReduceOp, SendBuf, Work,
};
use half::{bf16, f16};

use crate::backend::collective::pool::PooledBuf;
use crate::backend::types::{Collective, CollectiveOutput, PendingCollective, TransportWork};

/// A `burn-tp-comm` work handle writing into a pooled buffer, with the shapes of its output
/// and of one input shard.
struct HostWork<T> {
    work: Mutex<Option<Work<PooledBuf<T>>>>,
    out_shape: Shape,
    shard_shape: Shape,
}

impl<T: HostElement> TransportWork for HostWork<T> {
    fn finish(&self) -> Result<TensorData, CommError> {
        let work = self.work.lock().unwrap_or_else(|e| e.into_inner()).take();
        let work =
            work.ok_or_else(|| CommError::Backend("a collective was resolved twice".into()))?;
        // The pooled buffer becomes the tensor's storage: no copy.
        work.wait()
            .map(|buf| TensorData::from_bytes(buf.into_bytes(), self.out_shape.clone(), T::dtype()))
    }
    fn part(&self, part: usize, rows: std::ops::Range<usize>) -> Result<TensorData, CommError> {
        let guard = self.work.lock().unwrap_or_else(|e| e.into_inner());
        let work = guard
            .as_ref()
            .ok_or_else(|| CommError::Backend("a part of a resolved collective".into()))?;
        let row = self.shard_shape.num_elements() / self.shard_shape[0].max(1);
        let mut shape = self.shard_shape.clone();
        shape[0] = rows.len();
        // Into a pooled buffer: a fresh allocation per chunk would page-fault on every call.
        work.with_part_range(part, rows.start * row..rows.end * row, |v: &[T]| {
            let mut buf = PooledBuf::<T>::new(v.len());
            buf.as_mut_slice().copy_from_slice(v);
            TensorData::from_bytes(buf.into_bytes(), shape, T::dtype())
        })
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

/// The element types of the host transport.
pub(crate) trait HostElement: CommElement + Element + bytemuck::Pod {}
impl<T: CommElement + Element + bytemuck::Pod> HostElement for T {}

/// A tensor's values as the host transport reads them, typed on demand.
pub(crate) trait HostRead {
    /// The values as `T` (the tensor's dtype), read in place where the backend allows.
    fn values<T: HostElement>(self) -> Result<Box<dyn SendBuf<T>>, CommError>;
}

/// Values copied out of the backend (any backend: `float_into_data`).
pub(crate) struct DataRead(pub(crate) TensorData);

impl HostRead for DataRead {
    fn values<T: HostElement>(self) -> Result<Box<dyn SendBuf<T>>, CommError> {
        let dtype = self.0.dtype();
        self.0
            .try_into_vec::<T>()
            .map(|v| Box::new(v) as Box<dyn SendBuf<T>>)
            .map_err(|e| CommError::Backend(format!("reading a {dtype:?} tensor: {e:?}")))
    }
}

/// A call on a host buffer of whatever element type the data holds.
pub(crate) trait HostCall {
    /// What the call returns.
    type Output;
    /// Runs on the values (`shape`).
    fn call<T: HostElement>(self, values: Box<dyn SendBuf<T>>, shape: Shape) -> Self::Output;
}

/// The one dtype switch of the host transport: `call` on the values `read` gives, typed.
pub(crate) fn with_host_values<R: HostRead, C: HostCall>(
    dtype: DType,
    shape: Shape,
    read: R,
    call: C,
) -> Result<C::Output, CommError> {
    Ok(match comm_dtype(dtype) {
        Some(CommDType::F32) => call.call(read.values::<f32>()?, shape),
        Some(CommDType::F64) => call.call(read.values::<f64>()?, shape),
        Some(CommDType::F16) => call.call(read.values::<f16>()?, shape),
        Some(CommDType::BF16) => call.call(read.values::<bf16>()?, shape),
        Some(CommDType::I64) => call.call(read.values::<i64>()?, shape),
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
    if range.start == 0 && range.end == x.shape()[dim] {
        return x; // the whole dim: not even a view
    }
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

/// Posts `op` of `x` through the host, reading the values out of the backend.
pub(crate) fn host_start<B: Backend>(
    x: FloatTensor<B>,
    op: Collective,
    group: ProcessGroup,
) -> PendingCollective<B> {
    host_start_with::<B, _>(x, op, group, |moved| {
        burn::tensor::read_sync(B::float_into_data(moved))
            .map(DataRead)
            .map_err(|e| CommError::Backend(format!("reading the tensor failed: {e:?}")))
    })
}

/// Posts `op` of `x` through the host; `read` gives the values of `x` with the collective's dim
/// first (a backend that can reads them in place).
pub(crate) fn host_start_with<B: Backend, R: HostRead>(
    x: FloatTensor<B>,
    op: Collective,
    group: ProcessGroup,
    read: impl FnOnce(FloatTensor<B>) -> Result<R, CommError>,
) -> PendingCollective<B> {
    if op.is_local(&group) {
        return PendingCollective::new(x, op, group, Ok(None));
    }
    let moved = dim_first::<B>(x.clone(), op.dim());
    let (dtype, shape) = (moved.dtype(), moved.shape());
    let posted = read(moved)
        .and_then(|r| with_host_values(dtype, shape, r, PostOnHost { op, group: &group }))
        .map_err(|e| match e {
            CommError::Backend(m) => CommError::Backend(format!("{op:?}: {m}")),
            e => e,
        });
    let posted = match posted {
        Ok(Ok(work)) => Ok(Some(work)),
        Ok(Err(e)) | Err(e) => {
            // This rank will not post: its peers must hear now, not at their timeout.
            group.abort(&e);
            Err(e)
        }
    };
    PendingCollective::new(x, op, group, posted)
}

/// A tensor's values with its shape, which the transport checks across ranks and names in errors.
struct Shaped<T> {
    values: Box<dyn SendBuf<T>>,
    dims: Vec<usize>,
}

impl<T: 'static> SendBuf<T> for Shaped<T> {
    fn as_slice(&self) -> &[T] {
        self.values.as_slice()
    }
    fn shape(&self) -> Vec<usize> {
        self.dims.clone()
    }
}

struct PostOnHost<'a> {
    op: Collective,
    group: &'a ProcessGroup,
}

impl HostCall for PostOnHost<'_> {
    type Output = Result<Arc<dyn TransportWork>, CommError>;

    fn call<T: HostElement>(self, values: Box<dyn SendBuf<T>>, shard_shape: Shape) -> Self::Output {
        let (op, group) = (self.op, self.group);
        let world = group.world_size();
        let len = shard_shape.num_elements();
        let mut out_shape = shard_shape.clone();
        let values = Shaped {
            values,
            dims: shard_shape.to_vec(),
        };
        let work = match op {
            Collective::AllGather { .. } | Collective::GatherFromRegion { .. } => {
                out_shape[0] *= world;
                group.all_gather_async(values, PooledBuf::new(len * world))?
            }
            Collective::ReduceScatter { .. } => {
                out_shape[0] /= world;
                group.reduce_scatter_async(values, PooledBuf::new(len / world))?
            }
            Collective::AllReduce(r) => group.all_reduce_async(values, r, PooledBuf::new(len))?,
            Collective::ReduceFromRegion => {
                group.all_reduce_async(values, ReduceOp::Sum, PooledBuf::new(len))?
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
        Ok(None) => CollectiveOutput::Done(match op {
            Collective::ScatterToRegion { dim } => local_chunk::<B>(input, dim, &group),
            _ => input,
        }),
        Err(e) => CollectiveOutput::Failed(e),
        Ok(Some(inner)) => inner
            .finish()
            .map(|data| dim_first::<B>(B::float_from_data(data, &input.device()), op.dim()))
            .into(),
    }
}

/// Rows of chunk `chunk` of `chunks` of `m` rows.
pub(crate) fn chunk_rows(m: usize, chunk: usize, chunks: usize) -> std::ops::Range<usize> {
    let chunks = chunks.max(1);
    chunk * m / chunks..(chunk + 1) * m / chunks
}

/// Chunk `chunk` of `chunks` (rows, dim 0) of rank `part`'s shard of an all-gather started by
/// [`host_start`], as soon as it has arrived.
pub(crate) fn host_resolve_part<B: Backend>(
    pending: PendingCollective<B>,
    part: usize,
    chunk: usize,
    chunks: usize,
) -> CollectiveOutput<B> {
    if let Some(e) = part_unsupported(pending.op) {
        return CollectiveOutput::Failed(e);
    }
    let device = pending.input.device();
    let rows = chunk_rows(pending.input.shape()[0], chunk, chunks);
    match pending.posted {
        // Nothing in flight: a group of one, whose only part is the input.
        Ok(None) => CollectiveOutput::Done(crate::backend::collective::host::rows::<B>(
            pending.input,
            rows,
        )),
        Err(e) => CollectiveOutput::Failed(e),
        Ok(Some(inner)) => inner
            .part(part, rows)
            .map(|data| B::float_from_data(data, &device))
            .into(),
    }
}

/// `tp_resolve_part` serves dim-0 all-gathers only (the ring schedule's): the error otherwise.
pub(crate) fn part_unsupported(op: Collective) -> Option<CommError> {
    (op.dim() != 0 || !matches!(op, Collective::AllGather { .. }))
        .then(|| CommError::Backend(format!("tp_resolve_part of {op:?}")))
}

/// `Ok` if a buffer of `shape` with `strides` is dense row-major, so that a transport writing
/// (or reading) `shape.num_elements()` consecutive elements from its start fills exactly the
/// tensor: no padding between rows (a pitched allocation such as cubecl's "optimized" layout
/// pads each row's bytes, and a dense write into it scrambles the rows) and no broadcast.
/// Axes of size 1 carry any stride.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the device path's (`cuda.rs`) check
pub(crate) fn dense_layout(
    what: &str,
    shape: &[usize],
    strides: &[usize],
) -> Result<(), CommError> {
    let mut want = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != want {
            return Err(CommError::Backend(format!(
                "{what}: shape {shape:?} with strides {strides:?} is not dense (a transport \
                 writes the elements back to back)"
            )));
        }
        want *= n;
    }
    Ok(())
}

/// `x` in the dtype the fused ops compute in: half dtypes widened to f32, f32 and f64 as they
/// are.
pub(crate) fn widen<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    match x.dtype() {
        burn::tensor::DType::F16 | burn::tensor::DType::BF16 => {
            B::float_cast(x, burn::tensor::FloatDType::F32)
        }
        _ => x,
    }
}

/// `x` in `dtype` (no op when it is already).
pub(crate) fn cast_to<B: Backend>(x: FloatTensor<B>, dtype: burn::tensor::DType) -> FloatTensor<B> {
    if x.dtype() == dtype {
        x
    } else {
        B::float_cast(x, dtype.into())
    }
}

#[cfg(test)]
mod tests {
    use super::dense_layout;

    #[test]
    fn dense_layouts_pass_and_pitched_ones_are_refused() {
        assert!(dense_layout("x", &[4, 96], &[96, 1]).is_ok());
        assert!(dense_layout("x", &[2, 3, 100], &[300, 100, 1]).is_ok());
        // Size-1 axes carry any stride (what cubecl keeps after a reshape).
        assert!(dense_layout("x", &[1, 3, 100], &[7, 100, 1]).is_ok());
        assert!(dense_layout("x", &[], &[]).is_ok());
        // A pitched f32 row of 96 elements (384 bytes) padded to 512 bytes: 128 elements.
        let e = dense_layout("all_gather output", &[4, 96], &[128, 1]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("all_gather output")
                && msg.contains("[4, 96]")
                && msg.contains("[128, 1]"),
            "{msg}"
        );
        // A bf16 row of 100 (200 bytes) padded to 256 bytes; a transposed view; a broadcast.
        assert!(dense_layout("x", &[2, 3, 100], &[384, 128, 1]).is_err());
        assert!(dense_layout("x", &[3, 4], &[1, 3]).is_err());
        assert!(dense_layout("x", &[3, 4], &[0, 1]).is_err());
    }
}
