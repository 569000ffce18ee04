//! A rank's fully sharded data parallelism (`--fsdp`): its shards of the model and of the
//! AdamW state at the start, a step on them, its rows of the checkpoint.

use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor};
use burn_tp::checkpoint::{self, CheckpointInfo, Sharding};
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::dp::{DpOptimizer, GradClip};
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::ops::all_reduce;

use super::{BoxResult, Rank, Trainable};

impl<M: Trainable> Rank<'_, M> {
    /// `--fsdp`: this rank's shards of the model and of its AdamW state (fresh, or resumed
    /// straight into the shards from a checkpoint of any layout), and the optimizer stepping
    /// them. The replicas build in turns, each the whole model (its tp shard) from the same
    /// seed, keeping its rows alone: one whole model in memory at a time, not one a replica.
    pub(super) fn start_sharded(
        &self,
        (shard, replicas): &(ProcessGroup, ProcessGroup),
    ) -> BoxResult<(M, usize, DpOptimizer)> {
        let args = self.args;
        let mut built = None;
        for turn in 0..self.dp_group.world_size() {
            if turn == self.dp_rank {
                let whole = self.fresh(None)?;
                // QLoRA: the base packed before the sharding, which leaves a quantized
                // parameter whole (every replica quantizes the same values).
                let whole = match args.qlora {
                    true => whole.quantize_lora_base()?,
                    false => whole,
                };
                // With --ep, this rank's experts (their rows cut below).
                let whole = match &self.experts {
                    Some((ep, _)) => whole.expert_parallel(ep)?,
                    None => whole,
                };
                let fsdp = Fsdp::new(&whole, shard)
                    .with_replicas(replicas)
                    .with_reshard_after_forward(args.reshard_after_forward)
                    .with_compute_dtype(args.dtype.dtype());
                // With --ep, the experts' rows over the ranks of a shard group holding them.
                let fsdp = match &self.fsdp_experts {
                    Some((group, replicas)) => fsdp
                        .with_experts(whole.expert_params(), group)
                        .with_expert_replicas(replicas),
                    None => fsdp,
                };
                let tp_rank = self.tp_group.rank();
                let sharding = fsdp.sharding(&whole, tp_rank, self.checkpoint_map(&whole));
                // Each element counted by the rank that writes it (HSDP: the first replica).
                let clip = args.clip_grad.map(|max| {
                    let writes = sharding.map.writes.iter().any(|&w| w);
                    GradClip::sharded(&whole, &sharding, writes, &self.world, max)
                });
                built = Some((fsdp.shard(whole), fsdp, sharding, clip));
            }
            self.world.barrier()?;
        }
        let (model, fsdp, sharding, clip) = built.expect("every replica takes its turn");
        let adamw = AdamWConfig::new().init();
        let (model, first_step, adamw) = match &args.resume {
            Some(dir) => {
                let (model, info) =
                    checkpoint::load_sharded(model, dir, Some(self.config), &sharding)?;
                self.same_base(dir, &info)?;
                let adamw = checkpoint::load_optimizer_sharded(adamw, &model, dir, &sharding)?;
                (model, info.step as usize, adamw)
            }
            None => (model, 0, adamw),
        };
        let optim = DpOptimizer::new(adamw)
            .with_replicated(burn_tp::norm::ReplicatedGrads::new(&self.tp_group))
            .with_fsdp(fsdp.clone());
        let optim = match clip {
            Some(clip) => optim.with_clip(clip),
            None => optim,
        };
        self.fsdp
            .set((fsdp, sharding))
            .map_err(|_| "the model is built once")?;
        Ok((model, first_step, optim))
    }

    /// `--fsdp`'s checkpoint: each rank of the first shard group (HSDP's first replica) writes
    /// its rows of the model and of the AdamW state; any layout, with or without fsdp,
    /// resumes from it. Collective.
    pub(super) fn save_sharded(
        &self,
        (_, sharding): &(Fsdp, Sharding),
        model: &M,
        optim: &mut DpOptimizer,
        info: &CheckpointInfo,
    ) -> burn_tp::Result<()> {
        let adamw = optim.module_optimizer(model)?;
        // HSDP: the first replica of each shard writes it (with experts, not the same ranks
        // for every parameter).
        let writes = sharding.map.writes.iter().any(|&w| w);
        checkpoint::save_sharded(
            model,
            Some(adamw),
            self.checkpoint,
            info,
            sharding,
            &self.world,
            writes,
        )
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
