//! Sharded checkpoints: every rank writes only the slices it owns, and any tp reads back only the
//! slices it needs. No rank ever holds a full parameter, so checkpointing a model costs each
//! rank its own shard's memory, not the whole model's (what
//! [`FullOptimizerState`](crate::reshard::FullOptimizerState) and `to_full_module` cost).
//!
//! # Format
//! A checkpoint is a folder:
//! - `index.json`: the format, the run's [`CheckpointInfo`] (steps, tp, dp, the model's config),
//!   and for every tensor (`p{k}` for parameter `k` in visiting order, `p{k}.{field}` for its
//!   optimizer state, AdamW's moments) its dtype, full shape, the dimension it is cut along and
//!   which file holds which slice; the optimizer's scalars. Written last, atomically (a
//!   temporary file renamed over the old one): a folder without it is not a checkpoint.
//! - `step-{N}/rank-{r}.safetensors`: tensor-parallel rank `r`'s tensors, each stored with the
//!   dimension it is cut along first, so that a slice of it is one contiguous byte range. The
//!   shard folder is written under a temporary name and renamed into place before the index
//!   points at it; the folders of older saves are removed after.
//!
//! A checkpoint [`with_frozen_base`](CheckpointInfo::with_frozen_base) (a LoRA run's) holds the
//! trainable parameters and their state alone: the frozen base is where the run built it from,
//! and [`load`] keeps the model's own values of it (a QLoRA base stays quantized).
//!
//! A crash at any point leaves the previous `index.json` pointing at its own intact shards.
//! Data-parallel replicas hold the same tensors: only replica 0 writes.
//!
//! # Loading
//! [`load`] fills a model built at any tp (and [`load_optimizer`] its optimizer)
//! from a checkpoint saved at any other: each rank computes where its own shards lie ([`Reshard::layout`](crate::reshard::Reshard::layout)) and copies each
//! overlapping slice out of the memory-mapped files, touching only those pages.
//!
//! ```no_run
//! # use burn_tp::checkpoint::{CheckpointInfo, load, save};
//! # use burn_tp::gpt::GptConfig;
//! # fn demo(group: &burn_tp::comm::ProcessGroup, device: &burn::tensor::Device) -> burn_tp::Result<()> {
//! let config = GptConfig::new(64, 32, 64, 4, 2);
//! let model = config.init(group, device)?;
//! let info = CheckpointInfo::new(100, group.world_size(), 1, &config);
//! save(&model, None, "out/checkpoint".as_ref(), &info, group, 0)?;
//! // Later, at any tp: a freshly built model takes the saved values.
//! let model = config.init(group, device)?;
//! let (model, info) = load(model, "out/checkpoint".as_ref(), Some(&config), group)?;
//! # Ok(()) }
//! ```
//!
//! | file        | what                                                                  |
//! |-------------|-----------------------------------------------------------------------|
//! | `format.rs` | the index and its entries, dtypes, the cut dimension stored first     |
//! | `save.rs`   | [`save`]: each rank its slices, the index last                         |
//! | `load.rs`   | [`load`], [`load_optimizer`]: each rank the slices it needs, at any tp  |
//! | `sharding.rs` | [`Sharding`]: where a rank's tensors lie (tp, stage, fsdp rows)      |
//! | `burn_record.rs` | [`load_burn_record`], [`save_burn_record`]: a Burn record file (a plain burn-nn model's) in and out |

mod burn_record;
mod format;
mod load;
mod save;
mod sharding;

/// Where each of a model's parameters sits in the whole model, and which ones this rank writes:
/// a pipeline stage holds some blocks (and copies of the embedding and the head), and saves its
/// blocks under the whole model's parameter indices, so the checkpoint is the whole model's and
/// resumes at any number of stages ([`crate::pipeline::stage_map`] makes it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageMap {
    /// The whole model's index of each parameter, in visiting order.
    pub global: Vec<usize>,
    /// Whether this rank writes each parameter (a copy held by several stages is written once).
    pub writes: Vec<bool>,
    /// Whether this rank holds each parameter: a stage's unused copies of the embedding or the
    /// head are empty ([`crate::pipeline::drop_unused_ends`]), neither read nor written.
    pub held: Vec<bool>,
    /// The whole model's number of parameters.
    pub total: usize,
}

impl StageMap {
    /// A whole model of `n` parameters.
    pub fn whole(n: usize) -> Self {
        Self {
            global: (0..n).collect(),
            writes: vec![true; n],
            held: vec![true; n],
            total: n,
        }
    }

    /// The map of `model` split by expert parallelism: each mixture-of-experts layer holds
    /// ep rank `ep_rank`'s `1 / n_ep` of its experts ([`crate::moe`]), whose parameters are
    /// `experts`, into the model with every expert. So an ep rank saves its experts alone
    /// under the whole model's indices and reads back only its own, at any ep.
    ///
    /// ```text
    ///  whole:  router | e0 e1 e2 e3 | shared ...     (one layer, 4 experts, n_ep 2)
    ///  rank 0: router | e0 e1       | shared ...     writes router, e0, e1, shared
    ///  rank 1: router |       e2 e3 | shared ...     writes e2, e3 (the rest is rank 0's)
    /// ```
    ///
    /// A layer's experts are one run of `experts` in visiting order, and two layers' runs
    /// never touch (each layer's router comes first), so a run of length `L` on this rank is
    /// `L x n_ep` parameters of the whole model, this rank's at `ep_rank x L`. Parameters
    /// outside the runs are replicated over ep: rank 0 writes them.
    pub fn expert_parallel<M: burn::module::Module>(
        model: &M,
        experts: &std::collections::HashSet<burn::module::ParamId>,
        ep_rank: usize,
        n_ep: usize,
    ) -> Self {
        let ids = crate::model::param_ids(model);
        let mut map = Self::whole(0);
        let mut k = 0;
        while k < ids.len() {
            if !experts.contains(&ids[k]) {
                map.global.push(map.total);
                map.writes.push(ep_rank == 0);
                map.total += 1;
                k += 1;
                continue;
            }
            let run = ids[k..]
                .iter()
                .take_while(|id| experts.contains(id))
                .count();
            let first = map.total + ep_rank * run;
            map.global.extend(first..first + run);
            map.writes.extend(std::iter::repeat_n(true, run));
            map.total += run * n_ep;
            k += run;
        }
        map.held = vec![true; ids.len()];
        map
    }

    /// This map followed by `outer`, the map of the model this one maps into (an ep rank's
    /// experts into its pipeline stage's, [`expert_parallel`](Self::expert_parallel), then
    /// the stage's into the whole model's, [`crate::pipeline::stage_map`]). A parameter is
    /// written where both write it.
    pub fn then(&self, outer: &StageMap) -> StageMap {
        StageMap {
            global: self.global.iter().map(|&g| outer.global[g]).collect(),
            writes: (self.writes.iter().zip(&self.global))
                .map(|(&w, &g)| w && outer.writes[g])
                .collect(),
            held: (self.held.iter().zip(&self.global))
                .map(|(&h, &g)| h && outer.held[g])
                .collect(),
            total: outer.total,
        }
    }
}

use crate::error::file_error;

pub use burn_record::{load_burn_record, save_burn_record};
pub use format::{CheckpointInfo, INDEX};
pub(crate) use load::param_shapes;
pub use load::{
    load, load_optimizer, load_optimizer_sharded, load_optimizer_stage, load_sharded, load_stage,
};
pub use save::{save, save_sharded, save_stage};
pub(crate) use sharding::Written;
pub use sharding::{HeldRows, Sharding};

#[cfg(test)]
mod tests {
    use burn::module::{Param, ParamId};
    use burn::tensor::{Device, Tensor};

    use super::StageMap;

    fn params(n: usize) -> Vec<Param<Tensor<1>>> {
        let device = Device::flex();
        (0..n)
            .map(|_| Param::from_tensor(Tensor::zeros([2], &device)))
            .collect()
    }

    /// Two MoE layers of 4 experts (2 parameters each) at ep 2, each between a router and a
    /// shared expert: ep rank 1 holds experts 2 and 3 of each, the whole model's parameters
    /// 5..9 and 15..19, and writes them alone.
    #[test]
    fn an_ep_rank_maps_its_experts_into_the_whole_model() {
        let model = params(12); // r0 | e2 e2 e3 e3 | s0 | r1 | e2 e2 e3 e3 | s1
        let ids: Vec<ParamId> = model.iter().map(|p| p.id).collect();
        let experts = [1, 2, 3, 4, 7, 8, 9, 10]
            .map(|k| ids[k])
            .into_iter()
            .collect();
        let map = StageMap::expert_parallel(&model, &experts, 1, 2);
        assert_eq!(map.global, [0, 5, 6, 7, 8, 9, 10, 15, 16, 17, 18, 19]);
        let written: Vec<usize> = (0..12).filter(|&k| map.writes[k]).collect();
        assert_eq!(written, [1, 2, 3, 4, 7, 8, 9, 10]);
        assert_eq!(map.total, 20);
        // Rank 0: the first half of each run, and everything else.
        let map = StageMap::expert_parallel(&model, &experts, 0, 2);
        assert_eq!(map.global, [0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 19]);
        assert!(map.writes.iter().all(|&w| w));
        // No experts: the whole model, unchanged.
        let whole = StageMap::expert_parallel(&model, &Default::default(), 0, 1);
        assert_eq!(whole, StageMap::whole(12));
    }

    /// An ep rank's map into its stage's model, then the stage's into the whole: the indices
    /// compose, a parameter is written where both maps write it and held where the stage
    /// holds it.
    #[test]
    fn maps_compose_into_the_whole_model() {
        let inner = StageMap {
            global: vec![0, 3],
            writes: vec![false, true],
            held: vec![true, true],
            total: 4,
        };
        let stage = StageMap {
            global: vec![10, 11, 12, 13],
            writes: vec![true, true, true, false],
            held: vec![false, true, true, true],
            total: 30,
        };
        let map = inner.then(&stage);
        assert_eq!(map.global, [10, 13]);
        assert_eq!(map.writes, [false, false]);
        assert_eq!(map.held, [false, true]);
        assert_eq!(map.total, 30);
    }
}
