//! The collectives on burn's CUDA backend (the `Cube` selector), over NCCL (feature `cuda`).
//!
//! A [`ProcessGroup`] made with [`ProcessGroup::from_nccl`] carries an
//! [`NcclGroup`]; the ops below hand NCCL the device pointers of the cubecl tensors
//! (`ComputeClient::get_resource`), no host copy. Any other group (ranks as threads holding CUDA
//! tensors) takes the host path of the trait's default bodies.
//!
//! Stream ordering, conservatively: cubecl does not expose its compute stream, so NCCL's
//! communication stream cannot wait on a CUDA event of it. Instead:
//! - **start** allocates the output dense (NCCL writes `n` elements back to back; cubecl's
//!   default "optimized" allocation pads rows), takes both device pointers (which makes this
//!   thread's cubecl stream wait for any other stream that wrote them), *then* syncs that stream
//!   (every kernel writing the input has finished), and posts the collective on the
//!   communication stream;
//! - kernels queued between start and resolve run on cubecl's stream *beside* the collective (the
//!   overlap the parallel layers are written for is kept on the device);
//! - **resolve** blocks the host on the collective's completion event (with the group's timeout;
//!   a CUDA fault is an error at once), after which cubecl's later kernels read the output;
//! - a collective dropped unresolved blocks the host in its `Drop` until NCCL is done with the
//!   buffers, before they go back to cubecl's pool.
//!
//! What this loses against an event-ordered implementation: the host sync at start drains
//! cubecl's queue (the GPU idles while the host enqueues the next kernels), and the host block at
//! resolve stops the host from running ahead. The fix, noted in docs/DESIGN.md, is an event
//! recorded on cubecl's stream (or NCCL issued on it), once cubecl exposes either.
//!
//! At world size 1 collectives return their input without a call, unless the group asks for the
//! device path ([`NcclGroup::with_posts_at_world_one`]): how one GPU checks this file for real.

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::backend::ops::FloatTensorOps;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_tp_comm::nccl::{self, NcclGroup, RawOp};
use burn_tp_comm::{CommError, ProcessGroup, ReduceOp};
use cubecl_runtime::runtime::Runtime;

use super::types::TransportWork;
use super::{Collective, CollectiveOutput, PendingCollective, TpBackend};
use crate::backend::collective::host::{
    chunk_rows, comm_dtype, dense_layout, dim_first, host_resolve, host_resolve_part, host_start,
    part_unsupported, rows,
};

type Server = <CudaRuntime as Runtime>::Server;

impl TpBackend for CubeBackend {
    // The GEMM hook: cuBLAS (`cublas.rs`), burn's matmul where cuBLAS cannot read the layout.
    fn tp_matmul(a: CubeTensor, b: CubeTensor) -> CubeTensor {
        match crate::backend::matmul::cublas::matmul(&a, &b, None) {
            Ok(out) => out,
            Err(reason) => {
                crate::backend::matmul::cublas::note_fallback(&reason);
                Self::float_matmul(a, b)
            }
        }
    }

    fn tp_matmul_acc(acc: CubeTensor, a: CubeTensor, b: CubeTensor) -> CubeTensor {
        match crate::backend::matmul::cublas::matmul(&a, &b, Some(&acc)) {
            Ok(out) => out,
            // A shared accumulator: the product, then the add.
            Err(_) => Self::float_add(acc, Self::tp_matmul(a, b)),
        }
    }

    fn tp_start(x: CubeTensor, op: Collective, group: ProcessGroup) -> PendingCollective<Self> {
        match group.nccl().cloned() {
            Some(nccl) if op.communicates() && nccl.posts() => device_start(x, op, group, nccl),
            _ => host_start::<Self>(x, op, group),
        }
    }

    fn tp_resolve(pending: PendingCollective<Self>) -> CollectiveOutput<Self> {
        match device_work(&pending) {
            Some(work) => work.resolve().into(),
            None => host_resolve::<Self>(pending),
        }
    }

    fn tp_resolve_part(
        pending: PendingCollective<Self>,
        part: usize,
        chunk: usize,
        chunks: usize,
    ) -> CollectiveOutput<Self> {
        let Some(work) = device_work(&pending) else {
            return host_resolve_part::<Self>(pending, part, chunk, chunks);
        };
        if let Some(e) = part_unsupported(pending.op) {
            return CollectiveOutput::Failed(e);
        }
        // NCCL's all-gather completes as a whole: wait for it, then view the part's rows.
        let world = pending.group.world_size();
        work.completed()
            .map(|out| {
                let n = out.shape()[0] / world;
                let r = chunk_rows(n, chunk, chunks);
                rows::<Self>(out, part * n + r.start..part * n + r.end)
            })
            .into()
    }
}

fn device_work(pending: &PendingCollective<CubeBackend>) -> Option<Arc<NcclWork>> {
    let Ok(Some(inner)) = &pending.posted else {
        return None;
    };
    (inner.clone() as Arc<dyn Any + Send + Sync>)
        .downcast::<NcclWork>()
        .ok()
}

/// A cubecl CUDA buffer's storage, bound in place (`ManagedResource`: never freed, reused or
/// moved while held) so that the raw device pointer NCCL was given stays valid.
type DeviceResource = cubecl_runtime::storage::ManagedResource<
    <<Server as cubecl_runtime::server::ServerStorage>::Storage as cubecl_runtime::storage::ComputeStorage>::Resource,
>;

/// Holds a buffer's storage in place while NCCL uses its raw pointer; only kept and dropped.
struct Pinned(#[allow(dead_code)] DeviceResource);
// Safety: `DeviceResource` is `Send` (cubecl marks its `GpuResource` so) but not `Sync`: it
// carries a raw `*mut c_void` (cubecl's kernel-argument binding). `Pinned` never reads it: the
// field is private and only dropped, so a `&Pinned` shared between threads gives access to
// nothing.
unsafe impl Sync for Pinned {}

/// A collective posted on NCCL's communication stream from cubecl buffers.
struct NcclWork {
    work: Mutex<Option<nccl::DeviceWork>>,
    /// Ok(()) once the host has seen the completion event, or the error it got.
    state: Mutex<Option<Result<(), CommError>>>,
    /// The output, collective dim first (`[.., n_d * tp, ..]` moved to dim 0).
    output: CubeTensor,
    dim: usize,
    // The contiguous input and both storages, alive until the collective has completed.
    _input: CubeTensor,
    _pins: [Pinned; 2],
}

impl TransportWork for NcclWork {
    fn finish(&self) -> Result<burn::tensor::TensorData, CommError> {
        Err(CommError::Backend(
            "a device collective resolved through the host".into(),
        ))
    }
    fn part(
        &self,
        _: usize,
        _: std::ops::Range<usize>,
    ) -> Result<burn::tensor::TensorData, CommError> {
        self.finish()
    }
}

impl Drop for NcclWork {
    fn drop(&mut self) {
        // Dropped unresolved (an error elsewhere, a discarded handle): NCCL may still read the
        // input or write the output, whose storage goes back to cubecl's pool right after this.
        let work = self
            .work
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(work) = work
            && let Err(e) = work.wait_host()
        {
            eprintln!("burn-tp: a device collective dropped unresolved: {e}");
        }
    }
}

impl NcclWork {
    /// Blocks until the collective completed (once; later calls return the same outcome) and
    /// returns the output, collective dim first.
    fn completed(&self) -> Result<CubeTensor, CommError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.is_none() {
            let work = self.work.lock().unwrap_or_else(|e| e.into_inner()).take();
            *state = Some(match work {
                Some(w) => w.wait_host(),
                None => Err(CommError::Backend("a collective without work".into())),
            });
        }
        match state.as_ref().expect("set above") {
            Ok(()) => Ok(self.output.clone()),
            Err(e) => Err(e.clone()),
        }
    }

    fn resolve(&self) -> Result<CubeTensor, CommError> {
        Ok(dim_first::<CubeBackend>(self.completed()?, self.dim))
    }
}

fn failed(
    op: Collective,
    group: ProcessGroup,
    x: CubeTensor,
    e: CommError,
) -> PendingCollective<CubeBackend> {
    PendingCollective::new(x, op, group, Err(e))
}

fn device_start(
    x: CubeTensor,
    op: Collective,
    group: ProcessGroup,
    nccl: Arc<NcclGroup>,
) -> PendingCollective<CubeBackend> {
    let Some(dtype) = comm_dtype(x.dtype) else {
        let e = CommError::Backend(format!("{op:?}: unsupported dtype {:?} on NCCL", x.dtype));
        return failed(op, group, x, e);
    };
    let world = group.world_size();
    let (raw, dim) = match op {
        Collective::AllGather { dim } | Collective::GatherFromRegion { dim } => {
            (RawOp::AllGather, dim)
        }
        Collective::ReduceScatter { dim } => (RawOp::ReduceScatter, dim),
        Collective::AllReduce(r) => (RawOp::AllReduce(r), 0),
        Collective::ReduceFromRegion => (RawOp::AllReduce(ReduceOp::Sum), 0),
        Collective::CopyToRegion | Collective::ScatterToRegion { .. } => {
            unreachable!("local forwards take the host path, which posts nothing")
        }
    };
    // The collective's dim first, contiguous: rank-order concatenation (chunking) of the flat
    // buffer is then concatenation (chunking) along that dim.
    let input = into_contiguous(dim_first::<CubeBackend>(x.clone(), dim));
    let mut out_dims = input.shape().to_vec();
    match raw {
        RawOp::AllGather => out_dims[0] *= world,
        RawOp::ReduceScatter => {
            if !out_dims[0].is_multiple_of(world) {
                let e = CommError::NotDivisible {
                    op: "reduce_scatter",
                    len: out_dims[0],
                    world_size: world,
                };
                return failed(op, group, x, e);
            }
            out_dims[0] /= world;
        }
        _ => {}
    }
    let out_shape = Shape::from(out_dims);
    // Uninitialised (the collective writes every element) and dense: `float_empty` would give
    // cubecl's pitched layout, whose padded rows NCCL's back-to-back write would scramble.
    let output = empty_device_contiguous_dtype(
        input.client.clone(),
        input.device.clone(),
        out_shape.clone(),
        input.dtype,
    );
    let (n_in, n_out) = (input.shape().num_elements(), out_shape.num_elements());
    let elem = input.dtype.size();
    for (what, t) in [("input", &input), ("output", &output)] {
        if let Err(e) = dense_layout(&format!("{op:?} {what}"), t.meta.shape(), t.meta.strides()) {
            return failed(op, group, x, e);
        }
    }

    // Taking the pointers makes this thread's cubecl stream wait for other streams that wrote
    // the buffers; the sync after it drains that stream, so the input is written before NCCL's
    // stream (which sees neither) reads it.
    let resource = |t: &CubeTensor, n: usize, what: &str| {
        let res = t
            .client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| CommError::Backend(format!("{op:?}: device pointer: {e:?}")))?;
        let size = res.resource().size as usize;
        if size < n * elem {
            return Err(CommError::Backend(format!(
                "{op:?}: the {what} buffer holds {size} bytes, the collective needs {} ({n} x {elem})",
                n * elem
            )));
        }
        Ok(res)
    };
    let (res_in, res_out) = match (
        resource(&input, n_in, "input"),
        resource(&output, n_out, "output"),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return failed(op, group, x, e),
    };
    if let Err(e) = CubeBackend::sync(&input.device) {
        return failed(
            op,
            group,
            x,
            CommError::Backend(format!("{op:?}: device sync: {e:?}")),
        );
    }
    let (p_in, p_out) = (res_in.resource().ptr, res_out.resource().ptr);
    // Safety: both are live allocations of this GPU of `n_in` / `n_out` elements of `dtype`,
    // pinned (and their tensors kept) in the `NcclWork` until the collective has completed;
    // the output is written by nobody else.
    let work = match unsafe { nccl.post_raw(raw, dtype, (p_in, n_in), (p_out, n_out)) } {
        Ok(w) => w,
        Err(e) => return failed(op, group, x, e),
    };
    let inner: Arc<dyn TransportWork> = Arc::new(NcclWork {
        work: Mutex::new(Some(work)),
        state: Mutex::new(None),
        output,
        dim,
        _input: input,
        _pins: [Pinned(res_in), Pinned(res_out)],
    });
    PendingCollective::new(x, op, group, Ok(Some(inner)))
}
