//! Replicated parameters inside the tensor-parallel region (the norms' weights, the GPT's
//! learned positions): [`replicated_param`] and the coalesced gradient sum of
//! [`ReplicatedGrads`].

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::Result as TpResult;
use crate::linear::TpMode;
use crate::ops::{all_reduce, copy_to_tp_region};

/// Uses a replicated parameter inside the tensor-parallel region. In REDUCE_SCATTER mode each rank
/// applies it to its own sequence shard only, so its gradient is partial: `copy_to_tp_region`
/// sums it over the group (Megatron's sequence-parallel layer-norm fix), keeping the parameter
/// bitwise identical on every rank, one blocking all-reduce per use in the backward. Inside a
/// [`ReplicatedGrads::scope`] the parameter is used as it is and only marked: the scope's
/// [`finish`](ReplicatedGrads::finish) sums every marked gradient over the group at once after
/// the backward (Megatron's coalesced all-reduce of the layer-norm gradients). In ALL_REDUCE
/// mode every rank already sees the full gradient.
pub fn replicated_param<const D: usize>(
    p: &Param<Tensor<D>>,
    mode: TpMode,
    group: &ProcessGroup,
) -> Tensor<D> {
    match mode {
        TpMode::ReduceScatter => {
            let deferred = DEFERRED.with(|d| {
                d.borrow()
                    .as_ref()
                    .map(|ids| ids.lock().unwrap_or_else(|e| e.into_inner()).insert(p.id))
                    .is_some()
            });
            if deferred {
                p.val()
            } else {
                copy_to_tp_region(p.val(), group)
            }
        }
        TpMode::AllReduce => p.val(),
    }
}

type MarkedIds = Arc<Mutex<BTreeSet<ParamId>>>;

thread_local! {
    /// The marks of the innermost active [`ReplicatedGrads::scope`] on this (rank's) thread.
    static DEFERRED: RefCell<Option<MarkedIds>> = const { RefCell::new(None) };
}

/// One coalesced all-reduce per step for the replicated parameters' gradients in REDUCE_SCATTER
/// mode, in place of one blocking all-reduce per use inside the backward.
///
/// ```ignore
/// let replicated = ReplicatedGrads::new(&tp_group);
/// let loss = replicated.scope(|| model.loss(ids, targets, None))?; // marks, no collective
/// let mut grads = GradientsParams::from_grads(loss.backward(), &model);
/// replicated.finish(&model, &mut grads)?; // every marked gradient summed over tp at once
/// ```
///
/// The sum is linear, so it may come before or after the data-parallel average
/// ([`crate::dp::average_gradients`], [`crate::dp::GradReducer::finish`]); not with
/// [`crate::dp::DistributedAdamW`], whose gradients are reduced inside the backward. Call
/// `finish` after every backward of a scope: until then the marked gradients are partial.
#[derive(Debug)]
pub struct ReplicatedGrads {
    ids: MarkedIds,
    group: ProcessGroup,
}

impl ReplicatedGrads {
    /// For the tensor-parallel group `tp_group`.
    pub fn new(tp_group: &ProcessGroup) -> Self {
        Self {
            ids: Arc::default(),
            group: tp_group.clone(),
        }
    }

    /// Runs `f` (a forward) on this thread with the replicated parameters' gradient sums
    /// deferred to [`finish`](Self::finish).
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<MarkedIds>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                DEFERRED.with(|d| *d.borrow_mut() = previous);
            }
        }
        let _restore = Restore(DEFERRED.with(|d| d.borrow_mut().replace(self.ids.clone())));
        f()
    }

    /// Sums the gradients of every parameter marked since the last call over the tensor-parallel
    /// group, in one all-reduce of their concatenation (in the model's visiting order, the same on
    /// every rank), in place in `grads`.
    ///
    /// # Errors
    /// A communication error.
    pub fn finish<M: Module>(&self, model: &M, grads: &mut GradientsParams) -> TpResult<()> {
        let marked = std::mem::take(&mut *self.ids.lock().unwrap_or_else(|e| e.into_inner()));
        if marked.is_empty() || self.group.world_size() == 1 {
            return Ok(());
        }
        struct Gather<'a> {
            marked: &'a BTreeSet<ParamId>,
            grads: &'a GradientsParams,
            flat: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Gather<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.marked.contains(&param.id)
                    && let Some(g) = self.grads.get::<D>(param.id)
                {
                    self.flat.push(g.flatten(0, D - 1));
                }
            }
        }
        let mut gather = Gather {
            marked: &marked,
            grads,
            flat: Vec::new(),
        };
        model.visit(&mut gather);
        if gather.flat.is_empty() {
            return Ok(());
        }
        let _scope = burn_tp_comm::profile::scope("replicated gradients (coalesced)");
        let summed = all_reduce(Tensor::cat(gather.flat, 0), ReduceOp::Sum, &self.group)?;
        struct Scatter<'a> {
            marked: &'a BTreeSet<ParamId>,
            grads: &'a mut GradientsParams,
            summed: Tensor<1>,
            at: usize,
        }
        impl ModuleVisitor for Scatter<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.marked.contains(&param.id)
                    && let Some(own) = self.grads.remove::<D>(param.id)
                {
                    let n = own.shape().num_elements();
                    let g: Tensor<D> = self
                        .summed
                        .clone()
                        .narrow(0, self.at, n)
                        .reshape(own.shape());
                    self.at += n;
                    self.grads.register(param.id, g);
                }
            }
        }
        model.visit(&mut Scatter {
            marked: &marked,
            grads,
            summed,
            at: 0,
        });
        Ok(())
    }
}
