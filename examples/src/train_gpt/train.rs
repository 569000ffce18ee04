//! One rank's training: build (or resume) its shards, run the steps, save, sample.

use std::path::Path;
use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor};
use burn_tp::checkpoint;
use burn_tp::comm::profile::Profile;
use burn_tp::comm::{ProcessGroup, ReduceOp};
use burn_tp::context::{ContextParallel, CpLayout};
use burn_tp::dp::{DpOptimizer, GradClip, broadcast_parameters};
use burn_tp::dropout::DropoutStep;
use burn_tp::fsdp::Fsdp;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::ops::all_reduce;
use burn_tp::pipeline::{self, Pipeline, virtual_stage_layers};
use burn_tp::precision::cast_params;
use burn_tp::recompute;
use burn_tp::reshard::move_optimizer_state;

use super::pipelined::{held_out_pipelined, micro_batches, pp_schedule};
use super::trainable::Trainable;
use super::{Args, CheckpointTimes};
use crate::eval::{
    Data, batch, cp_chunks, dp_slice, generate, generate_pipelined, held_out_loss, replica_columns,
};

mod saving;
mod sharded;

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
    /// With `--fsdp`: how the model is sharded (set once the model is built).
    fsdp: std::cell::OnceCell<Fsdp>,
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
    /// This rank's shards (fresh, from a Hugging Face model, or resumed from the sharded
    /// checkpoint at any tp x dp), the step they start at, and the optimizer.
    fn start(&self) -> BoxResult<(M, usize, DpOptimizer)> {
        let (args, tp_group) = (self.args, &self.tp_group);
        // An imported MoE model at ep > 1 (no pipeline, resume or LoRA): each rank reads its
        // experts alone (and the dense weights, the same file on every rank: no broadcast).
        let direct_ep = match (&args.init_from, &self.experts, &self.pipe, &args.resume) {
            (Some(dir), Some((ep, _)), None, None) if !args.is_lora() => Some((dir, ep)),
            _ => None,
        };
        // dp replica 0 draws the weights first (only its tp rank 0 uses the RNG); the others
        // wait, then take replica 0's weights by broadcast (but for the direct import, which
        // draws nothing that stays and builds at ep, collectively, on every rank at once).
        if self.dp_rank != 0 && direct_ep.is_none() {
            self.world.barrier()?;
        }
        // Stages draw the whole model in turns, each from the same seed (one device RNG for
        // every rank thread), so every stage has the same weights; each keeps its blocks.
        let stages = self.pipe.as_ref().map_or(1, Pipeline::stages);
        let stage = self.pipe.as_ref().map_or(0, Pipeline::stage);
        // A stage's blocks (several ranges with the interleaved schedule).
        let n_layers = M::config_layers(self.config);
        let held = match &self.pipe {
            Some(pipe) => {
                let chunks =
                    virtual_stage_layers(n_layers, stages, pp_schedule(args), pipe.stage())?;
                Some(chunks.into_iter().flatten().collect::<Vec<usize>>())
            }
            None => None,
        };
        let mut fresh = None;
        for turn in 0..stages {
            if turn == stage {
                // Only the rank that draws (tp rank 0 of replica 0) touches the RNG.
                if stages > 1 && self.dp_rank == 0 && tp_group.rank() == 0 {
                    self.device.seed(args.seed);
                }
                fresh = Some(match (&held, &args.init_from) {
                    _ if let Some((dir, ep)) = direct_ep => {
                        M::import_expert_parallel(self.config, dir, (tp_group, ep), &self.device)?
                    }
                    // Only this stage's blocks, never the whole model at once; a Hugging Face
                    // import maps the whole model, then keeps its blocks.
                    (Some(held), None) => M::init_stage(self.config, tp_group, &self.device, held)?,
                    _ => M::init(self.config, tp_group, &self.device)?,
                });
            }
            if stages > 1 && self.dp_rank == 0 {
                self.pipe.as_ref().expect("stages > 1").group().barrier()?;
            }
        }
        let fresh = fresh.expect("every stage takes its turn");
        let fresh = match (&held, &args.init_from) {
            _ if direct_ep.is_some() => fresh,
            (Some(held), Some(dir)) => fresh.load_hf(dir, tp_group)?.keep_layers(held),
            (None, Some(dir)) => fresh.load_hf(dir, tp_group)?,
            (_, None) => fresh,
        };
        // LoRA: the adapters on (drawn by dp replica 0, broadcast below), the rest frozen.
        let fresh = super::trainable::lora_from_args(fresh, args)?;
        // A stage keeps the embedding and the head only where it uses them.
        let fresh = match &self.pipe {
            Some(pipe) => pipeline::drop_unused_ends(fresh, pipe.stage(), pipe.stages())?,
            None => fresh,
        };
        if let Some(pipe) = &self.pipe {
            let map = pipeline::stage_map(&fresh, n_layers, pipe.stage(), pipe.stages())?;
            self.stage_map.set(map).expect("the model is built once");
        }
        let (model, first_step) = match &args.resume {
            // Read slice by slice into this rank's shards (a stage's under the whole model's
            // indices).
            Some(dir) => {
                let (model, info) = match self.stage_map.get() {
                    Some(map) => {
                        checkpoint::load_stage(fresh, dir, Some(self.config), tp_group.rank(), map)?
                    }
                    None => checkpoint::load(fresh, dir, Some(self.config), tp_group)?,
                };
                // A LoRA checkpoint holds the adapters alone: they only fit the same base.
                if info.frozen_base != self.frozen_base() {
                    let what =
                        |b: &Option<String>| b.clone().unwrap_or("no base (a full model)".into());
                    return Err(format!(
                        "--resume {}: its adapters were trained over {}, this run's base is {}: \
                         resume with the run's --init-from (or --seed) and LoRA flags",
                        dir.display(),
                        what(&info.frozen_base),
                        what(&self.frozen_base())
                    )
                    .into());
                }
                (model, info.step as usize)
            }
            None => (fresh, 0),
        };
        if self.dp_rank == 0 && direct_ep.is_none() {
            self.world.barrier()?;
        }
        let model = match direct_ep {
            Some(_) => model,
            None => broadcast_parameters(model, &self.dp_group)?,
        };
        // QLoRA: every replica quantizes the same values (after the broadcast, which moves floats).
        let model = match args.qlora {
            true => model.quantize_lora_base()?,
            false => model,
        };
        let mut adamw = AdamWConfig::new().init();
        // A resumed run continues where the checkpoint left off: the optimizer state (resharded
        // to this tp) and the step count, so the batches and the AdamW bias correction go on.
        if let Some(dir) = &args.resume {
            adamw = match self.stage_map.get() {
                // This stage's part of the whole model's state.
                Some(map) => {
                    checkpoint::load_optimizer_stage(adamw, &model, dir, tp_group.rank(), map)?
                }
                None => checkpoint::load_optimizer(adamw, &model, dir, tp_group)?,
            };
        }
        // With --ep, each rank keeps its experts of the (identical) whole model, and their
        // part of a resumed optimizer state.
        let (model, adamw) = match &self.experts {
            Some(_) if direct_ep.is_some() => (model, adamw),
            Some((ep, _)) => {
                let split = model.clone().expert_parallel(ep)?;
                let adamw = match &args.resume {
                    Some(_) => {
                        let moved = move_optimizer_state(&adamw, &model, &split, |m| {
                            m.expert_parallel(ep)
                        })?;
                        AdamWConfig::new().init().load_record(moved)
                    }
                    None => adamw,
                };
                (split, adamw)
            }
            None => (model, adamw),
        };
        if let Some((shard, replicas)) = &self.fsdp_groups {
            return self.start_sharded(model, adamw, (shard, replicas), first_step);
        }
        let optim = super::optimizer::build(
            args,
            &model,
            adamw,
            (tp_group, &self.dp_group),
            self.pipe.as_ref(),
            self.experts.as_ref().map(|(_, expert_dp)| expert_dp),
        )?;
        let optim = match args.clip_grad {
            Some(max) => optim.with_clip(GradClip::new(&model, tp_group, max)),
            None => optim,
        };
        Ok((model, first_step, optim))
    }

    /// The model the forward and backward run: the master weights, or a bf16 copy of them.
    /// The model the forward runs for evaluation and sampling, in the run's dtype (with
    /// `--fsdp`, gathered whole: collective over the shard group).
    fn compute(&self, model: &M) -> BoxResult<M> {
        let model = match self.fsdp.get() {
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
        let fsdp = self.fsdp.get();
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
        let working = match self.fsdp.get() {
            Some(_) => model.clone(),
            None => cast_params(model.clone(), args.dtype.dtype()),
        };
        if let Some(pipe) = &self.pipe {
            return self.pipelined_step(pipe, model, working, (ids, targets), dropout, optim);
        }
        if let Some(fsdp) = self.fsdp.get() {
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
        let fsdp = self.fsdp.get();
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
