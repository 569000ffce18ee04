//! `TpBackend` for `Autodiff<B>`: the inner backend's forward, then one custom backward node
//! per op. Collectives take their Megatron adjoint (the table in [`super`]); the parallel
//! linears take `nodes::LinearBackward`, which runs the overlapped backward of
//! `backend/matmul/overlap.rs`. The nodes are in `nodes.rs`.

use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::{Autodiff, AutodiffBackend, Backend, TensorMetadata, tensor::FloatTensor};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::backend::attention::mask::AttentionSpec;
use crate::backend::attention::ring::{self, RingSpec};
use crate::backend::fused::dropout::{DropoutSpec, apply_mask};
use crate::backend::fused::norm::NormSpec;
use crate::backend::fused::swiglu::GluActivation;
use crate::backend::matmul::overlap::{column_forward, row_forward};
use crate::backend::{
    AllToAllSpec, Bias, Collective, CollectiveOutput, GradTap, LinearSpec, PendingCollective,
    TpBackend,
};

mod nodes;

use nodes::{
    AttentionState, CollectiveBackward, CollectiveState, LinearKind, NormBackward, NormState,
    TapBackward, adjoint_communicates, linear_op, tracked_if,
};

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

    fn tp_all_to_all(
        x: FloatTensor<Self>,
        spec: AllToAllSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        #[derive(Debug)]
        struct AllToAllBackward;
        impl<B: TpBackend> Backward<B, 1> for AllToAllBackward {
            type State = (AllToAllSpec, ProcessGroup);
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let (spec, group) = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dy| {
                    B::tp_all_to_all(dy, spec.reversed(), group)
                        .into_result()
                        .unwrap_or_else(|e| panic!("burn-tp: all-to-all backward failed: {e}"))
                });
            }
        }
        let y = match B::tp_all_to_all(x.primitive().clone(), spec.clone(), group.clone())
            .into_result()
        {
            Ok(y) => y,
            Err(e) => return CollectiveOutput::Failed(e),
        };
        let out = match AllToAllBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            // The adjoint needs only the counts: nothing of the tensors is kept.
            OpsKind::Tracked(prep) => prep.finish((spec, group), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        };
        CollectiveOutput::Done(out)
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
                let (dq, dk, dv) = B::tp_attention_kernel_backward(q, k, v, out, lse, d_out, spec);
                for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
                    if let Some(node) = parent {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }
        let (out, lse) = B::tp_attention_kernel(
            q.primitive().clone(),
            k.primitive().clone(),
            v.primitive().clone(),
            spec.clone(),
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

    fn tp_ring_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: RingSpec,
    ) -> CollectiveOutput<Self> {
        #[derive(Debug)]
        struct RingBackward;
        impl<B: TpBackend> Backward<B, 3> for RingBackward {
            type State = (AttentionState<B>, RingSpec);
            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let (
                    AttentionState {
                        q, k, v, out, lse, ..
                    },
                    ring,
                ) = ops.state;
                let d_out = grads.consume::<B>(&ops.node);
                let (dq, dk, dv) = ring::backward::<B>(q, k, v, out, lse, d_out, &ring)
                    .unwrap_or_else(|e| panic!("burn-tp: ring attention backward failed: {e}"));
                for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
                    if let Some(node) = parent {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }
        let (out, lse) = match ring::forward::<B>(
            q.primitive().clone(),
            k.primitive().clone(),
            v.primitive().clone(),
            &spec,
        ) {
            Ok(r) => r,
            Err(e) => return CollectiveOutput::Failed(e),
        };
        let out = match RingBackward
            .prepare::<C>([q.node(), k.node(), v.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // As the one-rank kernel: this rank's q, k, v, output and log-sum-exps.
                let state = AttentionState {
                    q: q.into_primitive(),
                    k: k.into_primitive(),
                    v: v.into_primitive(),
                    out: out.clone(),
                    lse,
                    spec: spec.attention.clone(),
                };
                prep.finish((state, spec), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        CollectiveOutput::Done(out)
    }

    fn tp_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Bias<Self>,
        spec: NormSpec,
    ) -> FloatTensor<Self> {
        let beta = beta.into_option();
        let y = B::tp_norm(
            x.primitive().clone(),
            gamma.primitive().clone(),
            beta.as_ref().map(|b| b.primitive().clone()).into(),
            spec,
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

    fn tp_glu(y: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GluBackward;
        impl<B: TpBackend> Backward<B, 1> for GluBackward {
            type State = (FloatTensor<B>, GluActivation);
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let (y, act) = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dz| {
                    B::tp_glu_backward(y, dz, act)
                });
            }
        }
        let z = B::tp_glu(y.primitive().clone(), act);
        match GluBackward
            .prepare::<C>([y.node()])
            .compute_bound()
            .stateful()
        {
            // Only the input: the gate's activation is recomputed.
            OpsKind::Tracked(prep) => prep.finish((y.into_primitive(), act), z),
            OpsKind::UnTracked(prep) => prep.finish(z),
        }
    }

    fn tp_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GeluBackward;
        impl<B: TpBackend> Backward<B, 1> for GeluBackward {
            type State = FloatTensor<B>;
            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _ck: &mut Checkpointer,
            ) {
                let x = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dy| {
                    B::tp_gelu_backward(x, dy)
                });
            }
        }
        let y = B::tp_gelu(x.primitive().clone());
        match GeluBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(x.into_primitive(), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
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
