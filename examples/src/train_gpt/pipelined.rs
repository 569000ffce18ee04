//! The pipeline's pieces of a rank's training: micro-batches, the held-out loss through the
//! stages, the schedule the arguments name.

use burn::tensor::{Device, Int, Tensor};
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::model::LanguageModel;
use burn_tp::pipeline::{self, MicroBatch, Pipeline, PipelineSchedule};

use super::{Args, PpSchedule};
use crate::eval::{Data, EVAL_BATCHES, batch, cp_chunks, dp_slice};

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// `ids`, `targets` (`[seq, batch]`) cut into `n` micro-batches of consecutive sequences.
pub(super) fn micro_batches(
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    n: usize,
) -> Vec<MicroBatch> {
    let per = ids.dims()[1] / n;
    (0..n)
        .map(|i| {
            (
                ids.clone().narrow(1, i * per, per),
                targets.clone().narrow(1, i * per, per),
            )
        })
        .collect()
}

/// [`held_out_loss`] through the pipeline: the same held-out batches, each this replica's
/// rows cut into micro-batches, the loss the last stage's, averaged over dp.
pub(super) fn held_out_pipelined<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    args: &Args,
    data: &Data,
    dp_rank: usize,
    dp_group: &ProcessGroup,
    device: &Device,
) -> BoxResult<f64> {
    let mut sum = 0.0;
    for k in 0..EVAL_BATCHES {
        let (ids, targets) = batch(&data.held_out, args, usize::MAX - k);
        let ids = cp_chunks(model, dp_slice(&ids, args, dp_rank, device))?;
        let targets = cp_chunks(model, dp_slice(&targets, args, dp_rank, device))?;
        let micro = micro_batches(ids, targets, args.micro_batches);
        let loss = pipe.from_last(pipeline::forward_loss(
            model,
            pipe,
            &micro,
            pp_schedule(args),
        )?)?;
        sum += dp_group.all_reduce(vec![loss], ReduceOp::Avg)?[0] as f64;
    }
    Ok(sum / EVAL_BATCHES as f64)
}

/// The library's schedule of `--pp-schedule` (and `--virtual-stages`).
pub(super) fn pp_schedule(args: &Args) -> PipelineSchedule {
    match args.pp_schedule {
        PpSchedule::Gpipe => PipelineSchedule::GPipe,
        PpSchedule::OneFOneB => PipelineSchedule::OneFOneB,
        PpSchedule::Interleaved => PipelineSchedule::Interleaved {
            virtual_stages: args.virtual_stages,
        },
    }
}
