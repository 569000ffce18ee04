//! Where each of a rank's tensors lies in the whole model: its tp layout, its pipeline stage's
//! indices and, where fully sharded data parallelism splits a tp shard again on dim 0
//! ([`crate::fsdp`]), the rows it holds.
//!
//! ```text
//!  a weight [rows, cols], tp 2 cuts cols (dim 1), fsdp 2 cuts each tp shard's rows (dim 0):
//!
//!              cols 0..c/2      cols c/2..c
//!  rows 0..r/2 | tp 0, fsdp 0 | tp 1, fsdp 0 |     each rank stores its box, dim 1 first
//!  rows r/2..r | tp 0, fsdp 1 | tp 1, fsdp 1 |     (the cut dimension), with `rows` saying
//!                                                 which rows of dim 0 it holds
//!  a bias [cols] (dim 0 cut by tp): fsdp narrows each tp piece's indices, no `rows` needed
//! ```

use std::ops::Range;

use burn::module::Module;

use super::StageMap;
use crate::reshard::{ParamLayout, Reshard};

/// The rows of dim 0 of a parameter's tp shard that a rank holds when fsdp splits the shard
/// again ([`crate::fsdp::Fsdp::sharding`] makes them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldRows {
    /// The tp shard's rows this rank holds.
    pub held: Range<usize>,
    /// The rank's tensor's dim 0: the `held` rows first, then zero padding.
    pub extent: usize,
}

/// Where each of a rank's parameters (in visiting order) lies in the whole model: what
/// [`save_sharded`](super::save_sharded) writes beside each slice and
/// [`load_sharded`](super::load_sharded) reads back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sharding {
    /// Each parameter's tp layout (of the tp shard, before fsdp).
    pub layouts: Vec<ParamLayout>,
    /// Each parameter's rows, where fsdp splits it (`None`: the whole tp shard).
    pub rows: Vec<Option<HeldRows>>,
    /// The whole model's index of each parameter, and which ones this rank writes.
    pub map: StageMap,
}

impl Sharding {
    /// `model`'s tp layout at tp rank `tp_rank`, its parameters the whole model's `map`; no
    /// fsdp rows.
    pub fn of<M: Module + Reshard>(model: &M, tp_rank: usize, map: StageMap) -> Self {
        let layouts = model.layout(tp_rank);
        Self {
            rows: vec![None; layouts.len()],
            layouts,
            map,
        }
    }

    /// What this rank writes of parameter `k` in its own tensor's indices: the dimension, the
    /// ranges along it and, where fsdp splits dim 0 and it is not that dimension, the held
    /// rows of dim 0 (the padding after them left out); `None` where it writes none of it.
    /// Each element of the whole model is written by one rank: what [`crate::dp::GradClip`]
    /// counts.
    pub(crate) fn written(&self, k: usize) -> Option<Written> {
        if !self.map.writes[k] {
            return None;
        }
        let region = self.region(k);
        let ranges: Vec<Range<usize>> = region
            .slices
            .iter()
            .filter(|s| s.writes)
            .map(|s| s.at..s.at + s.global.len())
            .collect();
        (!ranges.is_empty()).then(|| Written {
            dim: self.layouts[k].dim,
            ranges,
            rows: region.rows.map(|r| 0..r.len()),
        })
    }

    /// Parameter `k`'s slices along its layout's dimension, and its rows of dim 0 where that
    /// is not the cut dimension.
    pub(super) fn region(&self, k: usize) -> Region {
        let layout = &self.layouts[k];
        let whole = |p: &crate::reshard::Piece| Slice {
            global: p.global.clone(),
            at: p.local.start,
            writes: p.writes,
        };
        match &self.rows[k] {
            None => Region {
                slices: layout.pieces.iter().map(whole).collect(),
                rows: None,
            },
            // dim 0 is not cut by tp: the tp shard's rows are the whole's.
            Some(rows) if layout.dim != 0 => Region {
                slices: layout.pieces.iter().map(whole).collect(),
                rows: Some(rows.held.clone()),
            },
            // dim 0 is tp's cut: fsdp narrows each piece to the rows it holds.
            Some(rows) => Region {
                slices: layout
                    .pieces
                    .iter()
                    .filter_map(|p| {
                        let a = p.local.start.max(rows.held.start);
                        let b = p.local.end.min(rows.held.end);
                        (a < b).then(|| Slice {
                            global: p.global.start + (a - p.local.start)
                                ..p.global.start + (b - p.local.start),
                            at: a - rows.held.start,
                            writes: p.writes,
                        })
                    })
                    .collect(),
                rows: None,
            },
        }
    }
}

/// What a rank writes of one of its tensors ([`Sharding::written`]).
#[derive(Clone, Debug)]
pub(crate) struct Written {
    pub(crate) dim: usize,
    pub(crate) ranges: Vec<Range<usize>>,
    pub(crate) rows: Option<Range<usize>>,
}

/// One slice of a rank's tensor along the layout's dimension: `global`'s indices of the whole,
/// at index `at` of the rank's tensor (its dim first, the padding past the held rows cut off).
#[derive(Clone, Debug)]
pub(super) struct Slice {
    pub(super) global: Range<usize>,
    pub(super) at: usize,
    pub(super) writes: bool,
}

/// What a rank holds of one parameter: its slices along the cut dimension and, where the cut
/// is not dim 0 and fsdp splits dim 0, the rows of dim 0.
#[derive(Clone, Debug)]
pub(super) struct Region {
    pub(super) slices: Vec<Slice>,
    pub(super) rows: Option<Range<usize>>,
}
