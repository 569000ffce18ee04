//! The GPT's layer norm with replicated `gamma` and `beta`.

use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::{norm, replicated_param};
use crate::Result as TpResult;
use crate::backend::NormSpec;
use crate::init::owned;
use crate::linear::TpMode;
use crate::reshard::{ParamLayout, Reshard, solo};

/// Layer norm over the last dim with replicated `gamma`, `beta` (see [`replicated_param`]).
#[derive(Module, Debug)]
pub struct TpLayerNorm {
    /// `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// `[d_model]`.
    pub beta: Param<Tensor<1>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    epsilon: f64,
}

impl TpLayerNorm {
    /// Ones and zeros, like Burn's `LayerNormConfig::init` (epsilon 1e-5).
    pub fn new(d_model: usize, mode: TpMode, group: &ProcessGroup, device: &Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d_model], device)),
            beta: Param::from_tensor(Tensor::zeros([d_model], device)),
            group: group.clone(),
            mode,
            epsilon: 1e-5,
        }
    }

    /// From a Burn `LayerNorm` (its `gamma` and `beta`).
    pub fn from_full(norm: &LayerNorm, mode: TpMode, group: &ProcessGroup) -> Self {
        let gamma = norm.gamma.val();
        let beta = norm
            .beta
            .as_ref()
            .map_or_else(|| gamma.zeros_like(), |b| b.val());
        Self {
            gamma: Param::from_tensor(owned(gamma)),
            beta: Param::from_tensor(owned(beta)),
            group: group.clone(),
            mode,
            epsilon: 1e-5,
        }
    }

    /// As a Burn `LayerNorm` (detached copies).
    pub fn to_full(&self) -> LayerNorm {
        let gamma = self.gamma.val();
        let mut norm = LayerNormConfig::new(gamma.dims()[0]).init(&gamma.device());
        norm.gamma = Param::from_tensor(owned(gamma));
        norm.beta = Some(Param::from_tensor(owned(self.beta.val())));
        norm
    }

    /// Activation layout.
    pub fn mode(&self) -> TpMode {
        self.mode
    }

    /// `[.., d_model] -> [.., d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let gamma = replicated_param(&self.gamma, self.mode, &self.group);
        let beta = replicated_param(&self.beta, self.mode, &self.group);
        let spec = NormSpec {
            rms: false,
            epsilon: self.epsilon,
        };
        norm(x, gamma, Some(beta), spec)
    }
}

impl crate::linear::InMode for TpLayerNorm {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.mode = mode;
        self
    }
}

impl Reshard for TpLayerNorm {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(Self::from_full(&self.to_full(), self.mode(), &solo()))
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(Self::from_full(&full.to_full(), full.mode(), group))
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let r = self.group.rank();
        vec![
            ParamLayout::replicated(self.gamma.val().dims().to_vec(), r),
            ParamLayout::replicated(self.beta.val().dims().to_vec(), r),
        ]
    }
}
