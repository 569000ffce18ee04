//! One training step of a stage: [`loss_and_grads`] and its overlapped and recomputed forms.
//! The loop walks the schedule's [`actions`]; each action is one step function of
//! `StageStep` (a tracked forward or backward, or, recomputing, a forward that keeps only the
//! blocks' inputs and a backward that reruns them), the transfers all through
//! [`Transfers`](super::transfer::Transfers).

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use super::Pipeline;
use super::batches::{MicroBatch, check_micro_batches};
use super::prefetch::{Planned, StageShape};
use super::routers;
use super::schedule::{Action, PipelineSchedule, actions};
use super::stages::{sum_embedding_grad, virtual_stage_runs};
use super::transfer::{Side, Transfers};
use crate::dp::GradReducer;
use crate::dropout::DropoutStep;
use crate::fsdp::Fsdp;
use crate::model::LanguageModel;
use crate::moe::RouterStats;
use crate::recompute::{Part, Parts, Whole, merge, seeded_backward};
use crate::{Result, TpError};

/// What one step of a stage gives.
#[derive(Debug)]
pub struct PipelineStep {
    /// The mean loss over the micro-batches, on the last stage (`None` on the others).
    pub loss: Option<f32>,
    /// The gradients of this stage's parameters: those of the batch's mean loss.
    pub grads: GradientsParams,
    /// The most micro-batches whose activations this stage held at once (forward run, backward
    /// not yet): `stages - stage` at most with 1F1B, every micro-batch with GPipe.
    pub peak_in_flight: usize,
    /// Seconds this stage waited for an activation or a gradient (the bubble, and transfers
    /// not hidden), of [`step_s`](Self::step_s).
    pub idle_s: f64,
    /// Seconds of the whole call.
    pub step_s: f64,
}

/// The forward and backward of one step over `micro_batches` on this rank's stage `model` (a
/// [`LanguageModel::into_stage`] of the whole model), in `schedule`'s order: the mean loss over
/// the micro-batches (on the last stage) and the gradients of this stage's parameters, those of
/// the batch's mean loss ([`PipelineStep`]). Every stage passes the same
/// micro-batches (the first reads the ids, the last the targets, every stage their shapes).
/// `step`: dropout with that step's masks (the micro-batches being the batch's consecutive
/// rows). Collective over the pipeline.
///
/// # Errors
/// [`TpError::Config`] for no micro-batch, micro-batches of different shapes, or stages with
/// different micro-batches (naming each stage's count and shape); the model's
/// errors; a transfer that fails (a stage that errs or leaves makes every stage fail within the
/// timeout).
pub fn loss_and_grads<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
) -> Result<PipelineStep> {
    let mut out = run_step(
        model,
        pipe,
        micro_batches,
        schedule,
        step,
        None,
        false,
        &Whole,
    )?;
    sum_embedding_grad(model, pipe, &mut out.grads)?;
    Ok(out)
}

/// [`loss_and_grads`] with the data-parallel reduction overlapped with the backwards (Megatron's
/// `overlap_grad_reduce` under a pipeline): each forward runs on a view of `model` with
/// `reducer`'s taps ([`GradReducer`], or [`crate::dp::DistributedAdamW::reducer`]), and before
/// each backward the reducer is told whether it is the last micro-batch through its virtual stage, so a
/// bucket starts once its parameters' gradients are complete, while the other micro-batches and
/// virtual stages are still running. Finish with [`GradReducer::finish`] or
/// [`crate::dp::DistributedAdamW::step`]: the gradients returned are this rank's own until
/// then. A tied embedding's sum over the first and last stages is the reducer's: build it with
/// [`Pipeline::tied_embedding`] ([`GradReducer::with_groups`]). Collective over the pipeline.
///
/// # Errors
/// As [`loss_and_grads`].
pub fn loss_and_grads_overlapped<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
    reducer: &GradReducer,
) -> Result<PipelineStep> {
    reducer.begin(false);
    run_step(
        model,
        pipe,
        micro_batches,
        schedule,
        step,
        Some(reducer),
        false,
        &Whole,
    )
}

/// [`loss_and_grads`] of `model`, this rank's [`Fsdp`] shards of its stage: each micro-batch's
/// parts gathered just before they run, the next part's gathers posted while one runs (the
/// schedule fixes the order of the parts a stage asks for: `prefetch.rs`), recomputed in the backward (as [`loss_and_grads_recomputed`]) with
/// [`Fsdp::reshard_after_forward`]. The gradients are the shards', summed over the shard
/// group, as [`Fsdp::loss_and_grads`]'s ([`Fsdp::finish_grads`] averages them). Collective
/// over the pipeline and the shard group.
///
/// # Errors
/// As [`loss_and_grads`]; a communication error.
pub fn loss_and_grads_sharded<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
    fsdp: &Fsdp,
) -> Result<PipelineStep> {
    // A dense model's gathers reduce-scatter in their own backward, in autodiff's order; a
    // mixture of experts' are deferred to after each backward, in the gathers' order: an
    // expert no token reached sits elsewhere in one rank's graph than in another's, and the
    // ranks would pair different experts' reduce-scatters.
    let moe = model.router_loss_experts() > 0 || !model.expert_params().is_empty();
    let parts = fsdp.parts::<M>(moe);
    let recompute = fsdp.reshard_after_forward();
    let mut out = run_step(
        model,
        pipe,
        micro_batches,
        schedule,
        step,
        None,
        recompute,
        &parts,
    )?;
    sum_embedding_grad(model, pipe, &mut out.grads)?;
    Ok(out)
}

/// [`loss_and_grads`] with every block recomputed in its backward ([`crate::recompute`] under
/// a pipeline): a forward keeps only its blocks' inputs (and, on the last stage, the head's),
/// untracked, so each micro-batch in flight holds one `[s(/tp), batch, d_model]` tensor per
/// block; a backward reruns each block tracked, from the last, just before its own backward
/// (and the head and loss on the last stage). The same values, at the cost of one more forward
/// of the blocks. Collective over the pipeline.
///
/// # Errors
/// As [`loss_and_grads`].
pub fn loss_and_grads_recomputed<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
) -> Result<PipelineStep> {
    let mut out = run_step(
        model,
        pipe,
        micro_batches,
        schedule,
        step,
        None,
        true,
        &Whole,
    )?;
    sum_embedding_grad(model, pipe, &mut out.grads)?;
    Ok(out)
}

/// The schedule's forwards and backwards (the embedding's sum over the ends left out);
/// `recompute`: each block rerun in the backward.
#[allow(clippy::too_many_arguments)]
fn run_step<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
    reducer: Option<&GradReducer>,
    recompute: bool,
    parts: &dyn Parts<M>,
) -> Result<PipelineStep> {
    let started = Instant::now();
    let mut stage = StageStep::new(model, pipe, micro_batches, schedule, step, reducer)?;
    let inner = recompute.then(|| model.valid());
    let actions = actions(schedule, pipe.stage(), pipe.stages(), micro_batches.len());
    let shape = StageShape {
        virtual_stages: &stage.virtual_stages,
        first_virtual: stage.first_virtual,
        last_virtual: stage.last_virtual,
    };
    let order = shape.requests(&actions, recompute);
    let planned = Planned::new(parts, (model, inner.as_ref().unwrap_or(model)), order)?;
    stage.parts = &planned;
    for action in actions {
        match (action, &inner) {
            (
                Action::Forward {
                    virtual_stage,
                    micro,
                },
                None,
            ) => stage.forward(virtual_stage, micro)?,
            (
                Action::Backward {
                    virtual_stage,
                    micro,
                },
                None,
            ) => stage.backward(virtual_stage, micro)?,
            (
                Action::Forward {
                    virtual_stage,
                    micro,
                },
                Some(inner),
            ) => stage.forward_kept(inner, virtual_stage, micro)?,
            (
                Action::Backward {
                    virtual_stage,
                    micro,
                },
                Some(_),
            ) => stage.backward_recomputed(virtual_stage, micro)?,
        }
    }
    planned.finish(&mut stage.total)?;
    let StageStep {
        io,
        total,
        loss_sum,
        peak_in_flight,
        ..
    } = stage;
    let idle = io.finish()?;
    Ok(PipelineStep {
        loss: pipe.is_last().then_some(loss_sum),
        grads: total,
        peak_in_flight,
        idle_s: idle.as_secs_f64(),
        step_s: started.elapsed().as_secs_f64(),
    })
}

/// One stage's step in progress: what each (virtual stage, micro-batch) keeps from its forward to its
/// backward, the gradients and loss summed so far, and the stage's transfers.
struct StageStep<'a, M: LanguageModel> {
    model: &'a M,
    /// Where each part's parameters come from (the model itself, or fsdp's gathers).
    parts: &'a dyn Parts<M>,
    micro_batches: &'a [MicroBatch],
    reducer: Option<&'a GradReducer>,
    step: Option<DropoutStep>,
    /// `[seq, batch]` of each micro-batch.
    dims: [usize; 2],
    /// The blocks of each virtual stage this stage holds.
    virtual_stages: Vec<Vec<usize>>,
    /// Whether this stage's virtual stage `c` is the whole model's first (it embeds) or last (head).
    first_virtual: Option<usize>,
    last_virtual: Option<usize>,
    io: Transfers<'a>,
    device: Device,
    /// Per (virtual stage, micro-batch), `c * m + i`: the virtual stage's input (a leaf, but on the first
    /// virtual stage) and its output (or, on the last virtual stage, its loss); recomputing, its blocks'
    /// inputs (untracked) and on the last virtual stage the head's.
    inputs: Vec<Option<Tensor<3>>>,
    outputs: Vec<Option<Tensor<3>>>,
    losses: Vec<Option<Tensor<1>>>,
    kept: Vec<Vec<Tensor<3>>>,
    /// The routers' loss (a MoE model's; `routers.rs`): its total's width (0: none); per
    /// (virtual stage, micro-batch) this stage's statistics (tracked; recomputing, per block
    /// and held) and, on the last virtual stage, the micro-batch's total.
    router_width: usize,
    own: Vec<Vec<RouterStats>>,
    kept_stats: Vec<Vec<Vec<RouterStats>>>,
    totals: Vec<Option<Vec<f32>>>,
    total: GradientsParams,
    loss_sum: f32,
    held: usize,
    peak_in_flight: usize,
}

impl<'a, M: LanguageModel> StageStep<'a, M> {
    fn new(
        model: &'a M,
        pipe: &'a Pipeline,
        micro_batches: &'a [MicroBatch],
        schedule: PipelineSchedule,
        step: Option<DropoutStep>,
        reducer: Option<&'a GradReducer>,
    ) -> Result<Self> {
        static WHOLE: Whole = Whole;
        let dims = check_micro_batches(pipe, micro_batches)?;
        let m = micro_batches.len();
        let v = schedule.virtual_stages();
        let (p, stage) = (pipe.stages(), pipe.stage());
        if v > 1 && !m.is_multiple_of(p) {
            return Err(TpError::Config(format!(
                "pipeline: the interleaved schedule needs the micro-batches ({m}) to be a \
                 multiple of the stages ({p})"
            )));
        }
        // Activations travel as f32; a half-precision model gets them back in its dtype.
        let dtype = model.embedding_weight().val().dtype();
        let router_width = routers::width(model.router_loss_experts());
        let shape = model.activation_shape(dims);
        Ok(Self {
            model,
            parts: &WHOLE,
            micro_batches,
            reducer,
            step,
            dims,
            virtual_stages: virtual_stage_runs(model, v)?,
            first_virtual: (stage == 0).then_some(0),
            last_virtual: (stage == p - 1).then_some(v - 1),
            io: Transfers::with_extra(pipe, shape, dtype, router_width),
            device: micro_batches[0].0.device(),
            inputs: vec![None; v * m],
            outputs: vec![None; v * m],
            losses: vec![None; v * m],
            kept: vec![Vec::new(); v * m],
            router_width,
            own: vec![Vec::new(); v * m],
            kept_stats: vec![Vec::new(); v * m],
            totals: vec![None; v * m],
            total: GradientsParams::new(),
            loss_sum: 0.0,
            held: 0,
            peak_in_flight: 0,
        })
    }

    fn at(&self, c: usize, i: usize) -> usize {
        c * self.micro_batches.len() + i
    }

    /// Micro-batch `i`'s dropout: rows `i * batch..` of the batch's masks.
    fn micro_step(&self, i: usize) -> Option<DropoutStep> {
        let (m, b) = (self.micro_batches.len(), self.dims[1]);
        self.step.map(|s| DropoutStep {
            batch_offset: s.batch_offset + i * b,
            batch_total: Some(s.batch_total.unwrap_or(m * b)),
            ..s
        })
    }

    /// The micro-batches' share of the batch's mean loss.
    fn share(&self, loss: Tensor<1>) -> Tensor<1> {
        loss / self.micro_batches.len() as f64
    }

    fn in_flight(&mut self, delta: isize) {
        self.held = self.held.saturating_add_signed(delta);
        self.peak_in_flight = self.peak_in_flight.max(self.held);
    }

    /// Forward of virtual stage `c` on micro-batch `i`, tracked: its input (received, a leaf) and its
    /// output or loss kept for the backward.
    fn forward(&mut self, c: usize, i: usize) -> Result<()> {
        self.in_flight(1);
        let (ids, targets) = &self.micro_batches[i];
        // A tap is one node of one graph: a view per forward.
        let tapped = self.reducer.map(|r| r.view(self.model.clone()));
        let model = tapped.as_ref().unwrap_or(self.model);
        let at = self.at(c, i);
        let parts = self.parts;
        parts.switch_to(at);
        let (x, before) = if self.first_virtual == Some(c) {
            let ends = parts.part(model, Part::Ends, true)?;
            (ends.embed(ids.clone())?, vec![0.0; self.router_width])
        } else {
            let (x, before) = self.io.recv_with(Side::Prev, &self.device)?;
            let x = x.require_grad();
            self.inputs[at] = Some(x.clone());
            (x, before)
        };
        let (blocks, step) = (self.virtual_stages[c].clone(), self.micro_step(i));
        let (x, stats) = crate::moe::record(|| {
            blocks.into_iter().try_fold(x, |x, l| {
                parts.part(model, Part::Block(l), true)?.layer(l, x, step)
            })
        });
        let x = x?;
        let after = self.add_stats(&before, &stats, 1.0)?;
        if self.last_virtual == Some(c) {
            let ends = parts.part(model, Part::Ends, true)?;
            let mut loss = ends.head_loss(x, targets.clone())?;
            if let Some(r) = self.router_loss(stats, &before) {
                loss = loss.clone() + r.cast(loss.dtype());
            }
            self.losses[at] = Some(self.share(loss));
            self.totals[at] = Some(after);
        } else {
            self.io.send_with(Side::Next, x.clone().detach(), &after)?;
            self.outputs[at] = Some(x);
            self.own[at] = stats;
        }
        Ok(())
    }

    /// `total` plus (`sign` 1) or minus (-1) `stats`, with a routers' loss; else empty.
    fn add_stats(&self, total: &[f32], stats: &[RouterStats], sign: f32) -> Result<Vec<f32>> {
        match self.router_width {
            0 => Ok(Vec::new()),
            _ => routers::add(total, stats, sign),
        }
    }

    /// The routers' loss of `own` (tracked) with the other MoE layers' total `others` held:
    /// the whole loss's value with all of them, and `own`'s part of its gradient.
    fn router_loss(&self, own: Vec<RouterStats>, others: &[f32]) -> Option<Tensor<1>> {
        if self.router_width == 0 {
            return None;
        }
        let all = routers::with_held(own, others, &self.device);
        self.model.router_loss(&all)
    }

    /// The backward of `y` seeded with `dy`, and of the micro-batch's share of the routers'
    /// loss of `own` (tracked) with the other MoE layers' total `others` held.
    fn seeded_with_routers(
        &self,
        y: Tensor<3>,
        dy: Tensor<3>,
        own: Vec<RouterStats>,
        others: &[f32],
    ) -> Result<burn::tensor::Gradients> {
        if own.is_empty() || self.router_width == 0 {
            return Ok(seeded_backward(y, dy));
        }
        let seeded = (y.clone() * dy.cast(y.dtype())).sum();
        Ok(match self.router_loss(own, others) {
            Some(r) => (seeded.clone() + self.share(r).cast(seeded.dtype())).backward(),
            None => seeded.backward(),
        })
    }

    /// Backward of virtual stage `c` on micro-batch `i`: from its loss, or its output seeded with the
    /// gradient the next stage sends; its input's gradient sent back.
    fn backward(&mut self, c: usize, i: usize) -> Result<()> {
        self.in_flight(-1);
        // A virtual stage's parameters are complete after its last micro-batch's backward.
        if let Some(r) = self.reducer {
            r.set_last_micro_batch(i + 1 == self.micro_batches.len());
        }
        let at = self.at(c, i);
        self.parts.switch_to(at);
        // The reduce-scatters posted after the previous backward (fsdp's deferred ones).
        self.parts.finish(&mut self.total)?;
        let (mut grads, total) = match self.losses[at].take() {
            Some(loss) => {
                self.loss_sum += loss.clone().into_scalar::<f32>();
                let total = self.totals[at].take().unwrap_or_default();
                (loss.backward(), total)
            }
            None => {
                let (dy, total) = self.io.recv_with(Side::Next, &self.device)?;
                let y = self.outputs[at].take().expect("the forward ran first");
                let own = std::mem::take(&mut self.own[at]);
                let others = self.add_stats(&total, &own, -1.0)?;
                (self.seeded_with_routers(y, dy, own, &others)?, total)
            }
        };
        if let Some(x) = self.inputs[at].take() {
            let dx = x
                .grad_remove(&mut grads)
                .expect("a stage's input takes part in its output");
            self.io
                .send_with(Side::Prev, Tensor::from_inner(dx), &total)?;
        }
        self.parts.backward_done(&mut grads)?;
        merge(&mut self.total, grads, self.model);
        Ok(())
    }

    /// Forward of virtual stage `c` on micro-batch `i` off the tape (`inner`: the model's inner
    /// module), keeping only each block's input (and the head's, on the last virtual stage).
    fn forward_kept(&mut self, inner: &M, c: usize, i: usize) -> Result<()> {
        self.in_flight(1);
        let at = self.at(c, i);
        self.parts.switch_to(at);
        let (mut x, before) = if self.first_virtual == Some(c) {
            let ends = self.parts.part(inner, Part::Ends, false)?;
            let x = ends.embed(self.micro_batches[i].0.clone().inner())?;
            (x, vec![0.0; self.router_width])
        } else {
            self.io
                .recv_with(Side::Prev, &self.device.clone().without_autodiff())?
        };
        let mut stats = Vec::new();
        for l in self.virtual_stages[c].clone() {
            let part = self.parts.part(inner, Part::Block(l), false)?;
            let (next, block) = crate::moe::record(|| part.layer(l, x.clone(), self.micro_step(i)));
            self.kept[at].push(x);
            stats.push(block.into_iter().map(RouterStats::from_inner).collect());
            x = next?;
        }
        let all: Vec<RouterStats> = stats.iter().flatten().cloned().collect();
        let after = self.add_stats(&before, &all, 1.0)?;
        self.kept_stats[at] = stats;
        if self.last_virtual == Some(c) {
            self.kept[at].push(x);
            self.totals[at] = Some(after);
        } else {
            self.io.send_with(Side::Next, x, &after)?;
        }
        Ok(())
    }

    /// Backward of virtual stage `c` on micro-batch `i`, each block rerun tracked from its kept input
    /// just before its own backward, from the last.
    fn backward_recomputed(&mut self, c: usize, i: usize) -> Result<()> {
        self.in_flight(-1);
        let at = self.at(c, i);
        self.parts.switch_to(at);
        let model = self.model;
        let mut inputs = std::mem::take(&mut self.kept[at]);
        let mut stats = std::mem::take(&mut self.kept_stats[at]);
        let leaf = |x: Tensor<3>| Tensor::<3>::from_inner(x).require_grad();
        let (mut dy, total) = if self.last_virtual == Some(c) {
            let total = self.totals[at].take().unwrap_or_default();
            let h = leaf(inputs.pop().expect("the head's input"));
            let ends = self.parts.part(model, Part::Ends, true)?;
            let loss = ends.head_loss(h.clone(), self.micro_batches[i].1.clone())?;
            self.parts.finish(&mut self.total)?;
            let mut grads = self.share(loss.clone()).backward();
            self.parts.backward_done(&mut grads)?;
            // The routers' loss's value, every MoE layer's held: its gradient reaches each
            // block through the block's own term below.
            let loss = match self.router_loss(Vec::new(), &total) {
                Some(r) => loss.clone() + r.cast(loss.dtype()),
                None => loss,
            };
            self.loss_sum += self.share(loss).into_scalar::<f32>();
            let dy = h.grad_remove(&mut grads).expect("the head uses its input");
            merge(&mut self.total, grads, model);
            (Tensor::from_inner(dy), total)
        } else {
            self.io.recv_with(Side::Next, &self.device)?
        };
        for l in self.virtual_stages[c].clone().into_iter().rev() {
            let x = leaf(inputs.pop().expect("one input per block"));
            let held = stats.pop().unwrap_or_default();
            let part = self.parts.part(model, Part::Block(l), true)?;
            let (y, own) = crate::moe::record(|| part.layer(l, x.clone(), self.micro_step(i)));
            // This block's part of the routers' loss: its statistics tracked, every other
            // MoE layer's (the total less this block's kept ones) held.
            let others = self.add_stats(&total, &held, -1.0)?;
            self.parts.finish(&mut self.total)?;
            let mut grads = self.seeded_with_routers(y?, dy, own, &others)?;
            self.parts.backward_done(&mut grads)?;
            dy = Tensor::from_inner(
                x.grad_remove(&mut grads)
                    .expect("a block's input takes part in its output"),
            );
            merge(&mut self.total, grads, model);
        }
        if self.first_virtual == Some(c) {
            let ids = self.micro_batches[i].0.clone();
            let ends = self.parts.part(model, Part::Ends, true)?;
            let embedded = ends.embed(ids)?;
            self.parts.finish(&mut self.total)?;
            let mut grads = seeded_backward(embedded, dy);
            self.parts.backward_done(&mut grads)?;
            merge(&mut self.total, grads, model);
        } else {
            self.io.send_with(Side::Prev, dy, &total)?;
        }
        Ok(())
    }
}
