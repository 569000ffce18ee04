//! Where a rank's shard of each parameter lies in the full parameter: what a sharded checkpoint
//! writes beside each tensor, so that any tp can read back exactly the slices it needs.
//!
//! Every parallel module cuts a parameter along one dimension, in one or more pieces (a column
//! layer of contiguous chunks holds one piece of each chunk; a vocabulary shard holds one piece,
//! minus the padding; a replicated parameter holds the whole, as one piece). Pieces held by
//! several ranks (replicated parameters, replicated key / value heads) are written by the lowest
//! of them only.

use std::ops::Range;

/// One contiguous piece of a rank's tensor along the layout's dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The indices of this rank's tensor along the dimension.
    pub local: Range<usize>,
    /// The indices of the full tensor they hold.
    pub global: Range<usize>,
    /// Whether this rank writes the piece: it holds it alone, or is the lowest rank holding it.
    pub writes: bool,
}

/// Where one of a rank's parameters lies in the full (tp = 1, unpadded) parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    /// The full parameter's shape (a padded vocabulary counts its real ids only).
    pub global_shape: Vec<usize>,
    /// The dimension the pieces are cut along (every other dimension is whole).
    pub dim: usize,
    /// The pieces this rank holds, in local order.
    pub pieces: Vec<Piece>,
}

impl ParamLayout {
    /// A parameter every rank holds whole (`shape`); rank 0 of the group writes it.
    pub fn replicated(shape: Vec<usize>, rank: usize) -> Self {
        let n = shape.first().copied().unwrap_or(1);
        Self {
            global_shape: shape,
            dim: 0,
            pieces: vec![Piece {
                local: 0..n,
                global: 0..n,
                writes: rank == 0,
            }],
        }
    }

    /// Rank `rank`'s equal block of `dim`: `global_shape[dim] / tp` indices from
    /// `rank * global_shape[dim] / tp`; it alone holds it.
    pub fn block(global_shape: Vec<usize>, dim: usize, rank: usize, tp: usize) -> Self {
        let n = global_shape[dim] / tp;
        Self {
            global_shape,
            dim,
            pieces: vec![Piece {
                local: 0..n,
                global: rank * n..(rank + 1) * n,
                writes: true,
            }],
        }
    }

    /// Rank `rank`'s block of a padded dimension: `padded / tp` local indices starting at
    /// `rank * padded / tp` of the padded dimension, of which only those below
    /// `global_shape[dim]` (the real ones) exist in the full tensor.
    pub fn padded_block(
        global_shape: Vec<usize>,
        dim: usize,
        padded: usize,
        rank: usize,
        tp: usize,
    ) -> Self {
        let (n, real) = (padded / tp, global_shape[dim]);
        let start = (rank * n).min(real);
        let end = ((rank + 1) * n).min(real);
        let pieces = (start < end)
            .then(|| Piece {
                local: 0..end - start,
                global: start..end,
                writes: true,
            })
            .into_iter()
            .collect();
        Self {
            global_shape,
            dim,
            pieces,
        }
    }
}
