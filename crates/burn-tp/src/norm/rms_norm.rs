//! RMSNorm with a replicated weight (see [`replicated_param`]).

use burn::module::{Module, Param};
use burn::nn::{RmsNorm, RmsNormConfig};
use burn::tensor::{Device, Tensor};
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
#[derive(Module, Debug)]
pub struct TpRmsNorm {
    /// `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    epsilon: f64,
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
        }
    }

    /// From a Burn `RmsNorm`.
    pub fn from_full(norm: &RmsNorm, mode: TpMode, group: &ProcessGroup) -> Self {
        Self {
            gamma: Param::from_tensor(owned(norm.gamma.val())),
            group: group.clone(),
            mode,
            epsilon: norm.epsilon,
        }
    }

    /// As a Burn `RmsNorm` (a detached copy).
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
        let gamma = replicated_param(&self.gamma, self.mode, &self.group);
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

impl Reshard for TpRmsNorm {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(Self::from_full(&self.to_full(), self.mode, &solo()))
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(Self::from_full(&full.to_full(), full.mode, group))
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let r = self.group.rank();
        vec![ParamLayout::replicated(self.gamma.val().dims().to_vec(), r)]
    }
}
