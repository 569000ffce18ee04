//! RMSNorm with a replicated weight (see [`replicated_param`]).

use burn::module::{Module, Param};
use burn::nn::{RmsNorm, RmsNormConfig};
use burn::tensor::{DType, Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::{norm, replicated_param};
use crate::Result as TpResult;
use crate::backend::NormSpec;
use crate::init::owned;
use crate::linear::TpMode;
use crate::reshard::{ParamLayout, Reshard, solo};

/// RMSNorm over the last dim, as Burn's `RmsNorm` (half inputs computed in f32), one op whose
/// backward keeps only the input and the weight ([`TpBackend::tp_norm`](crate::backend::TpBackend::tp_norm)), with a replicated
/// `gamma` whose gradient is summed over the group in REDUCE_SCATTER mode, where each rank
/// normalizes its own sequence shard (like [`TpLayerNorm`](super::TpLayerNorm)).
///
/// With an [`offset`](Self::with_offset) of 1 it is Gemma's RMSNorm, `x / rms(x) * (1 + w)`, the
/// weight stored as `w` (zeros at init) and `1 + w` formed in f32, as transformers does.
#[derive(Module, Debug)]
pub struct TpRmsNorm {
    /// `[d_model]`: the scale, or the scale less the offset.
    pub gamma: Param<Tensor<1>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    epsilon: f64,
    /// Added to `gamma` before it scales (0, or Gemma's 1).
    offset: f64,
}

impl TpRmsNorm {
    /// Ones, like Burn's `RmsNormConfig::init`.
    pub fn new(
        d_model: usize,
        epsilon: f64,
        mode: TpMode,
        group: &ProcessGroup,
        device: &Device,
    ) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d_model], device)),
            group: group.clone(),
            mode,
            epsilon,
            offset: 0.0,
        }
    }

    /// Scales by `gamma + offset` (Gemma's `1 + w`: `offset` 1), `gamma` set to `1 - offset` so
    /// the scale starts at 1.
    pub fn with_offset(mut self, offset: f64) -> Self {
        if offset != 0.0 {
            // A new leaf from the values (an op on the old one would not be a parameter).
            let gamma = self.gamma.val();
            let (device, dtype) = (gamma.device(), gamma.dtype());
            let data = gamma.sub_scalar(offset).into_data();
            self.gamma = Param::from_tensor(Tensor::from_data(data, (&device, dtype)));
        }
        self.offset = offset;
        self
    }

    /// What is added to `gamma` before it scales.
    pub fn offset(&self) -> f64 {
        self.offset
    }

    /// From a Burn `RmsNorm`.
    pub fn from_full(norm: &RmsNorm, mode: TpMode, group: &ProcessGroup) -> Self {
        Self {
            gamma: Param::from_tensor(owned(norm.gamma.val())),
            group: group.clone(),
            mode,
            epsilon: norm.epsilon,
            offset: 0.0,
        }
    }

    /// As a Burn `RmsNorm` (a detached copy; its `gamma` this norm's, without the offset).
    pub fn to_full(&self) -> RmsNorm {
        let gamma = self.gamma.val();
        let mut norm = RmsNormConfig::new(gamma.dims()[0])
            .with_epsilon(self.epsilon)
            .init(&gamma.device());
        norm.gamma = Param::from_tensor(owned(gamma));
        norm
    }

    /// `[.., d_model] -> [.., d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mut gamma = replicated_param(&self.gamma, self.mode, &self.group);
        if self.offset != 0.0 {
            // `1 + w` in f32 for half weights (transformers' Gemma), else in their own dtype.
            if matches!(gamma.dtype(), DType::BF16 | DType::F16) {
                gamma = gamma.cast(DType::F32);
            }
            gamma = gamma.add_scalar(self.offset);
        }
        let spec = NormSpec {
            rms: true,
            epsilon: self.epsilon,
        };
        norm(x, gamma, None, spec)
    }
}

impl crate::linear::InMode for TpRmsNorm {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.mode = mode;
        self
    }
}

/// burn-nn's `RmsNorm` (its epsilon carried over).
impl crate::reshard::Twin<RmsNorm> for TpRmsNorm {
    fn from_twin(full: &RmsNorm, ctx: &crate::reshard::TwinContext) -> crate::Result<Self> {
        Ok(Self::from_full(full, ctx.settings.mode, &ctx.group))
    }
    fn to_twin(&self) -> crate::Result<RmsNorm> {
        Ok(self.to_full())
    }
}

impl Reshard for TpRmsNorm {
    fn to_full_module(&self) -> TpResult<Self> {
        let full = Self::from_full(&self.to_full(), self.mode, &solo());
        Ok(Self {
            offset: self.offset,
            ..full
        })
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        let shard = Self::from_full(&full.to_full(), full.mode, group);
        Ok(Self {
            offset: full.offset,
            ..shard
        })
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let r = self.group.rank();
        vec![ParamLayout::replicated(self.gamma.val().dims().to_vec(), r)]
    }
}
