//! A decoder's block as the incremental decode loop of
//! [`LanguageModel`](crate::model::LanguageModel) sees it, and the bookkeeping of the blocks a
//! pipeline stage holds, written once for every model family.

use burn::tensor::Tensor;

use crate::Result as TpResult;
use crate::attention::{KvCache, ParallelAttention};

/// A pre-norm block, `[s, batch, d_model] -> [s, batch, d_model]`: `x +
/// post_attn(attn(attn_norm(x)))`, then `x + post_mlp(mlp(mlp_norm(x)))` (the post hooks the
/// identity but for Gemma's "sandwich" norms).
pub trait DecoderBlock {
    /// The block's attention.
    fn attention(&self) -> &ParallelAttention;
    /// The block's attention, to set what is not a parameter (the context-parallel ring).
    fn attention_mut(&mut self) -> &mut ParallelAttention;
    /// The norm before the attention.
    fn attn_norm(&self, x: Tensor<3>) -> Tensor<3>;
    /// The norm before the MLP.
    fn mlp_norm(&self, x: Tensor<3>) -> Tensor<3>;
    /// The MLP.
    fn mlp(&self, x: Tensor<3>) -> TpResult<Tensor<3>>;
    /// The attention's output before it joins the residual: itself, or a norm of it (Gemma's
    /// `post_attention_layernorm`).
    fn post_attn(&self, a: Tensor<3>) -> Tensor<3> {
        a
    }
    /// The MLP's output before it joins the residual: itself, or a norm of it (Gemma's
    /// `post_feedforward_layernorm`).
    fn post_mlp(&self, m: Tensor<3>) -> Tensor<3> {
        m
    }

    /// The block over new positions after those in `kv` (which they join).
    fn try_forward_cached(&self, x: Tensor<3>, kv: &mut KvCache) -> TpResult<Tensor<3>> {
        let a = self
            .attention()
            .try_forward_cached(self.attn_norm(x.clone()), kv)?;
        let x = x + self.post_attn(a);
        let m = self.mlp(self.mlp_norm(x.clone()))?;
        Ok(x + self.post_mlp(m))
    }
}

/// Keeps blocks `layers` (the whole model's indices, in order) of `blocks`, whose whole-model
/// indices are `ids` (a pipeline stage's: [`crate::model::LanguageModel::keep_layers`]).
///
/// # Panics
/// If a block of `layers` is not held, naming `model` and what it holds.
pub(crate) fn keep_blocks<B>(
    model: &str,
    blocks: &mut Vec<B>,
    ids: &mut Vec<usize>,
    layers: &[usize],
) {
    let mut held: Vec<Option<B>> = std::mem::take(blocks).into_iter().map(Some).collect();
    for &l in layers {
        let at = ids.iter().position(|&b| b == l);
        let at = at.unwrap_or_else(|| panic!("{model}: block {l} is not held (it holds {ids:?})"));
        blocks.push(held[at].take().expect("a block is kept once"));
    }
    *ids = layers.to_vec();
}

/// The block of whole-model index `index` among `blocks` (whose indices are `ids`).
///
/// # Errors
/// [`TpError::Config`](crate::TpError::Config) naming `model`, the block and what is held.
pub(crate) fn block_at<'a, B>(
    model: &str,
    blocks: &'a [B],
    ids: &[usize],
    index: usize,
) -> TpResult<&'a B> {
    let at = ids.iter().position(|&b| b == index);
    at.map(|i| &blocks[i]).ok_or_else(|| {
        crate::TpError::Config(format!(
            "{model}: block {index} is not on this stage (it holds {ids:?})"
        ))
    })
}

/// Draws every block of a model of `n_layers` in order (`make`, which draws block `i`), keeping
/// blocks `layers` (in that order) and dropping each other one at once: a pipeline stage's
/// blocks with the whole model's weights, never the whole model in memory.
///
/// # Errors
/// [`TpError::Config`](crate::TpError::Config) naming `model` and a block past `n_layers`; the
/// first error of `make`.
pub(crate) fn draw_blocks<B>(
    model: &str,
    n_layers: usize,
    layers: &[usize],
    mut make: impl FnMut() -> TpResult<B>,
) -> TpResult<Vec<B>> {
    check_layers(model, n_layers, layers)?;
    let mut drawn: Vec<Option<B>> = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let block = make()?;
        drawn.push(layers.contains(&i).then_some(block));
    }
    Ok(layers
        .iter()
        .map(|&l| drawn[l].take().expect("each block kept once"))
        .collect())
}

/// Every block of `layers` within a model of `n_layers`.
///
/// # Errors
/// [`TpError::Config`](crate::TpError::Config) naming `model` and the first block past it.
pub(crate) fn check_layers(model: &str, n_layers: usize, layers: &[usize]) -> TpResult<()> {
    match layers.iter().find(|&&l| l >= n_layers) {
        Some(l) => Err(crate::TpError::Config(format!(
            "{model}: block {l} of a model of {n_layers} blocks"
        ))),
        None => Ok(()),
    }
}
