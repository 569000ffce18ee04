//! The collectives as a Burn backend extension, with Megatron adjoints as custom backward nodes.
//!
//! Two backend ops carry every collective: [`TpBackend::tp_start`] posts it and returns a
//! [`PendingPrimitive`]; [`TpBackend::tp_resolve`] waits and returns the tensor. The blocking form
//! is start + resolve; the parallel layers put compute in between. The default bodies move data
//! through the host with `burn-tp-comm` (right for the CPU backends, where a rank is a thread);
//! a device backend overrides them with its own transport.
//!
//! Adjoints (backward of each forward, per rank):
//!
//! | forward                 | backward                         |
//! |-------------------------|----------------------------------|
//! | all-gather(dim)         | reduce-scatter(dim)              |
//! | reduce-scatter(dim)     | all-gather(dim)                  |
//! | copy-to-tp-region (id)  | all-reduce (sum)                 |
//! | reduce-from-tp-region   | identity                         |
//! | all-reduce(sum / avg)   | all-reduce(sum / avg)            |
//! | all-reduce(max / min)   | all-reduce(sum) x [input == out] |
//! | gather-from-region(dim) | split(dim): keep own chunk       |
//! | scatter-to-region(dim)  | all-gather(dim)                  |

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::{
    Autodiff, Backend, ExtensionType, Flex, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, Shape, Slice, TensorData};
use burn_tp_comm::{CommElement, CommError, ProcessGroup, ReduceOp, Work};

use crate::linear::overlap::{
    Bias, ColumnSaved, LinearGrads, LinearSpec, Needs, column_backward, column_forward,
    row_backward, row_forward,
};
use half::{bf16, f16};

/// Which collective a [`PendingPrimitive`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Rank-order concatenation along `dim`: `[.., n_d, ..] -> [.., tp * n_d, ..]`.
    AllGather {
        /// The concatenated dimension.
        dim: usize,
    },
    /// Sum over ranks, then chunk `r` of `dim` to rank `r`: `[.., n_d, ..] -> [.., n_d / tp, ..]`.
    ReduceScatter {
        /// The scattered dimension.
        dim: usize,
    },
    /// Element-wise reduction to every rank; its backward is the true per-rank adjoint (an
    /// all-reduce), as data parallelism wants. Tensor parallel code uses the two below.
    AllReduce(ReduceOp),
    /// Megatron's `f`: identity forward, all-reduce (sum) backward.
    CopyToRegion,
    /// Megatron's `g`: all-reduce (sum) forward, identity backward.
    ReduceFromRegion,
    /// All-gather forward, split (keep this rank's chunk) backward: for a gathered output that
    /// feeds replicated compute (`gather_output`), where every rank holds the full gradient.
    GatherFromRegion {
        /// The concatenated dimension.
        dim: usize,
    },
    /// Split forward (keep this rank's chunk, no communication), all-gather backward.
    ScatterToRegion {
        /// The split dimension.
        dim: usize,
    },
}

impl Collective {
    /// The dimension the collective moves, or 0 for element-wise ones.
    fn dim(self) -> usize {
        match self {
            Collective::AllGather { dim }
            | Collective::ReduceScatter { dim }
            | Collective::GatherFromRegion { dim }
            | Collective::ScatterToRegion { dim } => dim,
            _ => 0,
        }
    }
}

/// The host side of a collective in flight (`Any`: a device backend finds its own work again).
pub(crate) trait InFlight: std::any::Any + Send + Sync {
    /// Waits for the whole result (once).
    fn finish(&self) -> Result<TensorData, CommError>;
    /// For an all-gather: waits for rank `part`'s shard only.
    fn part(&self, part: usize) -> Result<TensorData, CommError>;
}

/// A collective that failed before any communication.
struct Failed(CommError);

impl InFlight for Failed {
    fn finish(&self) -> Result<TensorData, CommError> {
        Err(self.0.clone())
    }
    fn part(&self, _: usize) -> Result<TensorData, CommError> {
        Err(self.0.clone())
    }
}

/// A `burn-tp-comm` work handle with the shapes of its output and of one input shard.
struct HostWork<T> {
    work: Mutex<Option<Work<Vec<T>>>>,
    out_shape: Shape,
    shard_shape: Shape,
}

impl<T: CommElement + burn::tensor::Element> InFlight for HostWork<T> {
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

/// A collective in flight at the backend level; [`TpBackend::tp_resolve`] completes it.
#[derive(Clone)]
pub struct PendingWork {
    /// The collective.
    pub op: Collective,
    /// The group it runs on.
    pub group: ProcessGroup,
    // `None`: nothing to communicate. Shared so the handle can cross the dispatch boundary by clone.
    pub(crate) inner: Option<Arc<dyn InFlight>>,
}

impl fmt::Debug for PendingWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PendingWork({:?} on rank {})",
            self.op,
            self.group.rank()
        )
    }
}

impl PendingWork {
    /// A collective that needs no communication (world size 1, identity forwards).
    pub fn ready(op: Collective, group: ProcessGroup) -> Self {
        Self {
            op,
            group,
            inner: None,
        }
    }

    /// A collective that failed before any communication: its resolve returns `error`.
    pub fn failed(op: Collective, group: ProcessGroup, error: CommError) -> Self {
        Self::in_flight(op, group, Arc::new(Failed(error)))
    }

    pub(crate) fn in_flight(op: Collective, group: ProcessGroup, inner: Arc<dyn InFlight>) -> Self {
        Self {
            op,
            group,
            inner: Some(inner),
        }
    }
}

/// A started collective: the input it was started from and the work in flight.
#[derive(ExtensionType)]
pub struct PendingPrimitive<B: Backend> {
    /// The tensor the collective was started from: it routes the resolve to its backend and is the
    /// autodiff parent of the result.
    pub input: FloatTensor<B>,
    /// The communication in flight.
    pub work: PendingWork,
}

impl<B: Backend> Clone for PendingPrimitive<B> {
    fn clone(&self) -> Self {
        Self {
            input: self.input.clone(),
            work: self.work.clone(),
        }
    }
}

/// The result of a resolved collective at the backend level.
#[derive(ExtensionType)]
pub enum CollectiveOutput<B: Backend> {
    /// The collective completed.
    Done(FloatTensor<B>),
    /// It failed on this rank (and, by the group's abort, on every rank).
    Failed(CommError),
}

impl<B: Backend> CollectiveOutput<B> {
    /// The tensor, or a panic naming the error: for backward nodes, which cannot return errors.
    pub fn expect_done(self, context: &str) -> FloatTensor<B> {
        match self {
            CollectiveOutput::Done(t) => t,
            CollectiveOutput::Failed(e) => panic!("burn-tp: {context} failed: {e}"),
        }
    }
}

/// Collectives as backend operations. Implemented for Flex and for `Autodiff<B>` (with custom
/// backward nodes); call them through [`crate::ops`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait TpBackend: Backend {
    /// Posts `op` of `x` on `group` and returns at once.
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingPrimitive<Self> {
        host_start::<Self>(x, op, group)
    }

    /// Waits for a started collective and returns its output.
    fn tp_resolve(#[extension_type] pending: PendingPrimitive<Self>) -> CollectiveOutput<Self> {
        host_resolve::<Self>(pending)
    }

    /// For a started all-gather along dim 0: rank `part`'s shard (`[n, ..]`), as soon as it has
    /// arrived, without waiting for the rest. Not differentiable (used inside backward nodes and
    /// the overlapped linear ops); the pending collective is still resolved or dropped after.
    fn tp_resolve_part(
        #[extension_type] pending: PendingPrimitive<Self>,
        part: usize,
    ) -> CollectiveOutput<Self> {
        host_resolve_part::<Self>(pending, part)
    }

    /// A row-wise loss with a precomputed gradient: returns `value` (`[n]`); its backward
    /// gives `input` (`[n, c]`) the gradient `jacobian * upstream[:, None]`, computed locally.
    /// Used by [`crate::loss::sharded_cross_entropy`] (softmax minus one-hot, no communication).
    fn tp_rowwise_loss(
        input: FloatTensor<Self>,
        value: FloatTensor<Self>,
        jacobian: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = (input, jacobian);
        value
    }

    /// Column-parallel linear with overlapped communication (see [`crate::linear::overlap`]):
    /// `x [.., d_in] -> [.., d_out/n]` (ALL_REDUCE) or `x [s/n, .., d_in] -> [s, .., d_out/n]`
    /// (REDUCE_SCATTER). `weight` is `[d_in, d_out/n]`, `bias` `[d_out/n]`.
    fn tp_column_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        column_forward::<Self>(x, weight, bias.into_option(), spec, &group)
            .map(|(y, _)| y)
            .into()
    }

    /// Row-parallel linear with overlapped communication: `x [.., d_in/n] -> [.., d_out]`
    /// (ALL_REDUCE) or `x [s, .., d_in/n] -> [s/n, .., d_out]` (REDUCE_SCATTER). `weight` is
    /// `[d_in/n, d_out]`, `bias` `[d_out]` (replicated, added once after the reduction).
    fn tp_row_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        #[extension_type] bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        row_forward::<Self>(x, weight, bias.into_option(), spec, &group).into()
    }
}

impl<B: Backend> From<Result<FloatTensor<B>, CommError>> for CollectiveOutput<B> {
    fn from(r: Result<FloatTensor<B>, CommError>) -> Self {
        match r {
            Ok(t) => CollectiveOutput::Done(t),
            Err(e) => CollectiveOutput::Failed(e),
        }
    }
}

impl TpBackend for Flex {}

/// Start + resolve on the inner backend, panicking on failure (for backward nodes).
pub fn collective_blocking<B: TpBackend>(
    x: FloatTensor<B>,
    op: Collective,
    group: &ProcessGroup,
) -> FloatTensor<B> {
    B::tp_resolve(B::tp_start(x, op, group.clone())).expect_done(&format!("{op:?} in backward"))
}

pub(crate) fn host_start<B: Backend>(
    x: FloatTensor<B>,
    op: Collective,
    group: ProcessGroup,
) -> PendingPrimitive<B> {
    let world = group.world_size();
    if world == 1
        || matches!(
            op,
            Collective::CopyToRegion | Collective::ScatterToRegion { .. }
        )
    {
        return PendingPrimitive {
            input: x,
            work: PendingWork::ready(op, group),
        };
    }
    // Put the collective's dim first: the flat buffer's rank-order concatenation (chunking) is
    // then concatenation (chunking) along that dim.
    let dim = op.dim();
    let moved = if dim == 0 {
        x.clone()
    } else {
        B::float_swap_dims(x.clone(), 0, dim)
    };
    let inner: Arc<dyn InFlight> = match burn::tensor::read_sync(B::float_into_data(moved)) {
        Ok(data) => match data.dtype() {
            DType::F32 => post::<f32>(data, op, &group),
            DType::F64 => post::<f64>(data, op, &group),
            DType::F16 => post::<f16>(data, op, &group),
            DType::BF16 => post::<bf16>(data, op, &group),
            other => Arc::new(Failed(CommError::Backend(format!(
                "{op:?}: unsupported dtype {other:?}"
            )))),
        },
        Err(e) => Arc::new(Failed(CommError::Backend(format!(
            "{op:?}: reading the tensor failed: {e:?}"
        )))),
    };
    PendingPrimitive {
        input: x,
        work: PendingWork {
            op,
            group,
            inner: Some(inner),
        },
    }
}

fn post<T: CommElement + burn::tensor::Element>(
    data: TensorData,
    op: Collective,
    group: &ProcessGroup,
) -> Arc<dyn InFlight> {
    let world = group.world_size();
    let shard_shape = data.shape().clone();
    let mut out_shape = shard_shape.clone();
    let dims = shard_shape.to_vec();
    let values = match data.try_into_vec::<T>() {
        Ok(v) => v,
        Err(e) => return Arc::new(Failed(CommError::Backend(format!("{e:?}")))),
    };
    let work: Work<Vec<T>> = match op {
        Collective::AllGather { .. } | Collective::GatherFromRegion { .. } => {
            out_shape[0] *= world;
            group.all_gather_shaped_async(values, dims)
        }
        Collective::ReduceScatter { .. } => {
            out_shape[0] /= world;
            match group.reduce_scatter_shaped_async(values, dims) {
                Ok(w) => w,
                Err(e) => return Arc::new(Failed(e)),
            }
        }
        Collective::AllReduce(r) => group.all_reduce_shaped_async(values, dims, r),
        Collective::ReduceFromRegion => group.all_reduce_shaped_async(values, dims, ReduceOp::Sum),
        Collective::CopyToRegion | Collective::ScatterToRegion { .. } => {
            unreachable!("local forwards post nothing")
        }
    };
    Arc::new(HostWork {
        work: Mutex::new(Some(work)),
        out_shape,
        shard_shape,
    })
}

pub(crate) fn host_resolve<B: Backend>(pending: PendingPrimitive<B>) -> CollectiveOutput<B> {
    let PendingPrimitive { input, work } = pending;
    let Some(inner) = &work.inner else {
        return CollectiveOutput::Done(match work.op {
            Collective::ScatterToRegion { dim } => local_chunk::<B>(input, dim, &work.group),
            _ => input,
        });
    };
    match inner.finish() {
        Ok(data) => {
            let out = B::float_from_data(data, &input.device());
            let dim = work.op.dim();
            CollectiveOutput::Done(if dim == 0 {
                out
            } else {
                B::float_swap_dims(out, 0, dim)
            })
        }
        Err(e) => CollectiveOutput::Failed(e),
    }
}

pub(crate) fn host_resolve_part<B: Backend>(
    pending: PendingPrimitive<B>,
    part: usize,
) -> CollectiveOutput<B> {
    let PendingPrimitive { input, work } = pending;
    if let Some(e) = part_unsupported(work.op) {
        return CollectiveOutput::Failed(e);
    }
    match &work.inner {
        // Nothing in flight: a group of one, whose only part is the input.
        None => CollectiveOutput::Done(input),
        Some(inner) => match inner.part(part) {
            Ok(data) => CollectiveOutput::Done(B::float_from_data(data, &input.device())),
            Err(e) => CollectiveOutput::Failed(e),
        },
    }
}

/// `tp_resolve_part` serves dim-0 all-gathers only (the ring schedule's): the error otherwise.
pub(crate) fn part_unsupported(op: Collective) -> Option<CommError> {
    (op.dim() != 0 || !matches!(op, Collective::AllGather { .. }))
        .then(|| CommError::Backend(format!("tp_resolve_part of {op:?}")))
}

/// This rank's chunk of `dim` (a view; no copy, no communication).
pub fn local_chunk<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    group: &ProcessGroup,
) -> FloatTensor<B> {
    let (rank, world) = (group.rank(), group.world_size());
    if world == 1 {
        return x;
    }
    let chunk = x.shape()[dim] / world;
    let mut slices = vec![Slice::full(); x.shape().num_dims()];
    slices[dim] = Slice::new(
        (rank * chunk) as isize,
        Some(((rank + 1) * chunk) as isize),
        1,
    );
    B::float_slice(x, &slices)
}

#[derive(Debug)]
struct CollectiveBackward;

#[derive(Clone, Debug)]
struct CollectiveState<P> {
    op: Collective,
    group: ProcessGroup,
    /// Input and output, kept only for max / min (the gradient goes where input == output).
    extremum: Option<(P, P)>,
}

impl<B: TpBackend> Backward<B, 1> for CollectiveBackward {
    type State = CollectiveState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let CollectiveState {
            op,
            group,
            extremum,
        } = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| match op {
            Collective::AllGather { dim } => {
                collective_blocking::<B>(grad, Collective::ReduceScatter { dim }, &group)
            }
            Collective::ReduceScatter { dim } => {
                collective_blocking::<B>(grad, Collective::AllGather { dim }, &group)
            }
            Collective::CopyToRegion | Collective::AllReduce(ReduceOp::Sum) => {
                collective_blocking::<B>(grad, Collective::AllReduce(ReduceOp::Sum), &group)
            }
            Collective::AllReduce(ReduceOp::Avg) => {
                collective_blocking::<B>(grad, Collective::AllReduce(ReduceOp::Avg), &group)
            }
            Collective::AllReduce(ReduceOp::Max | ReduceOp::Min) => {
                let (x, y) = extremum.expect("max / min keep input and output");
                let total =
                    collective_blocking::<B>(grad, Collective::AllReduce(ReduceOp::Sum), &group);
                let device = x.device();
                let bool_dtype =
                    burn::backend::get_or_init_device_settings::<B>(&device).bool_dtype;
                let mask =
                    B::bool_into_float(B::float_equal(x, y, bool_dtype), total.dtype().into());
                B::float_mul(total, mask)
            }
            Collective::ReduceFromRegion => grad,
            Collective::GatherFromRegion { dim } => local_chunk::<B>(grad, dim, &group),
            Collective::ScatterToRegion { dim } => {
                collective_blocking::<B>(grad, Collective::AllGather { dim }, &group)
            }
        });
    }
}

impl<B: TpBackend, C: CheckpointStrategy> TpBackend for Autodiff<B, C> {
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingPrimitive<Self> {
        let inner = B::tp_start(x.primitive().clone(), op, group);
        PendingPrimitive {
            input: x,
            work: inner.work,
        }
    }

    fn tp_rowwise_loss(
        input: FloatTensor<Self>,
        value: FloatTensor<Self>,
        jacobian: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct RowwiseLoss;
        impl<B: Backend> Backward<B, 1> for RowwiseLoss {
            type State = FloatTensor<B>;
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let jacobian = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |grad| {
                    let n = grad.shape()[0];
                    B::float_mul(
                        jacobian,
                        B::float_reshape(grad, burn::tensor::Shape::from(vec![n, 1])),
                    )
                });
            }
        }
        let value = value.into_primitive();
        match RowwiseLoss
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(jacobian.into_primitive(), value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }

    fn tp_column_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        linear_op::<B, C>(x, weight, bias, spec, group, |x, w, b, spec, group| {
            column_forward::<B>(x, w, b, spec, group)
                .map(|(y, saved)| (y, LinearKind::Column(saved)))
        })
    }

    fn tp_row_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Bias<Self>,
        spec: LinearSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        linear_op::<B, C>(x, weight, bias, spec, group, |x, w, b, spec, group| {
            // The row layer keeps its input for the wgrad.
            row_forward::<B>(x.clone(), w, b, spec, group).map(|y| (y, LinearKind::Row(x)))
        })
    }

    fn tp_resolve(pending: PendingPrimitive<Self>) -> CollectiveOutput<Self> {
        let PendingPrimitive { input, work } = pending;
        let inner = PendingPrimitive {
            input: input.primitive().clone(),
            work: work.clone(),
        };
        let out = match B::tp_resolve(inner) {
            CollectiveOutput::Done(out) => out,
            CollectiveOutput::Failed(e) => return CollectiveOutput::Failed(e),
        };
        let op = work.op;
        let extremum = matches!(op, Collective::AllReduce(ReduceOp::Max | ReduceOp::Min))
            .then(|| (input.primitive().clone(), out.clone()));
        // Graph nodes outlive a panicking rank's stack: they must not keep it in the group.
        let state = CollectiveState {
            op,
            group: work.group.weak(),
            extremum,
        };
        CollectiveOutput::Done(
            match CollectiveBackward
                .prepare::<C>([input.node()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }
}

/// The backward node of both parallel linears, over 2 parents (x, weight) or 3 (x, weight, bias).
#[derive(Debug)]
struct LinearBackward;

#[derive(Clone, Debug)]
enum LinearKind<B: Backend> {
    Column(ColumnSaved<B>),
    /// The row layer keeps its (sharded-feature) input.
    Row(FloatTensor<B>),
}

#[derive(Clone, Debug)]
struct LinearState<B: Backend> {
    kind: LinearKind<B>,
    weight: FloatTensor<B>,
    spec: LinearSpec,
    group: ProcessGroup,
}

impl<B: TpBackend, const N: usize> Backward<B, N> for LinearBackward {
    type State = LinearState<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents;
        let needs = Needs {
            input: parents[0].is_some(),
            weight: parents[1].is_some(),
            bias: N == 3 && parents[N - 1].is_some(),
        };
        let LinearState {
            kind,
            weight,
            spec,
            group,
        } = ops.state;
        let result = match kind {
            LinearKind::Column(saved) => {
                column_backward::<B>(grad, saved, weight, spec, &group, needs)
            }
            LinearKind::Row(input) => row_backward::<B>(grad, input, weight, spec, &group, needs),
        };
        let LinearGrads {
            input,
            weight,
            bias,
        } = result
            .unwrap_or_else(|e| panic!("burn-tp: parallel linear backward ({spec:?}) failed: {e}"));
        for (parent, g) in parents.into_iter().zip([input, weight, bias]) {
            if let (Some(node), Some(g)) = (parent, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

type LinearForward<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    LinearSpec,
    &ProcessGroup,
) -> Result<(FloatTensor<B>, LinearKind<B>), CommError>;

/// A parallel linear on `Autodiff<B>`: the inner forward, then one [`LinearBackward`] node.
fn linear_op<B: TpBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Bias<Autodiff<B, C>>,
    spec: LinearSpec,
    group: ProcessGroup,
    forward: LinearForward<B>,
) -> CollectiveOutput<Autodiff<B, C>> {
    let bias = bias.into_option();
    let inner_bias = bias.as_ref().map(|b| b.primitive().clone());
    let (y, kind) = match forward(
        x.primitive().clone(),
        weight.primitive().clone(),
        inner_bias,
        spec,
        &group,
    ) {
        Ok(out) => out,
        Err(e) => return CollectiveOutput::Failed(e),
    };
    // Graph nodes outlive a panicking rank's stack: they must not keep it in the group.
    let state = LinearState {
        kind,
        weight: weight.primitive().clone(),
        spec,
        group: group.weak(),
    };
    CollectiveOutput::Done(finish_linear::<B, C>(
        LinearBackward,
        state,
        x,
        weight,
        bias,
        y,
    ))
}

fn finish_linear<B: TpBackend, C: CheckpointStrategy>(
    node: LinearBackward,
    state: LinearState<B>,
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    y: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match bias {
        Some(b) => match node
            .prepare::<C>([x.node(), weight.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        },
        None => match node
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        },
    }
}
