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
//! The interleaved schedule ([`PipelineSchedule::Interleaved`]) gives each rank several chunks
//! of blocks ([`chunk_layers`]), a micro-batch crossing the ring once per chunk.
//!
//! Checkpoints: [`stage_map`] places a stage's parameters in the whole model, so
//! [`crate::checkpoint::save_stage`] writes the whole model's checkpoint and any pp resumes it.
//!
//! A stage is built with only its blocks ([`LanguageModel::init_stage`]: the others drawn and
//! dropped one at a time, so the weights are the whole model's at any number of stages).
//!
//! The data-parallel reduction is the caller's: after the step ([`loss_and_grads`], then
//! [`crate::dp::average_gradients`]), or overlapped with the backwards in buckets
//! ([`loss_and_grads_overlapped`], with [`GradReducer`] or the distributed optimizer).
//!
//! Limits of this first cut: activations move as f32 (a bf16 model's widened, then cast back).

use std::ops::Range;
use std::time::{Duration, Instant};

use burn::module::{ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Int, Tensor, TensorData};
use burn_tp_comm::{ProcessGroup, ReduceOp, RingLinks, Transfer};

use crate::dp::GradReducer;
use crate::dropout::DropoutStep;
use crate::model::LanguageModel;
use crate::recompute::merge;
use crate::{Result, TpError};

/// The order in which a stage runs its micro-batches' forwards and backwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// Every forward, then every backward (GPipe): simple, holds every micro-batch's
    /// activations.
    GPipe,
    /// One forward, one backward (Megatron's 1F1B): the same bubble, at most `stages`
    /// micro-batches' activations held.
    OneFOneB,
    /// Megatron's interleaved 1F1B: each rank holds `virtual_stages` chunks of blocks (virtual
    /// stage `c * stages + rank` is its chunk `c`), so a micro-batch crosses every rank
    /// `virtual_stages` times and the bubble shrinks by that factor, at the cost of as many more
    /// transfers. The micro-batches must be a multiple of the stages.
    Interleaved {
        /// Chunks per rank.
        virtual_stages: usize,
    },
}

impl PipelineSchedule {
    /// Chunks of blocks per rank: `virtual_stages`, or 1.
    pub fn chunks(self) -> usize {
        match self {
            Self::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }
}

/// One step of a stage's schedule: a micro-batch's forward or backward through one of the
/// rank's chunks (always chunk 0 but with the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of micro-batch `micro` through chunk `chunk`.
    Forward {
        /// The rank's chunk.
        chunk: usize,
        /// The micro-batch.
        micro: usize,
    },
    /// The backward of micro-batch `micro` through chunk `chunk`.
    Backward {
        /// The rank's chunk.
        chunk: usize,
        /// The micro-batch.
        micro: usize,
    },
}

/// What stage `stage` of `stages` runs, in order, for `micro_batches` micro-batches.
pub fn actions(
    schedule: PipelineSchedule,
    stage: usize,
    stages: usize,
    micro_batches: usize,
) -> Vec<Action> {
    let (p, m, v) = (stages, micro_batches, schedule.chunks());
    let total = m * v;
    // The k-th forward / backward: in groups of `p` micro-batches, each through the chunks in
    // turn (forward: chunk 0 first; backward: the last chunk first). Without chunks, micro k.
    let forward = |k: usize| Action::Forward {
        chunk: k % (p * v) / p,
        micro: if v == 1 { k } else { k / (p * v) * p + k % p },
    };
    let backward = |k: usize| Action::Backward {
        chunk: v - 1 - k % (p * v) / p,
        micro: if v == 1 { k } else { k / (p * v) * p + k % p },
    };
    let warmup = match schedule {
        PipelineSchedule::GPipe => total,
        PipelineSchedule::OneFOneB => (p - stage - 1).min(m),
        // Megatron's: all forwards first when the micro-batches just fill the pipe.
        PipelineSchedule::Interleaved { .. } if m == p => total,
        PipelineSchedule::Interleaved { .. } => ((p - stage - 1) * 2 + (v - 1) * p).min(total),
    };
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        out.push(forward(warmup + i));
        out.push(backward(i));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// The blocks of rank `stage`'s chunks (one range, but with the interleaved schedule: its
/// chunk `c` is virtual stage `c * stages + stage` of the blocks cut into `stages * chunks`).
///
/// # Errors
/// As [`stage_layers`] for `stages * chunks` stages.
pub fn chunk_layers(
    n_layers: usize,
    stages: usize,
    schedule: PipelineSchedule,
    stage: usize,
) -> Result<Vec<Range<usize>>> {
    let v = schedule.chunks();
    let all = stage_layers(n_layers, stages * v, None)?;
    Ok((0..v).map(|c| all[c * stages + stage].clone()).collect())
}

/// The blocks of each of `stages` stages: `counts[s]` blocks each when given (uneven cuts),
/// else as even as possible (the first stages one more).
///
/// # Errors
/// [`TpError::Config`] naming the values: no stage, more stages than blocks, counts that are not
/// one per stage, that do not add up to `n_layers` or leave a stage empty.
pub fn stage_layers(
    n_layers: usize,
    stages: usize,
    counts: Option<&[usize]>,
) -> Result<Vec<Range<usize>>> {
    if stages == 0 || stages > n_layers {
        return Err(TpError::Config(format!(
            "pipeline: {stages} stages for {n_layers} blocks (each stage needs one)"
        )));
    }
    let counts: Vec<usize> = match counts {
        Some(c) => {
            if c.len() != stages || c.iter().sum::<usize>() != n_layers || c.contains(&0) {
                return Err(TpError::Config(format!(
                    "pipeline: blocks per stage {c:?} must be {stages} positive counts adding \
                     up to {n_layers}"
                )));
            }
            c.to_vec()
        }
        None => (0..stages)
            .map(|s| n_layers / stages + usize::from(s < n_layers % stages))
            .collect(),
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|n| {
            start += n;
            start - n..start
        })
        .collect())
}

/// Where stage `stage`'s model (of `stages`; `model`, holding its blocks of a whole model of
/// `n_layers` blocks) keeps each parameter in the whole model, for the checkpoints: the blocks
/// under their own indices, the embedding (and the GPT's positions) written by the first stage,
/// the final norm and the head by the last. Parameters the stage does not use
/// ([`drop_unused_ends`]) are neither read nor written.
///
/// # Errors
/// [`TpError::Config`] naming both if `stage >= stages`.
pub fn stage_map<M: LanguageModel>(
    model: &M,
    n_layers: usize,
    stage: usize,
    stages: usize,
) -> Result<crate::checkpoint::StageMap> {
    check_stage("stage_map", stage, stages)?;
    let [pre, per, post] = model.param_sections();
    let held = model.held_layers();
    let mut global = Vec::new();
    let mut writes = Vec::new();
    global.extend(0..pre);
    writes.extend(std::iter::repeat_n(stage == 0, pre));
    for &b in &held {
        global.extend(pre + b * per..pre + (b + 1) * per);
        writes.extend(std::iter::repeat_n(true, per));
    }
    let after = pre + n_layers * per;
    global.extend(after..after + post);
    writes.extend(std::iter::repeat_n(stage + 1 == stages, post));
    Ok(crate::checkpoint::StageMap {
        global,
        writes,
        held: used_params(model, stage, stages),
        total: after + post,
    })
}

/// Stage `stage`'s model (of `stages`) without the parameters the stage never uses: the
/// embedding (and the GPT's positions) but on the first stage, and the table on the last when
/// the head is tied to it; the final norm and the head but on the last stage. Each is left
/// empty (its first dimension 0) and frozen, so a middle stage holds its blocks only (Megatron's
/// stages do not build them), and no optimizer state or gradient bucket waits for them.
/// [`stage_map`] neither reads nor writes them. A model with one stage is returned as it is.
///
/// # Errors
/// [`TpError::Config`] naming both if `stage >= stages`.
pub fn drop_unused_ends<M: LanguageModel>(model: M, stage: usize, stages: usize) -> Result<M> {
    check_stage("drop_unused_ends", stage, stages)?;
    struct Emptier {
        used: Vec<bool>,
        slot: usize,
    }
    impl ModuleMapper for Emptier {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let used = self.used.get(self.slot).copied().unwrap_or(true);
            self.slot += 1;
            if used {
                return param;
            }
            param
                .map(|t| {
                    let mut dims = t.dims();
                    dims[0] = 0;
                    Tensor::<D>::zeros(dims, &t.device()).cast(t.dtype())
                })
                .set_require_grad(false)
        }
    }
    let used = used_params(&model, stage, stages);
    Ok(model.map(&mut Emptier { used, slot: 0 }))
}

/// `stage` of `stages` names a stage.
fn check_stage(what: &str, stage: usize, stages: usize) -> Result<()> {
    match stage < stages {
        true => Ok(()),
        false => Err(TpError::Config(format!(
            "{what}: stage {stage} of {stages} stages (stages count from 0)"
        ))),
    }
}

/// Per parameter (visiting order): whether stage `stage` of `stages` uses it.
fn used_params<M: LanguageModel>(model: &M, stage: usize, stages: usize) -> Vec<bool> {
    struct Find {
        id: burn::module::ParamId,
        slot: usize,
        at: Option<usize>,
    }
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.id == self.id {
                self.at.get_or_insert(self.slot);
            }
            self.slot += 1;
        }
    }
    let [pre, per, post] = model.param_sections();
    let (first, last) = (stage == 0, stage + 1 == stages);
    let mut find = Find {
        id: model.embedding_weight().id,
        slot: 0,
        at: None,
    };
    model.visit(&mut find);
    let table = find.at;
    let tied = model.tied_head();
    let mut used: Vec<bool> = (0..pre)
        .map(|k| first || (last && tied && Some(k) == table))
        .collect();
    used.extend(std::iter::repeat_n(true, per * model.num_layers()));
    used.extend(std::iter::repeat_n(last, post));
    used
}

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
    /// [`GradReducer::new_summed`] and [`crate::dp::DistributedAdamW::new_summed`].
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

    fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }
}

/// One micro-batch's ids and targets, `[seq, batch]` each.
pub type MicroBatch = (Tensor<2, Int>, Tensor<2, Int>);

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
    let mut out = run_step(model, pipe, micro_batches, schedule, step, None, false)?;
    sum_embedding_grad(model, pipe, &mut out.grads)?;
    Ok(out)
}

/// [`loss_and_grads`] with the data-parallel reduction overlapped with the backwards (Megatron's
/// `overlap_grad_reduce` under a pipeline): each forward runs on a view of `model` with
/// `reducer`'s taps ([`GradReducer`], or [`crate::dp::DistributedAdamW::reducer`]), and before
/// each backward the reducer is told whether it is the last micro-batch through its chunk, so a
/// bucket starts once its parameters' gradients are complete, while the other micro-batches and
/// chunks are still running. Finish with [`GradReducer::finish`] or
/// [`crate::dp::DistributedAdamW::step`]: the gradients returned are this rank's own until
/// then. A tied embedding's sum over the first and last stages is the reducer's: build it with
/// [`Pipeline::tied_embedding`] ([`GradReducer::new_summed`]). Collective over the pipeline.
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
    )
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
    let mut out = run_step(model, pipe, micro_batches, schedule, step, None, true)?;
    sum_embedding_grad(model, pipe, &mut out.grads)?;
    Ok(out)
}

/// The schedule's forwards and backwards (the embedding's sum over the ends left out);
/// `recompute`: each block rerun in the backward.
fn run_step<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
    step: Option<DropoutStep>,
    reducer: Option<&GradReducer>,
    recompute: bool,
) -> Result<PipelineStep> {
    let started = Instant::now();
    let mut idle = Duration::ZERO;
    let m = micro_batches.len();
    let Some(first) = micro_batches.first() else {
        return Err(TpError::Config("pipeline: no micro-batch".into()));
    };
    let dims = first.0.dims();
    if let Some(i) = micro_batches
        .iter()
        .position(|(ids, t)| ids.dims() != dims || t.dims() != dims)
    {
        return Err(TpError::Config(format!(
            "pipeline: micro-batch {i} is {:?} / {:?}, micro-batch 0 {dims:?}",
            micro_batches[i].0.dims(),
            micro_batches[i].1.dims()
        )));
    }
    // Every stage must run the same micro-batches: checked first (one small all-gather), so a
    // mismatch is an error naming every stage's, not a transfer that never comes.
    let mine = [m as i64, dims[0] as i64, dims[1] as i64];
    let all = pipe.group.all_gather(mine.to_vec())?;
    if all.chunks(3).any(|c| c != mine) {
        let each: Vec<String> = all
            .chunks(3)
            .enumerate()
            .map(|(s, c)| format!("stage {s}: {} of [{}, {}]", c[0], c[1], c[2]))
            .collect();
        return Err(TpError::Config(format!(
            "pipeline: the stages' micro-batches differ ({})",
            each.join("; ")
        )));
    }
    let v = schedule.chunks();
    let (p, stage) = (pipe.stages(), pipe.stage());
    if v > 1 && !m.is_multiple_of(p) {
        return Err(TpError::Config(format!(
            "pipeline: the interleaved schedule needs the micro-batches ({m}) to be a multiple \
             of the stages ({p})"
        )));
    }
    let chunks = chunk_runs(model, v)?;
    let shape = model.activation_shape(dims);
    let len: usize = shape.iter().product();
    let device = first.0.device();
    // Micro-batch i is rows i * b.. of the batch: its rows of the batch's dropout masks.
    let micro_step = |i: usize| {
        step.map(|s| DropoutStep {
            batch_offset: s.batch_offset + i * dims[1],
            batch_total: Some(s.batch_total.unwrap_or(m * dims[1])),
            ..s
        })
    };
    // Activations travel as f32; a half-precision model gets them back in its dtype.
    let dtype = model.embedding_weight().val().dtype();
    let to_tensor = |v: Vec<f32>| -> Tensor<3> {
        Tensor::<3>::from_data(TensorData::new(v, shape), &device).cast(dtype)
    };
    // The first virtual stage embeds, the last runs the head.
    let first_virtual = |c: usize| stage == 0 && c == 0;
    let last_virtual = |c: usize| stage == p - 1 && c == v - 1;

    // Per (chunk, micro-batch): the chunk's input (a leaf, but on the first virtual stage) and
    // its output (or, on the last virtual stage, its loss), kept from the forward to the
    // backward.
    let at = |c: usize, i: usize| c * m + i;
    let mut inputs: Vec<Option<Tensor<3>>> = vec![None; v * m];
    let mut outputs: Vec<Option<Tensor<3>>> = vec![None; v * m];
    let mut losses: Vec<Option<Tensor<1>>> = vec![None; v * m];
    // Recomputing: per (chunk, micro-batch), its blocks' inputs (untracked), and on the last
    // virtual stage the head's.
    let mut kept: Vec<Vec<Tensor<3>>> = vec![Vec::new(); v * m];
    let inner = recompute.then(|| model.valid());
    let inner_device = device.clone().without_autodiff();
    let mut sends: Vec<Transfer<f32>> = Vec::new();
    let mut total = GradientsParams::new();
    let mut loss_sum = 0.0f32;
    let (mut held, mut peak_in_flight) = (0usize, 0usize);
    for action in actions(schedule, stage, p, m) {
        match action {
            Action::Forward { chunk: c, micro: i } if recompute => {
                held += 1;
                peak_in_flight = peak_in_flight.max(held);
                let inner = inner.as_ref().expect("recomputing");
                let mut x = if first_virtual(c) {
                    inner.embed(micro_batches[i].0.clone().inner())?
                } else {
                    let waiting = Instant::now();
                    let x = in_profile(|| Ok(pipe.links.recv_prev::<f32>(len)?.wait()?))?;
                    idle += waiting.elapsed();
                    Tensor::<3>::from_data(TensorData::new(x, shape), &inner_device).cast(dtype)
                };
                for l in chunks[c].clone() {
                    let next = inner.layer(l, x.clone(), micro_step(i))?;
                    kept[at(c, i)].push(x);
                    x = next;
                }
                if last_virtual(c) {
                    kept[at(c, i)].push(x);
                } else {
                    sends.push(in_profile(|| Ok(pipe.links.send_next(to_vec(x)?)?))?);
                }
            }
            Action::Backward { chunk: c, micro: i } if recompute => {
                held -= 1;
                let mut inputs = std::mem::take(&mut kept[at(c, i)]);
                let leaf = |x: Tensor<3>| Tensor::<3>::from_inner(x).require_grad();
                let mut dy = if last_virtual(c) {
                    let h = leaf(inputs.pop().expect("the head's input"));
                    let loss = model.head_loss(h.clone(), micro_batches[i].1.clone())? / m as f64;
                    loss_sum += loss.clone().into_scalar::<f32>();
                    let mut grads = loss.backward();
                    let dy = h.grad_remove(&mut grads).expect("the head uses its input");
                    merge(&mut total, grads, model);
                    Tensor::from_inner(dy)
                } else {
                    let waiting = Instant::now();
                    let dy = in_profile(|| Ok(pipe.links.recv_next::<f32>(len)?.wait()?))?;
                    idle += waiting.elapsed();
                    to_tensor(dy)
                };
                for l in chunks[c].clone().into_iter().rev() {
                    let x = leaf(inputs.pop().expect("one input per block"));
                    let y = model.layer(l, x.clone(), micro_step(i))?;
                    let mut grads = seeded_backward(y, dy);
                    dy = Tensor::from_inner(
                        x.grad_remove(&mut grads)
                            .expect("a block's input takes part in its output"),
                    );
                    merge(&mut total, grads, model);
                }
                if first_virtual(c) {
                    let grads = seeded_backward(model.embed(micro_batches[i].0.clone())?, dy);
                    merge(&mut total, grads, model);
                } else {
                    sends.push(in_profile(|| Ok(pipe.links.send_prev(to_vec(dy)?)?))?);
                }
            }
            Action::Forward { chunk: c, micro: i } => {
                held += 1;
                peak_in_flight = peak_in_flight.max(held);
                let (ids, targets) = &micro_batches[i];
                // A tap is one node of one graph: a view per forward.
                let tapped = reducer.map(|r| r.view(model.clone()));
                let model = tapped.as_ref().unwrap_or(model);
                let mut x = if first_virtual(c) {
                    model.embed(ids.clone())?
                } else {
                    let waiting = Instant::now();
                    let x = in_profile(|| Ok(pipe.links.recv_prev::<f32>(len)?.wait()?))?;
                    idle += waiting.elapsed();
                    let x = to_tensor(x).require_grad();
                    inputs[at(c, i)] = Some(x.clone());
                    x
                };
                for l in chunks[c].clone() {
                    x = model.layer(l, x, micro_step(i))?;
                }
                if last_virtual(c) {
                    let loss = model.head_loss(x, targets.clone())? / m as f64;
                    losses[at(c, i)] = Some(loss);
                } else {
                    sends.push(in_profile(|| {
                        Ok(pipe.links.send_next(to_vec(x.clone().detach())?)?)
                    })?);
                    outputs[at(c, i)] = Some(x);
                }
            }
            Action::Backward { chunk: c, micro: i } => {
                held -= 1;
                // A chunk's parameters are complete after its last micro-batch's backward.
                if let Some(r) = reducer {
                    r.set_last_micro_batch(i + 1 == m);
                }
                let mut grads = match losses[at(c, i)].take() {
                    Some(loss) => {
                        loss_sum += loss.clone().into_scalar::<f32>();
                        loss.backward()
                    }
                    None => {
                        let waiting = Instant::now();
                        let dy = in_profile(|| Ok(pipe.links.recv_next::<f32>(len)?.wait()?))?;
                        idle += waiting.elapsed();
                        let y = outputs[at(c, i)].take().expect("the forward ran first");
                        seeded_backward(y, to_tensor(dy))
                    }
                };
                if let Some(x) = inputs[at(c, i)].take() {
                    let dx = x
                        .grad_remove(&mut grads)
                        .expect("a stage's input takes part in its output");
                    sends.push(in_profile(|| {
                        Ok(pipe.links.send_prev(to_vec(Tensor::from_inner(dx))?)?)
                    })?);
                }
                merge(&mut total, grads, model);
            }
        }
    }
    let waiting = Instant::now();
    for send in sends {
        in_profile(|| Ok(send.wait()?))?;
    }
    idle += waiting.elapsed();
    Ok(PipelineStep {
        loss: pipe.is_last().then_some(loss_sum),
        grads: total,
        peak_in_flight,
        idle_s: idle.as_secs_f64(),
        step_s: started.elapsed().as_secs_f64(),
    })
}

/// The mean loss over `micro_batches` without a backward (evaluation): the forwards in
/// `schedule`'s order, on the model's inner (non-autodiff) backend. The loss on the last stage,
/// `None` on the others. Collective over the pipeline.
///
/// # Errors
/// As [`loss_and_grads`].
pub fn forward_loss<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    micro_batches: &[MicroBatch],
    schedule: PipelineSchedule,
) -> Result<Option<f32>> {
    let Some(first) = micro_batches.first() else {
        return Err(TpError::Config("pipeline: no micro-batch".into()));
    };
    let m = micro_batches.len();
    let v = schedule.chunks();
    let (p, stage) = (pipe.stages(), pipe.stage());
    let chunks = chunk_runs(model, v)?;
    let shape = model.activation_shape(first.0.dims());
    let len: usize = shape.iter().product();
    let inner = model.valid();
    let device = first.0.device().without_autodiff();
    let dtype = model.embedding_weight().val().dtype();
    let mut sends = Vec::new();
    let mut sum = 0.0f32;
    for action in actions(schedule, stage, p, m) {
        let Action::Forward { chunk: c, micro: i } = action else {
            continue;
        };
        let (ids, targets) = &micro_batches[i];
        let mut x = if stage == 0 && c == 0 {
            inner.embed(ids.clone().inner())?
        } else {
            let v = in_profile(|| Ok(pipe.links.recv_prev::<f32>(len)?.wait()?))?;
            Tensor::<3>::from_data(TensorData::new(v, shape), &device).cast(dtype)
        };
        for l in chunks[c].clone() {
            x = inner.layer(l, x, None)?;
        }
        if stage == p - 1 && c == v - 1 {
            let loss = inner.head_loss(x, targets.clone().inner())?;
            sum += loss.into_scalar::<f32>();
        } else {
            sends.push(in_profile(|| Ok(pipe.links.send_next(to_vec(x)?)?))?);
        }
    }
    for send in sends {
        in_profile(|| Ok(send.wait()?))?;
    }
    Ok(pipe.is_last().then(|| sum / m as f32))
}

/// The vocabulary-sharded logits (`[s, batch, V_p / tp]`) of `ids` (`[seq, batch]`) through
/// the pipeline, on the last stage (`None` on the others): one pass of the blocks, each stage
/// its chunks in turn (for generation and evaluation; no micro-batches, no dropout). `model`
/// runs as given: pass `model.valid()` and ids off the autodiff device for no tape.
/// Collective over the pipeline.
///
/// # Errors
/// The model's errors; a transfer that fails.
pub fn forward_logits<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    ids: Tensor<2, Int>,
    schedule: PipelineSchedule,
) -> Result<Option<Tensor<3>>> {
    let v = schedule.chunks();
    let (p, stage) = (pipe.stages(), pipe.stage());
    let chunks = chunk_runs(model, v)?;
    let shape = model.activation_shape(ids.dims());
    let len: usize = shape.iter().product();
    let device = ids.device();
    let dtype = model.embedding_weight().val().dtype();
    let mut logits = None;
    for (c, blocks) in chunks.iter().enumerate() {
        let mut x = if stage == 0 && c == 0 {
            model.embed(ids.clone())?
        } else {
            let v = in_profile(|| Ok(pipe.links.recv_prev::<f32>(len)?.wait()?))?;
            Tensor::<3>::from_data(TensorData::new(v, shape), &device).cast(dtype)
        };
        for &l in blocks {
            x = model.layer(l, x, None)?;
        }
        if stage == p - 1 && c == v - 1 {
            logits = Some(model.head_logits(x)?);
        } else {
            in_profile(|| Ok(pipe.links.send_next(to_vec(x)?)?.wait()?))?;
        }
    }
    Ok(logits)
}

/// The blocks of each of the model's `v` chunks: its held blocks (the whole model's indices)
/// cut into their contiguous runs.
fn chunk_runs<M: LanguageModel>(model: &M, v: usize) -> Result<Vec<Vec<usize>>> {
    let held = model.held_layers();
    if v == 1 {
        return Ok(vec![held]);
    }
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for l in held.iter().copied() {
        match runs.last_mut() {
            Some(run) if run.last() == Some(&(l.wrapping_sub(1))) => run.push(l),
            _ => runs.push(vec![l]),
        }
    }
    if runs.len() != v {
        return Err(TpError::Config(format!(
            "pipeline: {v} virtual stages but this stage holds blocks {held:?} ({} ranges: see \
             chunk_layers)",
            runs.len()
        )));
    }
    Ok(runs)
}

/// `f`'s transfers counted under their own label in the communication profile (per stage:
/// what each sent, received and waited), not under the layers'.
fn in_profile<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _scope = burn_tp_comm::profile::scope("pipeline transfers");
    f()
}

/// An activation's values, as they travel.
fn to_vec(t: Tensor<3>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| TpError::Config(format!("pipeline: reading an activation: {e:?}")))
}

/// The backward of `y` with upstream gradient `dy`: `sum(y * dy)`'s.
fn seeded_backward(y: Tensor<3>, dy: Tensor<3>) -> Gradients {
    let dy = dy.cast(y.dtype());
    (y * dy).sum().backward()
}

/// The embedding's gradient summed over the first and last stages (zeros where a stage has
/// none), so both copies of the table take the same update.
fn sum_embedding_grad<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    total: &mut GradientsParams,
) -> Result<()> {
    let Some(ends) = &pipe.ends else {
        return Ok(());
    };
    // Untied, the last stage does not use the table.
    if !model.tied_head() {
        return Ok(());
    }
    let weight: &Param<Tensor<2>> = model.embedding_weight();
    let w = weight.val();
    let (dims, device) = (w.dims(), w.device());
    let g = total
        .remove::<2>(weight.id)
        .unwrap_or_else(|| Tensor::<2>::zeros(dims, &device).inner());
    let values: Vec<f32> = g
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| TpError::Config(format!("pipeline: reading a gradient: {e:?}")))?;
    let summed = ends.all_reduce(values, ReduceOp::Sum)?;
    let g = Tensor::<2>::from_data(TensorData::new(summed, dims), &device);
    total.register(weight.id, g.inner());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(micro: usize) -> Action {
        Action::Forward { chunk: 0, micro }
    }
    fn b(micro: usize) -> Action {
        Action::Backward { chunk: 0, micro }
    }

    #[test]
    fn one_f_one_b_warms_up_then_alternates_and_runs_every_micro_batch_once() {
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 1, 4, 4),
            [f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]
        );
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 3, 4, 4),
            [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3)]
        );
        // Fewer micro-batches than stages: the warm-up is all of them.
        assert_eq!(
            actions(PipelineSchedule::OneFOneB, 0, 4, 2),
            [f(0), f(1), b(0), b(1)]
        );
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        for schedule in [
            PipelineSchedule::GPipe,
            PipelineSchedule::OneFOneB,
            interleaved,
        ] {
            let v = schedule.chunks();
            for stage in 0..4 {
                let a = actions(schedule, stage, 4, 8);
                for c in 0..v {
                    for micro in 0..8 {
                        let fw = a
                            .iter()
                            .position(|x| *x == Action::Forward { chunk: c, micro });
                        let bw = a
                            .iter()
                            .position(|x| *x == Action::Backward { chunk: c, micro });
                        assert!(
                            fw.unwrap() < bw.unwrap(),
                            "{schedule:?} stage {stage}: {c} {micro}"
                        );
                    }
                }
                assert_eq!(a.len(), 16 * v);
            }
        }
    }

    #[test]
    fn the_interleaved_schedule_is_megatrons() {
        use Action::{Backward as B, Forward as F};
        // 2 stages, 2 chunks, 4 micro-batches, stage 0: a warm-up of (2 - 0 - 1) * 2 + (2 - 1)
        // * 2 = 4 forwards (micro-batches in groups of 2, each group through chunk 0 then 1),
        // then one forward one backward (the backwards from the last chunk).
        let a = actions(PipelineSchedule::Interleaved { virtual_stages: 2 }, 0, 2, 4);
        assert_eq!(
            a,
            [
                F { chunk: 0, micro: 0 },
                F { chunk: 0, micro: 1 },
                F { chunk: 1, micro: 0 },
                F { chunk: 1, micro: 1 },
                F { chunk: 0, micro: 2 },
                B { chunk: 1, micro: 0 },
                F { chunk: 0, micro: 3 },
                B { chunk: 1, micro: 1 },
                F { chunk: 1, micro: 2 },
                B { chunk: 0, micro: 0 },
                F { chunk: 1, micro: 3 },
                B { chunk: 0, micro: 1 },
                B { chunk: 1, micro: 2 },
                B { chunk: 1, micro: 3 },
                B { chunk: 0, micro: 2 },
                B { chunk: 0, micro: 3 },
            ]
        );
        // The chunks of a stage: virtual stages c * stages + stage.
        let ranges = chunk_layers(8, 2, PipelineSchedule::Interleaved { virtual_stages: 2 }, 1);
        assert_eq!(ranges.unwrap(), [2..4, 6..8]);
    }

    #[test]
    fn stages_are_cut_evenly_or_as_asked() {
        assert_eq!(
            stage_layers(10, 4, None).unwrap(),
            [0..3, 3..6, 6..8, 8..10]
        );
        assert_eq!(stage_layers(4, 2, Some(&[1, 3])).unwrap(), [0..1, 1..4]);
        let e = stage_layers(4, 2, Some(&[2, 3])).unwrap_err().to_string();
        assert!(e.contains("[2, 3]") && e.contains('4'), "{e}");
        assert!(stage_layers(2, 3, None).is_err());
    }
}
