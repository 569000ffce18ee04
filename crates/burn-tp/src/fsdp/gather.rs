//! The gathers: each parameter's dim-0 shards all-gathered over the shard group (one collective
//! per parameter, all of a part's posted before the first is waited on), the padding cut off,
//! in the compute dtype where the gradient does not flow back through the gather.
//! The all-gather's backward is the reduce-scatter, so a tracked gather brings each rank its
//! shard's gradient summed over the group as soon as the parameter's gradient is complete; a
//! detached gather instead leaves each whole as a leaf ([`Leaf`]), whose reduce-scatter the
//! step posts after the part's backward and waits for later ([`Waiter`]).

use std::any::Any;
use std::collections::VecDeque;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Gradients, Tensor};
use burn_tp_comm::ProcessGroup;

use super::Fsdp;
use crate::ops::{Pending, all_gather_async, reduce_scatter_async};
use crate::{Result, TpError};

/// A gathered parameter left as a leaf of the graph (its gather untracked), its gradient taken
/// after a backward through it: the call posts its reduce-scatter (`None`: that backward did
/// not reach it) and gives the [`Waiter`] that adds this rank's shard of it to the step's
/// gradients. Called once per backward (the ends' twice when kept: the head's, the
/// embedding's).
pub(super) type Leaf = Box<dyn Fn(&mut Gradients) -> Result<Option<Waiter>>>;

/// A posted reduce-scatter of a gradient: waits, adds this rank's shard to the gradients.
pub(super) type Waiter = Box<dyn FnOnce(&mut GradientsParams) -> Result<()>>;

/// `leaf`'s [`Leaf`]: its gradient reduce-scattered over `group` into parameter `id`'s, in
/// the shard's `dtype` (f32 sums of a bf16 compute's gradients).
fn deferred<const D: usize>(
    leaf: Tensor<D>,
    id: ParamId,
    group: ProcessGroup,
    dtype: FloatDType,
) -> Leaf {
    Box::new(move |grads: &mut Gradients| {
        let Some(g) = leaf.grad_remove(grads) else {
            return Ok(None);
        };
        let g = match FloatDType::from(g.dtype()) == dtype {
            true => g,
            false => g.cast(dtype),
        };
        let pending = reduce_scatter_async(g, 0, &group)?;
        let waiter: Waiter = Box::new(move |total: &mut GradientsParams| {
            let shard = pending.wait()?;
            let sum = match total.remove::<D>(id) {
                Some(prev) => prev + shard,
                None => shard,
            };
            total.register(id, sum);
            Ok(())
        });
        Ok(Some(waiter))
    })
}

/// A part's gathers in flight, in its parameters' visiting order.
pub(super) struct InFlight {
    pending: VecDeque<Box<dyn Any + Send>>,
}

impl Fsdp {
    /// Posts the all-gather of every sharded parameter of `part` (tracked when its parameters
    /// are, but with `detach`).
    pub(super) fn start<X: Module>(&self, part: &X, detach: bool) -> Result<InFlight> {
        struct Start<'a> {
            fsdp: &'a Fsdp,
            detach: bool,
            pending: VecDeque<Box<dyn Any + Send>>,
            error: Option<TpError>,
        }
        impl ModuleVisitor for Start<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(&rows) = self.fsdp.rows.get(&param.id) else {
                    return;
                };
                if self.error.is_some() {
                    return;
                }
                // A whole parameter (the model not cut by `Fsdp::shard`) would gather silently
                // into the wrong rows: refuse it, naming the sizes.
                let group = self.fsdp.group_of(param.id);
                let (n, got) = (group.world_size(), param.val().dims()[0]);
                if got != rows.div_ceil(n) {
                    self.error = Some(TpError::Config(format!(
                        "fsdp: a parameter has {got} rows where this rank's shard of its {rows} \
                         rows over {n} ranks has {}: shard the model with Fsdp::shard first",
                        rows.div_ceil(n)
                    )));
                    return;
                }
                let shard = match self.detach {
                    true => param.val().detach(),
                    false => param.val(),
                };
                // Gathered in the compute dtype (half the bytes of f32 shards) where no
                // gradient flows back through the gather (a detached gather's leaves are
                // reduce-scattered in the shard's dtype); a tracked gather's backward would
                // sum the gradients in it.
                let shard = match self.fsdp.compute {
                    Some(dtype)
                        if (self.detach || !shard.is_require_grad())
                            && FloatDType::from(shard.dtype()) != dtype =>
                    {
                        shard.cast(dtype)
                    }
                    _ => shard,
                };
                match all_gather_async(shard, 0, group) {
                    Ok(p) => self.pending.push_back(Box::new(p)),
                    Err(e) => self.error = Some(e),
                }
            }
        }
        let mut start = Start {
            fsdp: self,
            detach,
            pending: VecDeque::new(),
            error: None,
        };
        part.visit(&mut start);
        start.error.map_or(
            Ok(InFlight {
                pending: start.pending,
            }),
            Err,
        )
    }

    /// `part` with each sharded parameter replaced by its gathered whole (same id), in the
    /// compute dtype: waits for `flight` (from [`start`](Self::start) of the same `part`).
    /// With `leaves` (a detached start), each whole is a leaf of the graph, pushed there.
    pub(super) fn finish<X: Module>(
        &self,
        part: X,
        flight: InFlight,
        leaves: Option<&mut Vec<Leaf>>,
    ) -> Result<X> {
        struct Finish<'a> {
            fsdp: &'a Fsdp,
            pending: VecDeque<Box<dyn Any + Send>>,
            leaves: Option<&'a mut Vec<Leaf>>,
            error: Option<TpError>,
        }
        impl ModuleMapper for Finish<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(&rows) = self.fsdp.rows.get(&param.id) else {
                    return param;
                };
                let pending = self
                    .pending
                    .pop_front()
                    .expect("one gather per sharded parameter")
                    .downcast::<Pending<D>>()
                    .expect("the same parameter's rank");
                if self.error.is_some() {
                    // Waited on all the same: the other ranks' calls complete.
                    let _ = pending.wait();
                    return param;
                }
                let (compute, p_id) = (self.fsdp.compute, param.id);
                let shard_dtype = FloatDType::from(param.val().dtype());
                match pending.wait() {
                    Ok(whole) => param.map(|shard| {
                        let whole = match self.leaves.as_mut() {
                            // A frozen parameter (a LoRA base) stays off the graph: no
                            // gradient, no reduce-scatter.
                            Some(leaves) if shard.is_require_grad() => {
                                let leaf = whole.detach().require_grad();
                                let group = self.fsdp.group_of(p_id).clone();
                                leaves.push(deferred(leaf.clone(), p_id, group, shard_dtype));
                                leaf
                            }
                            _ => whole,
                        };
                        let whole = whole.narrow(0, 0, rows);
                        match compute {
                            Some(dtype) if FloatDType::from(whole.dtype()) != dtype => {
                                whole.cast(dtype)
                            }
                            _ => whole,
                        }
                    }),
                    Err(e) => {
                        self.error = Some(e);
                        param
                    }
                }
            }
        }
        let mut finish = Finish {
            fsdp: self,
            pending: flight.pending,
            leaves,
            error: None,
        };
        let part = part.map(&mut finish);
        finish.error.map_or(Ok(part), Err)
    }
}
