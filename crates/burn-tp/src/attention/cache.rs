//! The KV cache of incremental decoding: one [`KvCache`] per attention layer in a
//! [`DecodeCache`], with the left padding of a batch of prompts.

use burn::tensor::Tensor;

/// The caches of a model's attention layers for incremental decoding (one [`KvCache`] a layer):
/// what [`LanguageModel::logits_cached`](crate::model::LanguageModel::logits_cached) extends.
#[derive(Clone, Debug, Default)]
pub struct DecodeCache {
    /// One cache per layer, in order.
    pub layers: Vec<KvCache>,
    /// Left padding of each sequence of the batch (empty: none): sequence `r`'s first
    /// `padding[r]` positions hold no tokens. No query sees them, and its learned positions
    /// count from its first token (rotary ones need not: their scores depend on position
    /// differences only), so each sequence gives what it gives alone.
    pub padding: Vec<usize>,
}

impl DecodeCache {
    /// Empty caches for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![KvCache::new(); n_layers],
            padding: Vec::new(),
        }
    }

    /// An empty cache for a batch of sequences left-padded by `padding` (one per sequence): the
    /// prompts of different lengths of batched generation.
    pub fn with_padding(padding: Vec<usize>) -> Self {
        Self {
            layers: Vec::new(),
            padding,
        }
    }

    /// The position ids `[s, b]` (row-major, sequence-major rows) of the next `s` positions of
    /// each of the `b` sequences: counted from each sequence's first token (0 for padding).
    pub fn positions(&self, s: usize, b: usize) -> Vec<usize> {
        let start = self.len();
        (0..s)
            .flat_map(|i| {
                (0..b).map(move |r| {
                    (start + i).saturating_sub(self.padding.get(r).copied().unwrap_or(0))
                })
            })
            .collect()
    }

    /// Positions cached (those of the first layer; every layer has as many).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The keys and values one attention layer has computed so far, for this rank's heads
/// (`[batch, local key / value heads, positions, head_dim]` each, keys rotated): what
/// incremental decoding reuses, so a new token costs one position's compute. Replicated key /
/// value heads are cached on every rank that uses them. With a sliding window of `w`, only the
/// last `w - 1` positions are kept (all the next query sees besides itself).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub(super) kv: Option<(Tensor<4>, Tensor<4>)>,
    /// Positions dropped from the front (outside every later query's window).
    pub(super) dropped: usize,
    /// Left padding of each sequence (the [`DecodeCache`]'s, which sets it).
    pub(crate) padding: Vec<usize>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions seen (the next one's index), kept or dropped past a sliding window.
    pub fn len(&self) -> usize {
        self.dropped + self.kept()
    }

    /// Positions kept.
    pub fn kept(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dims()[2])
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends new positions' keys and values; returns all those kept and how many of them come
    /// before the new ones.
    pub(super) fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>, usize) {
        let before = self.kept();
        let (k, v) = match self.kv.take() {
            Some((k0, v0)) => (Tensor::cat(vec![k0, k], 2), Tensor::cat(vec![v0, v], 2)),
            None => (k, v),
        };
        self.kv = Some((k.clone(), v.clone()));
        (k, v, before)
    }

    /// Keeps the last `n` positions only.
    pub(super) fn keep_last(&mut self, n: usize) {
        let kept = self.kept();
        if kept > n
            && let Some((k, v)) = self.kv.take()
        {
            // Copies, so the dropped positions' memory goes.
            let last = |x: Tensor<4>| crate::init::owned(x.narrow(2, kept - n, n));
            self.kv = (n > 0).then(|| (last(k), last(v)));
            self.dropped += kept - n;
        }
    }
}

/// The left padding of a batch's sequences, as the attention sees it.
pub(super) struct Padding {
    /// Per sequence.
    pub(super) rows: Vec<usize>,
    /// Position of the first key kept (a sliding window's cache drops the earlier ones).
    pub(super) first_key: usize,
}
