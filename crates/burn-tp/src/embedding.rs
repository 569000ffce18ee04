//! Vocab-parallel embedding (Megatron): the table is sharded by vocabulary rows.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Embedding, Initializer};
use burn::tensor::{Device, FloatDType, Int, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::error::check_divisible;
use crate::init::{init_replicated, owned, shard};
use crate::linear::TpMode;
use crate::ops::{all_gather, reduce_from_tp_region, reduce_scatter};
use crate::reshard::{Reshard, solo};
use crate::{Result as TpResult, TpError};

/// Configuration of a [`VocabParallelEmbedding`]; mirrors Burn's `EmbeddingConfig`.
#[derive(Config, Debug)]
pub struct VocabParallelEmbeddingConfig {
    /// Vocabulary size over all ranks (a multiple of tp).
    pub n_vocab: usize,
    /// Embedding width.
    pub d_model: usize,
    /// Output layout: replicated (ALL_REDUCE) or sharded on dim 0 (REDUCE_SCATTER).
    #[config(default = "TpMode::AllReduce")]
    pub mode: TpMode,
    /// Initializer of the full table (Burn's `EmbeddingConfig` default).
    #[config(default = "Initializer::Normal{mean:0.0, std:1.0}")]
    pub initializer: Initializer,
}

/// Embedding whose rows are split over the tensor-parallel group: rank `r` holds ids
/// `r * V/tp .. (r+1) * V/tp`. Ids outside that range look up zero; the partial embeddings are
/// then summed over the group (all-reduce, or reduce-scatter over dim 0 in REDUCE_SCATTER mode).
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// `[n_vocab / tp, d_model]`.
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    #[module(skip)]
    n_vocab: usize,
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
    /// Initializes this rank's rows of the table Burn's `EmbeddingConfig::init` gives at tp = 1.
    /// Collective over `group`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `n_vocab % tp != 0`; a communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<VocabParallelEmbedding> {
        let tp = group.world_size();
        check_divisible("VocabParallelEmbedding n_vocab", self.n_vocab, tp)?;
        let full = init_replicated(
            &self.initializer,
            [self.n_vocab, self.d_model],
            None,
            None,
            group,
            device,
        )?;
        Ok(VocabParallelEmbedding {
            weight: Param::from_tensor(shard(full, 0, group)),
            group: group.clone(),
            mode: self.mode,
            n_vocab: self.n_vocab,
        })
    }
}

impl VocabParallelEmbedding {
    /// Shards a full Burn `Embedding` (`[n_vocab, d_model]`).
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `n_vocab % tp != 0`.
    pub fn from_full(embedding: &Embedding, group: &ProcessGroup, mode: TpMode) -> TpResult<Self> {
        let [n_vocab, _] = embedding.weight.val().dims();
        let tp = group.world_size();
        check_divisible("VocabParallelEmbedding n_vocab", n_vocab, tp)?;
        Ok(Self {
            weight: Param::from_tensor(shard(embedding.weight.val(), 0, group)),
            group: group.clone(),
            mode,
            n_vocab,
        })
    }

    /// Gathers the full Burn `Embedding` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> TpResult<Embedding> {
        Ok(Embedding {
            weight: Param::from_tensor(owned(all_gather(self.weight.val(), 0, &self.group)?)),
        })
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
    /// [`TpError::OutOfRange`] for an id outside `0..n_vocab`; [`TpError::NotDivisible`] if
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
}

impl Reshard for VocabParallelEmbedding {
    fn to_full_module(&self) -> TpResult<Self> {
        Self::from_full(&self.to_full()?, &solo(), self.mode())
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Self::from_full(&full.to_full()?, group, full.mode())
    }
}
