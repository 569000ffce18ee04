//! [`LanguageModel`]: every decoder-only model behind one trait, so a training loop, its
//! checkpoints, its evaluation and generation are written once for all of them (the example's
//! `train_gpt` is one). A model family implements the few parts that differ (its embedding, a
//! block, its loss of the logits); everything else is written here once. It knows no file
//! format: the sharded checkpoints go through [`Reshard`], Hugging Face's through [`crate::hf`].

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::attention::DecodeCache;
use crate::decoder::DecoderBlock;
use crate::dropout::DropoutStep;
use crate::embedding::{VocabParallelEmbedding, VocabParallelHead};
use crate::linear::{LinearSpec, TpMode, TpSettings};
use crate::reshard::Reshard;

/// A sharded decoder-only language model a training loop can train, evaluate and checkpoint
/// (through [`Reshard`]) without knowing which one it is.
///
/// A model family implements the required methods (its parts: the embedding, the blocks, the
/// final norm, the loss of the logits); the provided ones (the forward, the loss, incremental
/// decoding, pipeline stages) are written once for every family.
pub trait LanguageModel: Module + Reshard + Clone + Send + 'static {
    /// Its configuration (serializable: a sharded checkpoint records it).
    type Config: Clone + Send + Sync + serde::Serialize + 'static;
    /// Its block (one transformer layer).
    type Block: DecoderBlock + Module;
    /// The family's name, in errors.
    const NAME: &'static str;

    /// The number of blocks of the model `config` describes.
    fn config_layers(config: &Self::Config) -> usize;

    /// This rank's shards keeping only blocks `layers` (a pipeline stage's, in order), with the
    /// whole model's weights for them, never holding the other blocks at once (the same model
    /// at every tp for one seed). Collective.
    ///
    /// # Errors
    /// Sizes that do not fit tp; a block the model does not have; a communication error.
    fn init_stage(
        config: &Self::Config,
        group: &ProcessGroup,
        device: &Device,
        layers: &[usize],
    ) -> crate::Result<Self>;

    /// The tensor-parallel group.
    fn group(&self) -> &ProcessGroup;

    /// How the parallel layers run.
    fn settings(&self) -> TpSettings;

    /// The vocabulary-parallel embedding (the head's weight when tied).
    fn embedding(&self) -> &VocabParallelEmbedding;

    /// The lm-head; `None` when tied to the embedding.
    fn head(&self) -> Option<&VocabParallelHead>;

    /// The blocks held, in order.
    fn blocks(&self) -> &[Self::Block];

    /// The whole model's index of each block held, in order: all of them, but on a pipeline
    /// stage.
    fn block_ids(&self) -> &[usize];

    /// The blocks held and their whole-model indices, to keep some of them.
    fn blocks_mut(&mut self) -> (&mut Vec<Self::Block>, &mut Vec<usize>);

    /// The norm after the last block, `[s(/tp), batch, d_model]`.
    fn final_norm(&self, x: Tensor<3>) -> Tensor<3>;

    /// The same model (weights shared) run in `mode` (ALL_REDUCE to decode incrementally).
    fn with_mode(self, mode: TpMode) -> Self;

    /// The first block's input, `[seq, batch]` ids -> `[s(/tp), batch, d_model]` (this rank's
    /// sequence shard in REDUCE_SCATTER mode). With [`layer`](Self::layer) and
    /// [`head_loss`](Self::head_loss), the parts [`loss`](Self::loss) composes, which
    /// [`crate::recompute`] runs one at a time.
    ///
    /// # Errors
    /// A sequence longer than the model takes; ids outside the vocabulary.
    fn embed(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>>;

    /// The embeddings `[s_new, batch, d_model]` of new positions `ids` (`[s_new, batch]`) after
    /// those in `cache` (ALL_REDUCE mode; the cache is already this model's).
    ///
    /// # Errors
    /// As [`embed`](Self::embed).
    fn embed_new(&self, ids: Tensor<2, Int>, cache: &DecodeCache) -> crate::Result<Tensor<3>>;

    /// Block `index` (the whole model's index) of `x` (`[s(/tp), batch, d_model]`), dropout on
    /// as in [`loss`](Self::loss) with `step`.
    ///
    /// # Errors
    /// A block not held; as the block's layers.
    fn layer(
        &self,
        index: usize,
        x: Tensor<3>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<3>>;

    /// The mean next-token loss of vocab-sharded `logits` (`[s, batch, V_p / tp]`; the padding
    /// columns masked out), replicated on every rank.
    ///
    /// # Errors
    /// Targets outside the vocabulary; a communication error.
    fn logits_loss(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> crate::Result<Tensor<1>>;

    /// How many parameters come before the blocks, in each block (the first held; see
    /// [`block_params`](Self::block_params)), and after them, in visiting order (what
    /// [`crate::pipeline::stage_map`] places a stage's parameters by).
    fn param_sections(&self) -> [usize; 3];

    /// The parameters of block `layer` of the whole model, held here or not, with every expert
    /// of a MoE block (as a checkpoint holds them): a model whose blocks differ (dense and MoE
    /// layers) says each; by default every block has the first held one's.
    fn block_params(&self, layer: usize) -> usize {
        let _ = layer;
        self.param_sections()[1]
    }

    /// The same model with every sequence split over `context`'s ranks (`None`: whole
    /// sequences on every rank): [`loss`](Self::loss) and [`embed`](Self::embed) then take this
    /// rank's chunks of the ids and targets (`[seq / cp, batch]`, cut by
    /// [`ContextParallel::split`](crate::context::ContextParallel::split)), each position at its
    /// global place, every attention over the whole sequence by ring attention; the loss is
    /// the mean over this rank's tokens (averaged over the ranks by the data-parallel reduction
    /// the ring is carved out of: [`crate::mesh::DeviceMesh::context_group`]).
    fn with_context_parallel(mut self, context: Option<crate::context::ContextParallel>) -> Self {
        for block in self.blocks_mut().0.iter_mut() {
            block.attention_mut().set_context_parallel(context.clone());
        }
        self
    }

    /// The context-parallel ring the sequences are split over, if any (the first block's).
    fn context_parallel(&self) -> Option<&crate::context::ContextParallel> {
        self.blocks()
            .first()
            .and_then(|b| b.attention().context_parallel())
    }

    /// This rank's shards (the same model at every tp for one seed). Collective.
    ///
    /// # Errors
    /// Sizes that do not fit tp; a communication error.
    fn init(config: &Self::Config, group: &ProcessGroup, device: &Device) -> crate::Result<Self> {
        let all: Vec<usize> = (0..Self::config_layers(config)).collect();
        Self::init_stage(config, group, device, &all)
    }

    /// Mean next-token loss of `[seq, batch]` ids and targets; `step`: training step (dropout on
    /// with that step's masks, for this dp rank's part of the global batch), `None`:
    /// evaluation.
    ///
    /// # Errors
    /// As [`embed`](Self::embed), [`layer`](Self::layer) and [`logits_loss`](Self::logits_loss).
    fn loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<1>> {
        let (logits, routers) = crate::moe::record(|| forward(self, ids, step));
        let loss = self.logits_loss(logits?, targets)?;
        Ok(match self.router_loss(&routers) {
            Some(aux) => loss.clone() + aux.cast(loss.dtype()),
            None => loss,
        })
    }

    /// [`loss`](Self::loss) of ids and targets in Burn's batch-first layout (`[batch, seq]`, as
    /// burn-nn's modules take them), transposed once here into the sequence-first layout every
    /// layer runs in (Megatron's: sequence parallelism splits dim 0).
    ///
    /// # Errors
    /// As [`loss`](Self::loss); ids and targets of different shapes, named.
    fn loss_batch_first(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> crate::Result<Tensor<1>> {
        if ids.dims() != targets.dims() {
            return Err(crate::TpError::Config(format!(
                "loss_batch_first: ids {:?} and targets {:?} ([batch, seq] both)",
                ids.dims(),
                targets.dims()
            )));
        }
        self.loss(ids.swap_dims(0, 1), targets.swap_dims(0, 1), step)
    }

    /// [`logits`](Self::logits) in Burn's batch-first layout: `[batch, seq]` ids ->
    /// `[batch, seq, V_p / tp]` vocab-sharded logits (each transposed once, at the edges).
    ///
    /// # Errors
    /// As [`logits`](Self::logits).
    fn logits_batch_first(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        Ok(self.logits(ids.swap_dims(0, 1))?.swap_dims(0, 1))
    }

    /// The parameters held by expert-parallel groups (the MoE layers' experts): reduced over
    /// the ranks holding the same experts, not the whole dp group ([`crate::dp::Experts`]).
    fn expert_params(&self) -> Vec<burn::module::ParamId> {
        Vec::new()
    }

    /// The experts each MoE layer's router chooses among when
    /// [`router_loss`](Self::router_loss) adds anything (the config's weights and experts, the
    /// same on every pipeline stage, whether it holds MoE layers or not); 0 otherwise.
    fn router_loss_experts(&self) -> usize {
        0
    }

    /// The routers' losses of a forward's MoE layers (their statistics in order), added to the
    /// training loss: none for a dense model.
    fn router_loss(&self, stats: &[crate::moe::RouterStats]) -> Option<Tensor<1>> {
        let _ = stats;
        None
    }

    /// Vocab-sharded logits `[seq, batch, V_p / tp]` (evaluation).
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn logits(&self, ids: Tensor<2, Int>) -> crate::Result<Tensor<3>> {
        forward(self, ids, None)
    }

    /// Vocab-sharded logits `[s_new, batch, V_p / tp]` of new positions after those in `cache`
    /// (incremental decoding, ALL_REDUCE mode).
    ///
    /// # Errors
    /// As [`embed_new`](Self::embed_new) and
    /// [`ParallelAttention::try_forward_cached`](crate::attention::ParallelAttention::try_forward_cached).
    fn logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        decode(self, ids, cache, false)
    }

    /// [`logits_cached`](Self::logits_cached) of the last new position only, `[1, batch,
    /// V_p / tp]` (the head runs on that position alone: what generation reads).
    ///
    /// # Errors
    /// As [`logits_cached`](Self::logits_cached).
    fn last_logits_cached(
        &self,
        ids: Tensor<2, Int>,
        cache: &mut DecodeCache,
    ) -> crate::Result<Tensor<3>> {
        decode(self, ids, cache, true)
    }

    /// The real vocabulary (the logits' columns past it are padding).
    fn n_vocab(&self) -> usize {
        self.embedding().n_vocab()
    }

    /// The number of blocks held.
    fn num_layers(&self) -> usize {
        self.blocks().len()
    }

    /// [`block_ids`](Self::block_ids), owned.
    fn held_layers(&self) -> Vec<usize> {
        self.block_ids().to_vec()
    }

    /// This model with blocks `layers` only (the whole model's indices, in order: a pipeline
    /// stage's, or an interleaved stage's several ranges: [`crate::pipeline`]), the others
    /// dropped. [`layer`](Self::layer) still takes the whole model's indices, so the dropout
    /// masks are the same at any number of stages. The embedding and the head stay (the first
    /// stage embeds, the last one runs the head; a tied head needs both):
    /// [`crate::pipeline::drop_unused_ends`] empties them where a stage does not use them.
    ///
    /// # Panics
    /// If a block of `layers` is not held.
    fn keep_layers(mut self, layers: &[usize]) -> Self {
        let (blocks, ids) = self.blocks_mut();
        crate::decoder::keep_blocks(Self::NAME, blocks, ids, layers);
        self
    }

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

    /// Model width (the embedding table's: a pipeline stage's empty table keeps it).
    fn d_model(&self) -> usize {
        self.embedding_weight().val().dims()[1]
    }

    /// The blocks' activation shape for ids of shape `ids` (`[seq, batch]`): `[seq, batch,
    /// d_model]`, or `[seq / tp, ..]` in REDUCE_SCATTER mode (this rank's sequence shard).
    fn activation_shape(&self, [s, b]: [usize; 2]) -> [usize; 3] {
        let d = self.d_model();
        match self.settings().mode {
            TpMode::AllReduce => [s, b, d],
            TpMode::ReduceScatter => [s / self.group().world_size(), b, d],
        }
    }

    /// The token embedding's table (`[V_p / tp, d_model]`; the head's weight when tied).
    fn embedding_weight(&self) -> &Param<Tensor<2>> {
        &self.embedding().weight
    }

    /// Whether the head is the embedding's table (tied): then the last pipeline stage uses the
    /// table too, and its gradient is summed over the first and last stages.
    fn tied_head(&self) -> bool {
        self.head().is_none()
    }

    /// The mean next-token loss of the last block's output `x` (`[s(/tp), batch, d_model]`):
    /// the final norm, the head and the cross-entropy.
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> crate::Result<Tensor<1>> {
        self.logits_loss(self.head_logits(x)?, targets)
    }

    /// The vocabulary-sharded logits `[s, batch, V_p / tp]` of the last block's output `x`
    /// (`[s(/tp), batch, d_model]`): the final norm, then the head (or the embedding's weight,
    /// tied).
    ///
    /// # Errors
    /// As [`loss`](Self::loss).
    fn head_logits(&self, x: Tensor<3>) -> crate::Result<Tensor<3>> {
        final_logits(self, x)
    }
}

/// The final norm of `x` (`[s(/tp), batch, d_model]`), then the head (or the embedding's
/// weight, tied): `[s, batch, V_p / tp]`. [`LanguageModel::head_logits`] unless a family
/// changes the logits after (Gemma's soft cap).
pub(crate) fn final_logits<M: LanguageModel>(model: &M, x: Tensor<3>) -> crate::Result<Tensor<3>> {
    let x = model.final_norm(x);
    match model.head() {
        Some(head) => head.try_forward(x),
        None => model
            .embedding()
            .try_tied_logits(x, LinearSpec::new(model.settings())),
    }
}

/// Logits `[seq, batch, V_p / tp]` of `ids` through every block held; dropout on with `step`.
pub(crate) fn forward<M: LanguageModel>(
    model: &M,
    ids: Tensor<2, Int>,
    step: Option<DropoutStep>,
) -> crate::Result<Tensor<3>> {
    let mut x = model.embed(ids)?;
    for &i in model.block_ids() {
        x = model.layer(i, x, step)?;
    }
    model.head_logits(x)
}

/// `ids` (`[seq, batch]`) within the `table` positions a model's rotary table covers (any
/// without one).
///
/// # Errors
/// [`TpError::Shape`](crate::TpError::Shape) naming `model`, the limit and the ids' shape.
pub(crate) fn check_positions(
    model: &'static str,
    ids: &Tensor<2, Int>,
    table: Option<usize>,
) -> crate::Result<()> {
    match table {
        Some(max_seq) if ids.dims()[0] > max_seq => Err(crate::TpError::Shape {
            op: model,
            expected: format!("[seq <= {max_seq}, batch]"),
            got: ids.dims().to_vec(),
        }),
        _ => Ok(()),
    }
}

/// Block `index` (the whole model's) of `model`, if held.
///
/// # Errors
/// [`TpError::Config`](crate::TpError::Config) naming the model, the block and what is held.
pub(crate) fn block_at<M: LanguageModel>(model: &M, index: usize) -> crate::Result<&M::Block> {
    crate::decoder::block_at(M::NAME, model.blocks(), model.block_ids(), index)
}

/// Positions already in `cache`, after making it `model`'s (one cache per block; a cache of
/// another model is started afresh).
pub(crate) fn cached_positions<M: LanguageModel>(model: &M, cache: &mut DecodeCache) -> usize {
    let n = model.blocks().len();
    if cache.layers.len() != n {
        let padding = std::mem::take(&mut cache.padding);
        *cache = DecodeCache::new(n);
        cache.padding = padding;
    }
    cache.len()
}

/// Logits of new positions `ids` (`[s_new, batch]`) after those in `cache`, which they join;
/// of the last one only (`[1, batch, V_p / tp]`) with `last_only`, as generation needs.
pub(crate) fn decode<M: LanguageModel>(
    model: &M,
    ids: Tensor<2, Int>,
    cache: &mut DecodeCache,
    last_only: bool,
) -> crate::Result<Tensor<3>> {
    cached_positions(model, cache);
    let mut x = model.embed_new(ids, cache)?;
    for (block, kv) in model.blocks().iter().zip(&mut cache.layers) {
        kv.padding.clone_from(&cache.padding);
        x = block.try_forward_cached(x, kv)?;
    }
    if last_only {
        let s = x.dims()[0];
        x = x.narrow(0, s - 1, 1);
    }
    model.head_logits(x)
}

/// The float parameters of `module` (for [`LanguageModel::param_sections`]).
pub(crate) fn count_params<M: Module>(module: &M) -> usize {
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

/// The ids of `module`'s float parameters, in visiting order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// The accessors of [`LanguageModel`] every family writes alike, for a model whose fields are
/// `tok`, `head`, `blocks` (of `$block`), `block_ids`, `group` and `options.settings` (the
/// GPT's, the Llama's, Gemma's); plus its name, config and `init_stage`: expands inside an
/// `impl LanguageModel for ...` block.
macro_rules! family_parts {
    ($name:literal, $config:ty, $block:ty) => {
        type Config = $config;
        type Block = $block;
        const NAME: &'static str = $name;

        fn config_layers(config: &$config) -> usize {
            config.n_layers
        }

        fn init_stage(
            config: &$config,
            group: &burn_tp_comm::ProcessGroup,
            device: &burn::tensor::Device,
            layers: &[usize],
        ) -> $crate::Result<Self> {
            config.init_layers(group, device, layers)
        }

        fn group(&self) -> &burn_tp_comm::ProcessGroup {
            &self.group
        }

        fn settings(&self) -> $crate::linear::TpSettings {
            self.options.settings
        }

        fn embedding(&self) -> &$crate::embedding::VocabParallelEmbedding {
            &self.tok
        }

        fn head(&self) -> Option<&$crate::embedding::VocabParallelHead> {
            self.head.as_ref()
        }

        fn blocks(&self) -> &[$block] {
            &self.blocks
        }

        fn block_ids(&self) -> &[usize] {
            &self.block_ids
        }

        fn blocks_mut(&mut self) -> (&mut Vec<$block>, &mut Vec<usize>) {
            (&mut self.blocks, &mut self.block_ids)
        }
    };
}
pub(crate) use family_parts;
