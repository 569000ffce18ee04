//! Pipeline parallelism: the model's blocks cut into stages, one per rank of a pipeline group,
//! a batch cut into micro-batches that flow through the stages, activations sent forward and
//! their gradients back ([`RingLinks`]), gradients accumulated over the micro-batches.
//!
//! ```text
//!  4 stages, 4 micro-batches, 1F1B (Megatron's non-interleaved schedule): each stage runs
//!  (stages - stage - 1) forwards to fill the pipe, then one forward and one backward in turn,
//!  then the backwards left; at most (stages - stage) micro-batches' activations are held.
//!
//!  stage 0  F0 F1 F2 F3 B0    B1    B2    B3
//!  stage 1     F0 F1 F2 B0 F3 B1    B2    B3
//!  stage 2        F0 F1 B0 F2 B1 F3 B2    B3
//!  stage 3           F0 B0 F1 B1 F2 B2 F3 B3
//!                                       (time ->; a stage waits where its input is not there)
//!
//!  GPipe: every forward, then every backward: all m micro-batches' activations held.
//! ```
//!
//! Stage `s` holds blocks `layers[s]` ([`LanguageModel::into_stage`]); the first stage embeds,
//! the last runs the head and the loss. Each stage's backward of a micro-batch is seeded with
//! the gradient of its output received from the next stage (`sum(y * dy)`, as
//! [`crate::recompute`] does). Every micro-batch's loss is divided by their number, so the
//! accumulated gradients are those of the batch's mean loss, as without a pipeline. The
//! embedding's gradient is summed over the first and last stages (Megatron's embedding group):
//! a tied head's part reaches the embedding, and every stage's copy of the table stays the same.
//! Dropout masks are the batch's logical masks (each micro-batch its rows of them), so they are
//! the same at any number of stages.
//!
//! The interleaved schedule ([`PipelineSchedule::Interleaved`]) gives each rank several virtual stages
//! of blocks ([`virtual_stage_layers`]), a micro-batch crossing the ring once per virtual stage.
//!
//! Checkpoints: [`stage_map`] places a stage's parameters in the whole model, so
//! [`crate::checkpoint::save_stage`] writes the whole model's checkpoint and any pp resumes it.
//!
//! A stage is built with only its blocks ([`LanguageModel::init_stage`]: the others drawn and
//! dropped one at a time, so the weights are the whole model's at any number of stages).
//!
//! The data-parallel reduction is the caller's: after the step ([`loss_and_grads`], then
//! [`crate::dp::average_gradients`]), or overlapped with the backwards in buckets
//! ([`loss_and_grads_overlapped`], with [`GradReducer`](crate::dp::GradReducer) or the distributed optimizer).
//!
//! A MoE model's routers' loss spans every stage's MoE layers: their statistics travel beside
//! the activations and gradients (`routers.rs` has the diagram).
//!
//! Limits of this first cut: activations move as f32 (a bf16 model's widened, then cast back).
//!
//! | file          | what                                                                     |
//! |---------------|--------------------------------------------------------------------------|
//! | `mod.rs`      | [`Pipeline`]: a rank's stage and its links                               |
//! | `schedule.rs` | the schedules as data: [`actions`] lists a stage's forwards and backwards, [`virtual_stage_layers`] / [`stage_layers`] cut the blocks |
//! | `stages.rs`   | a stage's model: [`stage_map`] (its parameters in the whole model's checkpoint), [`drop_unused_ends`] |
//! | `transfer.rs` | activations and gradients between stages: received, the wait timed, cast |
//! | `routers.rs`  | the routers' statistics that travel beside them (a MoE model's routers' loss spans the stages) |
//! | `step.rs`     | one training step: the loop over [`actions`] and each action's step function |
//! | `eval.rs`     | [`forward_loss`], [`forward_logits`]: evaluation and generation          |

mod batches;
mod eval;
mod prefetch;
mod routers;
mod schedule;
mod stages;
mod step;
mod transfer;

use burn::module::ParamId;
use burn_tp_comm::{ProcessGroup, RingLinks};

pub use batches::MicroBatch;
pub use eval::{forward_logits, forward_loss};
pub use schedule::{Action, PipelineSchedule, actions, stage_layers, virtual_stage_layers};
pub use stages::{drop_unused_ends, stage_map};
pub use step::{
    PipelineStep, loss_and_grads, loss_and_grads_overlapped, loss_and_grads_recomputed,
    loss_and_grads_sharded,
};

use crate::Result;
use crate::model::LanguageModel;

/// A rank's place in a pipeline: its stage, and its links to the stages before and after it.
#[derive(Clone, Debug)]
pub struct Pipeline {
    group: ProcessGroup,
    links: RingLinks,
    /// The first and last stages (the embedding's gradient is summed over them).
    ends: Option<ProcessGroup>,
}

impl Pipeline {
    /// The pipeline of `group`'s ranks, stage `s` on rank `s`. Collective over `group`.
    ///
    /// # Errors
    /// A communication error.
    pub fn new(group: &ProcessGroup) -> Result<Self> {
        let links = group.ring_links()?;
        let (s, n) = (group.rank(), group.world_size());
        let end = s == 0 || s == n - 1;
        let ends = group.split(usize::from(!end), s)?;
        Ok(Self {
            group: group.clone(),
            links,
            ends: (end && n > 1).then_some(ends),
        })
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.links.rank()
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.links.size()
    }

    /// The pipeline group (one rank per stage, stage `s` its rank `s`).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The embedding's table and the group of the first and last stages, on those stages of a
    /// model whose head is tied to the table (its gradient is summed over them): for
    /// [`GradReducer::with_groups`](crate::dp::GradReducer::with_groups) and [`crate::dp::DistributedAdamW::with_groups`].
    pub fn tied_embedding<M: LanguageModel>(&self, model: &M) -> Option<(ParamId, ProcessGroup)> {
        let ends = self.ends.as_ref()?;
        model
            .tied_head()
            .then(|| (model.embedding_weight().id, ends.clone()))
    }

    /// `value` of the last stage, on every stage (a loss, to report it everywhere). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn from_last(&self, value: Option<f32>) -> Result<f32> {
        let last = self.stages() - 1;
        Ok(self.group.broadcast(vec![value.unwrap_or(0.0)], last)?[0])
    }

    pub(crate) fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }
}
