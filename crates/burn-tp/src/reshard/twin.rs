//! [`Twin`]: a parallel module and its plain burn-nn twin, each made from the other field by
//! field (`#[derive(Twin)]` for a struct of one's own whose fields are named as its twin's).
//!
//! | parallel | plain (burn-nn) |
//! |---|---|
//! | `ColumnParallelLinear`, `RowParallelLinear` | `Linear` |
//! | `VocabParallelEmbedding` | `Embedding` |
//! | `TpLayerNorm`, `TpRmsNorm` | `LayerNorm`, `RmsNorm` |
//! | `ParallelAttention` | `attention::MultiHeadAttention` |
//! | `Param<Tensor<D>>` (replicated) | `Param<Tensor<D>>` |
//! | `Vec<T>`, `Option<T>` of those | `Vec<F>`, `Option<F>` |

use burn::module::Param;
use burn::tensor::Tensor;
use burn_tp_comm::ProcessGroup;

use crate::Result;
use crate::backend::types::TpSettings;
use crate::init::owned;

/// What a parallel module made from its plain twin needs besides the twin: the group it is
/// sharded over, how its layers run, and (for attention) whether it is causal.
#[derive(Clone, Debug)]
pub struct TwinContext {
    /// The tensor-parallel group.
    pub group: ProcessGroup,
    /// How the parallel layers run (mode, overlap, kernels).
    pub settings: TpSettings,
    /// Whether attention layers see only the past (a decoder's); burn-nn's
    /// `MultiHeadAttention` sees every key unless masked, so `false` by default.
    pub causal: bool,
}

impl TwinContext {
    /// `group`, default settings, non-causal attention.
    pub fn new(group: &ProcessGroup) -> Self {
        Self {
            group: group.clone(),
            settings: TpSettings::new(),
            causal: false,
        }
    }

    /// With `settings`.
    pub fn with_settings(mut self, settings: TpSettings) -> Self {
        self.settings = settings;
        self
    }

    /// With causal attention layers.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
}

/// A parallel module and its plain twin `F` (a burn-nn module, or a struct of them).
pub trait Twin<F>: Sized {
    /// This rank's shards of `full`.
    ///
    /// # Errors
    /// Sizes that do not split over the group; a setting that does not carry over (named).
    fn from_twin(full: &F, ctx: &TwinContext) -> Result<Self>;

    /// The plain twin, gathered (on every rank). Collective.
    ///
    /// # Errors
    /// A communication error; a setting the twin cannot hold (named).
    fn to_twin(&self) -> Result<F>;
}

/// A replicated parameter: every rank its own copy.
impl<const D: usize> Twin<Param<Tensor<D>>> for Param<Tensor<D>> {
    fn from_twin(full: &Param<Tensor<D>>, _ctx: &TwinContext) -> Result<Self> {
        Ok(Param::from_tensor(owned(full.val())))
    }
    fn to_twin(&self) -> Result<Param<Tensor<D>>> {
        Ok(Param::from_tensor(owned(self.val())))
    }
}

impl<T: Twin<F>, F> Twin<Vec<F>> for Vec<T> {
    fn from_twin(full: &Vec<F>, ctx: &TwinContext) -> Result<Self> {
        full.iter().map(|f| T::from_twin(f, ctx)).collect()
    }
    fn to_twin(&self) -> Result<Vec<F>> {
        self.iter().map(Twin::to_twin).collect()
    }
}

impl<T: Twin<F>, F> Twin<Option<F>> for Option<T> {
    fn from_twin(full: &Option<F>, ctx: &TwinContext) -> Result<Self> {
        full.as_ref().map(|f| T::from_twin(f, ctx)).transpose()
    }
    fn to_twin(&self) -> Result<Option<F>> {
        self.as_ref().map(Twin::to_twin).transpose()
    }
}
