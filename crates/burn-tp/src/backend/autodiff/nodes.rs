//! The backward nodes of `TpBackend` for `Autodiff<B>`: each collective's Megatron adjoint
//! (the table in [`crate::backend`]), the gradient tap, the norms, and the parallel linears'
//! [`LinearBackward`], which runs the overlapped backward of `backend/matmul/overlap.rs`.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, tensor::FloatTensor};
use burn_tp_comm::{CommError, ProcessGroup, ReduceOp};

use crate::backend::attention::mask::AttentionSpec;
use crate::backend::collective::host::local_chunk;
use crate::backend::fused::norm::NormSpec;
use crate::backend::matmul::overlap::{
    ColumnSaved, LinearGrads, Needs, column_backward, row_backward,
};
use crate::backend::{
    Bias, Collective, CollectiveOutput, GradTap, LinearSpec, TpBackend, collective_blocking,
};

#[derive(Debug)]
pub(super) struct CollectiveBackward;

/// What the attention's backward needs (and nothing more).
#[derive(Clone, Debug)]
pub(super) struct AttentionState<B: Backend> {
    pub(super) q: FloatTensor<B>,
    pub(super) k: FloatTensor<B>,
    pub(super) v: FloatTensor<B>,
    pub(super) out: FloatTensor<B>,
    /// The kernel's log-sum-exps, in its own layout.
    pub(super) lse: FloatTensor<B>,
    pub(super) spec: AttentionSpec,
}

/// Of `eq` (1 where this rank's input equals the max / min), the elements where no lower rank's
/// does: the gradient of a tie goes to one rank, the lowest, as it would for one rank's max.
pub(super) fn first_tied_rank<B: TpBackend>(
    eq: FloatTensor<B>,
    group: &ProcessGroup,
    bool_dtype: burn::tensor::BoolDType,
) -> FloatTensor<B> {
    let (r, n) = (group.rank(), group.world_size());
    if n == 1 {
        return eq;
    }
    // Every rank gathers every rank's `eq` (all must post, rank 0 included) and counts the lower
    // ranks tied on each element.
    let m = eq.shape()[0];
    let all = collective_blocking::<B>(eq.clone(), Collective::AllGather { dim: 0 }, group);
    if r == 0 {
        return eq;
    }
    let lower = (1..r).fold(
        crate::backend::collective::host::rows::<B>(all.clone(), 0..m),
        |acc, k| {
            B::float_add(
                acc,
                crate::backend::collective::host::rows::<B>(all.clone(), k * m..(k + 1) * m),
            )
        },
    );
    let none_lower = B::float_equal_elem(lower, burn_std::Scalar::Float(0.0), bool_dtype);
    B::float_mul(
        eq.clone(),
        B::bool_into_float(none_lower, eq.dtype().into()),
    )
}

#[derive(Clone, Debug)]
pub(super) struct CollectiveState<P> {
    pub(super) op: Collective,
    pub(super) group: ProcessGroup,
    /// Input and output, kept only for max / min (the gradient goes where input == output).
    pub(super) extremum: Option<(P, P)>,
}

impl<B: TpBackend> Backward<B, 1> for CollectiveBackward {
    type State = CollectiveState<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let CollectiveState {
            op,
            group,
            extremum,
        } = ops.state;
        let _scope = burn_tp_comm::profile::scope("collective backward");
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
                let float_dtype = total.dtype().into();
                let eq = B::bool_into_float(B::float_equal(x, y, bool_dtype), float_dtype);
                B::float_mul(total, first_tied_rank::<B>(eq, &group, bool_dtype))
            }
            Collective::ReduceFromRegion => grad,
            Collective::GatherFromRegion { dim } => local_chunk::<B>(grad, dim, &group),
            Collective::ScatterToRegion { dim } => {
                collective_blocking::<B>(grad, Collective::AllGather { dim }, &group)
            }
        });
    }
}

/// The gradient tap's node: the parameter's whole gradient of this backward, to the reducer.
#[derive(Debug)]
pub(super) struct TapBackward;

impl<B: TpBackend> Backward<B, 1> for TapBackward {
    type State = GradTap;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let tap = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            tap.shared.deliver::<B>(tap.slot, grad.clone());
            grad
        });
    }
}

/// The backward node of the norms, over 2 parents (x, gamma) or 3 (x, gamma, beta).
#[derive(Debug)]
pub(super) struct NormBackward;

#[derive(Clone, Debug)]
pub(super) struct NormState<B: Backend> {
    pub(super) x: FloatTensor<B>,
    pub(super) gamma: FloatTensor<B>,
    pub(super) spec: NormSpec,
}

impl<B: TpBackend, const N: usize> Backward<B, N> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let NormState { x, gamma, spec } = ops.state;
        let (dx, d_gamma, d_beta) = B::tp_norm_backward(x, gamma, dy, spec);
        for (parent, g) in ops
            .parents
            .into_iter()
            .zip([Some(dx), Some(d_gamma), d_beta])
        {
            if let (Some(node), Some(g)) = (parent, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// The backward node of both parallel linears, over 2 parents (x, weight) or 3 (x, weight, bias).
#[derive(Debug)]
pub(super) struct LinearBackward;

#[derive(Clone, Debug)]
pub(super) enum LinearKind<B: Backend> {
    Column(ColumnSaved<B>),
    /// The row layer keeps its (sharded-feature) input.
    Row(FloatTensor<B>),
}

#[derive(Clone, Debug)]
pub(super) struct LinearState<B: Backend> {
    pub(super) kind: LinearKind<B>,
    pub(super) weight: FloatTensor<B>,
    pub(super) spec: LinearSpec,
    pub(super) group: ProcessGroup,
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

pub(super) type LinearForward<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    LinearSpec,
    &ProcessGroup,
) -> Result<(FloatTensor<B>, LinearKind<B>), CommError>;

/// A parallel linear on `Autodiff<B>`: the inner forward, then one [`LinearBackward`] node.
pub(super) fn linear_op<B: TpBackend, C: CheckpointStrategy>(
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

/// Whether the backward of `op` posts a collective (so every rank must run it).
pub(super) fn adjoint_communicates(op: Collective) -> bool {
    !matches!(
        op,
        Collective::ReduceFromRegion | Collective::GatherFromRegion { .. }
    )
}

/// `x`, or, when `x` is untracked and `force`, a fresh leaf of it that requires grad. Every rank
/// must post the same collectives in the backward whatever its own requires-grad state (a peer
/// whose input is tracked runs the adjoint and waits for this rank's part), so an op whose adjoint
/// communicates is always part of the graph, as in Megatron where every rank's activations require
/// grad. A fresh leaf (new id), never the caller's tensor: a tensor shared by rank threads must not
/// join their graphs, and the caller's tensor keeps its own state.
pub(super) fn tracked_if<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    force: bool,
) -> FloatTensor<Autodiff<B, C>> {
    if !force || x.is_tracked() {
        return x;
    }
    <Autodiff<B, C> as AutodiffBackend>::from_inner(x.primitive().clone()).require_grad()
}

pub(super) fn finish_linear<B: TpBackend, C: CheckpointStrategy>(
    node: LinearBackward,
    state: LinearState<B>,
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    y: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    // The column backward always reduces dgrad and the row backward all-gathers its grad_output
    // in REDUCE_SCATTER mode: a rank with nothing to differentiate still takes part.
    let untracked =
        !x.is_tracked() && !weight.is_tracked() && bias.as_ref().is_none_or(|b| !b.is_tracked());
    let communicates = matches!(state.kind, LinearKind::Column(_))
        || state.spec.settings.mode == crate::backend::TpMode::ReduceScatter;
    let x = tracked_if::<B, C>(x, untracked && communicates);
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
