//! Vocab-parallel embedding (Megatron): the table is sharded by vocabulary rows.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Embedding, Initializer, Linear};
use burn::tensor::{Device, FloatDType, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::error::check_divisible;
use crate::init::{init_replicated, owned, shard};
use crate::linear::{LinearSpec, TpMode, TpSettings};
use crate::ops::{all_gather, reduce_from_tp_region, reduce_scatter};
use crate::reshard::{ParamLayout, Reshard, solo};
use crate::{Result as TpResult, TpError};

/// The vocabulary padded to a multiple of `multiple * tp` (Megatron's
/// `make_vocab_size_divisible_by`), so any tokenizer size shards at any tp.
pub(crate) fn padded_vocab(n_vocab: usize, multiple: usize, tp: usize) -> usize {
    n_vocab.next_multiple_of(multiple.max(1) * tp)
}

/// Configuration of a [`VocabParallelEmbedding`]; mirrors Burn's `EmbeddingConfig`.
#[derive(Config, Debug)]
pub struct VocabParallelEmbeddingConfig {
    /// Vocabulary size (any: the table is padded to a multiple of `vocab_multiple * tp` rows,
    /// zero and never looked up).
    pub n_vocab: usize,
    /// Embedding width.
    pub d_model: usize,
    /// The model's settings; the embedding uses their mode: output replicated (ALL_REDUCE) or
    /// sharded on dim 0 (REDUCE_SCATTER).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// Initializer of the full table (Burn's `EmbeddingConfig` default).
    #[config(default = "Initializer::Normal{mean:0.0, std:1.0}")]
    pub initializer: Initializer,
    /// The padded vocabulary is a multiple of `vocab_multiple * tp` (Megatron's `make_vocab_size_divisible_by`).
    #[config(default = 1)]
    pub vocab_multiple: usize,
}

/// Embedding whose rows are split over the tensor-parallel group: rank `r` holds ids
/// `r * V_p/tp .. (r+1) * V_p/tp` of the padded vocabulary `V_p` (a multiple of `vocab_multiple * tp`, [`Self::padded_vocab`]; the
/// padding rows are zero and never looked up). Ids outside that range look up zero; the partial
/// embeddings are then summed over the group (all-reduce, or reduce-scatter over dim 0 in
/// REDUCE_SCATTER mode).
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// `[V_p / tp, d_model]`.
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    #[module(skip)]
    n_vocab: usize,
    #[module(skip)]
    vocab_multiple: usize,
}

/// `full` (`[n_vocab, ..]` along `dim`) padded with zeros to `padded` along `dim`, and this rank's
/// chunk of it.
pub(crate) fn pad_and_shard(
    full: Tensor<2>,
    dim: usize,
    padded: usize,
    group: &ProcessGroup,
) -> Tensor<2> {
    let mut dims = full.dims();
    let extra = padded - dims[dim];
    let full = if extra > 0 {
        dims[dim] = extra;
        let zeros = Tensor::zeros(dims, (&full.device(), full.dtype()));
        Tensor::cat(vec![full, zeros], dim)
    } else {
        full
    };
    shard(full, dim, group)
}

/// Maps global vocabulary ids to this rank's rows: `(ids - r * v_local)` clamped into
/// `0..v_local`, and the mask of the ids this rank holds.
pub(crate) fn local_ids<const D: usize>(
    ids: Tensor<D, Int>,
    v_local: usize,
    group: &ProcessGroup,
) -> (Tensor<D, Int>, Tensor<D, burn::tensor::Bool>) {
    let local = ids - (group.rank() * v_local) as i64;
    let mine = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(v_local as i64));
    (local.clamp(0, v_local as i64 - 1), mine)
}

/// Checks that every id is in `0..vocab`.
pub(crate) fn check_ids(ids: &Tensor<2, Int>, vocab: usize) -> TpResult<()> {
    if ids.shape().num_elements() == 0 {
        return Ok(());
    }
    let max = ids.clone().max().into_scalar::<i64>();
    let min = ids.clone().min().into_scalar::<i64>();
    for id in [max, min] {
        if id < 0 || id as usize >= vocab {
            return Err(TpError::OutOfRange { id, vocab });
        }
    }
    Ok(())
}

impl VocabParallelEmbeddingConfig {
    /// Initializes this rank's rows of the table Burn's `EmbeddingConfig::init` gives at tp = 1
    /// (then padded). Collective over `group`.
    ///
    /// # Errors
    /// A communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<VocabParallelEmbedding> {
        let full = init_replicated(
            &self.initializer,
            [self.n_vocab, self.d_model],
            None,
            None,
            group,
            device,
        )?;
        Ok(VocabParallelEmbedding::build(
            full,
            group,
            self.settings.mode,
            self.vocab_multiple,
        ))
    }
}

/// burn-nn's `Embedding` (`[n_vocab, d_model]`), its rows split over the group (padded).
impl crate::reshard::Twin<Embedding> for VocabParallelEmbedding {
    fn from_twin(full: &Embedding, ctx: &crate::reshard::TwinContext) -> TpResult<Self> {
        Self::from_full(full, &ctx.group, ctx.settings.mode)
    }
    fn to_twin(&self) -> TpResult<Embedding> {
        self.to_full()
    }
}

impl VocabParallelEmbedding {
    /// The group this layer's vocabulary rows are sharded over (what a model of one's own
    /// passes to its other layers and to [`crate::norm::replicated_param`]).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Shards a full Burn `Embedding` (`[n_vocab, d_model]`), padded to a multiple of tp rows.
    ///
    /// # Errors
    /// None today (kept for the configs' symmetry).
    pub fn from_full(embedding: &Embedding, group: &ProcessGroup, mode: TpMode) -> TpResult<Self> {
        Ok(Self::build(embedding.weight.val(), group, mode, 1))
    }

    fn build(full: Tensor<2>, group: &ProcessGroup, mode: TpMode, vocab_multiple: usize) -> Self {
        let [n_vocab, _] = full.dims();
        let padded = padded_vocab(n_vocab, vocab_multiple, group.world_size());
        Self {
            weight: Param::from_tensor(pad_and_shard(full, 0, padded, group)),
            group: group.clone(),
            mode,
            n_vocab,
            vocab_multiple,
        }
    }

    /// Gathers the full Burn `Embedding` (`[n_vocab, d_model]`, without the padding) on every
    /// rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> TpResult<Embedding> {
        let all = all_gather(self.weight.val(), 0, &self.group)?;
        // An emptied table (a pipeline stage's unused copy) stays empty.
        let all = match all.dims()[0] {
            0 => all,
            _ => all.narrow(0, 0, self.n_vocab),
        };
        Ok(Embedding {
            weight: Param::from_tensor(owned(all)),
        })
    }

    /// The padded vocabulary (rows over all ranks).
    pub fn padded_vocab(&self) -> usize {
        self.weight.dims()[0] * self.group.world_size()
    }

    /// Output layout.
    pub fn mode(&self) -> TpMode {
        self.mode
    }

    /// Full vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Forward pass.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[d0, d1] -> [d0, d1, d_model]`, replicated
    /// - REDUCE_SCATTER: `[s, b] -> [s / tp, b, d_model]` (ids of the full sequence on every rank)
    ///
    /// # Panics
    /// [`TpError::OutOfRange`] for an id outside `0..n_vocab` (the real one); [`TpError::NotDivisible`] if
    /// `s % tp != 0` in REDUCE_SCATTER mode; a communication error.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        check_ids(&ids, self.n_vocab)?;
        let _scope = burn_tp_comm::profile::scope("VocabParallelEmbedding.forward");
        let tp = self.group.world_size();
        let [s, _] = ids.dims();
        if self.mode == TpMode::ReduceScatter {
            check_divisible("VocabParallelEmbedding: dim 0 (sequence) of the ids", s, tp)?;
        }
        let weight = self.weight.val();
        if tp == 1 {
            return Ok(burn::tensor::module::embedding(weight, ids));
        }
        let (local, mine) = local_ids(ids, weight.dims()[0], &self.group);
        let mask = mine
            .cast(FloatDType::from(weight.dtype()))
            .unsqueeze_dim::<3>(2);
        let partial = burn::tensor::module::embedding(weight, local) * mask;
        match self.mode {
            TpMode::AllReduce => reduce_from_tp_region(partial, &self.group),
            TpMode::ReduceScatter => reduce_scatter(partial, 0, &self.group),
        }
    }

    /// Logits of a head tied to this table: the shard `[V_p / tp, d_model]` is the column shard
    /// `[d_model, V_p / tp]` of the head, so this is a column-parallel linear over it.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_model] -> [.., V_p / tp]`
    /// - REDUCE_SCATTER: `[s / tp, .., d_model] -> [s, .., V_p / tp]`
    ///
    /// # Errors
    /// As [`column_parallel_linear`](crate::linear::column_parallel_linear).
    pub fn try_tied_logits<const D: usize>(
        &self,
        x: Tensor<D>,
        spec: LinearSpec,
    ) -> TpResult<Tensor<D>> {
        let weight = self.weight.val().transpose();
        crate::linear::column_parallel_linear(x, weight, None, spec, &self.group)
    }
}

impl crate::linear::InMode for VocabParallelEmbedding {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.mode = mode;
        self
    }
}

impl crate::linear::InMode for VocabParallelHead {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.spec.settings.mode = mode;
        self
    }
}

impl Reshard for VocabParallelEmbedding {
    fn to_full_module(&self) -> TpResult<Self> {
        let full = self.to_full()?.weight.val();
        Ok(Self::build(full, &solo(), self.mode, self.vocab_multiple))
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        let table = full.to_full()?.weight.val();
        Ok(Self::build(table, group, full.mode, full.vocab_multiple))
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let (r, tp) = (self.group.rank(), self.group.world_size());
        let [local, d_model] = self.weight.dims();
        vec![ParamLayout::padded_block(
            vec![self.n_vocab, d_model],
            0,
            local * tp,
            r,
            tp,
        )]
    }
}

/// The vocab-parallel lm-head over a padded vocabulary: a column-parallel linear
/// `d_model -> V_p` without bias, whose padding columns are zero (mask them out of the loss with
/// [`CrossEntropyOptions::n_vocab`](crate::loss::CrossEntropyOptions)). Its full form is the
/// unpadded Burn `Linear` `[d_model, n_vocab]`, so checkpoints move between tp sizes whose
/// paddings differ.
#[derive(Module, Debug)]
pub struct VocabParallelHead {
    /// `[d_model, V_p / tp]`.
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    spec: LinearSpec,
    #[module(skip)]
    n_vocab: usize,
    #[module(skip)]
    vocab_multiple: usize,
}

impl VocabParallelHead {
    /// The group this layer's vocabulary rows are sharded over (what a model of one's own
    /// passes to its other layers and to [`crate::norm::replicated_param`]).
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The head Burn's `LinearConfig::new(d_model, n_vocab).with_bias(false)` gives at tp = 1
    /// (same seed, same draws), padded and sharded. Collective over `group`.
    ///
    /// # Errors
    /// A communication error.
    pub fn init(
        d_model: usize,
        n_vocab: usize,
        vocab_multiple: usize,
        spec: LinearSpec,
        group: &ProcessGroup,
        device: &Device,
    ) -> TpResult<Self> {
        let initializer = Initializer::KaimingUniform {
            gain: crate::linear::INIT_GAIN,
            fan_out_only: false,
        };
        let full = crate::linear::init_full(d_model, n_vocab, false, &initializer, group, device)?;
        Self::from_full(&full, group, spec, vocab_multiple)
    }

    /// Pads and shards a full Burn `Linear` (`[d_model, n_vocab]`; its bias, if any, is
    /// rejected).
    ///
    /// # Errors
    /// [`TpError::Config`] for a `Linear` with a bias.
    pub fn from_full(
        linear: &Linear,
        group: &ProcessGroup,
        spec: LinearSpec,
        vocab_multiple: usize,
    ) -> TpResult<Self> {
        if linear.bias.is_some() {
            return Err(TpError::Config(
                "VocabParallelHead: the lm-head has no bias".into(),
            ));
        }
        let [_, n_vocab] = linear.weight.dims();
        let padded = padded_vocab(n_vocab, vocab_multiple, group.world_size());
        Ok(Self {
            weight: Param::from_tensor(pad_and_shard(linear.weight.val(), 1, padded, group)),
            group: group.clone(),
            spec,
            n_vocab,
            vocab_multiple,
        })
    }

    /// The full, unpadded Burn `Linear` `[d_model, n_vocab]` on every rank (detached).
    /// Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> TpResult<Linear> {
        let all = all_gather(self.weight.val(), 1, &self.group)?;
        Ok(Linear {
            weight: Param::from_tensor(owned(all.narrow(1, 0, self.n_vocab))),
            bias: None,
        })
    }

    /// The real vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Vocab-sharded logits, padding columns included (zero weights).
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_model] -> [.., V_p / tp]`
    /// - REDUCE_SCATTER: `[s / tp, .., d_model] -> [s, .., V_p / tp]`
    ///
    /// # Panics
    /// As [`ColumnParallelLinear::forward`](crate::linear::ColumnParallelLinear::forward).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward<const D: usize>(&self, x: Tensor<D>) -> TpResult<Tensor<D>> {
        crate::linear::column_parallel_linear(x, self.weight.val(), None, self.spec, &self.group)
    }
}

impl Reshard for VocabParallelHead {
    fn to_full_module(&self) -> TpResult<Self> {
        Self::from_full(&self.to_full()?, &solo(), self.spec, self.vocab_multiple)
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Self::from_full(&full.to_full()?, group, full.spec, full.vocab_multiple)
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let (r, tp) = (self.group.rank(), self.group.world_size());
        let [d_model, local] = self.weight.dims();
        vec![ParamLayout::padded_block(
            vec![d_model, self.n_vocab],
            1,
            local * tp,
            r,
            tp,
        )]
    }
}
