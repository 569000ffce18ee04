//! A tiny GPT with tensor parallelism: vocab-parallel embedding, parallel attention and MLP,
//! replicated layer norms, and a vocab-parallel lm-head with sharded cross-entropy.
//!
//! Activations are `[seq, batch, d_model]` (Megatron's layout), sharded on dim 0 between the
//! parallel regions in REDUCE_SCATTER mode (sequence parallel). The model is identical at every
//! tp: the same seed gives the same weights, and [`Reshard`](crate::reshard::Reshard) moves it
//! between tp sizes.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::attention::{DecodeCache, ParallelAttention, ParallelAttentionConfig};
use crate::decoder::DecoderBlock;
use crate::dropout::DropoutStep;
use crate::embedding::{VocabParallelEmbedding, VocabParallelEmbeddingConfig, VocabParallelHead};
use crate::error::check_divisible;
use crate::init::init_replicated;
use crate::linear::{LinearSpec, TpMode, TpSettings};
use crate::loss::{CrossEntropyOptions, sequence_cross_entropy};
use crate::model::{LanguageModel, count_params};
use crate::norm::{TpLayerNorm, replicated_param};
use crate::transformer::{ParallelMlp, ParallelMlpConfig};
use crate::{Result as TpResult, TpError};

/// Configuration of a [`Gpt`].
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Vocabulary size (any: the embedding and the head are padded to a multiple of tp, and the
    /// padding is masked out of the loss).
    pub n_vocab: usize,
    /// Longest sequence.
    pub max_seq: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads (a multiple of tp).
    pub n_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// MLP hidden width; `4 * d_model` when `None`.
    #[config(default = "None")]
    pub d_hidden: Option<usize>,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// Reuse the embedding table as the lm-head.
    #[config(default = false)]
    pub tie_embeddings: bool,
    /// One fused QKV projection per attention (else three).
    #[config(default = true)]
    pub fused_qkv: bool,
    /// z-loss coefficient of the cross-entropy.
    #[config(default = 0.0)]
    pub z_loss: f64,
    /// Label smoothing of the cross-entropy.
    #[config(default = 0.0)]
    pub label_smoothing: f64,
}

/// Pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
#[derive(Module, Debug)]
pub struct Block {
    /// Before attention.
    pub ln1: TpLayerNorm,
    /// Causal self-attention.
    pub attn: ParallelAttention,
    /// Before the MLP.
    pub ln2: TpLayerNorm,
    /// The MLP.
    pub mlp: ParallelMlp,
}

impl Block {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` (sharded on dim 0 in REDUCE_SCATTER mode).
    ///
    /// # Panics
    /// As the layers' `forward`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As the layers' `try_forward`.
    pub fn try_forward(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let x = x.clone() + self.attn.try_forward(self.ln1.forward(x), None, 0)?;
        Ok(x.clone() + self.mlp.try_forward(self.ln2.forward(x))?)
    }
}

/// The tiny GPT.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding, `[n_vocab / tp, d_model]`.
    pub tok: VocabParallelEmbedding,
    /// Learned positions, `[max_seq, d_model]`, replicated.
    pub pos: Param<Tensor<2>>,
    /// The blocks.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub ln_f: TpLayerNorm,
    /// lm-head `d_model -> V_p / tp` over the padded vocabulary (absent when tied to `tok`).
    pub head: Option<VocabParallelHead>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    options: GptOptions,
    /// The whole model's index of each block held.
    #[module(skip)]
    block_ids: Vec<usize>,
}

/// What a [`Gpt`] keeps of its config at run time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOptions {
    /// How the parallel layers run.
    pub settings: TpSettings,
    /// z-loss coefficient.
    pub z_loss: f64,
    /// Label smoothing.
    pub label_smoothing: f64,
}

impl GptConfig {
    /// Initializes this rank's shards; the same seed gives the same model at every tp.
    /// Collective over `group`.
    ///
    /// # Errors
    /// Sizes not divisible by tp (heads, hidden width); a communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<Gpt> {
        self.init_layers(group, device, &(0..self.n_layers).collect::<Vec<_>>())
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
    ) -> TpResult<Gpt> {
        // Before the first collective, as every size.
        crate::decoder::check_layers("Gpt", self.n_layers, layers)?;
        let (d, settings) = (self.d_model, self.settings);
        let mode = settings.mode;
        // Every size is checked before the first collective, so a bad config fails on each rank
        // at once instead of leaving its peers waiting.
        let tp = group.world_size();
        check_divisible("ParallelAttention n_heads", self.n_heads, tp)?;
        check_divisible("ParallelMlp d_hidden", self.d_hidden.unwrap_or(4 * d), tp)?;
        if !d.is_multiple_of(self.n_heads) {
            return Err(TpError::Config(format!(
                "ParallelAttention: d_model = {d} is not divisible by n_heads = {}",
                self.n_heads
            )));
        }
        let tok = VocabParallelEmbeddingConfig::new(self.n_vocab, d)
            .with_settings(settings)
            .init(group, device)?;
        let pos_init = burn::nn::Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let pos = init_replicated(&pos_init, [self.max_seq, d], None, None, group, device)?;
        let blocks = crate::decoder::draw_blocks("Gpt", self.n_layers, layers, || {
            Ok(Block {
                ln1: TpLayerNorm::new(d, mode, group, device),
                attn: ParallelAttentionConfig::new(d, self.n_heads)
                    .with_qkv_bias(true)
                    .with_out_bias(true)
                    .with_fused_qkv(self.fused_qkv)
                    .with_settings(settings)
                    .init(group, device)?,
                ln2: TpLayerNorm::new(d, mode, group, device),
                mlp: ParallelMlpConfig::new(d, self.d_hidden.unwrap_or(4 * d))
                    .with_settings(settings)
                    .init(group, device)?,
            })
        })?;
        let spec = LinearSpec::new(settings);
        // The draws of `LinearConfig::new(d, n_vocab).with_bias(false)` at tp = 1, padded.
        let head = (!self.tie_embeddings)
            .then(|| VocabParallelHead::init(d, self.n_vocab, 1, spec, group, device))
            .transpose()?;
        Ok(Gpt {
            tok,
            pos: Param::from_tensor(pos),
            blocks,
            ln_f: TpLayerNorm::new(d, mode, group, device),
            head,
            group: group.clone(),
            block_ids: layers.to_vec(),
            options: GptOptions {
                settings,
                z_loss: self.z_loss,
                label_smoothing: self.label_smoothing,
            },
        })
    }
}

impl Gpt {
    /// Run-time options.
    pub fn options(&self) -> GptOptions {
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
            pos: self.pos,
            blocks: self
                .blocks
                .into_iter()
                .map(|b| Block {
                    ln1: b.ln1.in_mode(mode),
                    attn: b.attn.in_mode(mode),
                    ln2: b.ln2.in_mode(mode),
                    mlp: b.mlp.in_mode(mode),
                })
                .collect(),
            ln_f: self.ln_f.in_mode(mode),
            head: self.head.in_mode(mode),
            group: self.group,
            options,
            block_ids: self.block_ids,
        }
    }

    /// Vocab-sharded logits.
    ///
    /// # Shapes
    /// - `ids`: `[seq, batch]` (the full sequence on every rank, in both modes)
    /// - output: `[seq, batch, V_p / tp]` over the padded vocabulary `V_p` (the padding columns
    ///   are masked out by [`loss`](Self::loss))
    ///
    /// # Panics
    /// [`TpError::Shape`] for a sequence longer than `max_seq`; ids outside the vocabulary;
    /// sizes not divisible by tp; a communication error.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        crate::model::forward(self, ids, None)
    }

    /// Vocab-sharded logits `[s_new, batch, V_p / tp]` of new positions `ids` (`[s_new, batch]`)
    /// after those in `cache`, which they join: incremental decoding, each new token costing one
    /// position's compute (ALL_REDUCE mode).
    ///
    /// # Errors
    /// As [`ParallelAttention::try_forward_cached`]; positions past `max_seq`.
    pub fn try_forward_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> TpResult<Tensor<3>> {
        crate::model::decode(self, ids, cache, false)
    }

    /// Mean next-token cross-entropy (replicated on every rank).
    ///
    /// # Shapes
    /// - `ids`, `targets`: `[seq, batch]`
    ///
    /// # Panics
    /// As [`forward`](Self::forward) and [`crate::loss::sharded_cross_entropy_with`].
    pub fn loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.try_loss(ids, targets)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`loss`](Self::loss), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`loss`](Self::loss)'s panics.
    pub fn try_loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        self.loss_of_logits(self.try_forward(ids)?, targets)
    }

    /// The mean cross-entropy of vocab-sharded `logits` (`[seq, batch, V_p / tp]`).
    pub(crate) fn loss_of_logits(
        &self,
        logits: Tensor<3>,
        targets: Tensor<2, Int>,
    ) -> TpResult<Tensor<1>> {
        // The logits cover the padded vocabulary: mask the padding.
        let options = CrossEntropyOptions {
            z_loss: self.options.z_loss,
            label_smoothing: self.options.label_smoothing,
            n_vocab: Some(self.tok.n_vocab()),
            ignore_index: None,
        };
        Ok(sequence_cross_entropy(logits, targets, None, &self.group, &options)?.mean)
    }
}

impl DecoderBlock for Block {
    fn attention(&self) -> &ParallelAttention {
        &self.attn
    }

    fn attention_mut(&mut self) -> &mut ParallelAttention {
        &mut self.attn
    }

    fn attn_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.ln1.forward(x)
    }

    fn mlp_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.ln2.forward(x)
    }

    fn mlp(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        self.mlp.try_forward(x)
    }
}

impl LanguageModel for Gpt {
    crate::model::family_parts!("Gpt", GptConfig, Block);

    fn final_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.ln_f.forward(x)
    }

    fn with_mode(self, mode: TpMode) -> Self {
        Gpt::with_mode(self, mode)
    }

    /// Token embeddings plus positions (this rank's sequence shard of them in REDUCE_SCATTER
    /// mode).
    fn embed(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        let [s, _] = ids.dims();
        let pos = self.pos.val();
        let [max_seq, d] = pos.dims();
        let context = self.context_parallel();
        let seq = s * context.map_or(1, |c| c.size());
        if seq > max_seq {
            return Err(TpError::Shape {
                op: "Gpt",
                expected: format!(
                    "[seq <= {max_seq}, batch] (this rank's {s} of a sequence of {seq} split over \
                     cp)"
                ),
                got: ids.dims().to_vec(),
            });
        }
        let (mode, group) = (self.options.settings.mode, &self.group);
        let x = self.tok.try_forward(ids)?;
        // Positions of this rank's rows: all of them, or its sequence shard.
        let rows = match mode {
            TpMode::AllReduce => 0..s,
            TpMode::ReduceScatter => {
                let shard = s / group.world_size();
                group.rank() * shard..(group.rank() + 1) * shard
            }
        };
        let table = replicated_param(&self.pos, mode, group);
        let pos = match context {
            None => table.slice([rows, 0..d]),
            // This rank's chunks' global positions.
            Some(c) => {
                let at: Vec<i64> = c.positions(seq)?[rows].iter().map(|&p| p as i64).collect();
                let n = at.len();
                let at = Tensor::<1, Int>::from_data(
                    burn::tensor::TensorData::new(at, [n]),
                    &x.device(),
                );
                table.select(0, at)
            }
        };
        Ok(x + pos.unsqueeze_dim::<3>(1))
    }

    /// Token embeddings plus the positions after those cached (each sequence's own, counted
    /// from its first token, when the prompts are left-padded).
    fn embed_new(&self, ids: Tensor<2, Int>, cache: &DecodeCache) -> TpResult<Tensor<3>> {
        let [s, b] = ids.dims();
        let start = cache.len();
        let pos = self.pos.val();
        let [max_seq, d] = pos.dims();
        if start + s > max_seq {
            return Err(TpError::Shape {
                op: "Gpt",
                expected: format!("positions below max_seq = {max_seq} (cached {start})"),
                got: ids.dims().to_vec(),
            });
        }
        let x = self.tok.try_forward(ids)?;
        let table = replicated_param(&self.pos, self.options.settings.mode, &self.group);
        let pos = if cache.padding.iter().any(|&p| p > 0) {
            let ids: Vec<i64> = cache
                .positions(s, b)
                .into_iter()
                .map(|p| p as i64)
                .collect();
            let ids = Tensor::<1, Int>::from_data(
                burn::tensor::TensorData::new(ids, [s * b]),
                &x.device(),
            );
            table.select(0, ids).reshape([s, b, d])
        } else {
            table.slice([start..start + s, 0..d]).unsqueeze_dim::<3>(1)
        };
        Ok(x + pos)
    }

    fn layer(&self, index: usize, x: Tensor<3>, _step: Option<DropoutStep>) -> TpResult<Tensor<3>> {
        crate::model::block_at(self, index)?.try_forward(x)
    }

    fn logits_loss(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        self.loss_of_logits(logits, targets)
    }

    fn param_sections(&self) -> [usize; 3] {
        [
            count_params(&self.tok) + 1,
            self.blocks.first().map_or(0, count_params),
            count_params(&self.ln_f) + self.head.as_ref().map_or(0, count_params),
        ]
    }
}

crate::reshard::reshard_fields!(Block {
    ln1,
    attn,
    ln2,
    mlp
});

crate::reshard::reshard_fields!(Gpt { tok, pos, blocks, ln_f, head }, group: group, keep: { options, block_ids });
