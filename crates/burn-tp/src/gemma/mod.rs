//! The Gemma family (Gemma 2, and Gemma 3's text models, `gemma3_text`) with tensor
//! parallelism, on the
//! Llama's parallel pieces: grouped-query attention with rotary positions, a vocabulary-parallel
//! embedding and tied head, the fused gate / up column layer.
//!
//! What makes it Gemma, each as transformers computes it:
//! - RMSNorm scaling by `1 + w` (the weight stored as `w`, zeros at init; `1 + w` in f32):
//!   [`TpRmsNorm::with_offset`];
//! - four norms per block (the "sandwich"): `x + post_attn_norm(attn(input_norm(x)))`, then
//!   `x + post_mlp_norm(mlp(pre_mlp_norm(x)))`;
//! - GeGLU with the tanh GELU ([`GluActivation::GeluTanh`]);
//! - the embeddings multiplied by `sqrt(d_model)`, rounded to the model's dtype;
//! - the scores scaled by `query_pre_attn_scalar ** -0.5`, an explicit `head_dim`;
//! - per-head q / k norms (Gemma 3), themselves `1 + w`;
//! - per-layer attention types ([`LayerType`]): sliding-window layers with their own rotary base
//!   (`rope_local_theta`) and a KV cache that keeps only the window, full-attention layers with
//!   theirs (Gemma 3's 5 : 1 pattern by default); each type's rotary table shared by its layers;
//! - Gemma 2's soft caps, `cap * tanh(x / cap)`: of the attention scores (inside the attention
//!   kernels, forward and backward, never materializing the scores) and of the final logits.
//!
//! Activations are `[seq, batch, d_model]`, sharded on dim 0 between the parallel regions in
//! REDUCE_SCATTER mode, as the Llama's; the model is the same at every tp for one seed.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{DType, Device, Int, Tensor};
use burn_tp_comm::ProcessGroup;

pub use crate::attention::LayerType;
use crate::attention::{DecodeCache, ParallelAttention, ParallelAttentionConfig};
use crate::decoder::DecoderBlock;
use crate::dropout::{DropoutKey, DropoutStep, residual_dropout};
use crate::embedding::{VocabParallelEmbedding, VocabParallelEmbeddingConfig, VocabParallelHead};
use crate::linear::{InMode, LinearSpec, TpMode, TpSettings};
use crate::llama::{GluActivation, ParallelSwiGlu, ParallelSwiGluConfig};
use crate::loss::{CrossEntropyOptions, sequence_cross_entropy};
use crate::model::{LanguageModel, count_params};
use crate::norm::TpRmsNorm;
use crate::{Result as TpResult, TpError};

/// Configuration of a [`Gemma`].
#[derive(Config, Debug)]
pub struct GemmaConfig {
    /// Vocabulary size (any: padded to a multiple of `vocab_multiple * tp`).
    pub n_vocab: usize,
    /// Longest sequence.
    pub max_seq: usize,
    /// Model width.
    pub d_model: usize,
    /// Query heads (a multiple of tp).
    pub n_heads: usize,
    /// Key / value heads (divides `n_heads`; a multiple or a divisor of tp).
    pub n_kv_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// GeGLU hidden width (a multiple of tp).
    pub d_ff: usize,
    /// Size of each attention head (Gemma's are not `d_model / n_heads`).
    pub head_dim: usize,
    /// The scores are scaled by `query_pre_attn_scalar ** -0.5`; `None` for `head_dim`.
    #[config(default = "None")]
    pub query_pre_attn_scalar: Option<f64>,
    /// Rotary base of the full-attention layers.
    #[config(default = 1_000_000.0)]
    pub rope_theta: f32,
    /// Rotary base of the sliding-window layers.
    #[config(default = 10_000.0)]
    pub rope_local_theta: f32,
    /// The window of the sliding layers; `None`: they see the whole causal past too.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Each layer's attention type; empty for Gemma 3's pattern (every sixth layer full, the
    /// others sliding).
    #[config(default = "Vec::new()")]
    pub layer_types: Vec<LayerType>,
    /// RMSNorm epsilon.
    #[config(default = 1e-6)]
    pub norm_eps: f64,
    /// RMSNorm on each head's queries and keys before the rotation (Gemma 3).
    #[config(default = true)]
    pub qk_norm: bool,
    /// The logits soft-capped to `(-cap, cap)` by `cap * tanh(logits / cap)`; `None`: not.
    #[config(default = "None")]
    pub final_logit_softcap: Option<f64>,
    /// The attention scores soft-capped likewise (Gemma 2's `attn_logit_softcapping`); `None`:
    /// not.
    #[config(default = "None")]
    pub attn_logit_softcap: Option<f64>,
    /// Dropout of each residual branch, and of the attention probabilities unless
    /// `attention_dropout` says otherwise (0: none).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Dropout of the attention probabilities where it differs from `dropout`; `None`:
    /// `dropout`.
    #[config(default = "None")]
    pub attention_dropout: Option<f64>,
    /// Seed of the dropout masks.
    #[config(default = 0)]
    pub dropout_seed: u64,
    /// The padded vocabulary is a multiple of `vocab_multiple * tp`.
    #[config(default = 1)]
    pub vocab_multiple: usize,
    /// Reuse the embedding table as the lm-head (every Gemma does).
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// Targets equal to this id are ignored by the loss.
    #[config(default = "None")]
    pub ignore_index: Option<i64>,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// A Gemma block: `x + drop(post_attn_norm(attn(input_norm(x))))`, then
/// `x + drop(post_mlp_norm(mlp(pre_mlp_norm(x))))`, activations `[s(/tp), b, d_model]`.
#[derive(Module, Debug)]
pub struct GemmaBlock {
    /// Before the attention (`input_layernorm`).
    pub input_norm: TpRmsNorm,
    /// Grouped-query attention, over a window on sliding layers.
    pub attn: ParallelAttention,
    /// After the attention (`post_attention_layernorm`).
    pub post_attn_norm: TpRmsNorm,
    /// Before the MLP (`pre_feedforward_layernorm`).
    pub pre_mlp_norm: TpRmsNorm,
    /// GeGLU MLP.
    pub mlp: ParallelSwiGlu,
    /// After the MLP (`post_feedforward_layernorm`).
    pub post_mlp_norm: TpRmsNorm,
}

/// What a [`Gemma`] keeps of its config at run time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmaOptions {
    /// How the parallel layers run.
    pub settings: TpSettings,
    /// Residual dropout.
    pub dropout: f64,
    /// Seed of the dropout masks.
    pub dropout_seed: u64,
    /// The loss's ignore index.
    pub ignore_index: Option<i64>,
    /// The final logits' soft cap.
    pub final_logit_softcap: Option<f64>,
}

/// A Gemma model.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor, TensorData};
/// use burn_tp::gemma::{GemmaConfig, LayerType};
/// use burn_tp::local::run_local;
/// use burn_tp::model::LanguageModel;
///
/// let device = Device::flex().autodiff();
/// device.seed(0);
/// let losses = run_local(2, move |group| -> burn_tp::Result<f32> {
///     // 64 tokens, 4 query heads and 1 key / value head of 16, GeGLU width 64; a sliding
///     // layer (window 4) then a full one.
///     let model = GemmaConfig::new(64, 16, 32, 4, 1, 2, 64, 16)
///         .with_sliding_window(Some(4))
///         .with_layer_types(vec![LayerType::Sliding, LayerType::Full])
///         .init(&group, &device)?;
///     let ids = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [16, 2]), &device);
///     let x: Vec<i64> = (0..32).map(|i| i % 64).collect();
///     let y: Vec<i64> = (0..32).map(|i| (i + 1) % 64).collect();
///     let loss = LanguageModel::loss(&model, ids(x), ids(y), None)?;
///     Ok(loss.into_scalar())
/// })
/// .expect("no rank panicked");
/// assert_eq!(losses[0].as_ref().ok(), losses[1].as_ref().ok());
/// ```
#[derive(Module, Debug)]
pub struct Gemma {
    /// Token embedding, `[V_p / tp, d_model]` (scaled by `sqrt(d_model)` when read).
    pub tok: VocabParallelEmbedding,
    /// The blocks.
    pub blocks: Vec<GemmaBlock>,
    /// Final norm.
    pub norm: TpRmsNorm,
    /// lm-head `d_model -> V_p / tp` (absent when tied to `tok`, as in every Gemma).
    pub head: Option<VocabParallelHead>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    options: GemmaOptions,
    /// The whole model's index of each block held.
    #[module(skip)]
    block_ids: Vec<usize>,
}

impl GemmaConfig {
    /// Each layer's attention type: `layer_types`, or Gemma 3's pattern (every sixth full).
    ///
    /// # Errors
    /// [`TpError::Config`] for `layer_types` of another length than `n_layers`.
    pub fn layer_kinds(&self) -> TpResult<Vec<LayerType>> {
        if self.layer_types.is_empty() {
            return Ok((0..self.n_layers)
                .map(|i| match (i + 1) % 6 {
                    0 => LayerType::Full,
                    _ => LayerType::Sliding,
                })
                .collect());
        }
        if self.layer_types.len() != self.n_layers {
            return Err(TpError::Config(format!(
                "Gemma: {} layer_types for n_layers = {}",
                self.layer_types.len(),
                self.n_layers
            )));
        }
        Ok(self.layer_types.clone())
    }

    /// The attention of layers of type `kind`.
    fn attention(&self, kind: LayerType) -> ParallelAttentionConfig {
        let (theta, window) = match kind {
            LayerType::Sliding => (self.rope_local_theta, self.sliding_window),
            LayerType::Full => (self.rope_theta, None),
        };
        let scalar = self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64);
        ParallelAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(Some(self.n_kv_heads))
            .with_head_dim(Some(self.head_dim))
            .with_rope_theta(Some(theta))
            .with_max_seq(self.max_seq)
            .with_dropout(self.attention_dropout.unwrap_or(self.dropout))
            .with_qk_norm(self.qk_norm.then_some(self.norm_eps))
            .with_norm_offset(1.0)
            .with_scale(Some(1.0 / scalar.sqrt()))
            .with_softcap(self.attn_logit_softcap)
            .with_sliding_window(window)
            .with_settings(self.settings)
    }

    /// Initializes this rank's shards; the same seed gives the same model at every tp.
    /// Collective over `group`.
    ///
    /// # Errors
    /// Head counts or widths that do not fit tp; a bad dropout, soft cap or `layer_types`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<Gemma> {
        self.init_layers(group, device, &(0..self.n_layers).collect::<Vec<_>>())
    }

    /// [`init`](Self::init) keeping only blocks `layers` (a pipeline stage's, in order), each
    /// other block drawn and dropped at once. Collective over `group`.
    ///
    /// # Errors
    /// As [`init`](Self::init); a block past `n_layers`.
    pub fn init_layers(
        &self,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> TpResult<Gemma> {
        // Every size is checked before the first collective, so a bad config fails on each rank
        // at once instead of leaving its peers waiting.
        crate::decoder::check_layers("Gemma", self.n_layers, layers)?;
        crate::dropout::check_rates("Gemma", self.dropout, self.attention_dropout)?;
        for (name, cap) in [
            ("final_logit_softcap", self.final_logit_softcap),
            ("attn_logit_softcap", self.attn_logit_softcap),
        ] {
            if let Some(cap) = cap.filter(|c| !(c.is_finite() && *c > 0.0)) {
                return Err(TpError::Config(format!(
                    "Gemma: {name} = {cap} (a soft cap must be finite and > 0)"
                )));
            }
        }
        if let Some(scalar) = self
            .query_pre_attn_scalar
            .filter(|s| !(s.is_finite() && *s > 0.0))
        {
            return Err(TpError::Config(format!(
                "Gemma: query_pre_attn_scalar = {scalar} (must be finite and > 0)"
            )));
        }
        let kinds = self.layer_kinds()?;
        let tp = group.world_size();
        let (sliding, full) = (
            self.attention(LayerType::Sliding),
            self.attention(LayerType::Full),
        );
        sliding.validate(tp)?;
        full.validate(tp)?;
        crate::error::check_divisible("Gemma d_ff", self.d_ff, tp)?;
        let (d, settings) = (self.d_model, self.settings);
        let tok = VocabParallelEmbeddingConfig::new(self.n_vocab, d)
            .with_settings(settings)
            .with_vocab_multiple(self.vocab_multiple)
            .init(group, device)?;
        let norm =
            || TpRmsNorm::new(d, self.norm_eps, settings.mode, group, device).with_offset(1.0);
        // One rotary table per layer type, shared by its layers (constants, not copied).
        let tables = (sliding.rotary_table(device), full.rotary_table(device));
        let mut next = kinds.iter();
        let blocks = crate::decoder::draw_blocks("Gemma", self.n_layers, layers, || {
            let (attn, rope) = match next.next().copied().unwrap_or(LayerType::Full) {
                LayerType::Sliding => (&sliding, tables.0.clone()),
                LayerType::Full => (&full, tables.1.clone()),
            };
            Ok(GemmaBlock {
                input_norm: norm(),
                attn: attn.init_with_rope(group, device, rope)?,
                post_attn_norm: norm(),
                pre_mlp_norm: norm(),
                mlp: ParallelSwiGluConfig::new(d, self.d_ff)
                    .with_activation(GluActivation::GeluTanh)
                    .with_settings(settings)
                    .init(group, device)?,
                post_mlp_norm: norm(),
            })
        })?;
        let spec = LinearSpec::new(settings);
        let head = (!self.tie_embeddings)
            .then(|| {
                VocabParallelHead::init(d, self.n_vocab, self.vocab_multiple, spec, group, device)
            })
            .transpose()?;
        Ok(Gemma {
            tok,
            blocks,
            norm: norm(),
            head,
            group: group.clone(),
            block_ids: layers.to_vec(),
            options: GemmaOptions {
                settings,
                dropout: self.dropout,
                dropout_seed: self.dropout_seed,
                ignore_index: self.ignore_index,
                final_logit_softcap: self.final_logit_softcap,
            },
        })
    }
}

impl GemmaBlock {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]`; with `dropout`, block `index`'s sites.
    fn try_forward(
        &self,
        x: Tensor<3>,
        dropout: Option<DropoutKey>,
        p: f64,
        index: usize,
        group: &ProcessGroup,
        mode: TpMode,
    ) -> TpResult<Tensor<3>> {
        let site = 1 + 3 * index as u64;
        let ctx = self.attn.context_parallel();
        let a = self
            .attn
            .try_forward(self.input_norm.forward(x.clone()), dropout, site)?;
        let a = self.post_attn_norm.forward(a);
        let x = x + residual_dropout(a, p, dropout, site + 1, (group, mode), ctx)?;
        let m = self.mlp.try_forward(self.pre_mlp_norm.forward(x.clone()))?;
        let m = self.post_mlp_norm.forward(m);
        Ok(x + residual_dropout(m, p, dropout, site + 2, (group, mode), ctx)?)
    }
}

impl Gemma {
    /// Run-time options.
    pub fn options(&self) -> GemmaOptions {
        self.options
    }

    /// The same model (its weights shared) run in `mode`: e.g. a sequence-parallel model in
    /// ALL_REDUCE mode to generate with the KV cache.
    pub fn with_mode(self, mode: TpMode) -> Self {
        let mut options = self.options;
        options.settings.mode = mode;
        Self {
            tok: self.tok.in_mode(mode),
            blocks: self
                .blocks
                .into_iter()
                .map(|b| GemmaBlock {
                    input_norm: b.input_norm.in_mode(mode),
                    attn: b.attn.in_mode(mode),
                    post_attn_norm: b.post_attn_norm.in_mode(mode),
                    pre_mlp_norm: b.pre_mlp_norm.in_mode(mode),
                    mlp: b.mlp.in_mode(mode),
                    post_mlp_norm: b.post_mlp_norm.in_mode(mode),
                })
                .collect(),
            norm: self.norm.in_mode(mode),
            head: self.head.in_mode(mode),
            group: self.group,
            options,
            block_ids: self.block_ids,
        }
    }

    /// The embeddings of `ids` times `sqrt(d_model)`, the factor rounded to their dtype (as
    /// transformers' `Gemma3TextScaledWordEmbedding`: 55.5, not 55.43, for a bf16 width of 3072).
    fn scaled_embedding(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        let x = self.tok.try_forward(ids)?;
        let scale = (LanguageModel::d_model(self) as f64).sqrt();
        let scale = match x.dtype() {
            DType::BF16 => f64::from(half::bf16::from_f64(scale).to_f32()),
            DType::F16 => f64::from(half::f16::from_f64(scale).to_f32()),
            DType::F32 => f64::from(scale as f32),
            _ => scale,
        };
        Ok(x.mul_scalar(scale))
    }
}

impl DecoderBlock for GemmaBlock {
    fn attention(&self) -> &ParallelAttention {
        &self.attn
    }

    fn attention_mut(&mut self) -> &mut ParallelAttention {
        &mut self.attn
    }

    fn attn_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.input_norm.forward(x)
    }

    fn mlp_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.pre_mlp_norm.forward(x)
    }

    fn mlp(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        self.mlp.try_forward(x)
    }

    fn post_attn(&self, a: Tensor<3>) -> Tensor<3> {
        self.post_attn_norm.forward(a)
    }

    fn post_mlp(&self, m: Tensor<3>) -> Tensor<3> {
        self.post_mlp_norm.forward(m)
    }
}

impl LanguageModel for Gemma {
    crate::model::family_parts!("Gemma", GemmaConfig, GemmaBlock);

    fn final_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.norm.forward(x)
    }

    fn with_mode(self, mode: TpMode) -> Self {
        Gemma::with_mode(self, mode)
    }

    fn embed(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        let table = self.blocks.first().and_then(|b| b.attn.max_positions());
        crate::model::check_positions(Self::NAME, &ids, table)?;
        self.scaled_embedding(ids)
    }

    fn embed_new(&self, ids: Tensor<2, Int>, _cache: &DecodeCache) -> TpResult<Tensor<3>> {
        // Rotary positions are the attention's: the tokens alone here.
        self.scaled_embedding(ids)
    }

    fn layer(&self, index: usize, x: Tensor<3>, step: Option<DropoutStep>) -> TpResult<Tensor<3>> {
        let o = self.options;
        let key = step.map(|at| DropoutKey {
            seed: o.dropout_seed,
            at,
        });
        let block = crate::model::block_at(self, index)?;
        block.try_forward(x, key, o.dropout, index, &self.group, o.settings.mode)
    }

    fn logits_loss(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        let options = CrossEntropyOptions {
            n_vocab: Some(self.n_vocab()),
            ignore_index: self.options.ignore_index,
            ..Default::default()
        };
        Ok(sequence_cross_entropy(logits, targets, None, &self.group, &options)?.mean)
    }

    fn param_sections(&self) -> [usize; 3] {
        [
            count_params(&self.tok),
            self.blocks.first().map_or(0, count_params),
            count_params(&self.norm) + self.head.as_ref().map_or(0, count_params),
        ]
    }

    /// The final norm, the head, then the soft cap where the config has one (elementwise, so
    /// each rank caps its own vocabulary shard).
    fn head_logits(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let logits = crate::model::final_logits(self, x)?;
        Ok(match self.options.final_logit_softcap {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        })
    }
}

crate::reshard::reshard_fields!(GemmaBlock {
    input_norm,
    attn,
    post_attn_norm,
    pre_mlp_norm,
    mlp,
    post_mlp_norm
});

crate::reshard::reshard_fields!(Gemma { tok, blocks, norm, head }, group: group, keep: { options, block_ids });
