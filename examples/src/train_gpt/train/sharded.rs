//! A rank's fully sharded data parallelism (`--fsdp`): its shards of the model and of the
//! AdamW state at the start, and a step on them.

use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{Int, Tensor};
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::dp::{DpOptimizer, GradClip};
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::ops::all_reduce;
use burn_tp::reshard::move_optimizer_state;

use super::{BoxResult, Rank, Trainable};

impl<M: Trainable> Rank<'_, M> {
    /// `--fsdp`: this rank's shards of the whole `model` and of its AdamW state (resumed, or
    /// fresh), and the optimizer stepping them.
    pub(super) fn start_sharded(
        &self,
        model: M,
        adamw: ModuleOptimizer,
        (shard, replicas): (&ProcessGroup, &ProcessGroup),
        first_step: usize,
    ) -> BoxResult<(M, usize, DpOptimizer)> {
        let args = self.args;
        let fsdp = Fsdp::new(&model, shard)
            .with_replicas(replicas)
            .with_reshard_after_forward(args.reshard_after_forward)
            .with_compute_dtype(args.dtype.dtype());
        let sharded = fsdp.shard(model.clone());
        let adamw = match &args.resume {
            Some(_) => {
                let moved = move_optimizer_state(&adamw, &model, &sharded, |m| Ok(fsdp.shard(m)))?;
                AdamWConfig::new().init().load_record(moved)
            }
            None => adamw,
        };
        let optim = DpOptimizer::new(adamw)
            .with_replicated(burn_tp::norm::ReplicatedGrads::new(&self.tp_group))
            .with_fsdp(fsdp.clone());
        let optim = match args.clip_grad {
            Some(max) => {
                optim.with_clip(GradClip::new(&model, &self.tp_group, max).with_fsdp(fsdp.clone()))
            }
            None => optim,
        };
        self.fsdp.set(fsdp).expect("the model is built once");
        Ok((sharded, first_step, optim))
    }

    /// A step on `fsdp`'s shards: each part gathered (in the run's dtype) just before it
    /// runs, the gradients reduce-scattered by the backward, AdamW on the shards.
    pub(super) fn sharded_step(
        &self,
        fsdp: &Fsdp,
        model: M,
        (ids, targets): (Tensor<2, Int>, Tensor<2, Int>),
        dropout: DropoutStep,
        optim: &mut DpOptimizer,
    ) -> BoxResult<(M, f64)> {
        let run = || fsdp.loss_and_grads(&model, ids, targets, Some(dropout));
        let (loss, grads) = match optim.replicated() {
            Some(r) => r.scope(run)?,
            None => run()?,
        };
        let mean = all_reduce(loss, ReduceOp::Avg, &self.dp_group)?;
        let value = mean.into_scalar::<f32>() as f64;
        if !value.is_finite() && !self.args.keep_going {
            return Ok((model, value));
        }
        let model = optim.step(self.args.lr, model.clone(), &model, grads, &self.dp_group)?;
        Ok((model, value))
    }
}
