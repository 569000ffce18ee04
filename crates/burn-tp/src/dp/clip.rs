//! [`GradClip`]: gradient clipping by the global norm (PyTorch's `clip_grad_norm_`, Megatron's
//! `--clip-grad`) over a model split by tp and, with fsdp, by the shard group, or at any layout
//! by the sharded checkpoint's writers (pipeline stages, expert parallelism, HSDP): each
//! element of the whole model counted once.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::Result;
use crate::checkpoint::{Sharding, Written};
use crate::fsdp::Fsdp;
use crate::model::param_ids;
use crate::reshard::Reshard;

/// Scales the gradients so that their global L2 norm is at most `max_norm`:
/// `g *= min(1, max_norm / (norm + 1e-6))`, the norm over the whole model's gradient (the
/// data-parallel average), each element once: of a tp-replicated parameter (a norm's weight,
/// key / value heads shared by several ranks) only the lowest holder's elements count, as the
/// sharded checkpoint writes them ([`crate::reshard::ParamLayout`]).
#[derive(Clone, Debug)]
pub struct GradClip {
    max_norm: f64,
    /// Per parameter: the dimension and this rank's local ranges along it that it counts
    /// (with [`sharded`](Self::sharded), in the rank's tensor, and the rows of dim 0).
    counted: HashMap<ParamId, Written>,
    /// Where the local sums add up: tp (then fsdp's shard group), or the whole world.
    sum_over: ProcessGroup,
    fsdp: Option<Fsdp>,
    /// With [`sharded`](Self::sharded): whether this rank counts anything.
    counts: bool,
    /// Made by [`sharded`](Self::sharded) (its sums over the world).
    sharded: bool,
}

impl GradClip {
    /// Clipping at `max_norm` for `model` (the whole tp shard: before an fsdp split), its tp
    /// group `tp_group`.
    pub fn new<M: Module + Reshard>(model: &M, tp_group: &ProcessGroup, max_norm: f64) -> Self {
        let ids = param_ids(model);
        let counted = ids
            .into_iter()
            .zip(model.layout(tp_group.rank()))
            .map(|(id, layout)| {
                let ranges = layout
                    .pieces
                    .iter()
                    .filter(|p| p.writes)
                    .map(|p| p.local.clone())
                    .collect();
                let dim = layout.dim;
                (
                    id,
                    Written {
                        dim,
                        ranges,
                        rows: None,
                    },
                )
            })
            .collect();
        Self {
            max_norm,
            counted,
            sum_over: tp_group.clone(),
            fsdp: None,
            counts: true,
            sharded: false,
        }
    }

    /// Clipping at `max_norm` for `model` (this rank's parameters as the sharded checkpoint
    /// sees them: a stage's, an ep rank's, fsdp's shards) where each rank counts the elements
    /// `sharding` says it writes ([`crate::checkpoint::save_sharded`]; `writes`: whether the
    /// rank writes at all, a data-parallel replica other than the writers' does not), the sums
    /// added over `world` (every rank of the run: one all-reduce of a scalar). The same norm
    /// as the whole model's on one rank, at any tp x pp x dp x ep, with or without fsdp.
    pub fn sharded<M: Module>(
        model: &M,
        sharding: &Sharding,
        writes: bool,
        world: &ProcessGroup,
        max_norm: f64,
    ) -> Self {
        let counted = param_ids(model)
            .into_iter()
            .enumerate()
            .filter_map(|(k, id)| sharding.written(k).map(|w| (id, w)))
            .collect();
        Self {
            max_norm,
            counted,
            sum_over: world.clone(),
            fsdp: None,
            counts: writes,
            sharded: true,
        }
    }

    /// The model's parameters are `fsdp`'s shards: each rank counts the rows it holds.
    pub fn with_fsdp(mut self, fsdp: Fsdp) -> Self {
        self.fsdp = Some(fsdp);
        self
    }

    /// The global norm of `model`'s gradients in `grads` (already averaged over dp), and the
    /// gradients scaled to at most `max_norm`. Collective over tp (and the fsdp shard group).
    ///
    /// # Errors
    /// A communication error.
    pub fn clip<M: Module>(&self, model: &M, grads: &mut GradientsParams) -> Result<f64> {
        struct SumSq<'a> {
            clip: &'a GradClip,
            grads: &'a GradientsParams,
            parts: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for SumSq<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let (Some(g), Some(w)) = (
                    self.grads.get::<D>(param.id),
                    self.clip.counted.get(&param.id),
                ) else {
                    return;
                };
                let (dim, ranges) = (&w.dim, &w.ranges);
                let mut g = g.cast(burn::tensor::FloatDType::F32);
                if let Some(rows) = &w.rows {
                    g = g.narrow(0, rows.start, rows.len());
                }
                // With fsdp the shard holds rows [r c, (r + 1) c) of the tp shard.
                let rows = match &self.clip.fsdp {
                    Some(f) => f.held_rows(param.id, g.dims()[0]),
                    None => 0..g.dims()[0],
                };
                for r in ranges {
                    let part = match *dim {
                        0 => {
                            let (s, e) = (r.start.max(rows.start), r.end.min(rows.end));
                            if s >= e {
                                continue;
                            }
                            g.clone().narrow(0, s - rows.start, e - s)
                        }
                        d => g.clone().narrow(d, r.start, r.len()),
                    };
                    self.parts.push(part.powi_scalar(2).sum());
                }
            }
        }
        let mut sum = SumSq {
            clip: self,
            grads,
            parts: Vec::new(),
        };
        model.visit(&mut sum);
        let local = match sum.parts.is_empty() || !self.counts {
            true => 0.0,
            false => Tensor::cat(sum.parts, 0).sum().into_scalar::<f64>(),
        };
        let (norm, scale) = self.norm_of(local)?;
        if let Some(scale) = scale {
            scale_grads(model, grads, scale);
        }
        Ok(norm)
    }

    /// The global norm from this rank's sum of squares `local` (summed over the ranks), and
    /// the scale of the gradients where the norm is above `max_norm`. Collective.
    pub(crate) fn norm_of(&self, local: f64) -> Result<(f64, Option<f64>)> {
        let mut total = self.sum_over.all_reduce(vec![local], ReduceOp::Sum)?[0];
        if let Some(f) = &self.fsdp {
            total = f.shard_group().all_reduce(vec![total], ReduceOp::Sum)?[0];
        }
        let norm = total.sqrt();
        let scale = self.max_norm / (norm + 1e-6);
        Ok((norm, (scale < 1.0).then_some(scale)))
    }

    /// Made by [`sharded`](Self::sharded): its sums run over the world, as the distributed
    /// optimizer's chunks need.
    pub(crate) fn is_sharded(&self) -> bool {
        self.sharded
    }

    /// The elements of parameter `id` (this rank's tensor, of shape `dims`) that this rank
    /// counts, as ranges of its row-major flattening (adjacent ones merged): what the
    /// distributed optimizer's chunks count ([`super::DistributedAdamW::step_clipped`]).
    pub(crate) fn counted_flat(&self, id: ParamId, dims: &[usize]) -> Vec<Range<usize>> {
        let Some(w) = self.counted.get(&id).filter(|_| self.counts) else {
            return Vec::new();
        };
        let d = w.dim;
        let inner: usize = dims[d + 1..].iter().product();
        let per_row: usize = dims[1..d.max(1)].iter().product();
        let outer: usize = dims[..d].iter().product();
        let mut out: Vec<Range<usize>> = Vec::new();
        for o in 0..outer {
            // Where fsdp's rows are set (dim 0 not the cut one), only the held rows count.
            if let Some(rows) = w.rows.as_ref().filter(|_| d > 0)
                && !rows.contains(&(o / per_row))
            {
                continue;
            }
            let base = o * dims[d] * inner;
            for r in &w.ranges {
                let next = base + r.start * inner..base + r.end * inner;
                match out.last_mut() {
                    Some(last) if last.end == next.start => last.end = next.end,
                    _ => out.push(next),
                }
            }
        }
        out
    }
}

fn scale_grads<M: Module>(model: &M, grads: &mut GradientsParams, scale: f64) {
    struct Scale<'a>(&'a mut GradientsParams, f64);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g.mul_scalar(self.1));
            }
        }
    }
    model.visit(&mut Scale(grads, scale));
}
