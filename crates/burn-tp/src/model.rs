//! [`LanguageModel`]: the GPT and the Llama behind one trait, so a training loop, its
//! checkpoints and its evaluation are written once for both (the example's `train_gpt` is one).
//! It knows no file format: the sharded checkpoints go through [`Reshard`], Hugging Face's
//! through [`crate::hf`].

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::attention::DecodeCache;
use crate::decoder::Decoder;

use crate::dropout::DropoutStep;
use crate::gpt::{Gpt, GptConfig};
use crate::llama::{Llama, LlamaConfig};
use crate::reshard::Reshard;

/// A sharded language model a training loop can train, evaluate and checkpoint (through
/// [`Reshard`]) without knowing which one it is.
pub trait LanguageModel: Module + Reshard + Clone + Send + 'static {
    /// Its configuration (serializable: a sharded checkpoint records it).
    type Config: Clone + Send + Sync + serde::Serialize + 'static;

    /// This rank's shards (the same model at every tp for one seed). Collective.
    ///
    /// # Errors
    /// Sizes that do not fit tp; a communication error.
    fn init(config: &Self::Config, group: &ProcessGroup, device: &Device) -> crate::Result<Self>;

    /// The number of blocks of the model `config` describes.
    fn config_layers(config: &Self::Config) -> usize;

    /// [`init`](Self::init) keeping only blocks `layers` (a pipeline stage's, in order), with the
    /// whole model's weights for them, never holding the other blocks at once.
    ///
    /// # Errors
    /// As [`init`](Self::init); a block the model does not have.
    fn init_stage(
        config: &Self::Config,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> crate::Result<Self>;

    /// Mean next-token loss of `[seq, batch]` ids and targets; `step`: training step (dropout on
    /// with that step's masks, for this dp rank's part of the global batch), `None`:
    /// evaluation.
    ///
    /// # Errors
    /// As the model's `try_loss`.
    fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<1>>;

    /// Vocab-sharded logits `[seq, batch, V_p / tp]` (evaluation).
    ///
    /// # Errors
    /// As the model's `try_forward`.
    fn logits(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>>;

    /// Vocab-sharded logits `[s_new, batch, V_p / tp]` of new positions after those in `cache`
    /// (incremental decoding, ALL_REDUCE mode).
    ///
    /// # Errors
    /// As the model's `try_forward_cached`.
    fn logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>>;

    /// [`logits_cached`](Self::logits_cached) of the last new position only, `[1, batch,
    /// V_p / tp]` (the head runs on that position alone: what generation reads).
    ///
    /// # Errors
    /// As [`logits_cached`](Self::logits_cached).
    fn last_logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>>;

    /// The real vocabulary (the logits' columns past it are padding).
    fn n_vocab(&self) -> usize;

    /// The same model (weights shared) run in `mode` (ALL_REDUCE to decode incrementally).
    fn with_mode(self, mode: crate::linear::TpMode) -> Self;

    /// The first block's input, `[seq, batch]` ids -> `[s(/tp), batch, d_model]` (this rank's
    /// sequence shard in REDUCE_SCATTER mode). With [`layer`](Self::layer) and
    /// [`head_loss`](Self::head_loss), the parts [`loss`](Self::loss) composes, which
    /// [`crate::recompute`] runs one at a time.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn embed(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>>;

    /// The number of blocks held.
    fn num_layers(&self) -> usize;

    /// The whole model's index of each block held, in order: all of them, but on a pipeline
    /// stage.
    fn held_layers(&self) -> Vec<usize>;

    /// This model with blocks `layers` only (the whole model's indices, in order: a pipeline
    /// stage's, or an interleaved stage's several ranges: [`crate::pipeline`]), the others
    /// dropped. [`layer`](Self::layer) still takes the whole model's indices, so the dropout
    /// masks are the same at any number of stages. The embedding and the head stay (the first
    /// stage embeds, the last one runs the head; a tied head needs both):
    /// [`crate::pipeline::drop_unused_ends`] empties them where a stage does not use them.
    ///
    /// # Panics
    /// If a block of `layers` is not held.
    fn keep_layers(self, layers: &[usize]) -> Self;

    /// [`keep_layers`](Self::keep_layers) of the range `layers`.
    ///
    /// # Panics
    /// As [`keep_layers`](Self::keep_layers).
    fn into_stage(self, layers: std::ops::Range<usize>) -> Self
    where
        Self: Sized,
    {
        self.keep_layers(&layers.collect::<Vec<_>>())
    }

    /// Model width.
    fn d_model(&self) -> usize;

    /// The blocks' activation shape for ids of shape `ids` (`[seq, batch]`): `[seq, batch,
    /// d_model]`, or `[seq / tp, ..]` in REDUCE_SCATTER mode (this rank's sequence shard).
    fn activation_shape(&self, ids: [usize; 2]) -> [usize; 3];

    /// The token embedding's table (`[V_p / tp, d_model]`; the head's weight when tied).
    fn embedding_weight(&self) -> &Param<Tensor<2>>;

    /// Whether the head is the embedding's table (tied): then the last pipeline stage uses the
    /// table too, and its gradient is summed over the first and last stages.
    fn tied_head(&self) -> bool;

    /// How many parameters come before the blocks, in each block, and after them, in visiting
    /// order (what [`crate::pipeline::stage_map`] places a stage's parameters by).
    fn param_sections(&self) -> [usize; 3];

    /// Block `index` of `x` (`[s(/tp), batch, d_model]`), dropout on as in
    /// [`loss`](Self::loss) with `step`.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn layer(
        &self,
        index: usize,
        x: Tensor<3>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<3>>;

    /// The mean next-token loss of the last block's output `x` (`[s(/tp), batch, d_model]`):
    /// the final norm, the head and the cross-entropy.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> crate::Result<Tensor<1>>;

    /// The vocabulary-sharded logits `[s, batch, V_p / tp]` of the last block's output `x`
    /// (`[s(/tp), batch, d_model]`): the final norm and the head.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn head_logits(&self, x: Tensor<3>) -> crate::Result<Tensor<3>>;
}

impl LanguageModel for Gpt {
    type Config = GptConfig;

    fn init(config: &GptConfig, group: &ProcessGroup, device: &Device) -> crate::Result<Self> {
        config.init(group, device)
    }

    fn config_layers(config: &GptConfig) -> usize {
        config.n_layers
    }

    fn init_stage(
        config: &GptConfig,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> crate::Result<Self> {
        config.init_layers(group, device, layers)
    }

    fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        _step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<1>> {
        self.try_loss(ids, targets)
    }

    fn logits(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        self.try_forward(ids)
    }

    fn logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        self.try_forward_cached(ids, cache)
    }

    fn last_logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        self.forward_cached(ids, cache, true)
    }

    fn n_vocab(&self) -> usize {
        self.tok.n_vocab()
    }

    fn with_mode(self, mode: crate::linear::TpMode) -> Self {
        Gpt::with_mode(self, mode)
    }

    fn embed(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        Gpt::embed(self, ids)
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn held_layers(&self) -> Vec<usize> {
        self.block_ids().to_vec()
    }

    fn keep_layers(mut self, layers: &[usize]) -> Self {
        self.keep_blocks(layers);
        self
    }

    fn d_model(&self) -> usize {
        self.pos.val().dims()[1]
    }

    fn activation_shape(&self, ids: [usize; 2]) -> [usize; 3] {
        let tp = self.group().world_size();
        activation_shape(
            self.options().settings.mode,
            tp,
            ids,
            LanguageModel::d_model(self),
        )
    }

    fn embedding_weight(&self) -> &Param<Tensor<2>> {
        &self.tok.weight
    }

    fn tied_head(&self) -> bool {
        self.head.is_none()
    }

    fn param_sections(&self) -> [usize; 3] {
        [
            count_params(&self.tok) + 1,
            self.blocks.first().map_or(0, count_params),
            count_params(&self.ln_f) + self.head.as_ref().map_or(0, count_params),
        ]
    }

    fn layer(
        &self,
        index: usize,
        x: Tensor<3>,
        _step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<3>> {
        let block = self.block_at(index)?;
        block.try_forward(x)
    }

    fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> crate::Result<Tensor<1>> {
        self.loss_of_logits(Decoder::logits(self, x)?, targets)
    }

    fn head_logits(&self, x: Tensor<3>) -> crate::Result<Tensor<3>> {
        Decoder::logits(self, x)
    }
}

impl LanguageModel for Llama {
    type Config = LlamaConfig;

    fn init(config: &LlamaConfig, group: &ProcessGroup, device: &Device) -> crate::Result<Self> {
        config.init(group, device)
    }

    fn config_layers(config: &LlamaConfig) -> usize {
        config.n_layers
    }

    fn init_stage(
        config: &LlamaConfig,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> crate::Result<Self> {
        config.init_layers(group, device, layers)
    }

    fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<1>> {
        Ok(self.try_loss(ids, targets, None, step)?.mean)
    }

    fn logits(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        self.try_forward(ids, None)
    }

    fn logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        self.try_forward_cached(ids, cache)
    }

    fn last_logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        self.forward_cached(ids, cache, true)
    }

    fn n_vocab(&self) -> usize {
        Llama::n_vocab(self)
    }

    fn with_mode(self, mode: crate::linear::TpMode) -> Self {
        Llama::with_mode(self, mode)
    }

    fn embed(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        Llama::embed(self, ids)
    }

    fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    fn held_layers(&self) -> Vec<usize> {
        self.block_ids().to_vec()
    }

    fn keep_layers(mut self, layers: &[usize]) -> Self {
        self.keep_blocks(layers);
        self
    }

    fn d_model(&self) -> usize {
        // The table's width: a pipeline stage's empty table keeps it.
        self.embedding_weight().val().dims()[1]
    }

    fn activation_shape(&self, ids: [usize; 2]) -> [usize; 3] {
        let tp = self.group().world_size();
        activation_shape(
            self.options().settings.mode,
            tp,
            ids,
            LanguageModel::d_model(self),
        )
    }

    fn embedding_weight(&self) -> &Param<Tensor<2>> {
        &self.tok.weight
    }

    fn tied_head(&self) -> bool {
        self.head.is_none()
    }

    fn param_sections(&self) -> [usize; 3] {
        [
            count_params(&self.tok),
            self.blocks.first().map_or(0, count_params),
            count_params(&self.norm) + self.head.as_ref().map_or(0, count_params),
        ]
    }

    fn layer(
        &self,
        index: usize,
        x: Tensor<3>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<3>> {
        Llama::layer(self, index, x, step)
    }

    fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> crate::Result<Tensor<1>> {
        Ok(self
            .loss_of_logits(Decoder::logits(self, x)?, targets, None)?
            .mean)
    }

    fn head_logits(&self, x: Tensor<3>) -> crate::Result<Tensor<3>> {
        Decoder::logits(self, x)
    }
}

/// The float parameters of `module`.
fn count_params<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl burn::module::ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut c = Count(0);
    module.visit(&mut c);
    c.0
}

/// `[seq, batch, d]`, or `[seq / tp, ..]` in REDUCE_SCATTER mode.
fn activation_shape(
    mode: crate::linear::TpMode,
    tp: usize,
    [s, b]: [usize; 2],
    d: usize,
) -> [usize; 3] {
    match mode {
        crate::linear::TpMode::AllReduce => [s, b, d],
        crate::linear::TpMode::ReduceScatter => [s / tp, b, d],
    }
}
