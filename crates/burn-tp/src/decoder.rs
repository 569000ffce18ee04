//! What the GPT and the Llama share around their blocks, written once: the logits (their own
//! head, or the embedding's weight when tied) and the incremental decode loop over a
//! [`DecodeCache`].

use burn::tensor::Tensor;

use crate::Result as TpResult;
use crate::attention::{DecodeCache, KvCache, ParallelAttention};
use crate::embedding::{VocabParallelEmbedding, VocabParallelHead};
use crate::linear::{LinearSpec, TpSettings};

/// A pre-norm block: `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`.
pub(crate) trait DecoderBlock {
    /// The block's attention.
    fn attention(&self) -> &ParallelAttention;
    /// The norm before the attention.
    fn attn_norm(&self, x: Tensor<3>) -> Tensor<3>;
    /// The norm before the MLP.
    fn mlp_norm(&self, x: Tensor<3>) -> Tensor<3>;
    /// The MLP.
    fn mlp(&self, x: Tensor<3>) -> TpResult<Tensor<3>>;

    /// The block over new positions after those in `kv` (which they join).
    fn try_forward_cached(&self, x: Tensor<3>, kv: &mut KvCache) -> TpResult<Tensor<3>> {
        let a = self
            .attention()
            .try_forward_cached(self.attn_norm(x.clone()), kv)?;
        let x = x + a;
        let m = self.mlp(self.mlp_norm(x.clone()))?;
        Ok(x + m)
    }
}

/// A decoder-only language model's parts around its blocks.
pub(crate) trait Decoder {
    /// The model's block.
    type Block: DecoderBlock;

    /// The vocabulary-parallel embedding (the head's weight when tied).
    fn embedding(&self) -> &VocabParallelEmbedding;
    /// The lm-head; `None` when tied to the embedding.
    fn head(&self) -> Option<&VocabParallelHead>;
    /// The blocks, in order.
    fn blocks(&self) -> &[Self::Block];
    /// The norm after the last block.
    fn final_norm(&self, x: Tensor<3>) -> Tensor<3>;
    /// How the parallel layers run.
    fn settings(&self) -> TpSettings;

    /// Vocab-sharded logits `[s(/tp), batch, d_model] -> [s, batch, V_p / tp]` of the last
    /// block's output: the final norm, then the head (or the embedding's weight, tied).
    fn logits(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let x = self.final_norm(x);
        match self.head() {
            Some(head) => head.try_forward(x),
            None => self
                .embedding()
                .try_tied_logits(x, LinearSpec::new(self.settings())),
        }
    }

    /// Positions already in `cache`, after making it this model's (one cache per block; a cache
    /// of another model is started afresh).
    fn cached_positions(&self, cache: &mut DecodeCache) -> usize {
        if cache.layers.len() != self.blocks().len() {
            let padding = std::mem::take(&mut cache.padding);
            *cache = DecodeCache::new(self.blocks().len());
            cache.padding = padding;
        }
        cache.len()
    }

    /// Logits of the embedded new positions `x` (`[s_new, batch, d_model]`) after those in
    /// `cache`, which they join (see [`cached_positions`](Self::cached_positions)); of the last
    /// one only (`[1, batch, V_p / tp]`) with `last_only`, as generation needs.
    fn decode(
        &self,
        mut x: Tensor<3>,
        cache: &mut DecodeCache,
        last_only: bool,
    ) -> TpResult<Tensor<3>> {
        self.cached_positions(cache);
        for (block, kv) in self.blocks().iter().zip(&mut cache.layers) {
            kv.padding.clone_from(&cache.padding);
            x = block.try_forward_cached(x, kv)?;
        }
        if last_only {
            let s = x.dims()[0];
            x = x.narrow(0, s - 1, 1);
        }
        self.logits(x)
    }
}
