//! [`ParallelAttention`]: causal self-attention with its heads split over the tensor-parallel
//! group, the one attention of both models. Multi-head (the GPT: `n_kv_heads = n_heads`, biases,
//! learned positions added before it) and grouped-query (the Llama: fewer key / value heads,
//! sharded or replicated, rotary positions, no biases) are the same module.

use burn::backend::Dispatch;
use burn::config::Config;
use burn::module::Module;
use burn::nn::{RotaryEncoding, RotaryEncodingConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;

use crate::backend::{AttentionDropout, AttentionSpec, TpBackend};
use crate::dropout::{DropoutKey, tp_dropout};
use crate::error::check_divisible;
use crate::linear::{
    ColumnChunk, ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear,
    RowParallelLinearConfig, TpMode, TpSettings,
};
use crate::norm::TpRmsNorm;
use crate::reshard::{ParamLayout, Reshard};
use crate::{Result as TpResult, TpError};

/// Configuration of a [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    /// Model width.
    pub d_model: usize,
    /// Query heads (a multiple of tp); each rank computes `n_heads / tp` of them.
    pub n_heads: usize,
    /// Key / value heads: `None` for as many as query heads (multi-head attention); else a
    /// divisor of `n_heads` that is a multiple of tp (sharded) or a divisor of tp (replicated:
    /// each rank keeps the one its query heads use, the gradients summed over those ranks).
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Size of each head: `None` for `d_model / n_heads`; else any (Qwen3, Mistral NeMo: the
    /// projections are `d_model -> n_heads head_dim` and back).
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Rotary positions with this base (Burn's `RotaryEncoding`, over `max_seq` positions); `None`
    /// for none (positions added to the embeddings instead).
    #[config(default = "None")]
    pub rope_theta: Option<f32>,
    /// Longest sequence: the rotary table's length (only with `rope_theta`).
    #[config(default = 0)]
    pub max_seq: usize,
    /// Llama 3's scaling of the rotary frequencies (only with `rope_theta`).
    #[config(default = "None")]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Biases on the q, k and v projections (the GPT's, Qwen2's).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// RMSNorm, with this epsilon, on each head's queries and keys before the rotation (Qwen3's
    /// `q_norm` and `k_norm`: one `[head_dim]` weight each, shared by every head); `None` for none.
    #[config(default = "None")]
    pub qk_norm: Option<f64>,
    /// A sliding window (Mistral's, Phi-3's): each query sees itself and the `window - 1` keys
    /// before it, and the KV cache keeps only those; `None` for the whole causal past.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// A bias on the output projection (the GPT's).
    #[config(default = false)]
    pub out_bias: bool,
    /// One fused QKV projection (full columns `[q: n_heads | k: n_kv_heads | v: n_kv_heads] x
    /// head_dim`, contiguous chunks each sharded on its own) instead of three.
    #[config(default = true)]
    pub fused_qkv: bool,
    /// Dropout of the attention probabilities (with the dropout key of a training step).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// Llama 3's scaling of the rotary frequencies (Hugging Face's `rope_scaling` / `rope_parameters`
/// of type `llama3`; Llama 3.1 - 3.3): wavelengths shorter than
/// `original_max_position_embeddings / high_freq_factor` are kept, those longer than
/// `original_max_position_embeddings / low_freq_factor` divided by `factor`, and those between
/// interpolated smoothly between the two.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// How much longer the context is than the one trained at first.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context the model was first trained at.
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// The scaled inverse frequencies of `freqs` (`[head_dim / 2]`), as transformers'
    /// `_compute_llama3_parameters`.
    pub fn apply(&self, freqs: Tensor<1>) -> Tensor<1> {
        let device = freqs.device();
        let values: Vec<f64> = freqs
            .into_data()
            .convert::<f64>()
            .try_to_vec::<f64>()
            .expect("f64 values");
        let old = self.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (old / self.low_freq_factor, old / self.high_freq_factor);
        let scaled: Vec<f32> = values
            .iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let f = if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / self.factor
                } else {
                    let smooth = (old / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * f / self.factor + smooth * f
                };
                f as f32
            })
            .collect();
        let n = scaled.len();
        Tensor::from_data(burn::tensor::TensorData::new(scaled, [n]), &device)
    }
}

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
}

impl ParallelAttentionConfig {
    fn n_kv(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// `head_dim`, or `d_model / n_heads`.
    fn head_size(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Checks the head counts and widths against `tp` (before any communication).
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] / [`TpError::Config`] naming the values.
    pub(crate) fn validate(&self, tp: usize) -> TpResult<()> {
        check_divisible("ParallelAttention n_heads", self.n_heads, tp)?;
        let (h, kv, d) = (self.n_heads, self.n_kv(), self.d_model);
        if kv == 0 || !h.is_multiple_of(kv) {
            return Err(TpError::Config(format!(
                "ParallelAttention: n_kv_heads = {kv} must divide n_heads = {h}"
            )));
        }
        if !(kv.is_multiple_of(tp) || tp.is_multiple_of(kv)) {
            return Err(TpError::Config(format!(
                "ParallelAttention: n_kv_heads = {kv} at tp = {tp}: one must divide the other"
            )));
        }
        if self.head_dim.is_none() && !d.is_multiple_of(h) {
            return Err(TpError::Config(format!(
                "ParallelAttention: d_model = {d} is not divisible by n_heads = {h} (or give \
                 head_dim)"
            )));
        }
        let hd = self.head_size();
        if hd == 0 {
            return Err(TpError::Config("ParallelAttention: head_dim = 0".into()));
        }
        if let Some(r) = self.rope_scaling
            && !(r.factor > 0.0
                && r.low_freq_factor > 0.0
                && r.high_freq_factor > r.low_freq_factor
                && r.original_max_position_embeddings > 0)
        {
            return Err(TpError::Config(format!(
                "ParallelAttention: rope_scaling needs factor > 0, 0 < low_freq_factor < \
                 high_freq_factor and original_max_position_embeddings > 0 (got {r:?})"
            )));
        }
        if self.sliding_window == Some(0) {
            return Err(TpError::Config(
                "ParallelAttention: sliding_window = 0 (each query must see itself)".into(),
            ));
        }
        if self.rope_theta.is_some() && (!hd.is_multiple_of(2) || self.max_seq == 0) {
            return Err(TpError::Config(format!(
                "ParallelAttention: rotary positions need an even head_dim (got {hd}) and \
                 max_seq > 0 (got {})",
                self.max_seq
            )));
        }
        Ok(())
    }

    /// Initializes this rank's heads (the full projections Burn's `LinearConfig` gives at
    /// tp = 1, sharded). Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] / [`TpError::Config`] for head counts that do not fit tp; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelAttention> {
        self.validate(group.world_size())?;
        let (h, kv) = (self.n_heads, self.n_kv());
        let hd = self.head_size();
        let chunk = |heads: usize| ColumnChunk::new(heads * hd).with_blocks(Some(heads));
        let column = |chunks: Vec<ColumnChunk>| {
            let width = chunks.iter().map(|c| c.width).sum();
            ColumnParallelLinearConfig::new(self.d_model, width)
                .with_bias(self.qkv_bias)
                .with_chunks(chunks)
                .with_settings(self.settings)
                .init(group, device)
        };
        let qkv = if self.fused_qkv {
            vec![column(vec![chunk(h), chunk(kv), chunk(kv)])?]
        } else {
            vec![
                column(vec![chunk(h)])?,
                column(vec![chunk(kv)])?,
                column(vec![chunk(kv)])?,
            ]
        };
        let out = RowParallelLinearConfig::new(h * hd, self.d_model)
            .with_bias(self.out_bias)
            .with_settings(self.settings)
            .init(group, device)?;
        // Partial gradients in either mode (see the field): the REDUCE_SCATTER norm's rule.
        let head_norm = |eps: f64| TpRmsNorm::new(hd, eps, TpMode::ReduceScatter, group, device);
        Ok(ParallelAttention {
            qkv,
            out,
            q_norm: self.qk_norm.map(head_norm),
            k_norm: self.qk_norm.map(head_norm),
            rope: self.rope_theta.map(|theta| {
                let config = RotaryEncodingConfig::new(self.max_seq, hd).with_theta(theta);
                match self.rope_scaling {
                    Some(scaling) => {
                        config.init_with_frequency_scaling(|f| scaling.apply(f), device)
                    }
                    None => config.init(device),
                }
            }),
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
            dropout: self.dropout,
            window: self.sliding_window,
        })
    }
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
        self.attend(q, k, v, 0, dropout, site, None)
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
        let tp = self.out.group().world_size();
        let hd = self.head_dim;
        let hq = self.n_heads / tp;
        let hkv = self.local_kv_heads(tp);
        // This rank's q, k and v columns, `[s, b, heads * hd]` over the full sequence.
        let (q, k, v) = if self.qkv.len() == 1 {
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
        let [s, b, _] = q.dims();
        // `[b, n, s, hd]`, each head normalized first where the model has q / k norms.
        let heads = |t: Tensor<3>, n: usize, norm: Option<&TpRmsNorm>| {
            let t = t.reshape([s, b, n, hd]);
            let t = match norm {
                Some(norm) => norm.forward(t),
                None => t,
            };
            t.permute([1, 2, 0, 3])
        };
        // The rotation in the rotary table's dtype (f32; it is a constant, not a parameter, so a
        // bf16 copy of the model keeps it), back to the activations' dtype after.
        let rotate = |t: Tensor<4>| match &self.rope {
            Some(rope) => {
                let dtype = t.dtype();
                rope.apply(t.cast(rope.freq_complex.dtype()), start)
                    .cast(dtype)
            }
            None => t,
        };
        Ok((
            rotate(heads(q, hq, self.q_norm.as_ref())),
            rotate(heads(k, hkv, self.k_norm.as_ref())),
            heads(v, hkv, None),
        ))
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
        let tp = self.out.group().world_size();
        let rank = self.out.group().rank();
        let hd = self.head_dim;
        let hq = self.n_heads / tp;
        let hkv = self.local_kv_heads(tp);
        let [b, _, s, _] = q.dims();
        let t = k.dims()[2];
        // Which keys each query sees, for either path: one rule (`AttentionSpec::sees`).
        let spec = AttentionSpec {
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
                }
            }),
            window: self.window,
            block: self.out.spec().settings.attention_tile,
            // Relative to the first key kept.
            padding: padding.map_or_else(Vec::new, |p| {
                p.rows
                    .iter()
                    .map(|&r| r.saturating_sub(p.first_key))
                    .collect()
            }),
            ..AttentionSpec::causal(start)
        };
        if self.out.spec().settings.fused_attention {
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
        let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
        // One mask per sequence with padding, else one for all.
        let masks = if spec.padding.is_empty() { 1 } else { b };
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
    kv: Option<(Tensor<4>, Tensor<4>)>,
    /// Positions dropped from the front (outside every later query's window).
    dropped: usize,
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
    fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>, usize) {
        let before = self.kept();
        let (k, v) = match self.kv.take() {
            Some((k0, v0)) => (Tensor::cat(vec![k0, k], 2), Tensor::cat(vec![v0, v], 2)),
            None => (k, v),
        };
        self.kv = Some((k.clone(), v.clone()));
        (k, v, before)
    }

    /// Keeps the last `n` positions only.
    fn keep_last(&mut self, n: usize) {
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
struct Padding {
    /// Per sequence.
    rows: Vec<usize>,
    /// Position of the first key kept (a sliding window's cache drops the earlier ones).
    first_key: usize,
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

/// Causal attention without the `[s, t]` score matrix (FlashAttention-2, the backend's
/// `tp_attention`; its backward recomputes each block's probabilities): `q` `[b, hq, s, hd]`
/// over `k`, `v` `[b, hkv, t, hd]`, query `i` at position `spec.start + i` seeing keys
/// `0 ..= spec.start + i`; each key / value head serves `hq / hkv` consecutive query heads
/// (never repeated in memory). Returns `[b, hq, s, hd]` in q's dtype (computed in f32).
///
/// # Errors
/// [`TpError::Shape`] naming the shapes: other batch or head sizes, `hkv` not dividing `hq`,
/// fewer keys than `spec.start + s`.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    spec: AttentionSpec,
) -> TpResult<Tensor<4>> {
    let ([b, hq, s, hd], [kb, hkv, t, khd], vd) = (q.dims(), k.dims(), v.dims());
    if kb != b
        || khd != hd
        || vd != [b, hkv, t, hd]
        || hkv == 0
        || !hq.is_multiple_of(hkv)
        || t < spec.start + s
        || spec.block == 0
        || !(spec.padding.is_empty() || spec.padding.len() == b)
    {
        return Err(TpError::Shape {
            op: "fused_attention",
            expected: format!(
                "q [b, hq, s, hd], k and v [b, hkv, t, hd] with hkv dividing hq and t >= start \
                 + s = {}, one padding per sequence or none (k {:?}, v {vd:?}, block {}, padding \
                 {:?})",
                spec.start + s,
                k.dims(),
                spec.block,
                spec.padding
            ),
            got: q.dims().to_vec(),
        });
    }
    Ok(Tensor::from_dispatch(
        <Dispatch as TpBackend>::tp_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            spec,
        ),
    ))
}
