//! A rank's optimizer step: the user's `TrainStep`, the gradients reduced over dp (after the
//! backward, in buckets during it, or reduce-scattered for the distributed optimizer), the
//! update.

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn_tp_comm::ProcessGroup;
use burn_train::{LearnerModel, TrainStep};

use super::{GradSync, TrainInput};
use crate::Result;
use crate::dp::{DistributedAdamW, DpOptimizer, GradReducer};
use crate::fsdp::Fsdp;

/// A rank's optimizer: the factory's, with the dp average after the backward or in buckets
/// during it; or the distributed optimizer: [`DpOptimizer`], as `train_gpt`'s. Fully sharded,
/// it steps the shards, each step's whole model gathered for the user's `TrainStep`.
pub(super) struct RankOptim(DpOptimizer, Option<Fsdp>);

impl RankOptim {
    /// `optim` (loaded, on resume) for `model` on `dp_group`, as `sync` asks (`fsdp`: the
    /// sharding of a fully sharded `model`).
    pub(super) fn new<M: Module>(
        sync: &GradSync,
        optim: ModuleOptimizer,
        model: &M,
        dp_group: &ProcessGroup,
        fsdp: Option<&Fsdp>,
    ) -> Result<Self> {
        if let Some(fsdp) = fsdp {
            let optim = DpOptimizer::new(optim).with_fsdp(fsdp.clone());
            return Ok(Self(optim, Some(fsdp.clone())));
        }
        Ok(Self(
            match sync {
                GradSync::AfterBackward | GradSync::FullySharded { .. } => DpOptimizer::new(optim),
                GradSync::Overlapped { bucket_bytes } => DpOptimizer::new(optim)
                    .with_reducer(GradReducer::new(model, dp_group, *bucket_bytes)),
                GradSync::Distributed {
                    config,
                    bucket_bytes,
                } => {
                    let mut zero = DistributedAdamW::new(config, model, dp_group, *bucket_bytes);
                    // This rank's chunks of a resumed state (saved at any dp).
                    zero.shard_module_optimizer(&optim, model)?;
                    DpOptimizer::distributed(optim, zero, config.clone())
                }
            },
            None,
        ))
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
        if let Some(fsdp) = &self.1 {
            let whole = fsdp.gather_whole(model)?;
            let out = TrainStep::step(&whole, item);
            drop(whole);
            let grads = fsdp.scatter_grads(model, out.grads)?;
            let shards = model.clone();
            *model = self.0.step(lr, shards.clone(), &shards, grads, dp_group)?;
            return Ok(out.item);
        }
        let view = self.0.attach(model.clone());
        let out = TrainStep::step(&view, item);
        let master = model.clone();
        *model = self
            .0
            .step(lr, master.clone(), &master, out.grads, dp_group)?;
        Ok(out.item)
    }

    /// The state as a Burn optimizer over this rank's shard, to save (the distributed
    /// optimizer's chunks gathered over dp first: collective over dp).
    pub(super) fn module_optimizer<M: Module>(&mut self, model: &M) -> Result<ModuleOptimizer> {
        Ok(self.0.module_optimizer(model)?.clone())
    }
}
