//! One rank's training: build (or resume) its shards, run the steps, save, sample.

use std::path::Path;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor};
use burn_tp::checkpoint;
use burn_tp::comm::profile::Profile;
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::context::{ContextParallel, CpLayout};
use burn_tp::dp::DpOptimizer;
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::ops::all_reduce;
use burn_tp::pipeline::{self, Pipeline};
use burn_tp::precision::cast_params;
use burn_tp::recompute;

use super::pipelined::{held_out_pipelined, micro_batches, pp_schedule};
use super::trainable::Trainable;
use super::{Args, CheckpointTimes};
use crate::eval::{
    Data, batch, cp_chunks, dp_slice, generate, generate_pipelined, held_out_loss, replica_columns,
};

mod saving;
mod sharded;
mod start;

type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

/// What a rank brings back.
pub(super) struct RankOut {
    /// Why training stopped early (a non-finite loss).
    pub(super) stopped: Option<String>,
    pub(super) profile: Option<Profile>,
    pub(super) timings: CheckpointTimes,
    pub(super) first_step: usize,
    pub(super) losses: Vec<f64>,
    pub(super) held_out: Vec<(usize, f64)>,
    pub(super) sample: Vec<i64>,
    /// Seconds of each optimizer step (forward, backward, reductions, update; no evaluation or
    /// checkpoint).
    pub(super) step_s: Vec<f64>,
    /// With `--pp`: per stage (of this rank's pipeline), the seconds it waited for an activation
    /// or a gradient and the seconds of its pipelined steps, summed over the run.
    pub(super) stage_idle: Vec<(f64, f64)>,
    /// A MoE model's tokens routed to each expert over the run, all MoE layers and dp ranks.
    pub(super) expert_tokens: Vec<u64>,
    /// The assignments the experts' capacity dropped, over the run and the dp ranks.
    pub(super) expert_dropped: u64,
}

/// This rank's place in the run: the world, the tp x dp mesh's groups, the device.
struct Rank<'a, M: LanguageModel> {
    args: &'a Args,
    config: &'a M::Config,
    data: &'a Data,
    world: ProcessGroup,
    tp_group: ProcessGroup,
    dp_group: ProcessGroup,
    dp_rank: usize,
    /// With `--pp`: this rank's stage and its links to the others.
    pipe: Option<Pipeline>,
    /// With `--pp`: every rank of this data-parallel replica (the checkpoint's writers), and
    /// where this stage's parameters sit in the whole model (set once the model is built).
    replica: ProcessGroup,
    stage_map: std::cell::OnceCell<checkpoint::StageMap>,
    /// With `--pp`: this stage's idle and pipelined seconds so far.
    pp_seconds: std::cell::Cell<(f64, f64)>,
    device: Device,
    checkpoint: &'a Path,
    /// With `--ep`: the ep group and the expert data-parallel group.
    experts: Option<(ProcessGroup, ProcessGroup)>,
    /// With `--fsdp`: the shard group and the replicas (HSDP).
    fsdp_groups: Option<(ProcessGroup, ProcessGroup)>,
    /// With `--fsdp --ep`: the groups the experts' rows are split and replicated over.
    fsdp_experts: Option<(ProcessGroup, ProcessGroup)>,
    /// With `--fsdp`: how the model is sharded and where its rows lie in the whole (set once
    /// the model is built).
    fsdp: std::cell::OnceCell<(Fsdp, checkpoint::Sharding)>,
}

pub(super) fn train_rank<M: Trainable>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    world: ProcessGroup,
    device: &Device,
    checkpoint: &Path,
) -> BoxResult<RankOut> {
    // The tp x dp x pp grid, its groups made once (tp ranks adjacent, stages the slowest).
    let mesh = DeviceMesh::with_pipeline(world.clone(), args.tp, args.pp)?;
    let experts = match args.ep {
        1 => None,
        ep => Some(mesh.expert_groups(ep)?),
    };
    // With --cp: the ring each sequence is split over (consecutive dp ranks).
    let context = match args.cp {
        1 => None,
        cp => Some(ContextParallel::new(
            mesh.context_group(cp)?,
            CpLayout::LoadBalanced,
        )?),
    };
    let fsdp_groups = args.fsdp_shard().map(|n| mesh.fsdp_groups(n)).transpose()?;
    let fsdp_experts = match (args.fsdp_shard(), args.ep) {
        (Some(n), ep) if ep > 1 => Some(mesh.fsdp_expert_groups(n, ep)?),
        _ => None,
    };
    let pipe = match args.pp {
        1 => None,
        _ => Some(Pipeline::new(mesh.pp_group())?),
    };
    let r = Rank::<M> {
        args,
        config,
        data,
        tp_group: mesh.tp_group().clone(),
        dp_group: mesh.dp_group().clone(),
        dp_rank: mesh.dp_rank(),
        pipe,
        replica: mesh.replica_group().clone(),
        experts,
        fsdp_groups,
        fsdp_experts,
        fsdp: std::cell::OnceCell::new(),
        stage_map: std::cell::OnceCell::new(),
        pp_seconds: std::cell::Cell::new((0.0, 0.0)),
        world,
        device: device.clone(),
        checkpoint,
    };
    let mut timings = CheckpointTimes::default();
    let load_start = Instant::now();
    let (model, first_step, mut optim) = r.start()?;
    let model = model.with_context_parallel(context);
    if args.resume.is_some() {
        timings.load_s = load_start.elapsed().as_secs_f64();
    }
    let (mut model, out) = r.train(model, first_step, &mut optim)?;
    if out.stopped.is_some() {
        // No checkpoint or sample of a diverged model: only the curve up to there.
        return Ok(RankOut { timings, ..out });
    }
    r.export(&model)?;
    let save_start = Instant::now();
    r.save(&mut model, &mut optim, first_step + args.steps)?;
    timings.save_s = save_start.elapsed().as_secs_f64();
    r.export_from_checkpoint()?;
    // Each stage's idle time, for rank 0 to report; with --profile each stage's first rank
    // writes its own profile (rank 0's is comm.csv).
    let stage_idle = match &r.pipe {
        Some(pipe) => {
            let (idle, busy) = r.pp_seconds.get();
            let all = pipe.group().all_gather(vec![idle, busy])?;
            if args.profile
                && pipe.stage() > 0
                && r.tp_group.rank() == 0
                && r.dp_rank == 0
                && let Some(profile) = r.world.profile()
            {
                let path = args.out.join(format!("comm-stage-{}.csv", pipe.stage()));
                std::fs::create_dir_all(&args.out)?;
                std::fs::write(&path, profile.to_csv())?;
            }
            all.chunks(2).map(|c| (c[0], c[1])).collect()
        }
        None => Vec::new(),
    };
    // The profile covers training only (not the sample below).
    let profile = r.world.profile();
    let sample = match &r.pipe {
        // Nothing to sample: no whole model (with --fsdp, gathered) for it.
        _ if args.sample_len == 0 => Vec::new(),
        None => generate(&r.compute(&model)?, args, data, &r.tp_group, &r.device)?,
        Some(pipe) => generate_pipelined(
            &r.compute(&model)?,
            pipe,
            pp_schedule(args),
            args,
            data,
            &r.tp_group,
            &r.device,
        )?,
    };
    Ok(RankOut {
        timings,
        profile,
        sample,
        stage_idle,
        ..out
    })
}

impl<M: Trainable> Rank<'_, M> {
    /// The model the forward and backward run: the master weights, or a bf16 copy of them.
    /// The model the forward runs for evaluation and sampling, in the run's dtype (with
    /// `--fsdp`, gathered whole: collective over the shard group).
    fn compute(&self, model: &M) -> BoxResult<M> {
        let model = match self.fsdp.get().map(|(f, _)| f) {
            Some(fsdp) => fsdp.unshard(model.clone())?,
            None => model.clone(),
        };
        Ok(cast_params(model, self.args.dtype.dtype()))
    }

    fn held_out(&self, model: &M) -> BoxResult<f64> {
        let (args, data) = (self.args, self.data);
        if let Some(pipe) = &self.pipe {
            return held_out_pipelined(
                &self.compute(model)?,
                pipe,
                args,
                data,
                self.dp_rank,
                &self.dp_group,
                &self.device,
            );
        }
        // With --fsdp the shards, each part gathered in turn.
        let fsdp = self.fsdp.get().map(|(f, _)| f);
        let model = match fsdp {
            Some(_) => model.clone(),
            None => self.compute(model)?,
        };
        held_out_loss(
            &model,
            args,
            data,
            self.dp_rank,
            &self.dp_group,
            &self.device,
            fsdp,
        )
    }

    /// The steps from `first_step`: the losses, the held-out losses, and why it stopped early.
    fn train(
        &self,
        mut model: M,
        first_step: usize,
        optim: &mut DpOptimizer,
    ) -> BoxResult<(M, RankOut)> {
        let args = self.args;
        let progress = (self.world.rank() == 0 && !args.quiet).then(|| {
            let bar = indicatif::ProgressBar::new(args.steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                    .expect("a valid template"),
            );
            bar
        });
        let start = Instant::now();
        let mut losses = Vec::with_capacity(args.steps);
        let mut held_out = vec![(first_step, self.held_out(&model)?)];
        let mut stopped = None;
        let mut step_s = Vec::with_capacity(args.steps);
        // Tokens routed to each expert (every MoE layer), this rank's batches.
        let mut expert_tokens: Vec<i64> = Vec::new();
        let mut dropped = 0i64;
        let end = first_step + args.steps;
        for step in first_step..end {
            let value;
            let step_start = Instant::now();
            let (stepped, routers) = burn_tp::moe::record(|| self.step(model, step, optim));
            (model, value) = stepped?;
            for r in &routers {
                dropped += r.dropped as i64;
                expert_tokens.resize(expert_tokens.len().max(r.counts.len()), 0);
                expert_tokens
                    .iter_mut()
                    .zip(&r.counts)
                    .for_each(|(t, &c)| *t += c as i64);
            }
            step_s.push(step_start.elapsed().as_secs_f64());
            losses.push(value);
            // Every rank sees the same (dp-averaged) value, so all stop at the same step.
            if !value.is_finite() && !args.keep_going {
                stopped = Some(format!(
                    "the loss is {value} at step {step}: training stopped (--keep-going to go \
                     on); loss.csv has the steps up to there"
                ));
                break;
            }
            if (step + 1) % args.eval_every == 0 || step + 1 == end {
                held_out.push((step + 1, self.held_out(&model)?));
            }
            if step + 1 != end
                && args
                    .save_every
                    .is_some_and(|n| (step + 1 - first_step).is_multiple_of(n))
            {
                self.save(&mut model, optim, step + 1)?;
            }
            if let Some(bar) = &progress {
                let tokens_per_s = ((step + 1 - first_step) * args.batch * args.seq) as f64
                    / start.elapsed().as_secs_f64();
                bar.set_message(format!("loss {value:.4}  {tokens_per_s:.0} tok/s"));
                bar.inc(1);
            }
        }
        if let Some(bar) = progress {
            bar.finish();
        }
        // Over the dp ranks (every tp rank of a replica routed the same tokens); the dropped
        // assignments last.
        let expert_tokens = match expert_tokens.is_empty() {
            true => Vec::new(),
            false => {
                expert_tokens.push(dropped);
                self.dp_group.all_reduce(expert_tokens, ReduceOp::Sum)?
            }
        };
        let (expert_tokens, dropped) = match expert_tokens.split_last() {
            Some((d, tokens)) => (tokens.to_vec(), *d as u64),
            None => (Vec::new(), 0),
        };
        let out = RankOut {
            expert_tokens: expert_tokens.into_iter().map(|t| t as u64).collect(),
            expert_dropped: dropped,
            stopped,
            profile: self.world.profile(),
            timings: CheckpointTimes::default(),
            first_step,
            losses,
            held_out,
            sample: Vec::new(),
            step_s,
            stage_idle: Vec::new(),
        };
        Ok((model, out))
    }

    /// One optimizer step: forward, backward, the gradients reduced over tp and dp, the update.
    /// Returns the model after it and the step's loss (mean over dp).
    fn step(&self, model: M, step: usize, optim: &mut DpOptimizer) -> BoxResult<(M, f64)> {
        let args = self.args;
        let (ids, targets) = self.batch(step);
        let (ids, targets) = (cp_chunks(&model, ids)?, cp_chunks(&model, targets)?);
        let (per, replica) = replica_columns(args, self.dp_rank);
        let dropout = DropoutStep::new(step as u64).with_batch(replica * per, args.batch);
        // With --fsdp the shards are the working model: each part gathered (and cast).
        let working = match self.fsdp.get().map(|(f, _)| f) {
            Some(_) => model.clone(),
            None => cast_params(model.clone(), args.dtype.dtype()),
        };
        if let Some(pipe) = &self.pipe {
            return self.pipelined_step(pipe, model, working, (ids, targets), dropout, optim);
        }
        if let Some(fsdp) = self.fsdp.get().map(|(f, _)| f) {
            return self.sharded_step(fsdp, model, (ids, targets), dropout, optim);
        }
        // Each block recomputed in the backward: the loss and the gradients at once.
        let recomputed = {
            let (ids, targets, working) = (ids.clone(), targets.clone(), &working);
            move || recompute::loss_and_grads(working, ids, targets, Some(dropout))
        };
        // The tapped view: each bucket's reduction starts during the backward.
        let forward = || {
            optim
                .attach(working.clone())
                .loss(ids, targets, Some(dropout))
        };
        let (loss, recomputed) = match (optim.replicated(), args.recompute_layers) {
            // The replicated parameters' tp sums deferred to one coalesced all-reduce.
            (Some(r), false) => (r.scope(forward)?, None),
            (None, false) => (forward()?, None),
            (Some(r), true) => r.scope(recomputed).map(|(l, g)| (l, Some(g)))?,
            (None, true) => recomputed().map(|(l, g)| (l, Some(g)))?,
        };
        let mean = all_reduce(loss.clone().detach(), ReduceOp::Avg, &self.dp_group)?;
        let value = mean.into_scalar::<f32>() as f64;
        if !value.is_finite() && !args.keep_going {
            return Ok((model, value));
        }
        // The copy's parameters have the master's ids: its gradients, in f32, step the master.
        let grads = match recomputed {
            Some(grads) => grads,
            None => GradientsParams::from_grads(loss.backward(), &working),
        };
        let model = optim.step(args.lr, model, &working, grads, &self.dp_group)?;
        Ok((model, value))
    }

    /// A step through the pipeline: the micro-batches' forwards and backwards in the schedule's
    /// order, the stage's gradients reduced (tp for the replicated parameters, dp) and stepped.
    /// The loss (the last stage's) is reported on every rank.
    fn pipelined_step(
        &self,
        pipe: &Pipeline,
        model: M,
        working: M,
        (ids, targets): (Tensor<2, Int>, Tensor<2, Int>),
        dropout: DropoutStep,
        optim: &mut DpOptimizer,
    ) -> BoxResult<(M, f64)> {
        let args = self.args;
        let micro = micro_batches(ids, targets, args.micro_batches);
        let schedule = pp_schedule(args);
        // With buckets, each starts as its parameters' last micro-batch's backward ends.
        let buckets = optim.buckets();
        let dropout = Some(dropout);
        let fsdp = self.fsdp.get().map(|(f, _)| f);
        let run = || match buckets {
            _ if let Some(fsdp) = fsdp => {
                pipeline::loss_and_grads_sharded(&working, pipe, &micro, schedule, dropout, fsdp)
            }
            Some(r) => {
                pipeline::loss_and_grads_overlapped(&working, pipe, &micro, schedule, dropout, r)
            }
            None if args.recompute_layers => {
                pipeline::loss_and_grads_recomputed(&working, pipe, &micro, schedule, dropout)
            }
            None => pipeline::loss_and_grads(&working, pipe, &micro, schedule, dropout),
        };
        let out = match optim.replicated() {
            Some(r) => r.scope(run)?,
            None => run()?,
        };
        let (idle, busy) = self.pp_seconds.get();
        self.pp_seconds.set((idle + out.idle_s, busy + out.step_s));
        let loss = pipe.from_last(out.loss)?;
        let value = self.dp_group.all_reduce(vec![loss], ReduceOp::Avg)?[0] as f64;
        if !value.is_finite() && !args.keep_going {
            return Ok((model, value));
        }
        let model = optim.step(args.lr, model, &working, out.grads, &self.dp_group)?;
        Ok((model, value))
    }

    /// This dp rank's part of step `step`'s batch: ids and targets `[seq, batch / dp]`.
    fn batch(&self, step: usize) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let (ids, targets) = batch(&self.data.train, self.args, step);
        (
            dp_slice(&ids, self.args, self.dp_rank, &self.device),
            dp_slice(&targets, self.args, self.dp_rank, &self.device),
        )
    }
}
