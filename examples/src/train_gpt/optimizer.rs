//! `train_gpt`'s optimizer: Burn's AdamW after the data-parallel average, or the distributed
//! optimizer, with what the run's flags ask of the gradients' reduction.

use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn_tp::comm::ProcessGroup;
use burn_tp::dp::{DistributedAdamW, DpOptimizer, Experts, GradReducer, ReduceGroups};
use burn_tp::norm::ReplicatedGrads;
use burn_tp::pipeline::Pipeline;

use super::Args;
use super::trainable::Trainable;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The optimizer of `model` (its AdamW state `adamw`, fresh or resumed): Burn's AdamW after
/// the dp average (in buckets with `--overlap-grad-reduce`; the replicated parameters' tp sums
/// coalesced), or the distributed optimizer (`--distributed-optimizer`); with `--ep`, the
/// experts' gradients over `expert_dp`, the ranks holding the same experts. Collective over dp.
pub(super) fn build<M: Trainable>(
    args: &Args,
    model: &M,
    adamw: ModuleOptimizer,
    (tp_group, dp_group): (&ProcessGroup, &ProcessGroup),
    pipe: Option<&Pipeline>,
    expert_dp: Option<&ProcessGroup>,
) -> BoxResult<DpOptimizer> {
    let bucket_bytes = (args.bucket_mb * (1 << 20) as f64) as usize;
    let experts = expert_dp.map(|expert_dp| Experts {
        params: model.expert_params().into_iter().collect(),
        group: expert_dp.clone(),
    });
    // A tied embedding's gradient, summed over the first and last stages by the buckets;
    // the experts' over the ranks holding the same experts.
    let groups = ReduceGroups {
        summed: pipe.and_then(|p| p.tied_embedding(model)),
        experts: experts.clone(),
    };
    let zero = match args.distributed_optimizer {
        true => {
            let mut zero = DistributedAdamW::with_groups(
                &AdamWConfig::new(),
                model,
                dp_group,
                bucket_bytes,
                groups.clone(),
            );
            // This rank's chunks of a resumed state (saved at any dp).
            zero.shard_module_optimizer(&adamw, model)?;
            Some(zero)
        }
        false => None,
    };
    let optim = match zero {
        Some(zero) => DpOptimizer::distributed(adamw, zero, AdamWConfig::new()),
        // The distributed optimizer reduces its gradients inside the backward, so it keeps
        // the replicated parameters' per-use all-reduces; the others take one coalesced
        // tp all-reduce per step (sequence parallel).
        None => {
            let optim = DpOptimizer::new(adamw).with_replicated(ReplicatedGrads::new(tp_group));
            match args.overlap_grad_reduce {
                true => optim.with_reducer(GradReducer::with_groups(
                    model,
                    dp_group,
                    bucket_bytes,
                    groups,
                )),
                false => optim,
            }
        }
    };
    let optim = match experts {
        Some(experts) => optim.with_experts(experts),
        None => optim,
    };
    Ok(optim)
}
