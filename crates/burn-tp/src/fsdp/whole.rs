//! A step that runs on the whole model in one piece (Burn's Learner's `TrainStep`, a closure
//! over the model, cannot be run part by part): every parameter gathered before it, every
//! gradient reduce-scattered back to the shards after it.
//!
//! ```text
//!  shards ── gather_whole (all posted, then waited) ──> whole leaves (same ids)
//!                                                        │ the caller's forward + backward
//!  shard gradients <── scatter_grads (all posted, then waited) ── whole gradients
//! ```
//!
//! Between steps a rank holds its rows alone, as [`Fsdp::loss_and_grads`]'s do; during the
//! step it holds the whole once (its parameters, then their gradients), not one part at a time.

use std::collections::HashSet;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor};

use super::Fsdp;
use super::gather::Waiter;
use crate::ops::{Pending, reduce_scatter_async};
use crate::{Result, TpError};

impl Fsdp {
    /// The whole model of `shards` for a step run on it in one piece: every sharded parameter
    /// gathered (every gather posted before the first is waited on), cut to its rows, in the
    /// compute dtype, a fresh leaf with the shard's id (trainable where the shard is). Its
    /// gradients go back to the shards with [`scatter_grads`](Self::scatter_grads).
    /// Collective over the shard group.
    ///
    /// # Errors
    /// A communication error; a model not cut by [`shard`](Self::shard).
    pub fn gather_whole<M: Module>(&self, shards: &M) -> Result<M> {
        struct Leaves<'a>(&'a Fsdp, HashSet<ParamId>);
        impl ModuleMapper for Leaves<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                if !self.0.rows.contains_key(&param.id) {
                    return param;
                }
                let trainable = self.1.contains(&param.id);
                param.map(|t| t.detach().set_require_grad(trainable))
            }
        }
        let ids = crate::model::param_ids(shards).into_iter();
        let trainable = ids.zip(crate::reshard::trainable(shards));
        let trainable = trainable.filter_map(|(id, t)| t.then_some(id)).collect();
        let flight = self.start(shards, true)?;
        let whole = self.finish(shards.clone(), flight, None)?;
        Ok(whole.map(&mut Leaves(self, trainable)))
    }

    /// `grads` of the model [`gather_whole`](Self::gather_whole) gave (each sharded parameter's
    /// gradient of its whole) as the shards' gradients: each reduce-scattered over the shard
    /// group to this rank's rows, in the shard's dtype (every reduce-scatter posted before the
    /// first is waited on), summed over the group as [`loss_and_grads`](Self::loss_and_grads)
    /// leaves them; [`finish_grads`](Self::finish_grads) then averages them. The gradients of
    /// parameters that are not sharded are kept. Collective over the shard group.
    ///
    /// # Errors
    /// A communication error; a gradient whose rows are not its parameter's.
    pub fn scatter_grads<M: Module>(
        &self,
        shards: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        struct Post<'a> {
            fsdp: &'a Fsdp,
            grads: &'a mut GradientsParams,
            pending: Vec<Waiter>,
            error: Option<TpError>,
        }
        impl ModuleVisitor for Post<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(&rows) = self.fsdp.rows.get(&param.id) else {
                    return;
                };
                let Some(g) = self.grads.remove::<D>(param.id) else {
                    return;
                };
                if self.error.is_some() {
                    return;
                }
                let mut dims = g.dims();
                if dims[0] != rows {
                    self.error = Some(TpError::Config(format!(
                        "fsdp: a gradient of {} rows for a parameter of {rows}: the gradients \
                         of the model Fsdp::gather_whole gave",
                        dims[0]
                    )));
                    return;
                }
                let shard = param.val();
                let g = match FloatDType::from(g.dtype()) {
                    dtype if dtype != FloatDType::from(shard.dtype()) => {
                        g.cast(FloatDType::from(shard.dtype()))
                    }
                    _ => g,
                };
                // The padded rows' gradient is zero, so the padding stays zero.
                let group = self.fsdp.group_of(param.id);
                let padded = shard.dims()[0] * group.world_size();
                let g = match padded - rows {
                    0 => g,
                    pad => {
                        dims[0] = pad;
                        let zeros = Tensor::<D>::zeros(dims, (&g.device(), g.dtype()));
                        Tensor::cat(vec![g, zeros], 0)
                    }
                };
                let id = param.id;
                match reduce_scatter_async(g, 0, group) {
                    Ok(pending) => self.pending.push(Box::new(move |grads| {
                        let pending: Pending<D> = pending;
                        grads.register(id, pending.wait()?);
                        Ok(())
                    })),
                    Err(e) => self.error = Some(e),
                }
            }
        }
        let mut post = Post {
            fsdp: self,
            grads: &mut grads,
            pending: Vec::new(),
            error: None,
        };
        shards.visit(&mut post);
        let (pending, mut error) = (post.pending, post.error);
        // Every posted reduce-scatter waited on, the other ranks' calls completing too.
        for wait in pending {
            if let Err(e) = wait(&mut grads) {
                error.get_or_insert(e);
            }
        }
        error.map_or(Ok(grads), Err)
    }
}
