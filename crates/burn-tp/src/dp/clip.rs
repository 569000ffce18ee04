//! [`GradClip`]: gradient clipping by the global norm (PyTorch's `clip_grad_norm_`, Megatron's
//! `--clip-grad`) over a model split by tp and, with fsdp, by the shard group: each element of
//! the whole model counted once.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::Result;
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
    /// Per parameter: the dimension and this rank's local ranges along it that it counts.
    counted: HashMap<ParamId, (usize, Vec<Range<usize>>)>,
    tp: ProcessGroup,
    fsdp: Option<Fsdp>,
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
                (id, (layout.dim, ranges))
            })
            .collect();
        Self {
            max_norm,
            counted,
            tp: tp_group.clone(),
            fsdp: None,
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
                let (Some(g), Some((dim, ranges))) = (
                    self.grads.get::<D>(param.id),
                    self.clip.counted.get(&param.id),
                ) else {
                    return;
                };
                let g = g.cast(burn::tensor::FloatDType::F32);
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
        let local = match sum.parts.is_empty() {
            true => 0.0,
            false => Tensor::cat(sum.parts, 0).sum().into_scalar::<f64>(),
        };
        let mut total = self.tp.all_reduce(vec![local], ReduceOp::Sum)?[0];
        if let Some(f) = &self.fsdp {
            total = f.shard_group().all_reduce(vec![total], ReduceOp::Sum)?[0];
        }
        let norm = total.sqrt();
        let scale = self.max_norm / (norm + 1e-6);
        if scale < 1.0 {
            scale_grads(model, grads, scale);
        }
        Ok(norm)
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
