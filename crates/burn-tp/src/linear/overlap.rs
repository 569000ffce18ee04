//! The parallel-linear algorithm on backend primitives: forward and backward of the column- and
//! row-parallel layers, with communication overlapped by compute. Autodiff plumbing lives in
//! [`crate::backend`]; this file is only the math and the schedule.
//!
//! Notation: `n` = tp world size, `r` = this rank, `m` = rows of one rank's sequence shard after
//! flattening leading dims (`[s/n, b, h] -> [s/n * b, h]`). Weights use Burn's row layout
//! `[d_in, d_out]`.
//!
//! ```text
//!  REDUCE_SCATTER mode (sequence parallel), tp = n
//!
//!  column layer  x_r [s/n,b,d_in] --all-gather--> X [s,b,d_in] @ W_r [d_in, d_out/n] -> [s,b,d_out/n]
//!  row layer     y_r [s,b,d_in/n] @ W_r [d_in/n, d_out] -> partial [s,b,d_out] --reduce-scatter--> [s/n,b,d_out]
//!
//!  The split schedule (nanotron), for out = gathered @ rhs while `gathered` is all-gathered:
//!
//!          gathered rows (rank order)              out rows
//!        +----------------------------+        +----------------------+
//!        | rank 0      \              |        | before  (after wait) |
//!        | ...          > before      |        |                      |
//!        | rank r-1    /              |        +----------------------+
//!        +----------------------------+        | own  (during comm)   |  <- local @ rhs, computed
//!        | rank r   = local (own)     |        |                      |     while the gather flies
//!        +----------------------------+        +----------------------+
//!        | rank r+1    \              |        | after   (after wait) |
//!        | ...          > after       |        |                      |
//!        | rank n-1    /              |        +----------------------+
//!        +----------------------------+
//!   "before" is empty on rank 0 and "after" on rank n-1.
//! ```
//!
//! Uses of the schedule:
//! - row backward: `grad_input = all_gather(grad_output) @ W_r^T`, then
//!   `grad_weight = input^T @ total_grad_output`, `grad_bias = sum(total_grad_output)`;
//! - column forward: `out = all_gather(x) @ W_r`.
//!
//! The column backward overlaps differently: the dgrad (`grad_out @ W_r^T`) hides the
//! re-gather of `x` (`recompute_all_gather`), and the wgrad (`X^T @ grad_out`) hides the
//! reduce-scatter of dgrad. In ALL_REDUCE mode the column backward hides the all-reduce of dgrad
//! behind the wgrad.
//!
//! Every buffer here is a fresh tensor owned by one call: no scratch is shared between layers,
//! calls in flight, or gradient accumulations.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Shape, Slice};
use burn_tp_comm::{CommError, ProcessGroup};

use super::TpMode;
use crate::backend::{Collective, CollectiveOutput, PendingPrimitive, TpBackend};

/// How a parallel linear runs, as passed to the backend ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearSpec {
    /// Activation layout.
    pub mode: TpMode,
    /// Column layer, REDUCE_SCATTER mode: save only the local shard of the input and re-gather it
    /// in backward (less memory, one more all-gather, hidden behind the dgrad matmul).
    pub recompute_all_gather: bool,
    /// How to overlap a gather with the matmul that consumes it.
    pub schedule: OverlapSchedule,
}

/// The overlap schedule for a gather feeding a matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OverlapSchedule {
    /// Own shard during the communication, the rest after it (nanotron).
    #[default]
    Split,
}

/// Inputs of a parallel-linear op as they cross the dispatch boundary: an optional bias.
#[derive(burn::backend::ExtensionType)]
pub enum Bias<B: Backend> {
    /// No bias.
    None,
    /// The bias: `[d_out / n]` for the column layer, `[d_out]` (replicated) for the row layer.
    Some(FloatTensor<B>),
}

impl<B: Backend> Bias<B> {
    /// As an `Option`.
    pub fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Bias::None => None,
            Bias::Some(b) => Some(b),
        }
    }
}

type Res<T> = Result<T, CommError>;

fn resolve<B: TpBackend>(p: PendingPrimitive<B>) -> Res<FloatTensor<B>> {
    match B::tp_resolve(p) {
        CollectiveOutput::Done(t) => Ok(t),
        CollectiveOutput::Failed(e) => Err(e),
    }
}

fn start<B: TpBackend>(
    x: FloatTensor<B>,
    op: Collective,
    group: &ProcessGroup,
) -> PendingPrimitive<B> {
    B::tp_start(x, op, group.clone())
}

/// `[d0, .., k] -> [d0 * .. , k]`.
fn flatten<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let dims = x.shape().to_vec();
    let k = *dims.last().expect("rank >= 1");
    let m = dims.iter().product::<usize>() / k.max(1);
    B::float_reshape(x, Shape::from(vec![m, k]))
}

/// `[m, c] -> lead ++ [c]`.
fn unflatten<B: Backend>(x: FloatTensor<B>, lead: &[usize]) -> FloatTensor<B> {
    let c = x.shape()[1];
    let mut dims = lead.to_vec();
    dims.push(c);
    B::float_reshape(x, Shape::from(dims))
}

fn rows<B: Backend>(x: FloatTensor<B>, range: std::ops::Range<usize>) -> FloatTensor<B> {
    B::float_slice(
        x,
        &[
            Slice::new(range.start as isize, Some(range.end as isize), 1),
            Slice::full(),
        ],
    )
}

fn add_bias<B: Backend>(y2: FloatTensor<B>, bias: Option<FloatTensor<B>>) -> FloatTensor<B> {
    match bias {
        Some(b) => {
            let d = b.shape()[0];
            B::float_add(y2, B::float_reshape(b, Shape::from(vec![1, d])))
        }
        None => y2,
    }
}

/// `sum` over rows: `[m, c] -> [c]`.
fn sum_rows<B: Backend>(g2: FloatTensor<B>) -> FloatTensor<B> {
    let c = g2.shape()[1];
    B::float_reshape(B::float_sum_dim(g2, 0), Shape::from(vec![c]))
}

/// `out = gathered @ rhs`, where `gathered` (`[n * m, k]`) is the all-gather in flight of this
/// rank's `local` (`[m, k]`). Returns `(out [n * m, c], gathered [n * m, k])`. See the diagram
/// at the top of this file.
pub fn gather_matmul<B: TpBackend>(
    local: FloatTensor<B>,
    pending: PendingPrimitive<B>,
    rhs: FloatTensor<B>,
    group: &ProcessGroup,
    schedule: OverlapSchedule,
) -> Res<(FloatTensor<B>, FloatTensor<B>)> {
    match schedule {
        OverlapSchedule::Split => split_schedule(local, pending, rhs, group),
    }
}

fn split_schedule<B: TpBackend>(
    local: FloatTensor<B>,
    pending: PendingPrimitive<B>,
    rhs: FloatTensor<B>,
    group: &ProcessGroup,
) -> Res<(FloatTensor<B>, FloatTensor<B>)> {
    let (r, n) = (group.rank(), group.world_size());
    let m = local.shape()[0];
    let c = rhs.shape()[1];
    // 1. own block while the gather is in flight
    let own = B::float_matmul(local.clone(), rhs.clone());
    if n == 1 {
        drop(pending);
        return Ok((own, local));
    }
    // 2. wait
    let gathered = flatten::<B>(resolve(pending)?);
    // 3. the blocks before and after ours, written around it into one fresh buffer
    let out = B::float_empty(
        Shape::from(vec![n * m, c]),
        &own.device(),
        own.dtype().into(),
    );
    let block =
        |lo: usize, hi: usize| [Slice::new(lo as isize, Some(hi as isize), 1), Slice::full()];
    let mut out = B::float_slice_assign(out, &block(r * m, (r + 1) * m), own);
    if r > 0 {
        let before = B::float_matmul(rows::<B>(gathered.clone(), 0..r * m), rhs.clone());
        out = B::float_slice_assign(out, &block(0, r * m), before);
    }
    if r + 1 < n {
        let after = B::float_matmul(rows::<B>(gathered.clone(), (r + 1) * m..n * m), rhs);
        out = B::float_slice_assign(out, &block((r + 1) * m, n * m), after);
    }
    Ok((out, gathered))
}

/// What the column forward keeps for its backward.
#[derive(Clone, Debug)]
pub struct ColumnSaved<B: Backend> {
    /// The input as the wgrad needs it: `x` (ALL_REDUCE), the gathered `X` or, with
    /// `recompute_all_gather`, the local shard `x_r` (REDUCE_SCATTER).
    pub input: FloatTensor<B>,
    /// Whether `input` is the local shard to re-gather.
    pub needs_gather: bool,
}

/// Column forward: `[.., d_in] -> [.., d_out / n]` (ALL_REDUCE) or
/// `[s/n, .., d_in] -> [s, .., d_out / n]` (REDUCE_SCATTER, all-gather overlapped).
pub fn column_forward<B: TpBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Res<(FloatTensor<B>, ColumnSaved<B>)> {
    let mut lead = x.shape().to_vec();
    lead.pop();
    match spec.mode {
        TpMode::AllReduce => {
            let y = add_bias::<B>(B::float_matmul(flatten::<B>(x.clone()), weight), bias);
            Ok((
                unflatten::<B>(y, &lead),
                ColumnSaved {
                    input: x,
                    needs_gather: false,
                },
            ))
        }
        TpMode::ReduceScatter => {
            let pending = start::<B>(x.clone(), Collective::AllGather { dim: 0 }, group);
            let (y, gathered) = gather_matmul::<B>(
                flatten::<B>(x.clone()),
                pending,
                weight,
                group,
                spec.schedule,
            )?;
            lead[0] *= group.world_size();
            let y = unflatten::<B>(add_bias::<B>(y, bias), &lead);
            let saved = if spec.recompute_all_gather {
                ColumnSaved {
                    input: x,
                    needs_gather: true,
                }
            } else {
                ColumnSaved {
                    input: unflatten::<B>(gathered, &lead),
                    needs_gather: false,
                }
            };
            Ok((y, saved))
        }
    }
}

/// Gradients of a parallel linear; `None` where not asked for.
pub struct LinearGrads<B: Backend> {
    /// Same shape as the layer input.
    pub input: Option<FloatTensor<B>>,
    /// Same shape as the weight shard.
    pub weight: Option<FloatTensor<B>>,
    /// Same shape as the bias.
    pub bias: Option<FloatTensor<B>>,
}

/// Which gradients the backward must produce.
#[derive(Clone, Copy, Debug)]
pub struct Needs {
    /// Input gradient.
    pub input: bool,
    /// Weight gradient.
    pub weight: bool,
    /// Bias gradient.
    pub bias: bool,
}

/// Column backward. `grad` is `[.., d_out / n]` (`[s, .., d_out / n]` in REDUCE_SCATTER mode).
pub fn column_backward<B: TpBackend>(
    grad: FloatTensor<B>,
    saved: ColumnSaved<B>,
    weight: FloatTensor<B>,
    spec: LinearSpec,
    group: &ProcessGroup,
    needs: Needs,
) -> Res<LinearGrads<B>> {
    let mut gathered_lead = grad.shape().to_vec();
    gathered_lead.pop();
    let g2 = flatten::<B>(grad);
    // The re-gather of x flies during the dgrad matmul.
    let pending_x = saved
        .needs_gather
        .then(|| start::<B>(saved.input.clone(), Collective::AllGather { dim: 0 }, group));
    let dgrad = needs.input.then(|| {
        let gx = B::float_matmul(g2.clone(), B::float_transpose(weight));
        let d_in = gx.shape()[1];
        let mut dims = gathered_lead.clone();
        dims.push(d_in);
        B::float_reshape(gx, Shape::from(dims))
    });
    // The reduction of dgrad flies during the wgrad matmul.
    let op = match spec.mode {
        TpMode::AllReduce => Collective::AllReduce(burn_tp_comm::ReduceOp::Sum),
        TpMode::ReduceScatter => Collective::ReduceScatter { dim: 0 },
    };
    let pending_dx = dgrad.map(|gx| start::<B>(gx, op, group));
    let input = match pending_x {
        Some(p) => resolve(p)?,
        None => saved.input,
    };
    let weight_grad = needs
        .weight
        .then(|| B::float_matmul(B::float_transpose(flatten::<B>(input)), g2.clone()));
    let bias_grad = needs.bias.then(|| sum_rows::<B>(g2));
    let input_grad = pending_dx.map(resolve).transpose()?;
    Ok(LinearGrads {
        input: input_grad,
        weight: weight_grad,
        bias: bias_grad,
    })
}

/// Row forward: `[.., d_in / n] -> [.., d_out]` (ALL_REDUCE, all-reduced) or
/// `[s, .., d_in / n] -> [s/n, .., d_out]` (REDUCE_SCATTER). The replicated bias is added once,
/// after the reduction, by every rank to its own output.
pub fn row_forward<B: TpBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Res<FloatTensor<B>> {
    let mut lead = x.shape().to_vec();
    lead.pop();
    let partial = unflatten::<B>(B::float_matmul(flatten::<B>(x), weight), &lead);
    let op = match spec.mode {
        TpMode::AllReduce => Collective::ReduceFromRegion,
        TpMode::ReduceScatter => Collective::ReduceScatter { dim: 0 },
    };
    let reduced = resolve(start::<B>(partial, op, group))?;
    let mut out_lead = reduced.shape().to_vec();
    out_lead.pop();
    Ok(unflatten::<B>(
        add_bias::<B>(flatten::<B>(reduced), bias),
        &out_lead,
    ))
}

/// Row backward. `grad` is `[.., d_out]` (replicated, ALL_REDUCE) or `[s/n, .., d_out]`
/// (REDUCE_SCATTER: all-gathered with the split schedule; see the diagram).
pub fn row_backward<B: TpBackend>(
    grad: FloatTensor<B>,
    input: FloatTensor<B>,
    weight: FloatTensor<B>,
    spec: LinearSpec,
    group: &ProcessGroup,
    needs: Needs,
) -> Res<LinearGrads<B>> {
    let mut lead = input.shape().to_vec();
    lead.pop();
    let w_t = B::float_transpose(weight);
    let (grad_input, total) = match spec.mode {
        TpMode::AllReduce => {
            let g2 = flatten::<B>(grad);
            (needs.input.then(|| B::float_matmul(g2.clone(), w_t)), g2)
        }
        TpMode::ReduceScatter => {
            let pending = start::<B>(grad.clone(), Collective::AllGather { dim: 0 }, group);
            let (gx, total) =
                gather_matmul::<B>(flatten::<B>(grad), pending, w_t, group, spec.schedule)?;
            (needs.input.then_some(gx), total)
        }
    };
    let weight_grad = needs
        .weight
        .then(|| B::float_matmul(B::float_transpose(flatten::<B>(input)), total.clone()));
    let bias_grad = needs.bias.then(|| sum_rows::<B>(total));
    Ok(LinearGrads {
        input: grad_input.map(|g| unflatten::<B>(g, &lead)),
        weight: weight_grad,
        bias: bias_grad,
    })
}
