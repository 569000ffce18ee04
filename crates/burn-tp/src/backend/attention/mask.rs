//! Which keys a query sees: [`AttentionSpec`], the one visibility rule (causal, sliding window,
//! left padding) of the attention kernels (`flash.rs`'s tensor-op tiles, `flash_cpu.rs`'s CPU
//! kernel) and of the materialized path (`crate::attention`), and the dropout of one call.

use std::ops::Range;

use crate::backend::fused::dropout::DropoutKey;

/// Rows of a query tile and columns of a key tile (the default of `TpSettings::attention_tile`).
pub const TILE: usize = 256;

/// What one attention call needs besides q, k and v.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Position of the first query (the keys before it are a KV cache): query `i` sees keys
    /// `0 ..= start + i`.
    pub start: usize,
    /// Dropout of the probabilities, if any.
    pub dropout: Option<AttentionDropout>,
    /// Query rows (and key columns) per tile.
    pub tile: usize,
    /// A sliding window (Mistral's, Phi-3's): query `i` sees only the `window` keys
    /// `start + i + 1 - window ..= start + i` (transformers' `kv_idx > q_idx - sliding_window`),
    /// and the key tiles wholly before its window are skipped; `None` for every key before it.
    pub window: Option<usize>,
    /// Left padding per sequence (empty: none): sequence `b`'s keys before `padding[b]` are
    /// hidden from every query but the one at their own position (batched generation's
    /// prompts of different lengths; a padding query then sees itself, not an empty row).
    pub padding: Vec<usize>,
    /// The scores' scale: `None` for `1 / sqrt(head_dim)`; Gemma's
    /// `query_pre_attn_scalar ** -0.5` where its scalar is not the head size.
    pub scale: Option<f64>,
    /// Gemma 2's soft cap of the scores, `cap * tanh(s / cap)` (after the scale, before the
    /// mask and the softmax); `None` for none.
    pub softcap: Option<f64>,
    /// Whether a query sees only the keys up to its own position (`start + i`); `false`: every
    /// key (an encoder's self-attention, cross-attention), `start` then only places the dropout.
    pub causal: bool,
    /// Key padding per sequence (empty: none): sequence `b`'s keys from `key_lengths[b]` on are
    /// hidden from every query (burn-nn's `mask_pad` of right-padded sequences).
    pub key_lengths: Vec<usize>,
    /// Key padding anywhere, per sequence (empty: none): `key_mask[b][j]` hides key `j` of
    /// sequence `b` from every query (burn-nn's `mask_pad` that is not right padding: left
    /// padding, holes). Tiles are then masked, none skipped for it.
    pub key_mask: Vec<Vec<bool>>,
}

/// The dropout of one attention call: this rank's region of the logical mask of site `site`
/// (`[batch_total, heads_total, s, t]`).
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionDropout {
    /// Probability of dropping.
    pub p: f64,
    /// The step's key.
    pub key: DropoutKey,
    /// The dropout site.
    pub site: u64,
    /// Sequences in the global batch.
    pub batch_total: usize,
    /// This rank's sequences in it.
    pub batch: Range<usize>,
    /// Query heads over all ranks.
    pub heads_total: usize,
    /// This rank's query heads among them.
    pub heads: Range<usize>,
    /// Where the call's queries and keys sit in the mask's `[s, t]`; `None` when they are all
    /// of it (every call but a ring step of context parallelism, `crate::context`).
    pub positions: Option<MaskPositions>,
}

/// The place of one call's queries and keys in a longer sequence's dropout mask: query `i` is
/// row `queries + i` of the mask `[.., length, length]`, key `j` its column `keys + j`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskPositions {
    /// The first query's position.
    pub queries: usize,
    /// The first key's position.
    pub keys: usize,
    /// The whole sequence's length.
    pub length: usize,
}

impl AttentionDropout {
    /// The mask's `[s, t]` and the region of it that query tile `rows` and key tile `cols` of a
    /// call of `s` queries and `t` keys cover.
    pub(crate) fn place(
        &self,
        [s, t]: [usize; 2],
        rows: &Range<usize>,
        cols: &Range<usize>,
    ) -> ([usize; 2], Range<usize>, Range<usize>) {
        match self.positions {
            None => ([s, t], rows.clone(), cols.clone()),
            Some(p) => (
                [p.length, p.length],
                p.queries + rows.start..p.queries + rows.end,
                p.keys + cols.start..p.keys + cols.end,
            ),
        }
    }
}

impl AttentionSpec {
    /// Causal attention from position `start`, no dropout, tiles of 256 rows.
    pub fn causal(start: usize) -> Self {
        Self {
            start,
            dropout: None,
            tile: TILE,
            window: None,
            padding: Vec::new(),
            scale: None,
            softcap: None,
            causal: true,
            key_lengths: Vec::new(),
            key_mask: Vec::new(),
        }
    }

    /// Sequence `b`'s keys (those past it are padding).
    pub(crate) fn key_len(&self, b: usize) -> usize {
        self.key_lengths.get(b).copied().unwrap_or(usize::MAX)
    }

    /// The scores' scale for heads of `hd`: [`scale`](Self::scale), or `1 / sqrt(hd)`.
    pub(crate) fn scale_for(&self, hd: usize) -> f64 {
        self.scale.unwrap_or_else(|| 1.0 / (hd as f64).sqrt())
    }

    /// Sequence `b`'s left padding.
    pub(crate) fn pad(&self, b: usize) -> usize {
        self.padding.get(b).copied().unwrap_or(0)
    }

    /// The rule: whether query `i` of sequence `b` sees key `j`: `j` among its [`keys`]
    /// (its causal past, in its window) and not another position's padding. The kernels apply
    /// it a row at a time: [`keys`] as a range, then the padding before [`pad`].
    ///
    /// [`keys`]: Self::keys
    /// [`pad`]: Self::pad
    pub(crate) fn sees(&self, b: usize, i: usize, j: usize) -> bool {
        self.keys(i).contains(&j)
            && j < self.key_len(b)
            && !self.key_masked(b, j)
            && (j >= self.pad(b) || j == self.start + i)
    }

    /// Whether [`key_mask`](Self::key_mask) hides key `j` of sequence `b`.
    pub(crate) fn key_masked(&self, b: usize, j: usize) -> bool {
        self.key_mask
            .get(b)
            .is_some_and(|m| m.get(j).copied().unwrap_or(false))
    }

    /// The keys query `i` sees before padding: its causal past, cut to its window (every key
    /// when not causal: the range's end is then `usize::MAX`).
    pub(crate) fn keys(&self, i: usize) -> Range<usize> {
        let end = if self.causal {
            self.start + i + 1
        } else {
            usize::MAX
        };
        self.first_key(i)..end
    }

    /// The first key query `i` sees (the last is `start + i`).
    pub(crate) fn first_key(&self, i: usize) -> usize {
        self.window
            .map_or(0, |w| (self.start + i + 1).saturating_sub(w))
    }

    /// Whether some query of tile `rows` sees some key of tile `cols` (else the tile is
    /// skipped), and whether some key of it is hidden from some query (then it is masked).
    pub(crate) fn visible(&self, rows: &Range<usize>, cols: &Range<usize>) -> (bool, bool) {
        let (first_query, last_query) = (self.start + rows.start, self.start + rows.end - 1);
        let longest = self.key_lengths.iter().copied().max().unwrap_or(usize::MAX);
        let seen = (!self.causal || cols.start <= last_query)
            && cols.end > self.first_key(rows.start)
            && cols.start < longest;
        let masked = (self.causal && cols.end - 1 > first_query)
            || cols.start < self.first_key(rows.end - 1)
            || self.key_lengths.iter().any(|&l| l < cols.end)
            || !self.key_mask.is_empty();
        (seen, masked)
    }
}

/// `0..n` cut into tiles of `tile` (the last one shorter).
pub(crate) fn tiles(n: usize, tile: usize) -> Vec<Range<usize>> {
    (0..n.div_ceil(tile))
        .map(|i| i * tile..((i + 1) * tile).min(n))
        .collect()
}
