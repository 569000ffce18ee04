//! `TpBackend` for `Autodiff<B>`: the inner backend's forward, then one custom backward node
//! per op. Collectives take their Megatron adjoint (the table in [`super`]); the parallel
//! linears take [`LinearBackward`], which runs the overlapped backward of [`super::overlap`].

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, tensor::FloatTensor};
use burn_tp_comm::{CommError, ProcessGroup, ReduceOp};

use super::dropout::{DropoutSpec, apply_mask};
use super::flash;
use super::host::local_chunk;
use super::mask::AttentionSpec;
use super::norm::{self, NormSpec};
use super::overlap::{
    ColumnSaved, LinearGrads, Needs, column_backward, column_forward, row_backward, row_forward,
};
use super::swiglu;
use super::{
    Bias, Collective, CollectiveOutput, GradTap, LinearSpec, PendingCollective, TpBackend,
    collective_blocking,
};

#[derive(Debug)]
struct CollectiveBackward;

/// What the attention's backward needs (and nothing more).
#[derive(Clone, Debug)]
struct AttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: flash::Lse<B>,
    spec: AttentionSpec,
}

/// Of `eq` (1 where this rank's input equals the max / min), the elements where no lower rank's
/// does: the gradient of a tie goes to one rank, the lowest, as it would for one rank's max.
fn first_tied_rank<B: TpBackend>(
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
        crate::backend::host::rows::<B>(all.clone(), 0..m),
        |acc, k| {
            B::float_add(
                acc,
                crate::backend::host::rows::<B>(all.clone(), k * m..(k + 1) * m),
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
struct TapBackward;

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

impl<B: TpBackend, C: CheckpointStrategy> TpBackend for Autodiff<B, C> {
    fn tp_grad_tap(x: FloatTensor<Self>, tap: GradTap) -> FloatTensor<Self> {
        let out = x.primitive().clone();
        match TapBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(tap, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn tp_grad_bucket(
        like: FloatTensor<Self>,
        tap: GradTap,
        bucket: usize,
    ) -> CollectiveOutput<Self> {
        // The buckets were started by the inner backend's ops inside the backward.
        match B::tp_grad_bucket(like.primitive().clone(), tap, bucket).into_result() {
            Ok(t) => CollectiveOutput::Done(<Self as AutodiffBackend>::from_inner(t)),
            Err(e) => CollectiveOutput::Failed(e),
        }
    }

    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingCollective<Self> {
        B::tp_start(x.primitive().clone(), op, group).with_input(x)
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

    fn tp_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct AttentionBackward;
        impl<B: TpBackend> Backward<B, 3> for AttentionBackward {
            type State = AttentionState<B>;
            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let AttentionState {
                    q,
                    k,
                    v,
                    out,
                    lse,
                    spec,
                } = ops.state;
                let d_out = grads.consume::<B>(&ops.node);
                let (dq, dk, dv) = flash::backward::<B>(q, k, v, out, &lse, d_out, &spec);
                for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
                    if let Some(node) = parent {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }
        let (out, lse) = flash::forward::<B>(
            q.primitive().clone(),
            k.primitive().clone(),
            v.primitive().clone(),
            &spec,
        );
        match AttentionBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // What FlashAttention keeps: q, k, v, the output and each row's log-sum-exp.
                let state = AttentionState {
                    q: q.into_primitive(),
                    k: k.into_primitive(),
                    v: v.into_primitive(),
                    out: out.clone(),
                    lse,
                    spec,
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn tp_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Bias<Self>,
        spec: NormSpec,
    ) -> FloatTensor<Self> {
        let beta = beta.into_option();
        let y = norm::forward::<B>(
            x.primitive().clone(),
            gamma.primitive().clone(),
            beta.as_ref().map(|b| b.primitive().clone()),
            &spec,
        );
        // What the backward needs: the input and the weight (the statistics are recomputed).
        let state = NormState {
            x: x.primitive().clone(),
            gamma: gamma.primitive().clone(),
            spec,
        };
        match beta {
            Some(b) => match NormBackward
                .prepare::<C>([x.node(), gamma.node(), b.node()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            },
            None => match NormBackward
                .prepare::<C>([x.node(), gamma.node()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            },
        }
    }

    fn tp_dropout(x: FloatTensor<Self>, spec: DropoutSpec) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct DropoutBackward;
        impl<B: Backend> Backward<B, 1> for DropoutBackward {
            type State = DropoutSpec;
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let spec = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dy| {
                    apply_mask::<B>(dy, &spec)
                });
            }
        }
        let y = apply_mask::<B>(x.primitive().clone(), &spec);
        match DropoutBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            // The mask is regenerated from its counters: nothing else is kept.
            OpsKind::Tracked(prep) => prep.finish(spec, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn tp_swiglu(y: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SwiGluBackward;
        impl<B: Backend> Backward<B, 1> for SwiGluBackward {
            type State = FloatTensor<B>;
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let y = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dz| {
                    swiglu::backward::<B>(y, dz)
                });
            }
        }
        let z = swiglu::forward::<B>(y.primitive().clone());
        match SwiGluBackward
            .prepare::<C>([y.node()])
            .compute_bound()
            .stateful()
        {
            // Only the input: the gate's sigmoid is recomputed.
            OpsKind::Tracked(prep) => prep.finish(y.into_primitive(), z),
            OpsKind::UnTracked(prep) => prep.finish(z),
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

    fn tp_resolve(pending: PendingCollective<Self>) -> CollectiveOutput<Self> {
        let (op, group) = (pending.op, pending.group.clone());
        let input = tracked_if::<B, C>(pending.input.clone(), adjoint_communicates(op));
        let out = match B::tp_resolve(pending.with_input(input.primitive().clone())).into_result() {
            Ok(out) => out,
            Err(e) => return CollectiveOutput::Failed(e),
        };
        let extremum = matches!(op, Collective::AllReduce(ReduceOp::Max | ReduceOp::Min))
            .then(|| (input.primitive().clone(), out.clone()));
        // Graph nodes outlive a panicking rank's stack: they must not keep it in the group.
        let state = CollectiveState {
            op,
            group: group.weak(),
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

/// The backward node of the norms, over 2 parents (x, gamma) or 3 (x, gamma, beta).
#[derive(Debug)]
struct NormBackward;

#[derive(Clone, Debug)]
struct NormState<B: Backend> {
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    spec: NormSpec,
}

impl<B: Backend, const N: usize> Backward<B, N> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _ck: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let NormState { x, gamma, spec } = ops.state;
        let (dx, d_gamma, d_beta) = norm::backward::<B>(x, gamma, dy, &spec);
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

/// Whether the backward of `op` posts a collective (so every rank must run it).
fn adjoint_communicates(op: Collective) -> bool {
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
fn tracked_if<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    force: bool,
) -> FloatTensor<Autodiff<B, C>> {
    if !force || x.is_tracked() {
        return x;
    }
    <Autodiff<B, C> as AutodiffBackend>::from_inner(x.primitive().clone()).require_grad()
}

fn finish_linear<B: TpBackend, C: CheckpointStrategy>(
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
        || state.spec.settings.mode == super::TpMode::ReduceScatter;
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
