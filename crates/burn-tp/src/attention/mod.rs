//! [`ParallelAttention`]: causal self-attention with its heads split over the tensor-parallel
//! group, the one attention of both models. Multi-head (the GPT: `n_kv_heads = n_heads`, biases,
//! learned positions added before it) and grouped-query (the Llama: fewer key / value heads,
//! sharded or replicated, rotary positions, no biases) are the same module.
//!
//! | file         | what                                                                      |
//! |--------------|---------------------------------------------------------------------------|
//! | `mod.rs`     | [`ParallelAttention`]: the projections, the heads, either kernel           |
//! | `config.rs`  | [`ParallelAttentionConfig`]: sizes checked against tp, initialisation; burn-nn's `MultiHeadAttention` in and out |
//! | `input.rs`   | [`AttentionInput`]: self- or cross-attention with key padding               |
//! | `rotary.rs`  | rotary positions, [`Llama3RopeScaling`]                                    |
//! | `cache.rs`   | [`DecodeCache`], [`KvCache`]: incremental decoding, left padding           |
//! | `kernel.rs`  | [`fused_attention`]: the tiled kernel on `Tensor`s                         |
//!
//! Which keys a query sees (causal, window, padding) is one rule,
//! [`AttentionSpec`]'s, used by both kernels and by the
//! materialized path here.

mod cache;
mod config;
mod input;
mod kernel;
mod rotary;

use burn::module::Module;
use burn::nn::RotaryEncoding;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;

pub use cache::{DecodeCache, KvCache};
pub use config::{LayerType, ParallelAttentionConfig};
pub use input::AttentionInput;

pub use kernel::fused_attention;
pub use rotary::Llama3RopeScaling;

use crate::backend::{AttentionDropout, AttentionSpec};
use crate::context::ContextParallel;
use crate::dropout::{DropoutKey, tp_dropout};
use crate::linear::{ColumnParallelLinear, RowParallelLinear, TpMode};
use crate::norm::TpRmsNorm;
use crate::reshard::{ParamLayout, Reshard};
use crate::{Result as TpResult, TpError};
use cache::Padding;

/// Causal self-attention with heads split over the tensor-parallel group: the QKV projection
/// column-parallel (each rank computes its query heads and the key / value heads they use),
/// attention per local head, the output projection row-parallel.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// `[qkv]` (fused: `d_model -> (n_heads + 2 n_kv_heads) head_dim`, this rank's heads of each
    /// chunk) or `[q, k, v]` (each `d_model -> heads head_dim`, this rank's heads).
    pub qkv: Vec<ColumnParallelLinear>,
    /// `n_heads head_dim / tp -> d_model`.
    pub out: RowParallelLinear,
    /// RMSNorm of each query head (`[head_dim]`, replicated), with `qk_norm`. Each rank
    /// normalizes its own heads, so the weight's gradient is summed over the group in either
    /// mode (built in REDUCE_SCATTER mode for that, as a sequence shard's norm; a replicated key
    /// / value head's ranks each add the part their own query heads give it).
    pub q_norm: Option<TpRmsNorm>,
    /// RMSNorm of each key head (`[head_dim]`, replicated), as `q_norm`.
    pub k_norm: Option<TpRmsNorm>,
    /// Rotary table `[max_seq, head_dim]` (a constant, not a parameter), with rotary positions.
    pub rope: Option<RotaryEncoding>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dropout: f64,
    window: Option<usize>,
    /// The scores' scale (`None`: `1 / sqrt(head_dim)`).
    scale: Option<f64>,
    /// The scores' soft cap, if any.
    softcap: Option<f64>,
    /// Whether a query sees only the positions up to its own (a decoder's), or every key.
    causal: bool,
    /// How its scores are computed: the attention's own setting, from `TpSettings` at init.
    #[module(skip)]
    kernel: Kernel,
    /// The context-parallel ring its sequences are split over, if any
    /// ([`set_context_parallel`](Self::set_context_parallel)).
    #[module(skip)]
    context: Option<ContextParallel>,
}

/// How an attention layer computes its scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// By tiles of `tile` rows and columns, never the `[s, t]` scores (FlashAttention-2).
    Fused { tile: usize },
    /// The scores, mask, softmax and probabilities as tracked ops, each kept for the backward.
    Materialized,
}

impl ParallelAttention {
    /// Query heads over all ranks.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Key / value heads over all ranks.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// The sliding window, if any.
    pub fn sliding_window(&self) -> Option<usize> {
        self.window
    }

    /// Splits every sequence over `context`'s ranks (`None`: each rank holds whole
    /// sequences): [`try_forward`](Self::try_forward)'s `x` is then this rank's chunks of it
    /// (`[seq / cp (/tp), b, d_model]`, in [`ContextParallel::chunks`]' order), rotated at their
    /// global positions, attending over the whole sequence by ring attention (the fused
    /// kernel's, whatever the kernel setting).
    pub fn set_context_parallel(&mut self, context: Option<ContextParallel>) {
        self.context = context;
    }

    /// The context-parallel ring, if any.
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.context.as_ref()
    }

    /// The positions its rotary table covers (`max_seq`); `None` without rotary positions.
    pub fn max_positions(&self) -> Option<usize> {
        self.rope.as_ref().map(|r| r.freq_complex.dims()[0])
    }

    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` (sharded on dim 0 in REDUCE_SCATTER mode),
    /// without dropout.
    ///
    /// # Panics
    /// As the linears' `forward`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.try_forward(x, None, 0)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Forward; with `dropout = Some(key)`, the attention probabilities are dropped with the
    /// logical mask of site `site` (`[global batch, n_heads, s, s]`: this rank's sequences and
    /// heads), so the masks are the same at every tp and dp.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(
        &self,
        x: Tensor<3>,
        dropout: Option<DropoutKey>,
        site: u64,
    ) -> TpResult<Tensor<3>> {
        let (q, k, v) = self.project(x, 0)?;
        let Some(ctx) = &self.context else {
            return self.attend(q, k, v, 0, dropout, site, None);
        };
        if !self.causal {
            return Err(TpError::Config(format!(
                "ParallelAttention: a non-causal attention over a sequence split over cp {} \
                 ranks is not supported (ring attention is causal)",
                ctx.size()
            )));
        }
        // The chunks of the whole sequence this rank holds, rotated at their own positions.
        let seq = q.dims()[2] * ctx.size();
        let chunks = ctx.chunks(seq)?;
        if let Some(table) = self.max_positions()
            && seq > table
        {
            return Err(TpError::Config(format!(
                "ParallelAttention: a sequence of {seq} positions (cp {} x {}) past the rotary \
                 table's {table}",
                ctx.size(),
                seq / ctx.size()
            )));
        }
        let at_chunks = |t: Tensor<4>| {
            let parts = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| self.rotate(t.clone().narrow(2, i * c.len(), c.len()), c.start))
                .collect();
            Tensor::cat(parts, 2)
        };
        let (q, k) = match self.rope {
            Some(_) => (at_chunks(q), at_chunks(k)),
            None => (q, k),
        };
        let [b, _, s, _] = q.dims();
        let spec = self.spec(b, dropout, site, 0, None);
        let ctx_out = ctx.attention(q, k, v, spec)?;
        let hq = self.n_heads / self.out.group().world_size();
        let y = ctx_out
            .permute([2, 0, 1, 3])
            .reshape([s, b, hq * self.head_dim]);
        self.out.try_forward(y)
    }

    /// Forward of new positions after those in `cache` (incremental decoding): `x` is
    /// `[s_new, b, d_model]`, every position on every rank (ALL_REDUCE mode); their keys and
    /// values join this rank's heads' cache, and each attends to every cached position before it
    /// (with a sliding window, to those in its window: the cache then keeps `window - 1`).
    ///
    /// # Errors
    /// [`TpError::Config`] in REDUCE_SCATTER mode (a new token cannot be split over the
    /// sequence: build the model in ALL_REDUCE mode to generate); positions past the rotary
    /// table; as [`forward`](Self::forward)'s panics.
    pub fn try_forward_cached(&self, x: Tensor<3>, cache: &mut KvCache) -> TpResult<Tensor<3>> {
        if self.out.spec().settings.mode != TpMode::AllReduce {
            return Err(TpError::Config(
                "ParallelAttention: incremental decoding runs in ALL_REDUCE mode (a new token \
                 cannot be split over the sequence): build the model with TpMode::AllReduce"
                    .into(),
            ));
        }
        if !self.causal {
            return Err(TpError::Config(
                "ParallelAttention: incremental decoding of a non-causal attention (every key \
                 seen): decode with a causal one"
                    .into(),
            ));
        }
        if let Some(ctx) = &self.context {
            return Err(TpError::Config(format!(
                "ParallelAttention: incremental decoding of a sequence split over cp {} ranks: \
                 decode with the context-parallel ring unset (set_context_parallel(None))",
                ctx.size()
            )));
        }
        let start = cache.len();
        let [s, _, _] = x.dims();
        if let Some(rope) = &self.rope {
            let table = rope.freq_complex.dims()[0];
            if start + s > table {
                return Err(TpError::Config(format!(
                    "ParallelAttention: positions {start}..{} past the rotary table's {table}",
                    start + s
                )));
            }
        }
        let padding = cache.padding.iter().any(|&p| p > 0).then(|| Padding {
            rows: cache.padding.clone(),
            first_key: cache.dropped,
        });
        if let Some(p) = &padding
            && p.rows.len() != x.dims()[1]
        {
            return Err(TpError::Shape {
                op: "ParallelAttention::try_forward_cached",
                expected: format!(
                    "[s_new, batch = {} (the cache's padded sequences), d_model]",
                    p.rows.len()
                ),
                got: x.dims().to_vec(),
            });
        }
        // Rotary positions stay the batch's (a padded row's shifted by its padding): the scores
        // depend on position differences only, so each row scores as it would alone.
        let (q, k, v) = self.project(x, start)?;
        let (k, v, before) = cache.append(k, v);
        let out = self.attend(q, k, v, before, None, 0, padding.as_ref())?;
        if let Some(w) = self.window {
            cache.keep_last(w - 1);
        }
        Ok(out)
    }

    /// This rank's q `[b, hq, s, hd]` and k, v `[b, hkv, s, hd]` of `x` (`[s, b, d_model]`),
    /// q and k rotated for positions `start..start + s`.
    fn project(&self, x: Tensor<3>, start: usize) -> TpResult<(Tensor<4>, Tensor<4>, Tensor<4>)> {
        self.project_from(x, None, start)
    }

    /// [`project`](Self::project), the keys and values of `memory` (`[t, b, d_model]`) where
    /// given (cross-attention: the separate q, k and v projections).
    fn project_from(
        &self,
        x: Tensor<3>,
        memory: Option<Tensor<3>>,
        start: usize,
    ) -> TpResult<(Tensor<4>, Tensor<4>, Tensor<4>)> {
        let tp = self.out.group().world_size();
        let hd = self.head_dim;
        let hq = self.n_heads / tp;
        let hkv = self.local_kv_heads(tp);
        // This rank's q, k and v columns, `[s, b, heads * hd]` over the full sequence.
        let (q, k, v) = if let Some(memory) = memory {
            (
                self.qkv[0].try_forward(x)?,
                self.qkv[1].try_forward(memory.clone())?,
                self.qkv[2].try_forward(memory)?,
            )
        } else if self.qkv.len() == 1 {
            let y = self.qkv[0].try_forward(x)?;
            (
                y.clone().narrow(2, 0, hq * hd),
                y.clone().narrow(2, hq * hd, hkv * hd),
                y.narrow(2, (hq + hkv) * hd, hkv * hd),
            )
        } else {
            (
                self.qkv[0].try_forward(x.clone())?,
                self.qkv[1].try_forward(x.clone())?,
                self.qkv[2].try_forward(x)?,
            )
        };
        let [_, b, _] = q.dims();
        // `[b, n, s, hd]`, each head normalized first where the model has q / k norms.
        let heads = |t: Tensor<3>, n: usize, norm: Option<&TpRmsNorm>| {
            let s = t.dims()[0];
            let t = t.reshape([s, b, n, hd]);
            let t = match norm {
                Some(norm) => norm.forward(t),
                None => t,
            };
            t.permute([1, 2, 0, 3])
        };
        // Rotated here for whole sequences; a context-parallel rank's chunks each by theirs.
        let rotate = |t: Tensor<4>| match self.context {
            None => self.rotate(t, start),
            Some(_) => t,
        };
        Ok((
            rotate(heads(q, hq, self.q_norm.as_ref())),
            rotate(heads(k, hkv, self.k_norm.as_ref())),
            heads(v, hkv, None),
        ))
    }

    /// `t` (`[b, h, s, hd]`) rotated for positions `start..start + s` (none without rotary
    /// positions), in the rotary table's dtype (f32; it is a constant, not a parameter, so a
    /// bf16 copy of the model keeps it), back to the activations' dtype after.
    fn rotate(&self, t: Tensor<4>, start: usize) -> Tensor<4> {
        match &self.rope {
            Some(rope) => {
                let dtype = t.dtype();
                rope.apply(t.cast(rope.freq_complex.dtype()), start)
                    .cast(dtype)
            }
            None => t,
        }
    }

    /// Which keys each query of `b` sequences sees from position `start` (either path's
    /// one rule, `AttentionSpec::sees`), and the dropout of site `site`.
    fn spec(
        &self,
        b: usize,
        dropout: Option<DropoutKey>,
        site: u64,
        start: usize,
        padding: Option<&Padding>,
    ) -> AttentionSpec {
        let tp = self.out.group().world_size();
        let rank = self.out.group().rank();
        let hq = self.n_heads / tp;
        AttentionSpec {
            dropout: dropout.filter(|_| self.dropout > 0.0).map(|key| {
                let (batch_total, batch) = key.batch(b);
                AttentionDropout {
                    p: self.dropout,
                    key,
                    site,
                    batch_total,
                    batch,
                    heads_total: self.n_heads,
                    heads: rank * hq..(rank + 1) * hq,
                    positions: None,
                }
            }),
            window: self.window,
            scale: self.scale,
            softcap: self.softcap,
            tile: match self.kernel {
                Kernel::Fused { tile } => tile,
                Kernel::Materialized => crate::backend::attention::mask::TILE,
            },
            // Relative to the first key kept.
            padding: padding.map_or_else(Vec::new, |p| {
                p.rows
                    .iter()
                    .map(|&r| r.saturating_sub(p.first_key))
                    .collect()
            }),
            causal: self.causal,
            ..AttentionSpec::causal(start)
        }
    }

    fn local_kv_heads(&self, tp: usize) -> usize {
        if self.n_kv_heads >= tp {
            self.n_kv_heads / tp
        } else {
            1
        }
    }

    /// Causal attention of the queries of positions `start..start + s` over the keys and values
    /// of positions `0..t` (`t = start + s`; positions counted from the first key kept), within
    /// the sliding window if any, no key of a sequence's left padding seen, then the output
    /// projection: `[s, b, d_model]`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        start: usize,
        dropout: Option<DropoutKey>,
        site: u64,
        padding: Option<&Padding>,
    ) -> TpResult<Tensor<3>> {
        let spec = self.spec(q.dims()[0], dropout, site, start, padding);
        self.attend_with(q, k, v, spec, dropout, site)
    }

    /// [`attend`](Self::attend) with the visibility and dropout of `spec`.
    fn attend_with(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        spec: AttentionSpec,
        dropout: Option<DropoutKey>,
        site: u64,
    ) -> TpResult<Tensor<3>> {
        let tp = self.out.group().world_size();
        let rank = self.out.group().rank();
        let hd = self.head_dim;
        let hq = self.n_heads / tp;
        let hkv = self.local_kv_heads(tp);
        let [b, _, s, _] = q.dims();
        let t = k.dims()[2];
        if let Kernel::Fused { .. } = self.kernel {
            let ctx = fused_attention(q, k, v, spec)?;
            let ctx = ctx.permute([2, 0, 1, 3]).reshape([s, b, hq * hd]);
            return self.out.try_forward(ctx);
        }
        // Each local key / value head serves `hq / hkv` consecutive local query heads.
        let group = hq / hkv;
        let expand = |x: Tensor<4>| {
            if group == 1 {
                return x;
            }
            x.unsqueeze_dim::<5>(2)
                .expand([b, hkv, group, t, hd])
                .reshape([b, hq, t, hd])
        };
        let (k, v) = (expand(k), expand(v));
        let scores = q.matmul(k.swap_dims(2, 3)) * spec.scale_for(hd);
        let scores = match spec.softcap {
            Some(cap) => scores.div_scalar(cap).tanh().mul_scalar(cap),
            None => scores,
        };
        // One mask per sequence with padding, else one for all.
        let masks =
            if spec.padding.is_empty() && spec.key_lengths.is_empty() && spec.key_mask.is_empty() {
                1
            } else {
                b
            };
        let spec = &spec;
        let hidden: Vec<bool> = (0..masks)
            .flat_map(|r| (0..s).flat_map(move |i| (0..t).map(move |j| !spec.sees(r, i, j))))
            .collect();
        let hidden = Tensor::<4, Bool>::from_data(
            TensorData::new(hidden, [masks, 1, s, t]),
            &scores.device(),
        );
        let att = softmax(scores.mask_fill(hidden, f32::NEG_INFINITY), 3);
        let (b_total, batch) = dropout.map_or((b, 0..b), |k| k.batch(b));
        let att = tp_dropout(
            att,
            self.dropout,
            dropout,
            site,
            [b_total, self.n_heads, s, t],
            [batch, rank * hq..(rank + 1) * hq, 0..s, 0..t],
        );
        let ctx = att.matmul(v).permute([2, 0, 1, 3]).reshape([s, b, hq * hd]);
        self.out.try_forward(ctx)
    }
}

impl crate::linear::InMode for ParallelAttention {
    fn in_mode(self, mode: TpMode) -> Self {
        Self {
            qkv: self.qkv.in_mode(mode),
            out: self.out.in_mode(mode),
            ..self
        }
    }
}

impl Reshard for ParallelAttention {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(Self {
            qkv: self.qkv.to_full_module()?,
            out: self.out.to_full_module()?,
            q_norm: self.q_norm.to_full_module()?,
            k_norm: self.k_norm.to_full_module()?,
            rope: self.rope.clone(),
            context: self.context.clone(),
            ..*self
        })
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(Self {
            qkv: Reshard::shard_module(&full.qkv, group)?,
            out: Reshard::shard_module(&full.out, group)?,
            q_norm: Reshard::shard_module(&full.q_norm, group)?,
            k_norm: Reshard::shard_module(&full.k_norm, group)?,
            rope: full.rope.clone(),
            context: full.context.clone(),
            ..*full
        })
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        // The rotary table is a constant, not a parameter.
        let mut out = self.qkv.layout(rank);
        out.extend(self.out.layout(rank));
        out.extend(self.q_norm.layout(rank));
        out.extend(self.k_norm.layout(rank));
        out
    }
}
