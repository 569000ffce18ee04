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
}

use crate::error::file_error;

pub use format::{CheckpointInfo, INDEX};
pub(crate) use load::param_shapes;
pub use load::{
    load, load_optimizer, load_optimizer_sharded, load_optimizer_stage, load_sharded, load_stage,
};
pub use save::{save, save_sharded, save_stage};
pub use sharding::{HeldRows, Sharding};
