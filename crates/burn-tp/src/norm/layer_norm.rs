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
    /// Ones and zeros, like Burn's `LayerNormConfig::init` (epsilon 1e-5, Burn's default;
    /// [`with_epsilon`](Self::with_epsilon) for another).
    pub fn new(d_model: usize, mode: TpMode, group: &ProcessGroup, device: &Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d_model], device)),
            beta: Param::from_tensor(Tensor::zeros([d_model], device)),
            group: group.clone(),
            mode,
            epsilon: 1e-5,
        }
    }

    /// The same norm with `epsilon` added to the variance.
    pub fn with_epsilon(mut self, epsilon: f64) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// The value added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// From a Burn `LayerNorm`: its `gamma`, `beta` and epsilon.
    ///
    /// # Panics
    /// As [`try_from_full`](Self::try_from_full).
    pub fn from_full(norm: &LayerNorm, mode: TpMode, group: &ProcessGroup) -> Self {
        Self::try_from_full(norm, mode, group).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`from_full`](Self::from_full), fallible.
    ///
    /// # Errors
    /// A `LayerNorm` without `beta` (`LayerNormConfig::with_bias(false)`): this norm always
    /// has one, which training would move away from zero.
    pub fn try_from_full(norm: &LayerNorm, mode: TpMode, group: &ProcessGroup) -> TpResult<Self> {
        let gamma = norm.gamma.val();
        let Some(beta) = norm.beta.as_ref() else {
            return Err(crate::TpError::Config(format!(
                "TpLayerNorm::from_full: a LayerNorm of d_model {} without beta (bias: false) \
                 is not supported; TpLayerNorm always has one",
                gamma.dims()[0]
            )));
        };
        Ok(Self {
            gamma: Param::from_tensor(owned(gamma)),
            beta: Param::from_tensor(owned(beta.val())),
            group: group.clone(),
            mode,
            epsilon: burn_nn_epsilon(norm)?,
        })
    }

    /// As a Burn `LayerNorm` (detached copies), with this norm's epsilon.
    pub fn to_full(&self) -> LayerNorm {
        let gamma = self.gamma.val();
        let mut norm = LayerNormConfig::new(gamma.dims()[0])
            .with_epsilon(self.epsilon)
            .init(&gamma.device());
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

/// burn-nn's `LayerNorm` (its epsilon carried over; one without beta refused).
impl crate::reshard::Twin<LayerNorm> for TpLayerNorm {
    fn from_twin(full: &LayerNorm, ctx: &crate::reshard::TwinContext) -> TpResult<Self> {
        Self::try_from_full(full, ctx.settings.mode, &ctx.group)
    }
    fn to_twin(&self) -> TpResult<LayerNorm> {
        Ok(self.to_full())
    }
}

impl Reshard for TpLayerNorm {
    fn to_full_module(&self) -> TpResult<Self> {
        Self::try_from_full(&self.to_full(), self.mode(), &solo())
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Self::try_from_full(&full.to_full(), full.mode(), group)
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let r = self.group.rank();
        vec![
            ParamLayout::replicated(self.gamma.val().dims().to_vec(), r),
            ParamLayout::replicated(self.beta.val().dims().to_vec(), r),
        ]
    }
}

/// A burn-nn `LayerNorm`'s epsilon. burn-nn 0.22 keeps the field private and shows it only in
/// the module's display (`epsilon: 0.00001`, Rust's shortest round-trip form of the `f64`, so
/// the parse is exact); a display without it is an error rather than a silent default.
fn burn_nn_epsilon(norm: &LayerNorm) -> TpResult<f64> {
    let shown = format!("{norm}");
    shown
        .split("epsilon:")
        .nth(1)
        .and_then(|rest| {
            let end = rest.find([',', '}', '\n']).unwrap_or(rest.len());
            rest[..end].trim().parse::<f64>().ok()
        })
        .ok_or_else(|| {
            crate::TpError::Config(format!(
                "TpLayerNorm::from_full: no epsilon in the LayerNorm's display `{shown}`"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burn-nn LayerNorm's epsilon and parameters carried over and back; a bias-less one
    /// refused, naming it.
    #[test]
    fn from_full_carries_burn_nns_epsilon_and_refuses_a_norm_without_beta() {
        let device = Device::flex();
        let group = solo();
        for eps in [1e-5, 1e-6, 0.1, 3.5e-12] {
            let full = LayerNormConfig::new(6).with_epsilon(eps).init(&device);
            let norm = TpLayerNorm::from_full(&full, TpMode::AllReduce, &group);
            assert_eq!(norm.epsilon(), eps);
            assert_eq!(burn_nn_epsilon(&norm.to_full()).unwrap(), eps);
            // The same outputs as burn-nn's at that epsilon (it matters at 0.1).
            let x = Tensor::<2>::from_data([[0.1f32, -0.2, 0.3, 0.05, 0.0, -0.1]], &device);
            let (a, b) = (full.forward(x.clone()), norm.forward(x));
            let diff: f32 = (a - b).abs().max().into_scalar();
            assert!(diff < 1e-5, "epsilon {eps}: {diff}");
        }
        let bare = LayerNormConfig::new(4).with_bias(false).init(&device);
        let err = TpLayerNorm::try_from_full(&bare, TpMode::AllReduce, &group).unwrap_err();
        assert!(err.to_string().contains("without beta"), "{err}");
    }
}
