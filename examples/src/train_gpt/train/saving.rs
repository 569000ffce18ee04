//! A rank's checkpoint and exports: the sharded save (a LoRA run's adapters alone), the
//! Hugging Face and PEFT exports.

use std::path::Path;

use burn_tp::checkpoint::{self, CheckpointInfo, Sharding};
use burn_tp::dp::DpOptimizer;
use burn_tp::hf::HfConfig;

use super::{BoxResult, Rank, Trainable};

impl<M: Trainable> Rank<'_, M> {
    /// Whether the exports are made from the checkpoint, on one rank: a pipelined run's (no
    /// rank holds every block), a QLoRA run's (its merged export adds the adapters to the
    /// full-precision base it was imported from, not to the quantized copy it trained over).
    fn exports_from_checkpoint(&self) -> bool {
        self.pipe.is_some() || self.args.qlora
    }

    /// `--export-hf` and `--export-peft` of the trained `model` (or, for
    /// [`exports_from_checkpoint`](Self::exports_from_checkpoint), nothing: see
    /// [`export_from_checkpoint`](Self::export_from_checkpoint)). Collective.
    pub(super) fn export(&self, model: &M) -> BoxResult<()> {
        let args = self.args;
        if self.exports_from_checkpoint()
            || (args.export_hf.is_none() && args.export_peft.is_none())
        {
            return Ok(());
        }
        let whole;
        let model = match self.fsdp.get() {
            Some((fsdp, _)) => {
                whole = fsdp.unshard(model.clone())?;
                &whole
            }
            None => model,
        };
        if let Some(dir) = &args.export_hf {
            // Every expert on every ep rank again, for the export (collective over ep).
            let whole = match self.experts {
                Some(_) => model.clone().gather_experts()?,
                None => model.clone(),
            };
            // A LoRA run's export is the merged model (`--merge-lora`; each rank its shards).
            let whole = match args.is_lora() {
                true => whole.merge_lora(),
                false => whole,
            };
            if self.dp_rank == 0 {
                whole.save_hf(self.config, args.init_from.as_deref(), dir, &self.tp_group)?;
            }
            self.world.barrier()?;
        }
        if let Some(dir) = &args.export_peft {
            // The adapters gathered to tp 1 (collective over tp), written once.
            let whole = burn_tp::reshard::Reshard::to_full_module(model)?;
            if self.dp_rank == 0 && self.tp_group.rank() == 0 {
                self.write_peft(&whole, dir)?;
            }
            self.world.barrier()?;
        }
        Ok(())
    }

    /// The adapters of the whole (tp 1) `model` as a PEFT folder in `dir`.
    fn write_peft(&self, whole: &M, dir: &Path) -> BoxResult<()> {
        let hf = match &self.args.init_from {
            Some(from) => HfConfig::from_dir(from)?,
            None => M::hf_config(self.config)?,
        };
        let base = self
            .args
            .init_from
            .as_ref()
            .map(|p| p.display().to_string());
        whole.save_peft(&hf, dir, base.as_deref())?;
        Ok(())
    }

    /// The exports of a pipelined or QLoRA run: the checkpoint just saved (the whole model's,
    /// every stage's blocks; a LoRA run's adapters over its base, built again in f32) read back
    /// whole on world rank 0 and written as [`export`](Self::export) writes them, once.
    /// Collective.
    pub(super) fn export_from_checkpoint(&self) -> BoxResult<()> {
        let args = self.args;
        let exports = args.export_hf.is_some() || args.export_peft.is_some();
        if !self.exports_from_checkpoint() || !exports {
            return Ok(());
        }
        if self.world.rank() == 0 {
            let solo = burn_tp::comm::LocalGroup::new(1)?.remove(0);
            // The frozen base as the run built it: imported, or the seed's draw.
            self.device.seed(args.seed);
            burn_tp::local::set_init_seed(args.seed);
            let whole = M::init(self.config, &solo, &self.device)?;
            let whole = match &args.init_from {
                Some(dir) => whole.load_hf(dir, &solo)?,
                None => whole,
            };
            let whole = super::super::trainable::lora_from_args(whole, args)?;
            let (whole, _) = checkpoint::load(whole, self.checkpoint, Some(self.config), &solo)?;
            if let Some(dir) = &args.export_peft {
                self.write_peft(&whole, dir)?;
            }
            if let Some(dir) = &args.export_hf {
                let whole = match args.is_lora() {
                    true => whole.merge_lora(),
                    false => whole,
                };
                whole.save_hf(self.config, args.init_from.as_deref(), dir, &solo)?;
            }
        }
        self.world.barrier()?;
        Ok(())
    }

    /// What a LoRA run's checkpoint says its frozen base is (it holds the adapters alone):
    /// `--init-from`'s folder, or the draw of `--seed`; `None` for a full fine-tune.
    pub(super) fn frozen_base(&self) -> Option<String> {
        let args = self.args;
        args.is_lora().then(|| match &args.init_from {
            Some(dir) => {
                let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
                format!("the Hugging Face model in {}", dir.display())
            }
            None => format!("the --seed {} draw", args.seed),
        })
    }

    /// This rank's slices of the model and the AdamW state after `steps` steps, into the
    /// sharded checkpoint (data-parallel replica 0 writes; every rank waits for it). The
    /// distributed optimizer's chunks are gathered over dp first; with `--fsdp` each rank of
    /// the first shard group writes its rows; with `--ep` each rank of the first ep group
    /// its experts, under the whole model's indices (it resumes at any ep).
    pub(super) fn save(
        &self,
        model: &mut M,
        optim: &mut DpOptimizer,
        steps: usize,
    ) -> burn_tp::Result<()> {
        let a = self.args;
        let info = CheckpointInfo::new(steps as u64, a.tp, a.dp, self.config).with_pp(a.pp);
        // A LoRA run saves its adapters and their state alone: the base is where it came from.
        let info = match self.frozen_base() {
            Some(base) => info.with_frozen_base(base),
            None => info,
        };
        if let Some(fsdp) = self.fsdp.get() {
            return self.save_sharded(fsdp, model, optim, &info);
        }
        let adamw = optim.module_optimizer(model)?;
        match (&self.experts, self.stage_map.get()) {
            // The writers span the first ep group's dp ranks: the whole world takes part.
            (Some((ep, _)), _) => {
                let map = self.checkpoint_map(model);
                let sharding = Sharding::of(model, self.tp_group.rank(), map);
                let writes = self.dp_rank < ep.world_size();
                checkpoint::save_sharded(
                    model,
                    Some(adamw),
                    self.checkpoint,
                    &info,
                    &sharding,
                    &self.world,
                    writes,
                )?;
            }
            // Every stage its blocks, under the whole model's indices: one checkpoint.
            (None, Some(map)) => checkpoint::save_stage(
                model,
                Some(adamw),
                self.checkpoint,
                &info,
                self.tp_group.rank(),
                &self.replica,
                self.dp_rank,
                map,
            )?,
            (None, None) => checkpoint::save(
                model,
                Some(adamw),
                self.checkpoint,
                &info,
                &self.tp_group,
                self.dp_rank,
            )?,
        }
        self.world.barrier()?;
        Ok(())
    }
}
