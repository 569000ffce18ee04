//! [`DpOptimizer`]: one gradient-sync-then-step for every training loop (the example's
//! `train_gpt` and the Learner strategy, [`crate::train`]): Burn's optimizer with the gradients
//! averaged over dp after the backward or in buckets during it, the replicated parameters' tp
//! sums coalesced where asked; or the distributed optimizer (ZeRO-1).

use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::FloatDType;
use burn_tp_comm::ProcessGroup;

use super::{DistributedAdamW, Experts, GradClip, GradReducer, average_gradients_with};
use crate::Result;
use crate::fsdp::Fsdp;
use crate::norm::ReplicatedGrads;
use crate::precision::cast_grads;

/// A rank's optimizer over a data-parallel group: Burn's `optim` (AdamW, or any) after the
/// gradients' dp average, or the [`DistributedAdamW`].
///
/// A step is [`attach`](Self::attach) (the model the forward runs: a tapped view whose buckets
/// start during the backward, or the model), the backward, then [`step`](Self::step).
pub struct DpOptimizer {
    optim: ModuleOptimizer,
    zero: Option<(DistributedAdamW, AdamWConfig)>,
    reducer: Option<GradReducer>,
    replicated: Option<ReplicatedGrads>,
    experts: Option<Experts>,
    fsdp: Option<Fsdp>,
    clip: Option<GradClip>,
    grad_norm: Option<f64>,
    /// Whether the replicas were found to agree (at the first step).
    replicas_checked: bool,
}

impl DpOptimizer {
    /// `optim`, the gradients averaged over dp after each backward.
    pub fn new(optim: ModuleOptimizer) -> Self {
        Self {
            optim,
            zero: None,
            reducer: None,
            replicated: None,
            experts: None,
            fsdp: None,
            clip: None,
            grad_norm: None,
            replicas_checked: false,
        }
    }

    /// The gradients averaged over dp in `reducer`'s buckets during the backward instead.
    pub fn with_reducer(mut self, reducer: GradReducer) -> Self {
        self.reducer = Some(reducer);
        self
    }

    /// The replicated parameters' tp sums deferred to one coalesced all-reduce per step
    /// (sequence parallel: run the forward and backward in [`ReplicatedGrads::scope`] of
    /// [`replicated`](Self::replicated)).
    pub fn with_replicated(mut self, replicated: ReplicatedGrads) -> Self {
        self.replicated = Some(replicated);
        self
    }

    /// Expert parallelism: `experts`' gradients summed over their own group (divided by dp),
    /// the rest averaged over dp ([`super::average_gradients_with`]). With buckets, the
    /// reducer or distributed optimizer must have been built with the same experts
    /// ([`super::ReduceGroups::experts`]).
    pub fn with_experts(mut self, experts: Experts) -> Self {
        self.experts = Some(experts);
        self
    }

    /// Fully sharded: the model is `fsdp`'s shards, whose gradients the backward already
    /// summed over the shard group ([`Fsdp::loss_and_grads`]); the step averages them
    /// ([`Fsdp::finish_grads`]) instead of the dp all-reduce. Not with buckets, the
    /// distributed optimizer (the state is already sharded) or experts.
    pub fn with_fsdp(mut self, fsdp: Fsdp) -> Self {
        self.fsdp = Some(fsdp);
        self
    }

    /// The gradients clipped by their global norm after the dp reduction, before the update
    /// ([`GradClip`]; with the distributed optimizer, its chunks:
    /// [`DistributedAdamW::step_clipped`] says how to build the clip).
    pub fn with_clip(mut self, clip: GradClip) -> Self {
        self.clip = Some(clip);
        self
    }

    /// The global gradient norm of the last step (before clipping), with [`with_clip`](Self::with_clip).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.grad_norm
    }

    /// The distributed optimizer `zero` (AdamW of `config`, its state sharded over dp); `optim`
    /// holds the state in Burn's form only to save it ([`module_optimizer`](Self::module_optimizer)).
    pub fn distributed(
        optim: ModuleOptimizer,
        zero: DistributedAdamW,
        config: AdamWConfig,
    ) -> Self {
        Self {
            optim,
            zero: Some((zero, config)),
            reducer: None,
            replicated: None,
            experts: None,
            fsdp: None,
            clip: None,
            grad_norm: None,
            replicas_checked: false,
        }
    }

    /// The buckets that reduce during the backward (the distributed optimizer's, or the
    /// reducer's), if any: what a pipeline's overlapped step takes.
    pub fn buckets(&self) -> Option<&GradReducer> {
        match &self.zero {
            Some((z, _)) => Some(z.reducer()),
            None => self.reducer.as_ref(),
        }
    }

    /// The replicated parameters' coalesced tp sums, if asked.
    pub fn replicated(&self) -> Option<&ReplicatedGrads> {
        self.replicated.as_ref()
    }

    /// The model the forward runs: `model` with the buckets' taps (each bucket's reduction
    /// starts during the backward), or `model` itself.
    pub fn attach<M: Module>(&self, model: M) -> M {
        match (&self.zero, &self.reducer) {
            (Some((z, _)), _) => z.attach(model, true),
            (None, Some(r)) => r.attach(model, true),
            (None, None) => model,
        }
    }

    /// The step after a backward: `grads` (of `working`, the model the forward ran: `model`
    /// itself, or a half copy whose parameters have the master's ids) reduced over dp in f32
    /// (the buckets finished, or averaged now; the replicated parameters' tp sum, which
    /// commutes with it), then the optimizer on `model`; or the distributed optimizer's step
    /// (this rank's chunks of the f32 average, stepped, gathered). Collective over dp.
    ///
    /// # Errors
    /// The first communication error; a combination it does not run (named).
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        working: &M,
        mut grads: GradientsParams,
        dp_group: &ProcessGroup,
    ) -> Result<M> {
        let lr = lr.into();
        if self.experts.is_some() && self.buckets().is_some_and(|b| !b.has_experts()) {
            return Err(crate::TpError::Config(
                "expert parallelism with buckets: build the reducer or the distributed optimizer \
                 with the experts (ReduceGroups::experts), so their gradients reduce over their \
                 own group"
                    .into(),
            ));
        }
        if self.fsdp.is_some()
            && (self.zero.is_some() || self.reducer.is_some() || self.experts.is_some())
        {
            return Err(crate::TpError::Config(
                "fsdp: its gradients are reduced by the backward's reduce-scatters; not with \
                 buckets, the distributed optimizer or expert parallelism"
                    .into(),
            ));
        }
        if self.zero.is_some() && self.clip.as_ref().is_some_and(|c| !c.is_sharded()) {
            return Err(crate::TpError::Config(
                "gradient clipping with the distributed optimizer: each rank's chunks are \
                 summed over the world; build the clip with GradClip::sharded (every rank \
                 counting)"
                    .into(),
            ));
        }
        // The buckets and the fsdp check their own replicas; the average after the backward here.
        if !self.replicas_checked && self.buckets().is_none() && self.fsdp.is_none() {
            super::check_replicas(&model, dp_group, self.experts.as_ref()).map_err(
                |e| match e {
                    crate::TpError::ReplicasDiffer { param, ranks, .. } => {
                        crate::TpError::ReplicasDiffer {
                            what: "DpOptimizer".into(),
                            param,
                            ranks,
                        }
                    }
                    e => e,
                },
            )?;
        }
        self.replicas_checked = true;
        if let Some((z, _)) = &mut self.zero {
            cast_grads(working, &mut grads, FloatDType::F32);
            let (model, norm) = z.step_clipped(lr.base(), model, grads, self.clip.as_ref())?;
            self.grad_norm = norm;
            return Ok(model);
        }
        // Half-precision gradients accumulate in f32 in the reducer.
        if let Some(r) = &self.reducer {
            r.finish(working, &mut grads)?;
        }
        cast_grads(working, &mut grads, FloatDType::F32);
        if let Some(r) = &self.replicated {
            r.finish(working, &mut grads)?;
        }
        if let Some(fsdp) = &self.fsdp {
            fsdp.finish_grads(&model, &mut grads)?;
        } else if self.reducer.is_none() {
            average_gradients_with(&model, &mut grads, dp_group, self.experts.as_ref())?;
        }
        if let Some(clip) = &self.clip {
            self.grad_norm = Some(clip.clip(&model, &mut grads)?);
        }
        Ok(self.optim.step(lr, model, grads))
    }

    /// The optimizer state in Burn's form over this rank's shard, to save (the distributed
    /// optimizer's chunks gathered over dp first: collective over dp then).
    ///
    /// # Errors
    /// A communication error.
    pub fn module_optimizer<M: Module>(&mut self, model: &M) -> Result<&ModuleOptimizer> {
        if let Some((zero, config)) = &self.zero {
            self.optim = zero.to_module_optimizer(config, model)?;
        }
        Ok(&self.optim)
    }
}
