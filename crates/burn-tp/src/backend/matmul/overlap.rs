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
//! The ring schedule visits the blocks in arrival order instead: own, then rank r-1, r-2, ...,
//! each peer's shard in chunks of rows as the ring delivers them, so compute waits only for the
//! last chunk.
//!
//! Uses of the schedule:
//! - row backward: `grad_input = all_gather(grad_output) @ W_r^T`, then
//!   `grad_weight = input^T @ total_grad_output`, `grad_bias = sum(total_grad_output)`;
//! - column forward: `out = all_gather(x) @ W_r`.
//!
//! The column backward overlaps differently: the dgrad (`grad_out @ W_r^T`) hides the
//! re-gather of `x` (`recompute_all_gather`), and dgrad is computed in `n` column blocks, each
//! reduce-scattered (all-reduced in ALL_REDUCE mode) as soon as it is computed, so the reductions
//! fly during the later blocks and the wgrad (`X^T @ grad_out`).
//!
//! Where the transport moves data inside the wait, on the caller's thread (ranks as threads
//! without a link), nothing can be hidden: every schedule then takes one block, the sync path's
//! work ([`ProcessGroup::progresses_in_background`]).
//!
//! Every buffer here is a fresh tensor owned by one call: no scratch is shared between layers,
//! calls in flight, or gradient accumulations.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Shape, Slice};
use burn_tp_comm::profile::scope;
use burn_tp_comm::{CommError, ProcessGroup};

use crate::backend::collective::host::rows;
use crate::backend::{
    Collective, LinearSpec, OverlapSchedule, PendingCollective, TpBackend, TpMode,
};

/// Chunks, over all the peers' shards together, in the ring schedule (at least one a shard):
/// 4 a shard at tp = 2, 2 at tp = 4. Finer chunks shorten the compute left after the last one
/// arrives but add a copy and smaller GEMMs per chunk; measured (docs/PERFORMANCE.md, section
/// 3), 4 in all beat 8 at tp = 2, and 2 a shard beat 4 at tp = 4.
const RING_CHUNKS: usize = 4;

fn resolve<B: TpBackend>(p: PendingCollective<B>) -> Result<FloatTensor<B>, CommError> {
    B::tp_resolve(p).into_result()
}

fn start<B: TpBackend>(
    x: FloatTensor<B>,
    op: Collective,
    group: &ProcessGroup,
) -> PendingCollective<B> {
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

/// Visits the rows of an all-gather in flight, block by block, as the schedule makes them
/// available: first this rank's own rows (`local`, `[m, k]`) while the gather is in flight, then
/// the others. `visit(rows, block)` gets the row range in the gathered `[n * m, k]` matrix.
/// Returns the gathered matrix if `keep_gathered` (the collective's own output, either schedule).
pub(crate) fn visit_gathered<B: TpBackend>(
    local: FloatTensor<B>,
    pending: PendingCollective<B>,
    group: &ProcessGroup,
    schedule: OverlapSchedule,
    keep_gathered: bool,
    mut visit: impl FnMut(std::ops::Range<usize>, FloatTensor<B>),
) -> Result<Option<FloatTensor<B>>, CommError> {
    let (r, n) = (group.rank(), group.world_size());
    let m = local.shape()[0];
    if n == 1 || !group.progresses_in_background() {
        // Nothing to hide: the transport moves the data inside the wait, on this thread (ranks
        // as threads without a link). One block, the whole matrix: the sync path's work.
        let gathered = if n == 1 {
            local
        } else {
            flatten::<B>(resolve(pending)?)
        };
        visit(0..n * m, gathered.clone());
        return Ok(keep_gathered.then_some(gathered));
    }
    // 1. own block while the gather is in flight
    visit(r * m..(r + 1) * m, local.clone());
    match schedule {
        OverlapSchedule::Split => {
            // 2. wait for everything; 3. the blocks before and after ours
            let gathered = flatten::<B>(resolve(pending)?);
            if r > 0 {
                visit(0..r * m, rows::<B>(gathered.clone(), 0..r * m));
            }
            if r + 1 < n {
                visit(
                    (r + 1) * m..n * m,
                    rows::<B>(gathered.clone(), (r + 1) * m..n * m),
                );
            }
            Ok(keep_gathered.then_some(gathered))
        }
        OverlapSchedule::Ring => {
            // 2. each peer's shard as it arrives, in ring order (r-1, r-2, ...), chunk by chunk
            // (a ring delivers a shard progressively): compute waits only for the last chunk.
            // Chunks are of dim 0 of the gathered tensor (`m0` rows a shard, each `m / m0`
            // rows once flattened).
            let m0 = pending.input.shape()[0].max(1);
            let per = m / m0;
            let chunks = RING_CHUNKS.div_ceil(n - 1).min(m0);
            drop(local);
            for k in 1..n {
                let p = (r + n - k) % n;
                for c in 0..chunks {
                    let rows = crate::backend::collective::host::chunk_rows(m0, c, chunks);
                    if rows.is_empty() {
                        continue;
                    }
                    let part = B::tp_resolve_part(pending.clone(), p, c, chunks).into_result()?;
                    visit(
                        p * m + rows.start * per..p * m + rows.end * per,
                        flatten::<B>(part),
                    );
                }
            }
            // The whole gather, complete by now: the transport's own output (a warm pooled
            // buffer on the host) rather than a concatenation of the parts into fresh memory.
            Ok(match keep_gathered {
                true => Some(flatten::<B>(resolve(pending)?)),
                false => None,
            })
        }
    }
}

/// `out = gathered @ rhs`, where `gathered` (`[n * m, k]`) is the all-gather in flight of this
/// rank's `local` (`[m, k]`): each block's rows are computed as soon as the block is available
/// and written into one fresh `[n * m, c]` buffer. Returns `(out, gathered if keep_gathered)`.
/// See the diagram at the top of this file.
pub(crate) fn gather_matmul<B: TpBackend>(
    local: FloatTensor<B>,
    pending: PendingCollective<B>,
    rhs: FloatTensor<B>,
    group: &ProcessGroup,
    schedule: OverlapSchedule,
    keep_gathered: bool,
) -> Result<(FloatTensor<B>, Option<FloatTensor<B>>), CommError> {
    let n = group.world_size();
    let (m, c) = (local.shape()[0], rhs.shape()[1]);
    let mut out = None;
    let gathered = visit_gathered::<B>(
        local,
        pending,
        group,
        schedule,
        keep_gathered,
        |range, block| {
            let y = B::tp_matmul(block, rhs.clone());
            if range.len() == n * m {
                out = Some(y);
                return;
            }
            let buf = out.take().unwrap_or_else(|| {
                B::float_empty(Shape::from(vec![n * m, c]), &y.device(), y.dtype().into())
            });
            out = Some(B::float_slice_assign(buf, &row_slices(range), y));
        },
    )?;
    Ok((out.expect("at least the own block"), gathered))
}

fn row_slices(range: std::ops::Range<usize>) -> [Slice; 2] {
    [
        Slice::new(range.start as isize, Some(range.end as isize), 1),
        Slice::full(),
    ]
}

/// What the column forward keeps for its backward.
#[derive(Clone, Debug)]
pub(crate) struct ColumnSaved<B: Backend> {
    /// The input as the wgrad needs it: `x` (ALL_REDUCE), the gathered `X` or, with
    /// `recompute_all_gather`, the local shard `x_r` (REDUCE_SCATTER).
    pub(crate) input: FloatTensor<B>,
    /// Whether `input` is the local shard to re-gather.
    pub(crate) needs_gather: bool,
}

/// Column forward: `[.., d_in] -> [.., d_out / n]` (ALL_REDUCE) or
/// `[s/n, .., d_in] -> [s, .., d_out / n]` (REDUCE_SCATTER, all-gather overlapped).
pub(crate) fn column_forward<B: TpBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Result<(FloatTensor<B>, ColumnSaved<B>), CommError> {
    let _scope = scope("ColumnParallelLinear.forward");
    let mut lead = x.shape().to_vec();
    lead.pop();
    match spec.settings.mode {
        TpMode::AllReduce => {
            let y = add_bias::<B>(B::tp_matmul(flatten::<B>(x.clone()), weight), bias);
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
            let keep = !spec.settings.recompute_all_gather;
            let (y, gathered) = gather_matmul::<B>(
                flatten::<B>(x.clone()),
                pending,
                weight,
                group,
                spec.settings.schedule,
                keep,
            )?;
            lead[0] *= group.world_size();
            let y = unflatten::<B>(add_bias::<B>(y, bias), &lead);
            let saved = if spec.settings.recompute_all_gather {
                ColumnSaved {
                    input: x,
                    needs_gather: true,
                }
            } else {
                ColumnSaved {
                    input: unflatten::<B>(gathered.expect("kept"), &lead),
                    needs_gather: false,
                }
            };
            Ok((y, saved))
        }
    }
}

/// Gradients of a parallel linear; `None` where not asked for.
pub(crate) struct LinearGrads<B: Backend> {
    /// Same shape as the layer input.
    pub(crate) input: Option<FloatTensor<B>>,
    /// Same shape as the weight shard.
    pub(crate) weight: Option<FloatTensor<B>>,
    /// Same shape as the bias.
    pub(crate) bias: Option<FloatTensor<B>>,
}

/// Which gradients the backward must produce.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Needs {
    /// Input gradient.
    pub(crate) input: bool,
    /// Weight gradient.
    pub(crate) weight: bool,
    /// Bias gradient.
    pub(crate) bias: bool,
}

/// Column backward. `grad` is `[.., d_out / n]` (`[s, .., d_out / n]` in REDUCE_SCATTER mode).
pub(crate) fn column_backward<B: TpBackend>(
    grad: FloatTensor<B>,
    saved: ColumnSaved<B>,
    weight: FloatTensor<B>,
    spec: LinearSpec,
    group: &ProcessGroup,
    needs: Needs,
) -> Result<LinearGrads<B>, CommError> {
    let _scope = scope("ColumnParallelLinear.backward");
    let mut gathered_lead = grad.shape().to_vec();
    gathered_lead.pop();
    let g2 = flatten::<B>(grad);
    // The re-gather of x flies during the dgrad matmul.
    let pending_x = saved
        .needs_gather
        .then(|| start::<B>(saved.input.clone(), Collective::AllGather { dim: 0 }, group));
    // The reduction of dgrad flies during the wgrad matmul. Where the transport progresses in the
    // background, dgrad is computed and posted in column blocks (`d_in / n` each, a reduction of
    // its own), so the first blocks' reductions also fly while the next blocks are computed.
    let op = match spec.settings.mode {
        TpMode::AllReduce => Collective::AllReduce(burn_tp_comm::ReduceOp::Sum),
        TpMode::ReduceScatter => Collective::ReduceScatter { dim: 0 },
    };
    let n = group.world_size();
    let blocks = if n > 1 && group.progresses_in_background() {
        n
    } else {
        1
    };
    // Run always, as Megatron does, even when this rank's input needs no gradient: every rank
    // must post the same collectives whatever its own requires-grad state.
    let pending_dx = (needs.input || n > 1).then(|| {
        let w_t = B::float_transpose(weight);
        let d_in = w_t.shape()[1];
        (0..blocks)
            .map(|k| k * d_in / blocks..(k + 1) * d_in / blocks)
            .filter(|cols| !cols.is_empty())
            .map(|cols| {
                let w_k = if cols.len() == d_in {
                    w_t.clone()
                } else {
                    crate::backend::collective::host::slice_dim::<B>(w_t.clone(), 1, cols.clone())
                };
                let mut dims = gathered_lead.clone();
                dims.push(cols.len());
                let gx = B::float_reshape(B::tp_matmul(g2.clone(), w_k), Shape::from(dims));
                start::<B>(gx, op, group)
            })
            .collect::<Vec<_>>()
    });
    let input = match pending_x {
        Some(p) => resolve(p)?,
        None => saved.input,
    };
    let weight_grad = needs
        .weight
        .then(|| B::tp_matmul(B::float_transpose(flatten::<B>(input)), g2.clone()));
    let bias_grad = needs.bias.then(|| sum_rows::<B>(g2));
    let input_grad = match pending_dx {
        Some(pending) if needs.input => {
            let mut parts = pending
                .into_iter()
                .map(resolve)
                .collect::<Result<Vec<_>, CommError>>()?;
            Some(if parts.len() == 1 {
                parts.remove(0)
            } else {
                let last = parts[0].shape().num_dims() - 1;
                B::float_cat(parts, last)
            })
        }
        Some(pending) => {
            // Completed and dropped: the peers' reductions need this rank's part.
            for p in pending {
                resolve(p)?;
            }
            None
        }
        None => None,
    };
    Ok(LinearGrads {
        input: input_grad,
        weight: weight_grad,
        bias: bias_grad,
    })
}

/// Row forward: `[.., d_in / n] -> [.., d_out]` (ALL_REDUCE, all-reduced) or
/// `[s, .., d_in / n] -> [s/n, .., d_out]` (REDUCE_SCATTER). The replicated bias is added once,
/// after the reduction, by every rank to its own output.
pub(crate) fn row_forward<B: TpBackend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Result<FloatTensor<B>, CommError> {
    let _scope = scope("RowParallelLinear.forward");
    let mut lead = x.shape().to_vec();
    lead.pop();
    let partial = unflatten::<B>(B::tp_matmul(flatten::<B>(x), weight), &lead);
    let op = match spec.settings.mode {
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
pub(crate) fn row_backward<B: TpBackend>(
    grad: FloatTensor<B>,
    input: FloatTensor<B>,
    weight: FloatTensor<B>,
    spec: LinearSpec,
    group: &ProcessGroup,
    needs: Needs,
) -> Result<LinearGrads<B>, CommError> {
    let _scope = scope("RowParallelLinear.backward");
    let mut lead = input.shape().to_vec();
    lead.pop();
    let w_t = B::float_transpose(weight);
    let x2 = flatten::<B>(input);
    let (grad_input, weight_grad, bias_grad) = match spec.settings.mode {
        TpMode::AllReduce => {
            let g2 = flatten::<B>(grad);
            let gx = needs.input.then(|| B::tp_matmul(g2.clone(), w_t));
            let gw = needs
                .weight
                .then(|| B::tp_matmul(B::float_transpose(x2), g2.clone()));
            (gx, gw, needs.bias.then(|| sum_rows::<B>(g2)))
        }
        TpMode::ReduceScatter if spec.settings.schedule == OverlapSchedule::Ring => {
            // Everything per block, as the blocks arrive: dgrad rows, and the wgrad / bias
            // partial sums of those rows.
            let pending = start::<B>(grad.clone(), Collective::AllGather { dim: 0 }, group);
            let n = group.world_size();
            let (m, d_in) = (
                grad.shape()
                    .to_vec()
                    .iter()
                    .rev()
                    .skip(1)
                    .product::<usize>(),
                w_t.shape()[1],
            );
            let (mut gx, mut gw, mut gb) = (None, None, None);
            let add = |acc: Option<FloatTensor<B>>, t: FloatTensor<B>| {
                Some(acc.map_or(t.clone(), |a| B::float_add(a, t)))
            };
            visit_gathered::<B>(
                flatten::<B>(grad),
                pending,
                group,
                spec.settings.schedule,
                false,
                |range, block| {
                    if needs.input {
                        let y = B::tp_matmul(block.clone(), w_t.clone());
                        gx = Some(if range.len() == n * m {
                            y
                        } else {
                            let buf = gx.take().unwrap_or_else(|| {
                                B::float_empty(
                                    Shape::from(vec![n * m, d_in]),
                                    &y.device(),
                                    y.dtype().into(),
                                )
                            });
                            B::float_slice_assign(buf, &row_slices(range.clone()), y)
                        });
                    }
                    if needs.weight {
                        let x_rows = B::float_transpose(rows::<B>(x2.clone(), range));
                        gw = Some(match gw.take() {
                            Some(acc) => B::tp_matmul_acc(acc, x_rows, block.clone()),
                            None => B::tp_matmul(x_rows, block.clone()),
                        });
                    }
                    if needs.bias {
                        gb = add(gb.take(), sum_rows::<B>(block));
                    }
                },
            )?;
            (gx, gw, gb)
        }
        TpMode::ReduceScatter => {
            let pending = start::<B>(grad.clone(), Collective::AllGather { dim: 0 }, group);
            let (gx, total) = gather_matmul::<B>(
                flatten::<B>(grad),
                pending,
                w_t,
                group,
                spec.settings.schedule,
                true,
            )?;
            let total = total.expect("kept");
            let gw = needs
                .weight
                .then(|| B::tp_matmul(B::float_transpose(x2), total.clone()));
            (
                needs.input.then_some(gx),
                gw,
                needs.bias.then(|| sum_rows::<B>(total)),
            )
        }
    };
    Ok(LinearGrads {
        input: grad_input.map(|g| unflatten::<B>(g, &lead)),
        weight: weight_grad,
        bias: bias_grad,
    })
}
