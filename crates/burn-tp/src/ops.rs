//! Differentiable collectives on `Tensor<D>`, the distributed primitives every parallel layer is
//! built from. Each has a blocking form and an `_async` form returning a [`Pending`] tensor; the
//! communication is in flight between the two, so compute placed there overlaps it.
//!
//! Gradients follow Megatron's adjoints (see [`crate::backend`]): `all_gather` and
//! `reduce_scatter` are each other's backward; `copy_to_tp_region` (identity forward) and
//! `reduce_from_tp_region` (all-reduce forward) are each other's backward.
//!
//! Any dimension works: dim 0 is the sequence-parallel case (`[s/tp, b, h] <-> [s, b, h]`), the
//! last dim is `gather_output` (`[.., h/tp] -> [.., h]`). Non-contiguous inputs (transposed,
//! sliced) are read in logical order.

use burn::backend::{Dispatch, DispatchTensor};
use burn::tensor::{Shape, Tensor, TensorData};
use burn_tp_comm::{ProcessGroup, ReduceOp, SendBuf};

use crate::backend::collective::host::{DataRead, HostCall, HostElement, with_host_values};
use crate::backend::{AllToAllSpec, Collective, CollectiveOutput, PendingCollective, TpBackend};
use crate::error::check_divisible;
use crate::{Result, TpError};

/// A collective in flight. [`wait`](Self::wait) returns its output; until then the caller is free
/// to compute.
#[must_use = "a started collective completes only when waited on"]
pub struct Pending<const D: usize> {
    inner: PendingCollective<Dispatch>,
}

impl<const D: usize> std::fmt::Debug for Pending<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl<const D: usize> Pending<D> {
    /// Waits for the collective and returns its output.
    ///
    /// # Errors
    /// [`TpError::Comm`] when the communication fails (on every rank).
    pub fn wait(self) -> Result<Tensor<D>> {
        into_tensor(<Dispatch as TpBackend>::tp_resolve(self.inner))
    }
}

/// The tensor of a dispatch-level collective output, or its error.
pub(crate) fn into_tensor<const D: usize>(out: CollectiveOutput<Dispatch>) -> Result<Tensor<D>> {
    Ok(Tensor::from_dispatch(out.into_result()?))
}

fn start<const D: usize>(x: Tensor<D>, op: Collective, group: &ProcessGroup) -> Pending<D> {
    let x: DispatchTensor = x.into_dispatch();
    Pending {
        inner: <Dispatch as TpBackend>::tp_start(x, op, group.clone()),
    }
}

fn check_dim<const D: usize>(op: &'static str, dim: usize) -> Result<()> {
    if dim >= D {
        return Err(TpError::DimOutOfRange { op, dim, rank: D });
    }
    Ok(())
}

/// Starts an all-gather along `dim`: `[.., n, ..] -> [.., tp * n, ..]`, shards in rank order.
/// Backward: reduce-scatter along `dim`.
///
/// # Errors
/// [`TpError::DimOutOfRange`] if `dim >= D`.
pub fn all_gather_async<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Pending<D>> {
    check_dim::<D>("all_gather", dim)?;
    Ok(start(x, Collective::AllGather { dim }, group))
}

/// Blocking [`all_gather_async`].
///
/// # Errors
/// As [`all_gather_async`] and [`Pending::wait`].
pub fn all_gather<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    all_gather_async(x, dim, group)?.wait()
}

/// Starts a reduce-scatter (sum) along `dim`: `[.., n, ..] -> [.., n / tp, ..]`, rank `r` keeps
/// chunk `r`. Backward: all-gather along `dim`.
///
/// # Errors
/// [`TpError::NotDivisible`] (before any communication) if `n % tp != 0`;
/// [`TpError::DimOutOfRange`] if `dim >= D`.
pub fn reduce_scatter_async<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Pending<D>> {
    check_dim::<D>("reduce_scatter", dim)?;
    let (size, tp) = (x.dims()[dim], group.world_size());
    check_divisible(format!("reduce_scatter: dim {dim} of the input"), size, tp)?;
    Ok(start(x, Collective::ReduceScatter { dim }, group))
}

/// Blocking [`reduce_scatter_async`].
///
/// # Errors
/// As [`reduce_scatter_async`] and [`Pending::wait`].
pub fn reduce_scatter<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    reduce_scatter_async(x, dim, group)?.wait()
}

/// Starts an element-wise all-reduce. Its backward is the per-rank adjoint (all-reduce of the
/// gradient; for max / min, routed to the elements that won), which is what data parallelism
/// wants. For tensor parallelism use [`reduce_from_tp_region`], whose backward is the identity.
pub fn all_reduce_async<const D: usize>(
    x: Tensor<D>,
    op: ReduceOp,
    group: &ProcessGroup,
) -> Pending<D> {
    start(x, Collective::AllReduce(op), group)
}

/// Blocking [`all_reduce_async`].
///
/// # Errors
/// As [`Pending::wait`].
pub fn all_reduce<const D: usize>(
    x: Tensor<D>,
    op: ReduceOp,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    all_reduce_async(x, op, group).wait()
}

/// Megatron's `f`: identity forward; backward all-reduces (sums) the gradient over the group.
/// Put it where a replicated activation enters rank-specific compute.
pub fn copy_to_tp_region<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    // Posts nothing, so it cannot fail.
    start(x, Collective::CopyToRegion, group)
        .wait()
        .expect("copy_to_tp_region communicates nothing")
}

/// Megatron's `g`: all-reduce (sum) forward; identity backward. Put it where rank partial sums
/// become one replicated activation.
///
/// # Errors
/// As [`Pending::wait`].
pub fn reduce_from_tp_region<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    reduce_from_tp_region_async(x, group).wait()
}

/// Async [`reduce_from_tp_region`].
pub fn reduce_from_tp_region_async<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
) -> Pending<D> {
    start(x, Collective::ReduceFromRegion, group)
}

/// Megatron's gather-from-region: all-gather along `dim` forward; backward keeps this rank's
/// chunk of the gradient (no communication). Use it where the gathered tensor feeds replicated
/// compute, as `gather_output` does; use [`all_gather`] where it feeds rank-specific compute.
///
/// # Errors
/// [`TpError::DimOutOfRange`] and as [`Pending::wait`].
pub fn gather_from_tp_region<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    check_dim::<D>("gather_from_tp_region", dim)?;
    start(x, Collective::GatherFromRegion { dim }, group).wait()
}

/// Megatron's scatter-to-region: keeps this rank's chunk of `dim` (no communication); backward
/// all-gathers the gradient.
///
/// # Errors
/// [`TpError::NotDivisible`] if `dim`'s size is not a multiple of the world size;
/// [`TpError::DimOutOfRange`] if `dim >= D`.
pub fn scatter_to_tp_region<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    check_dim::<D>("scatter_to_tp_region", dim)?;
    let (size, tp) = (x.dims()[dim], group.world_size());
    check_divisible(
        format!("scatter_to_tp_region: dim {dim} of the input"),
        size,
        tp,
    )?;
    start(x, Collective::ScatterToRegion { dim }, group).wait()
}

/// Sends `send_rows[p]` consecutive rows of `x` (`[rows, ..]`, rank `p`'s rows after rank
/// `p - 1`'s) to each rank `p` of `group`, and returns the rows every rank sent here, in rank
/// order: `[sum(send_rows), ..] -> [sum(recv_rows), ..]`. Expert parallelism's dispatch (each
/// token to the rank of its expert) and, with the counts swapped, its combine. Blocking.
/// Backward: the same exchange the other way round.
///
/// # Errors
/// [`TpError::Config`] if the counts do not have one entry per rank or `send_rows` does not add
/// up to the rows of `x`; [`TpError::Comm`] (`Counts` on every rank) if a rank's count to a
/// peer differs from what the peer expects, or the communication fails.
pub fn all_to_all<const D: usize>(
    x: Tensor<D>,
    send_rows: &[usize],
    recv_rows: &[usize],
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    let (n, rows) = (group.world_size(), x.dims()[0]);
    if send_rows.len() != n || recv_rows.len() != n || send_rows.iter().sum::<usize>() != rows {
        return Err(TpError::Config(format!(
            "all_to_all: send_rows {send_rows:?} and recv_rows {recv_rows:?} need one entry per \
             rank of {n}, and send_rows must add up to the input's {rows} rows"
        )));
    }
    if n == 1 && send_rows == recv_rows {
        return Ok(x);
    }
    let spec = AllToAllSpec {
        send_rows: send_rows.to_vec(),
        recv_rows: recv_rows.to_vec(),
    };
    into_tensor(<Dispatch as TpBackend>::tp_all_to_all(
        x.into_dispatch(),
        spec,
        group.clone(),
    ))
}

/// Copies `root`'s tensor to every rank (not differentiable: the output is detached). Every
/// rank passes a tensor of the same shape and dtype; only the root's values matter.
///
/// # Errors
/// As [`Pending::wait`], or an invalid root.
pub fn broadcast<const D: usize>(
    x: Tensor<D>,
    root: usize,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    if group.world_size() == 1 {
        return Ok(x.detach());
    }
    let device = x.device();
    let data = x.detach().into_data();
    let (dtype, shape) = (data.dtype(), data.shape().clone());
    let out = with_host_values(dtype, shape, DataRead(data), Broadcast { root, group })??;
    Ok(Tensor::from_data(out, (&device, dtype)))
}

struct Broadcast<'a> {
    root: usize,
    group: &'a ProcessGroup,
}

impl HostCall for Broadcast<'_> {
    type Output = Result<TensorData>;

    fn call<T: HostElement>(self, values: Box<dyn SendBuf<T>>, shape: Shape) -> Self::Output {
        let values = values.as_slice().to_vec();
        Ok(TensorData::new(
            self.group.broadcast(values, self.root)?,
            shape,
        ))
    }
}

/// `a · b` (`[.., m, k] · [.., k, n]`) through the GEMM hook the parallel layers use
/// ([`TpBackend::tp_matmul`]): burn's matmul, but on CUDA, where it is cuBLAS (issue 36). For
/// checking the hook against burn's own `matmul`; differentiable (on `Autodiff`, burn's).
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_matmul(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// The exact GELU, `x Phi(x)` (Burn's `gelu`: the GPT's MLP), with its exact derivative in the
/// backward ([`TpBackend::tp_gelu`]; Burn's own backward differentiates the tanh
/// approximation); on Flex each is one pass over the tensor. Any shape, in x's dtype.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_gelu(x.into_dispatch()))
}
