//! The pipeline without a backward: the mean loss of a batch (evaluation) and the logits of
//! ids (generation).

use burn::tensor::{DType, Int, Tensor};

use super::Pipeline;
use super::batches::MicroBatch;
use super::routers;
use super::schedule::{Action, PipelineSchedule, actions};
use super::stages::virtual_stage_runs;
use super::transfer::{Side, Transfers};
use crate::model::LanguageModel;
use crate::{Result, TpError};

/// The mean loss over `micro_batches` without a backward (evaluation): the forwards in
/// `schedule`'s order, on the model's inner (non-autodiff) backend. The loss on the last stage,
/// `None` on the others. Collective over the pipeline.
///
/// # Errors
/// As [`loss_and_grads`](super::loss_and_grads).
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
    let v = schedule.virtual_stages();
    let (p, stage) = (pipe.stages(), pipe.stage());
    let runs = virtual_stage_runs(model, v)?;
    let inner = model.valid();
    let device = first.0.device().without_autodiff();
    let dtype = model.embedding_weight().val().dtype();
    // A MoE model's routers' loss, as the training loss has it (`routers.rs`).
    let width = routers::width(model.router_loss_experts());
    let shape = model.activation_shape(first.0.dims());
    let mut io = Transfers::with_extra(pipe, shape, dtype, width);
    let mut sum = 0.0f32;
    for action in actions(schedule, stage, p, m) {
        let Action::Forward {
            virtual_stage: c,
            micro: i,
        } = action
        else {
            continue;
        };
        let (ids, targets) = &micro_batches[i];
        let (x, before) = if stage == 0 && c == 0 {
            (inner.embed(ids.clone().inner())?, vec![0.0; width])
        } else {
            io.recv_with(Side::Prev, &device)?
        };
        let blocks = runs[c].clone();
        let (x, stats) = crate::moe::record(|| {
            blocks
                .into_iter()
                .try_fold(x, |x, l| inner.layer(l, x, None))
        });
        let x = x?;
        let after = match width {
            0 => Vec::new(),
            _ => routers::add(&before, &stats, 1.0)?,
        };
        if stage == p - 1 && c == v - 1 {
            let mut loss = inner.head_loss(x, targets.clone().inner())?;
            if width > 0
                && let Some(r) = model.router_loss(&[routers::held(&after, &device, DType::F32)])
            {
                loss = loss.clone() + r.cast(loss.dtype());
            }
            sum += loss.into_scalar::<f32>();
        } else {
            io.send_with(Side::Next, x, &after)?;
        }
    }
    io.finish()?;
    Ok(pipe.is_last().then(|| sum / m as f32))
}

/// The vocabulary-sharded logits (`[s, batch, V_p / tp]`) of `ids` (`[seq, batch]`) through
/// the pipeline, on the last stage (`None` on the others): one pass of the blocks, each stage
/// its virtual stages in turn (for generation and evaluation; no micro-batches, no dropout). `model`
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
    let v = schedule.virtual_stages();
    let (p, stage) = (pipe.stages(), pipe.stage());
    let runs = virtual_stage_runs(model, v)?;
    let device = ids.device();
    let dtype = model.embedding_weight().val().dtype();
    let mut io = Transfers::new(pipe, model.activation_shape(ids.dims()), dtype);
    let mut logits = None;
    for (c, blocks) in runs.iter().enumerate() {
        let mut x = if stage == 0 && c == 0 {
            model.embed(ids.clone())?
        } else {
            io.recv(Side::Prev, &device)?
        };
        for &l in blocks {
            x = model.layer(l, x, None)?;
        }
        if stage == p - 1 && c == v - 1 {
            logits = Some(model.head_logits(x)?);
        } else {
            io.send(Side::Next, x)?;
        }
    }
    io.finish()?;
    Ok(logits)
}
