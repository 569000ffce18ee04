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
    /// Keys and values `[b, h, capacity, hd]`, positions `first..first + kept` filled: the
    /// buffers grow by doubling and take each new position in place, instead of being copied
    /// whole at every step (a concatenation per token); a sliding window moves `first` on, and
    /// the kept positions move to the front only when the buffers are full.
    pub(super) kv: Option<(Tensor<4>, Tensor<4>)>,
    /// The buffers' first kept position.
    first: usize,
    /// Positions kept.
    kept: usize,
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
        self.kept
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends new positions' keys and values; returns all those kept (views of the buffers)
    /// and how many of them come before the new ones.
    pub(super) fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>, usize) {
        let (first, before) = (self.first, self.kept);
        let [b, h, s, hd] = k.dims();
        let need = before + s;
        let (kb, vb) = match self.kv.take() {
            // Room left: written in place (the buffers' only owner once the last step's views
            // are dropped; Flex copies otherwise, as a concatenation would).
            Some((kb, vb)) if kb.dims()[2] >= first + need => {
                let at = [0..b, 0..h, first + before..first + need, 0..hd];
                (kb.slice_assign(at.clone(), k), vb.slice_assign(at, v))
            }
            // Full: what is kept and the new positions moved to the front of buffers twice
            // that size, one copy amortized over the steps that fill the rest.
            held => {
                let grow = |old: Option<Tensor<4>>, new: Tensor<4>| {
                    let spare = Tensor::<4>::zeros([b, h, need, hd], (&new.device(), new.dtype()));
                    let mut parts = Vec::with_capacity(3);
                    if let Some(old) = old {
                        parts.push(old.narrow(2, first, before));
                    }
                    parts.extend([new, spare]);
                    Tensor::cat(parts, 2)
                };
                let (k0, v0) = held.unzip();
                self.first = 0;
                (grow(k0, k), grow(v0, v))
            }
        };
        self.kept = need;
        let view = |t: &Tensor<4>| t.clone().narrow(2, self.first, need);
        let (k, v) = (view(&kb), view(&vb));
        self.kv = Some((kb, vb));
        (k, v, before)
    }

    /// Keeps the last `n` positions only (no copy: the buffers' front is reused when they
    /// fill, so they stay within twice the window).
    pub(super) fn keep_last(&mut self, n: usize) {
        if self.kept > n {
            let drop = self.kept - n;
            self.first += drop;
            self.kept = n;
            self.dropped += drop;
            if n == 0 {
                (self.kv, self.first) = (None, 0);
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn positions(start: usize, s: usize) -> Tensor<4> {
        let v: Vec<f32> = (0..2 * 3 * s * 4)
            .map(|i| (start * 1000 + i) as f32)
            .collect();
        Tensor::from_data(TensorData::new(v, [2, 3, s, 4]), &Device::flex())
    }

    fn values(t: Tensor<4>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// Appends (a prompt, then one position at a time, past each growth) give what
    /// concatenating gives; a clone taken midway keeps its own positions while the original
    /// goes on writing in place; a sliding window keeps the last positions, step after step
    /// (through the moves to the buffers' front), in buffers of at most twice the window.
    #[test]
    fn appends_in_place_equal_concatenation_and_clones_do_not_share_writes() {
        let mut cache = KvCache::new();
        let mut want_k = positions(0, 5);
        let (k, _, before) = cache.append(want_k.clone(), want_k.clone() * 2.0);
        assert_eq!((before, cache.kept()), (0, 5));
        assert_eq!(values(k), values(want_k.clone()));
        let mut snapshot = None;
        for step in 1..=12 {
            let new = positions(step, 1);
            want_k = Tensor::cat(vec![want_k, new.clone()], 2);
            let (k, v, before) = cache.append(new.clone(), new * 2.0);
            assert_eq!(before, 4 + step);
            assert_eq!(values(k), values(want_k.clone()), "keys after step {step}");
            assert_eq!(
                values(v),
                values(want_k.clone() * 2.0),
                "values after step {step}"
            );
            if step == 3 {
                snapshot = Some((cache.clone(), want_k.clone()));
            }
        }
        let (mut clone, at_3) = snapshot.unwrap();
        let (k, _, before) = clone.append(positions(99, 1), positions(99, 1));
        assert_eq!(before, 8);
        let want = Tensor::cat(vec![at_3, positions(99, 1)], 2);
        assert_eq!(values(k), values(want), "the clone's own positions");
        cache.keep_last(4);
        assert_eq!((cache.kept(), cache.len()), (4, 17));
        let (k, _, before) = cache.append(positions(50, 1), positions(50, 1));
        assert_eq!(before, 4);
        let mut want = Tensor::cat(vec![want_k.narrow(2, 13, 4), positions(50, 1)], 2);
        assert_eq!(values(k), values(want.clone()), "the window's positions");
        for step in 51..80 {
            cache.keep_last(4);
            want = want.narrow(2, 1, 4);
            let new = positions(step, 1);
            want = Tensor::cat(vec![want, new.clone()], 2);
            let (k, _, before) = cache.append(new.clone(), new);
            assert_eq!(before, 4);
            assert_eq!(values(k), values(want.clone()), "window keys at {step}");
        }
        assert_eq!(cache.len(), 17 + 30);
        // Moved to the front of buffers of twice the window and its new position.
        assert_eq!(cache.kv.as_ref().unwrap().0.dims()[2], 2 * 5);
    }
}
