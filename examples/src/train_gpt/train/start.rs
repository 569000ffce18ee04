//! A rank's model and optimizer as the run starts: drawn or imported, a stage's blocks, resumed
//! from the sharded checkpoint at any layout, expert parallel; `--fsdp`'s in `sharded.rs`.

use std::path::{Path, PathBuf};

use burn::optim::AdamWConfig;
use burn_tp::checkpoint::{self, CheckpointInfo, Sharding, StageMap};
use burn_tp::comm::ProcessGroup;
use burn_tp::dp::{
    DpOptimizer, Experts, GradClip, broadcast_parameters, broadcast_parameters_with,
};
use burn_tp::pipeline::{self, Pipeline, virtual_stage_layers};

use super::super::pipelined::pp_schedule;
use super::{BoxResult, Rank, Trainable};

impl<M: Trainable> Rank<'_, M> {
    /// This rank's shards (fresh, from a Hugging Face model, or resumed from the sharded
    /// checkpoint at any tp x dp), the step they start at, and the optimizer.
    pub(super) fn start(&self) -> BoxResult<(M, usize, DpOptimizer)> {
        if let Some(groups) = &self.fsdp_groups {
            return self.start_sharded(groups);
        }
        let (args, tp_group) = (self.args, &self.tp_group);
        // An imported MoE model at ep > 1 (no pipeline, resume or LoRA): each rank reads its
        // experts alone (and the dense weights, the same file on every rank: no broadcast).
        let direct_ep = match (&args.init_from, &self.experts, &self.pipe, &args.resume) {
            (Some(dir), Some((ep, _)), None, None) if !args.is_lora() => Some((dir, ep)),
            _ => None,
        };
        let (model, first_step) = match self.experts.as_ref().filter(|_| direct_ep.is_none()) {
            Some((ep, expert_dp)) => self.start_expert_parallel(ep, expert_dp)?,
            None => self.start_replicated(direct_ep)?,
        };
        // QLoRA: every replica quantizes the same values (after the broadcast, which moves floats).
        let model = match args.qlora {
            true => model.quantize_lora_base()?,
            false => model,
        };
        let mut adamw = AdamWConfig::new().init();
        // A resumed run continues where the checkpoint left off: the optimizer state (resharded
        // to this tp, a stage's or an ep rank's part) and the step count, so the batches and
        // the AdamW bias correction go on.
        if let Some(dir) = &args.resume {
            let map = self.checkpoint_map(&model);
            adamw = checkpoint::load_optimizer_stage(adamw, &model, dir, tp_group.rank(), &map)?;
        }
        let optim = super::super::optimizer::build(
            args,
            &model,
            adamw,
            (tp_group, &self.dp_group),
            self.pipe.as_ref(),
            self.experts.as_ref().map(|(_, expert_dp)| expert_dp),
        )?;
        let optim = match args.clip_grad {
            Some(max) => optim.with_clip(self.grad_clip(&model, max)),
            None => optim,
        };
        Ok((model, first_step, optim))
    }

    /// `--clip-grad MAX` of `model` (this rank's: a stage's, an ep rank's): each element of
    /// the whole model counted by the rank that writes it to the checkpoint (dp replica 0, or
    /// with `--ep` the first ep group), summed over the world. The distributed optimizer's
    /// chunks split each bucket over dp (the experts' over the ranks holding them), so there
    /// every rank counts its chunks of what its stage holds at its tp rank.
    fn grad_clip(&self, model: &M, max: f64) -> GradClip {
        let zero = self.args.distributed_optimizer;
        let sharding = Sharding::of(model, self.tp_group.rank(), self.map_of(model, zero));
        let writers = self.experts.as_ref().map_or(1, |(ep, _)| ep.world_size());
        let counts = zero || self.dp_rank < writers;
        GradClip::sharded(model, &sharding, counts, &self.world, max)
    }

    /// The model of [`start`](Self::start) without `--ep` (or with its direct import) and the
    /// step it starts at. dp replica 0 draws the weights first (only its tp rank 0 uses the
    /// RNG); the others wait, then take replica 0's weights by broadcast (but for the direct
    /// import, which draws nothing that stays and builds at ep, collectively, on every rank at
    /// once).
    fn start_replicated(
        &self,
        direct_ep: Option<(&PathBuf, &ProcessGroup)>,
    ) -> BoxResult<(M, usize)> {
        if self.dp_rank != 0 && direct_ep.is_none() {
            self.world.barrier()?;
        }
        let fresh = self.fresh(direct_ep)?;
        let (model, first_step) = match &self.args.resume {
            Some(dir) => self.resume(fresh, dir)?,
            None => (fresh, 0),
        };
        if self.dp_rank == 0 && direct_ep.is_none() {
            self.world.barrier()?;
        }
        let model = match direct_ep {
            Some(_) => model,
            None => broadcast_parameters(model, &self.dp_group)?,
        };
        Ok((model, first_step))
    }

    /// The model of [`start`](Self::start) with `--ep` and the step it starts at: the
    /// replicas in turns each draw the whole model from the seed and keep their experts, so
    /// the process holds one whole model at a time (every replica drawing at once held one
    /// each); the checkpoint's values then read into the rank's experts alone. A broadcast
    /// (the experts within the ranks holding them, the rest from dp rank 0) makes the replicas
    /// identical whatever their devices' generators.
    fn start_expert_parallel(
        &self,
        ep: &ProcessGroup,
        expert_dp: &ProcessGroup,
    ) -> BoxResult<(M, usize)> {
        let mut built = None;
        for turn in 0..self.dp_group.world_size() {
            if turn == self.dp_rank {
                built = Some(self.fresh(None)?.expert_parallel(ep)?);
            }
            self.world.barrier()?;
        }
        let model = built.expect("every replica takes its turn");
        let experts = Experts {
            params: model.expert_params().into_iter().collect(),
            group: expert_dp.clone(),
        };
        let model = broadcast_parameters_with(model, &self.dp_group, &experts)?;
        match &self.args.resume {
            Some(dir) => self.resume(model, dir),
            None => Ok((model, 0)),
        }
    }

    /// `model` with the values of the checkpoint in `dir` (read slice by slice into this
    /// rank's shards, a stage's or an ep rank's under the whole model's indices), and the step
    /// it was saved at.
    fn resume(&self, model: M, dir: &Path) -> BoxResult<(M, usize)> {
        let map = self.checkpoint_map(&model);
        let tp_rank = self.tp_group.rank();
        let (model, info) = checkpoint::load_stage(model, dir, Some(self.config), tp_rank, &map)?;
        self.same_base(dir, &info)?;
        Ok((model, info.step as usize))
    }

    /// Where each of `model`'s parameters lies in the whole model's checkpoint: its pipeline
    /// stage's blocks (set by [`fresh`](Self::fresh)) and, once `--ep` split it, its experts.
    pub(super) fn checkpoint_map(&self, model: &M) -> StageMap {
        self.map_of(model, false)
    }

    /// [`checkpoint_map`](Self::checkpoint_map), where `every_ep_rank` writes what its stage
    /// holds (not only ep rank 0 the parameters replicated over ep).
    fn map_of(&self, model: &M, every_ep_rank: bool) -> StageMap {
        let n_ep = self.experts.as_ref().map_or(1, |(ep, _)| ep.world_size());
        let (experts, ep_rank) = match &self.experts {
            Some((ep, _)) => (model.expert_params().into_iter().collect(), ep.rank()),
            None => (Default::default(), 0),
        };
        let mut map = StageMap::expert_parallel(model, &experts, ep_rank, n_ep);
        if every_ep_rank {
            map.writes.fill(true);
        }
        match self.stage_map.get() {
            Some(stage) => map.then(stage),
            None => map,
        }
    }

    /// A LoRA checkpoint holds the adapters alone: they only fit the base they were trained
    /// over (`info`'s, read from `dir`), which must be this run's.
    pub(super) fn same_base(&self, dir: &Path, info: &CheckpointInfo) -> BoxResult<()> {
        if info.frozen_base == self.frozen_base() {
            return Ok(());
        }
        let what = |b: &Option<String>| b.clone().unwrap_or("no base (a full model)".into());
        Err(format!(
            "--resume {}: its adapters were trained over {}, this run's base is {}: resume with \
             the run's --init-from (or --seed) and LoRA flags",
            dir.display(),
            what(&info.frozen_base),
            what(&self.frozen_base())
        )
        .into())
    }

    /// This rank's model as the run starts it (drawn, or imported; LoRA on; a stage's blocks
    /// and ends), before any resume. The stages of a replica draw in turns from the same seed;
    /// with `--fsdp` or `--ep`, every replica (in its turn), so that they all draw the same weights.
    pub(super) fn fresh(&self, direct_ep: Option<(&PathBuf, &ProcessGroup)>) -> BoxResult<M> {
        let (args, tp_group) = (self.args, &self.tp_group);
        let fsdp = self.fsdp_groups.is_some();
        // Every replica draws the whole model, in its turn, with --fsdp and --ep (not their
        // direct import): each then keeps its part.
        let in_turns = fsdp || (self.experts.is_some() && direct_ep.is_none());
        let turns = self.dp_rank == 0 || in_turns;
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
                if (stages > 1 || in_turns) && turns && tp_group.rank() == 0 {
                    self.device.seed(args.seed);
                    burn_tp::local::set_init_seed(args.seed);
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
            if stages > 1 && turns {
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
        let fresh = super::super::trainable::lora_from_args(fresh, args)?;
        // A stage keeps the embedding and the head only where it uses them.
        let fresh = match &self.pipe {
            Some(pipe) => pipeline::drop_unused_ends(fresh, pipe.stage(), pipe.stages())?,
            None => fresh,
        };
        if let Some(pipe) = &self.pipe {
            let map = pipeline::stage_map(&fresh, n_layers, pipe.stage(), pipe.stages())?;
            self.stage_map.set(map).expect("the model is built once");
        }
        Ok(fresh)
    }
}
