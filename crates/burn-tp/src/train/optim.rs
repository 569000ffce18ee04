//! A rank's optimizer step: the user's `TrainStep`, the gradients reduced over dp (after the
//! backward, in buckets during it, or reduce-scattered for the distributed optimizer), the
//! update.

use burn::module::Module;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn_tp_comm::ProcessGroup;
use burn_train::{LearnerModel, TrainStep};

use super::{GradSync, TrainInput};
use crate::Result;
use crate::dp::{DistributedAdamW, GradReducer, average_gradients};

/// A rank's optimizer: the factory's, with the dp average after the backward or in buckets
/// during it; or the distributed optimizer.
pub(super) struct RankOptim {
    optim: ModuleOptimizer,
    reducer: Option<GradReducer>,
    zero: Option<(DistributedAdamW, AdamWConfig)>,
}

impl RankOptim {
    /// `optim` (loaded, on resume) for `model` on `dp_group`, as `sync` asks.
    pub(super) fn new<M: Module>(
        sync: &GradSync,
        optim: ModuleOptimizer,
        model: &M,
        dp_group: &ProcessGroup,
    ) -> Result<Self> {
        Ok(match sync {
            GradSync::AfterBackward => Self {
                optim,
                reducer: None,
                zero: None,
            },
            GradSync::Overlapped { bucket_bytes } => Self {
                optim,
                reducer: Some(GradReducer::new(model, dp_group, *bucket_bytes)),
                zero: None,
            },
            GradSync::Distributed {
                config,
                bucket_bytes,
            } => {
                let mut zero = DistributedAdamW::new(config, model, dp_group, *bucket_bytes);
                // This rank's chunks of a resumed state (saved at any dp).
                zero.shard_module_optimizer(&optim, model)?;
                Self {
                    optim,
                    reducer: None,
                    zero: Some((zero, config.clone())),
                }
            }
        })
    }

    /// One training step of `model` on `item`: the user's `TrainStep`, the gradients reduced
    /// over dp, the update. Returns the step's output item.
    pub(super) fn step<M: LearnerModel>(
        &mut self,
        model: &mut M,
        item: TrainInput<M>,
        lr: burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate,
        dp_group: &ProcessGroup,
    ) -> Result<<M as TrainStep>::Output> {
        if let Some((zero, _)) = &mut self.zero {
            let view = zero.attach(model.clone(), true);
            let out = TrainStep::step(&view, item);
            *model = zero.step(lr.base(), model.clone(), out.grads)?;
            return Ok(out.item);
        }
        let out = match &self.reducer {
            Some(reducer) => {
                let view = reducer.attach(model.clone(), true);
                let mut out = TrainStep::step(&view, item);
                reducer.finish(&*model, &mut out.grads)?;
                out
            }
            None => {
                let mut out = TrainStep::step(&*model, item);
                average_gradients(&*model, &mut out.grads, dp_group)?;
                out
            }
        };
        *model = model.clone().optimize(&mut self.optim, lr, out.grads);
        Ok(out.item)
    }

    /// The state as a Burn optimizer over this rank's shard, to save (the distributed
    /// optimizer's chunks gathered over dp first: collective over dp).
    pub(super) fn module_optimizer<M: Module>(&mut self, model: &M) -> Result<ModuleOptimizer> {
        if let Some((zero, config)) = &self.zero {
            self.optim = zero.to_module_optimizer(config, model)?;
        }
        Ok(self.optim.clone())
    }
}
