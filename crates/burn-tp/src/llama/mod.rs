//! A Llama-class model with tensor parallelism: grouped-query attention with rotary positions,
//! RMSNorm, a SwiGLU MLP, a padded vocabulary masked out of the loss, a loss mask / ignore index,
//! dropout from a tensor-parallel RNG tracker, and a tied or untied head.
//!
//! Activations are `[seq, batch, d_model]` like [`Gpt`](crate::gpt::Gpt)'s, sharded on dim 0
//! between the parallel regions in REDUCE_SCATTER mode. The model is identical at every tp (the
//! same seed gives the same weights; dropout masks are the same logical masks) and
//! [`Reshard`](crate::reshard::Reshard) moves it between tp sizes, the padding included.
//!
//! | file           | what                                                             |
//! |----------------|------------------------------------------------------------------|
//! | `mod.rs`       | [`LlamaConfig`], [`Llama`], [`LlamaBlock`]                       |
//! | `experts.rs`   | the MoE layers' experts split over ep and gathered back       |
//! | `model.rs`     | its block as the decoder sees it, its `LanguageModel` parts      |
//!
//! Dropout (both models' attention, this one's residuals) is [`crate::dropout`].

mod experts;
mod model;

use crate::norm::TpRmsNorm;
pub use crate::transformer::{GluActivation, ParallelSwiGlu, ParallelSwiGluConfig};

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::attention::{
    DecodeCache, LayerType, Llama3RopeScaling, ParallelAttention, ParallelAttentionConfig,
};
use crate::dropout::{DropoutKey, DropoutStep, residual_dropout};
use crate::embedding::{VocabParallelEmbedding, VocabParallelEmbeddingConfig, VocabParallelHead};
use crate::linear::{LinearSpec, TpMode, TpSettings};
use crate::loss::{CrossEntropyOptions, CrossEntropyOutput, sequence_cross_entropy};
use crate::model::{LanguageModel, count_params};
use crate::moe::{ExpertsConfig, MoeLayer};
use crate::{Result as TpResult, TpError};

/// Configuration of a [`Llama`].
#[derive(Config, Debug)]
pub struct LlamaConfig {
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
    /// SwiGLU hidden width (a multiple of tp).
    pub d_ff: usize,
    /// Rotary base.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// Size of each attention head: `None` for `d_model / n_heads`.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Llama 3's scaling of the rotary frequencies (Llama 3.1 - 3.3).
    #[config(default = "None")]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// RMSNorm epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Dropout of each residual branch, and of the attention probabilities unless
    /// `attention_dropout` says otherwise (0: none).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Dropout of the attention probabilities where it differs from `dropout` (a Hugging Face
    /// config's `attention_dropout`; those models have no residual dropout); `None`: `dropout`.
    #[config(default = "None")]
    pub attention_dropout: Option<f64>,
    /// Seed of the dropout masks.
    #[config(default = 0)]
    pub dropout_seed: u64,
    /// The padded vocabulary is a multiple of `vocab_multiple * tp`.
    #[config(default = 1)]
    pub vocab_multiple: usize,
    /// Reuse the embedding table as the lm-head.
    #[config(default = false)]
    pub tie_embeddings: bool,
    /// Targets equal to this id are ignored by the loss.
    #[config(default = "None")]
    pub ignore_index: Option<i64>,
    /// Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    #[config(default = false)]
    pub out_bias: bool,
    /// RMSNorm (epsilon `norm_eps`) on each head's queries and keys before the rotation (Qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
    /// Sliding-window attention over this many positions (Mistral, Phi-3); `None` for the
    /// whole causal past.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Each layer's attention type where they differ (Qwen2 / Qwen3's `layer_types`, or
    /// `max_window_layers`): sliding layers take `sliding_window`, full ones see the whole
    /// causal past; empty: every layer `sliding_window`'s.
    #[config(default = "Vec::new()")]
    pub layer_types: Vec<LayerType>,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE) in the layers it says; `None`:
    /// every MLP dense.
    #[config(default = "None")]
    pub experts: Option<ExpertsConfig>,
}

/// Pre-norm Llama block: `x + drop(attn(norm(x)))`, then `x + drop(mlp(norm(x)))`.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    /// Before attention.
    pub attn_norm: TpRmsNorm,
    /// Grouped-query attention.
    pub attn: ParallelAttention,
    /// Before the MLP.
    pub mlp_norm: TpRmsNorm,
    /// SwiGLU MLP.
    pub mlp: Option<ParallelSwiGlu>,
    /// The mixture of experts in place of the dense MLP, in a MoE layer.
    pub moe: Option<MoeLayer>,
}

/// What a [`Llama`] keeps of its config at run time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaOptions {
    /// How the parallel layers run.
    pub settings: TpSettings,
    /// Residual dropout.
    pub dropout: f64,
    /// Seed of the dropout masks.
    pub dropout_seed: u64,
    /// The loss's ignore index.
    pub ignore_index: Option<i64>,
    /// Weights of the routers' load-balancing loss and z-loss in the training loss.
    pub router_loss: (f64, f64),
    /// The experts each MoE layer routes over (0: a dense model).
    pub routed_experts: usize,
}

/// The Llama-class model.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor, TensorData};
/// use burn_tp::linear::{TpMode, TpSettings};
/// use burn_tp::dropout::DropoutStep;
/// use burn_tp::llama::LlamaConfig;
/// use burn_tp::local::run_local;
///
/// let device = Device::flex().autodiff();
/// device.seed(0); // once, before the rank threads: the same model at every tp
/// let losses = run_local(2, move |group| -> burn_tp::Result<f32> {
///     // 50 tokens (padded to 50 at tp 2), 4 query heads, 2 key / value heads, SwiGLU width 64.
///     let model = LlamaConfig::new(50, 16, 32, 4, 2, 2, 64)
///         .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
///         .with_dropout(0.1)
///         .init(&group, &device)?;
///     let ids = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [16, 2]), &device);
///     let x: Vec<i64> = (0..32).map(|i| i % 50).collect();
///     let y: Vec<i64> = (0..32).map(|i| (i + 1) % 50).collect();
///     // Drop the first token of each sequence from the loss (a prompt, say).
///     let mut keep = vec![1.0f32; 32];
///     keep[..2].fill(0.0);
///     let mask = Tensor::<1>::from_floats(keep.as_slice(), &device).reshape([16, 2]);
///     let out = model.try_loss(ids(x), ids(y), Some(mask), Some(DropoutStep::new(0)))?;
///     let _grads = out.mean.backward();
///     Ok(out.mean.into_scalar())
/// })
/// .expect("no rank panicked");
/// // The same loss on both ranks.
/// assert_eq!(losses[0].as_ref().ok(), losses[1].as_ref().ok());
/// ```
#[derive(Module, Debug)]
pub struct Llama {
    /// Token embedding, `[V_p / tp, d_model]`.
    pub tok: VocabParallelEmbedding,
    /// The blocks.
    pub blocks: Vec<LlamaBlock>,
    /// Final norm.
    pub norm: TpRmsNorm,
    /// lm-head `d_model -> V_p / tp` (absent when tied to `tok`).
    pub head: Option<VocabParallelHead>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    options: LlamaOptions,
    /// The whole model's index of each block held.
    #[module(skip)]
    block_ids: Vec<usize>,
    /// Per block of the whole model, held or not: its parameters as built (every expert), for
    /// a pipeline stage's place in the whole model (dense and MoE blocks differ).
    #[module(skip)]
    block_params: Vec<usize>,
    /// Per block of the whole model: whether it is a mixture of experts.
    #[module(skip)]
    block_moe: Vec<bool>,
}

impl LlamaConfig {
    /// Initializes this rank's shards; the same seed gives the same model at every tp.
    /// Collective over `group`.
    ///
    /// # Errors
    /// Head counts or widths that do not fit tp; a communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<Llama> {
        self.init_layers(group, device, &(0..self.n_layers).collect::<Vec<_>>())
    }

    /// [`init_layers`](Self::init_layers) with the experts split over `ep` as well (each rank
    /// holds `n_experts / ep` of each MoE layer's experts; [`crate::moe`]). Collective over
    /// `group` (tp) and `ep`.
    ///
    /// # Errors
    /// As [`init`](Self::init); experts that `ep` does not divide.
    pub fn init_expert_parallel(
        &self,
        group: &ProcessGroup,
        ep: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> TpResult<Llama> {
        self.build(group, ep, device, layers)
    }

    /// [`init`](Self::init) keeping only blocks `layers` (a pipeline stage's, in order): each
    /// other block is drawn and dropped at once, so the kept ones have the whole model's
    /// weights, and no more than one block beyond them is ever held. Collective over `group`.
    ///
    /// # Errors
    /// As [`init`](Self::init); a block past `n_layers`.
    pub fn init_layers(
        &self,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> TpResult<Llama> {
        self.build(group, &crate::reshard::solo(), device, layers)
    }

    fn build(
        &self,
        group: &ProcessGroup,
        ep: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> TpResult<Llama> {
        // Before the first collective, as every size.
        crate::decoder::check_layers("Llama", self.n_layers, layers)?;
        let (d, settings) = (self.d_model, self.settings);
        let mode = settings.mode;
        // Every size is checked before the first collective, so a bad config fails on each rank
        // at once instead of leaving its peers waiting.
        crate::dropout::check_rates("Llama", self.dropout, self.attention_dropout)?;
        let tp = group.world_size();
        let attn = ParallelAttentionConfig::new(d, self.n_heads)
            .with_n_kv_heads(Some(self.n_kv_heads))
            .with_head_dim(self.head_dim)
            .with_rope_theta(Some(self.rope_theta))
            .with_rope_scaling(self.rope_scaling)
            .with_max_seq(self.max_seq)
            .with_dropout(self.attention_dropout.unwrap_or(self.dropout))
            .with_qkv_bias(self.qkv_bias)
            .with_out_bias(self.out_bias)
            .with_qk_norm(self.qk_norm.then_some(self.norm_eps))
            .with_sliding_window(self.sliding_window)
            .with_settings(settings);
        attn.validate(tp)?;
        if !self.layer_types.is_empty() && self.layer_types.len() != self.n_layers {
            return Err(TpError::Config(format!(
                "Llama: {} layer_types for n_layers = {}",
                self.layer_types.len(),
                self.n_layers
            )));
        }
        // Full layers where the types say (the same rotary table: one base).
        let full = attn.clone().with_sliding_window(None);
        let mut kinds = self.layer_types.iter();
        crate::error::check_divisible("Llama d_ff", self.d_ff, tp)?;
        let moe = self.experts.as_ref().map(|x| x.layer(d, settings));
        if let Some(moe) = &moe {
            moe.validate(tp, ep.world_size())?;
        }
        let tok = VocabParallelEmbeddingConfig::new(self.n_vocab, d)
            .with_settings(settings)
            .with_vocab_multiple(self.vocab_multiple)
            .init(group, device)?;
        let norm = |g: &ProcessGroup| TpRmsNorm::new(d, self.norm_eps, mode, g, device);
        // One rotary table for every block (a constant: shared, not copied).
        let rope = attn.rotary_table(device);
        // The index of the block being drawn (draw_blocks draws them all, in order).
        let mut next = 0usize;
        let mut block_params = Vec::with_capacity(self.n_layers);
        let mut block_moe = Vec::with_capacity(self.n_layers);
        let blocks = crate::decoder::draw_blocks("Llama", self.n_layers, layers, || {
            let i = next;
            next += 1;
            let attn = match kinds.next() {
                Some(LayerType::Full) => full.init_with_rope(group, device, rope.clone())?,
                _ => attn.init_with_rope(group, device, rope.clone())?,
            };
            let moe = match &moe {
                Some(moe) if self.experts.as_ref().is_some_and(|x| x.is_sparse(i)) => {
                    Some(moe.init(group, ep, device)?)
                }
                _ => None,
            };
            let mlp = moe
                .is_none()
                .then(|| {
                    ParallelSwiGluConfig::new(d, self.d_ff)
                        .with_settings(settings)
                        .init(group, device)
                })
                .transpose()?;
            let block = LlamaBlock {
                attn_norm: norm(group),
                attn,
                mlp_norm: norm(group),
                mlp,
                moe,
            };
            // Every expert's, as a checkpoint holds them (under ep: times ep).
            let experts = block.moe.as_ref().map_or(0, |m| {
                m.experts.iter().map(count_params).sum::<usize>() * (ep.world_size() - 1)
            });
            block_params.push(count_params(&block) + experts);
            block_moe.push(block.moe.is_some());
            Ok(block)
        })?;
        let spec = LinearSpec::new(settings);
        let head = (!self.tie_embeddings)
            .then(|| {
                VocabParallelHead::init(d, self.n_vocab, self.vocab_multiple, spec, group, device)
            })
            .transpose()?;
        Ok(Llama {
            tok,
            blocks,
            norm: norm(group),
            head,
            group: group.clone(),
            block_ids: layers.to_vec(),
            block_params,
            block_moe,
            options: LlamaOptions {
                settings,
                dropout: self.dropout,
                dropout_seed: self.dropout_seed,
                ignore_index: self.ignore_index,
                router_loss: self
                    .experts
                    .as_ref()
                    .map_or((0.0, 0.0), |x| (x.aux_loss_coef, x.z_loss_coef)),
                routed_experts: self.experts.as_ref().map_or(0, |x| x.n_experts),
            },
        })
    }
}

impl LlamaBlock {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]`; with `dropout`, block `index`'s sites
    /// (the model's forward runs it: the sites and the dropout rate are the model's).
    pub(crate) fn try_forward(
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
            .try_forward(self.attn_norm.forward(x.clone()), dropout, site)?;
        let x = x + residual_dropout(a, p, dropout, site + 1, (group, mode), ctx)?;
        let m = self.ffn(self.mlp_norm.forward(x.clone()))?;
        Ok(x + residual_dropout(m, p, dropout, site + 2, (group, mode), ctx)?)
    }

    /// The dense MLP or the mixture of experts (whose routers' statistics go to
    /// [`crate::moe::record`]).
    fn ffn(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        match (&self.mlp, &self.moe) {
            (_, Some(moe)) => Ok(moe.try_forward(x)?.0),
            (Some(mlp), None) => mlp.try_forward(x),
            (None, None) => Err(TpError::Config("Llama block without an MLP".into())),
        }
    }
}

impl Llama {
    /// Run-time options.
    pub fn options(&self) -> LlamaOptions {
        self.options
    }

    /// The same model (its weights shared) run in `mode`: e.g. a sequence-parallel model in
    /// ALL_REDUCE mode to generate with the KV cache.
    pub fn with_mode(self, mode: TpMode) -> Self {
        use crate::linear::InMode;
        let mut options = self.options;
        options.settings.mode = mode;
        Self {
            tok: self.tok.in_mode(mode),
            blocks: self
                .blocks
                .into_iter()
                .map(|b| LlamaBlock {
                    attn_norm: b.attn_norm.in_mode(mode),
                    attn: b.attn.in_mode(mode),
                    mlp_norm: b.mlp_norm.in_mode(mode),
                    mlp: b.mlp.map(|m| m.in_mode(mode)),
                    moe: b.moe.map(|m| m.in_mode(mode)),
                })
                .collect(),
            norm: self.norm.in_mode(mode),
            head: self.head.in_mode(mode),
            group: self.group,
            options,
            block_ids: self.block_ids,
            block_params: self.block_params,
            block_moe: self.block_moe,
        }
    }

    /// The whole model's blocks' parameter counts with `dense` more in each dense block and
    /// `sparse` more in each MoE block (LoRA's adapters, [`crate::lora`]).
    pub(crate) fn with_added_block_params(mut self, dense: usize, sparse: usize) -> Self {
        for (n, &moe) in self.block_params.iter_mut().zip(&self.block_moe) {
            *n += if moe { sparse } else { dense };
        }
        self
    }

    /// [`with_added_block_params`](Self::with_added_block_params) taking them off again.
    pub(crate) fn with_removed_block_params(mut self, dense: usize, sparse: usize) -> Self {
        for (n, &moe) in self.block_params.iter_mut().zip(&self.block_moe) {
            *n -= if moe { sparse } else { dense };
        }
        self
    }

    /// Vocab-sharded logits without dropout (evaluation).
    ///
    /// # Shapes
    /// - `ids`: `[seq, batch]` (the full sequence on every rank, in both modes)
    /// - output: `[seq, batch, V_p / tp]` (padding columns included: see
    ///   [`CrossEntropyOptions::n_vocab`])
    ///
    /// # Panics
    /// Ids outside the vocabulary; a sequence longer than `max_seq`; sizes not divisible by tp; a
    /// communication error.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids, None)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Logits; with `step = Some(..)` dropout is on, with the masks of that training step (and
    /// this data-parallel rank's part of the global batch).
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(
        &self,
        ids: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> TpResult<Tensor<3>> {
        crate::model::forward(self, ids, step)
    }

    /// Vocab-sharded logits `[s_new, batch, V_p / tp]` of new positions `ids` (`[s_new, batch]`)
    /// after those in `cache`, which they join: incremental decoding, each new token costing one
    /// position's compute (ALL_REDUCE mode; no dropout).
    ///
    /// # Errors
    /// As [`ParallelAttention::try_forward_cached`] and [`forward`](Self::forward)'s panics.
    pub fn try_forward_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> TpResult<Tensor<3>> {
        crate::model::decode(self, ids, cache, false)
    }

    /// Mean next-token cross-entropy over every target (replicated on every rank), no dropout.
    ///
    /// # Panics
    /// As [`forward`](Self::forward) and [`crate::loss::sharded_cross_entropy_with`].
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.try_loss(ids, targets, None, None)
            .map(|out| out.mean)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The loss with a mask and dropout: per-token losses and the mean over the kept tokens
    /// (`loss_mask` 1 to keep, 0 to drop; targets equal to the config's `ignore_index` are
    /// dropped too); the padded vocabulary is masked out of the softmax.
    ///
    /// # Shapes
    /// - `ids`, `targets`, `loss_mask`: `[seq, batch]`
    /// - output: `per_token` `[seq * batch]`, `mean` `[1]`
    ///
    /// # Errors
    /// As [`loss`](Self::loss)'s panics.
    pub fn try_loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        loss_mask: Option<Tensor<2>>,
        step: Option<DropoutStep>,
    ) -> TpResult<CrossEntropyOutput> {
        let (logits, routers) = crate::moe::record(|| self.try_forward(ids, step));
        let mut out = self.loss_of_logits(logits?, targets, loss_mask)?;
        if let Some(aux) = self.router_loss(&routers) {
            out.mean = out.mean.clone() + aux.cast(out.mean.dtype());
        }
        Ok(out)
    }

    /// The cross-entropy of vocab-sharded `logits` (`[seq, batch, V_p / tp]`), as
    /// [`try_loss`](Self::try_loss).
    pub(crate) fn loss_of_logits(
        &self,
        logits: Tensor<3>,
        targets: Tensor<2, Int>,
        loss_mask: Option<Tensor<2>>,
    ) -> TpResult<CrossEntropyOutput> {
        let options = CrossEntropyOptions {
            n_vocab: Some(self.n_vocab()),
            ignore_index: self.options.ignore_index,
            ..Default::default()
        };
        sequence_cross_entropy(logits, targets, loss_mask, &self.group, &options)
    }
}

crate::reshard::reshard_fields!(LlamaBlock {
    attn_norm,
    attn,
    mlp_norm,
    mlp,
    moe
});

crate::reshard::reshard_fields!(Llama { tok, blocks, norm, head }, group: group, keep: { options, block_ids, block_params, block_moe });
