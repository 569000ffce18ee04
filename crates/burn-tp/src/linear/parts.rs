//! Contiguous parts of a column-parallel layer's output features (nanotron's
//! `contiguous_chunks`): a fused projection whose parts have different widths (q, k, v of
//! grouped-query attention; gate and up of SwiGLU) is sharded part by part, so every rank holds a
//! piece of each part.
//!
//! ```text
//! full columns:   [ q: 8 heads          | k: 2 heads | v: 2 heads ]      (tp = 4)
//! rank r shard:   [ q heads 2r, 2r+1 | k head r/2 | v head r/2 ]      k, v: 2 blocks < tp,
//!                                                                      each on 2 ranks
//! ```
//!
//! A part of `blocks` equal blocks (heads) gives each rank `blocks / tp` consecutive blocks when
//! `tp` divides `blocks`; when `blocks` divides `tp` (grouped-query attention with fewer key /
//! value heads than ranks), block `r / (tp / blocks)` is replicated on `tp / blocks` consecutive
//! ranks: each keeps the heads its query heads use, and the replicas' gradients are summed over
//! the group of ranks that hold the same block.

use std::ops::Range;

use burn::config::Config;
use burn::tensor::Tensor;
use burn_tp_comm::ProcessGroup;

use crate::TpError;
use crate::ops::copy_to_tp_region;

type TpResult<T> = std::result::Result<T, TpError>;

/// One contiguous part of a column-parallel layer's output features (nanotron's
/// `contiguous_chunks`): `width` columns made of `blocks` equal blocks (heads). With
/// `blocks % tp == 0` each rank takes `blocks / tp` consecutive blocks; with `tp % blocks == 0`
/// (fewer key / value heads than ranks) block `r / (tp / blocks)` is replicated on `tp / blocks`
/// consecutive ranks, and their gradients are summed over those ranks.
#[derive(Config, Debug, PartialEq, Eq)]
pub struct FusedPart {
    /// Columns of the part in the full weight.
    pub width: usize,
    /// Equal blocks the part is made of (its heads); `None`: split in `tp` blocks.
    #[config(default = "None")]
    pub blocks: Option<usize>,
}

/// Where rank `r`'s columns of each part are, in the full weight and in its shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PartPlacement {
    /// Columns of the full weight.
    pub full: Range<usize>,
    /// Columns of the rank's shard.
    pub local: Range<usize>,
    /// The block is replicated on `tp / blocks > 1` ranks.
    pub replicated: bool,
}

/// The parts of `d_output` columns (one part of all of them when `parts` is empty) placed for
/// `rank` of `tp`.
///
/// # Errors
/// [`TpError::Config`] if the widths do not add up to `d_output`, a width is not a multiple of its
/// blocks, blocks and tp do not divide one another, or two replicated parts have different
/// block counts; [`TpError::NotDivisible`] for a plain part not divisible by tp.
pub(crate) fn place(
    parts: &[FusedPart],
    d_output: usize,
    tp: usize,
    rank: usize,
) -> TpResult<Vec<PartPlacement>> {
    let whole = [FusedPart::new(d_output)];
    let parts = if parts.is_empty() { &whole[..] } else { parts };
    let total: usize = parts.iter().map(|c| c.width).sum();
    if total != d_output {
        return Err(TpError::Config(format!(
            "ColumnParallelLinear: part widths {:?} add up to {total}, not d_output = {d_output}",
            parts.iter().map(|c| c.width).collect::<Vec<_>>()
        )));
    }
    let mut replicated_blocks = None;
    let (mut full_at, mut local_at) = (0, 0);
    let mut out = Vec::with_capacity(parts.len());
    for c in parts {
        let blocks = c.blocks.unwrap_or(tp);
        if c.blocks.is_none() && !c.width.is_multiple_of(tp) {
            return Err(TpError::NotDivisible {
                what: "ColumnParallelLinear d_output".into(),
                size: c.width,
                tp,
            });
        }
        if blocks == 0 || !c.width.is_multiple_of(blocks) {
            return Err(TpError::Config(format!(
                "ColumnParallelLinear: a part of width {} cannot be cut in {blocks} blocks",
                c.width
            )));
        }
        let bw = c.width / blocks;
        let (full, replicated) = if blocks.is_multiple_of(tp) {
            let per = blocks / tp;
            (rank * per * bw..(rank + 1) * per * bw, false)
        } else if tp.is_multiple_of(blocks) {
            if *replicated_blocks.get_or_insert(blocks) != blocks {
                return Err(TpError::Config(format!(
                    "ColumnParallelLinear: replicated parts must have the same number of blocks \
                     (got {} and {blocks})",
                    replicated_blocks.unwrap_or(blocks)
                )));
            }
            let g = rank / (tp / blocks);
            (g * bw..(g + 1) * bw, true)
        } else {
            return Err(TpError::Config(format!(
                "ColumnParallelLinear: a part of {blocks} blocks (heads) at tp = {tp}: one must \
                 divide the other"
            )));
        };
        let w = full.len();
        out.push(PartPlacement {
            full: full.start + full_at..full.end + full_at,
            local: local_at..local_at + w,
            replicated,
        });
        full_at += c.width;
        local_at += w;
    }
    Ok(out)
}

/// The group of ranks holding the same replicated blocks (`None` when no part is replicated).
/// Collective over `group` when some part is.
pub(crate) fn replica_group(
    parts: &[FusedPart],
    group: &ProcessGroup,
) -> TpResult<Option<ProcessGroup>> {
    let (tp, r) = (group.world_size(), group.rank());
    let blocks = parts
        .iter()
        .filter_map(|c| c.blocks)
        .find(|&b| b < tp && tp.is_multiple_of(b));
    match blocks {
        Some(b) => Ok(Some(group.split(r / (tp / b), r)?)),
        None => Ok(None),
    }
}

/// The rank's shard of a full tensor whose `dim` holds the columns.
pub(crate) fn shard_columns<const D: usize>(
    full: Tensor<D>,
    dim: usize,
    placement: &[PartPlacement],
) -> Tensor<D> {
    let parts = placement
        .iter()
        .map(|p| full.clone().narrow(dim, p.full.start, p.full.len()))
        .collect::<Vec<_>>();
    Tensor::cat(parts, dim)
}

/// The full tensor from every rank's shard gathered along `dim` (`[.., tp * local, ..]`), given
/// every rank's placement.
pub(crate) fn unshard_columns<const D: usize>(
    gathered: Tensor<D>,
    dim: usize,
    placements: &[Vec<PartPlacement>],
) -> Tensor<D> {
    let local = gathered.dims()[dim] / placements.len();
    let n_parts = placements[0].len();
    let mut pieces = Vec::new();
    for c in 0..n_parts {
        // Each full column range once, in order: ranks holding a replica after the first skip it.
        let mut next = placements[0][c].full.start;
        for (r, p) in placements.iter().enumerate() {
            let p = &p[c];
            if p.full.start == next {
                pieces.push(
                    gathered
                        .clone()
                        .narrow(dim, r * local + p.local.start, p.local.len()),
                );
                next = p.full.end;
            }
        }
    }
    Tensor::cat(pieces, dim)
}

/// The weight (or bias) a rank computes with: its shard, with the replicated columns passed
/// through `copy_to_tp_region` over `replicas` so their gradients are summed over the ranks that
/// hold the same blocks.
pub(crate) fn with_replicas<const D: usize>(
    shard: Tensor<D>,
    dim: usize,
    placement: &[PartPlacement],
    replicas: &ProcessGroup,
) -> Tensor<D> {
    let parts = placement
        .iter()
        .map(|p| {
            let part = shard.clone().narrow(dim, p.local.start, p.local.len());
            if p.replicated {
                copy_to_tp_region(part, replicas)
            } else {
                part
            }
        })
        .collect::<Vec<_>>();
    Tensor::cat(parts, dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_parts_place_heads_and_replicas() {
        // q: 8 heads of 2, k and v: 2 heads of 2, at tp = 4.
        let parts = [
            FusedPart::new(16).with_blocks(Some(8)),
            FusedPart::new(4).with_blocks(Some(2)),
            FusedPart::new(4).with_blocks(Some(2)),
        ];
        let p = place(&parts, 24, 4, 3).unwrap();
        assert_eq!(p[0].full, 12..16);
        assert_eq!(p[1].full, 18..20); // k head 1
        assert_eq!(p[2].full, 22..24); // v head 1
        assert_eq!((p[1].local.clone(), p[1].replicated), (4..6, true));
        assert!(!p[0].replicated);
        let e = place(&parts, 24, 3, 0).unwrap_err();
        assert!(e.to_string().contains("8 blocks"), "{e}");
        let e = place(&parts, 25, 4, 0).unwrap_err();
        assert!(e.to_string().contains("add up to 24"), "{e}");
    }

    /// Every rank of tp 1, 2 and 4 against a table written out by hand: `(full q, full k,
    /// full v)` columns, the local layout, and whether k / v are replicated.
    #[test]
    fn part_placement_of_every_rank_matches_the_table() {
        type Row = (Range<usize>, Range<usize>, Range<usize>);
        let check = |heads: [usize; 3], tp: usize, table: &[Row], replicated: bool| {
            // Heads of 2 columns: q, k, v.
            let parts = heads.map(|h| FusedPart::new(2 * h).with_blocks(Some(h)));
            let width = 2 * heads.iter().sum::<usize>();
            for (rank, (q, k, v)) in table.iter().enumerate() {
                let p = place(&parts, width, tp, rank).unwrap();
                let tag = format!("heads {heads:?} tp {tp} rank {rank}");
                assert_eq!(
                    [p[0].full.clone(), p[1].full.clone(), p[2].full.clone()],
                    [q.clone(), k.clone(), v.clone()],
                    "{tag}"
                );
                let (nq, nk) = (q.len(), k.len());
                assert_eq!(p[0].local, 0..nq, "{tag}");
                assert_eq!(p[1].local, nq..nq + nk, "{tag}");
                assert_eq!(p[2].local, nq + nk..nq + 2 * nk, "{tag}");
                assert!(!p[0].replicated, "{tag}");
                assert_eq!(
                    (p[1].replicated, p[2].replicated),
                    (replicated, replicated),
                    "{tag}"
                );
            }
        };
        // 8 query heads, 2 key / value heads: columns q 0..16, k 16..20, v 20..24.
        check([8, 2, 2], 1, &[(0..16, 16..20, 20..24)], false);
        check(
            [8, 2, 2],
            2,
            &[(0..8, 16..18, 20..22), (8..16, 18..20, 22..24)],
            false,
        );
        check(
            [8, 2, 2],
            4,
            &[
                (0..4, 16..18, 20..22),
                (4..8, 16..18, 20..22),
                (8..12, 18..20, 22..24),
                (12..16, 18..20, 22..24),
            ],
            true,
        );
        // 4 query heads, 1 key / value head (multi-query): q 0..8, k 8..10, v 10..12.
        check(
            [4, 1, 1],
            2,
            &[(0..4, 8..10, 10..12), (4..8, 8..10, 10..12)],
            true,
        );
        check(
            [4, 1, 1],
            4,
            &[
                (0..2, 8..10, 10..12),
                (2..4, 8..10, 10..12),
                (4..6, 8..10, 10..12),
                (6..8, 8..10, 10..12),
            ],
            true,
        );
    }
}
