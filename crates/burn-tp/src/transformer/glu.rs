//! The gated MLP (SwiGLU; GeGLU for Gemma): gate and up as one fused column-parallel layer of
//! two parts of one fused projection.

use burn::backend::Dispatch;
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::Result as TpResult;
pub use crate::backend::GluActivation;
use crate::backend::TpBackend;
use crate::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, FusedPart, RowParallelLinear,
    RowParallelLinearConfig, TpSettings,
};

/// Configuration of a [`ParallelSwiGlu`].
#[derive(Config, Debug)]
pub struct ParallelSwiGluConfig {
    /// Model width.
    pub d_model: usize,
    /// Hidden width over all ranks (a multiple of tp).
    pub d_ff: usize,
    /// The gate's activation: SiLU (SwiGLU) or the tanh GELU (Gemma's GeGLU).
    #[config(default = "GluActivation::Silu")]
    pub activation: GluActivation,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// `down(act(x W_gate) * (x W_up))`, `act` SiLU (Burn's `SwiGlu` with `linear_inner` = gate and
/// `linear_outer` = up, then a down projection; no biases) or the tanh GELU. Gate and up are one column-parallel
/// layer `d_model -> 2 d_ff` with full columns `[gate | up]`, each part sharded on its own, so a
/// rank's shard is `[gate_r | up_r]`; down is row-parallel. One reduction per call.
#[derive(Module, Debug)]
pub struct ParallelSwiGlu {
    /// `d_model -> 2 d_ff / tp` (`[gate_r | up_r]`).
    pub gate_up: ColumnParallelLinear,
    /// `d_ff / tp -> d_model`.
    pub down: RowParallelLinear,
    /// The gate's activation.
    #[module(skip)]
    activation: GluActivation,
}

impl ParallelSwiGluConfig {
    /// Initializes this rank's shards. Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `d_ff % tp != 0`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelSwiGlu> {
        Ok(ParallelSwiGlu {
            gate_up: ColumnParallelLinearConfig::new(self.d_model, 2 * self.d_ff)
                .with_bias(false)
                .with_parts(vec![FusedPart::new(self.d_ff), FusedPart::new(self.d_ff)])
                .with_settings(self.settings)
                .init(group, device)?,
            down: RowParallelLinearConfig::new(self.d_ff, self.d_model)
                .with_bias(false)
                .with_settings(self.settings)
                .init(group, device)?,
            activation: self.activation,
        })
    }
}

impl ParallelSwiGluConfig {
    /// This rank's shards of full weights: `gate_up` `[d_model, 2 d_ff]` (`[gate | up]`) and
    /// `down` `[d_ff, d_model]` (Burn's `[in, out]`, no biases).
    ///
    /// # Errors
    /// As [`init`](Self::init); weights of other shapes.
    pub fn init_from(
        &self,
        gate_up: Tensor<2>,
        down: Tensor<2>,
        group: &ProcessGroup,
    ) -> TpResult<ParallelSwiGlu> {
        let (d, f) = (self.d_model, self.d_ff);
        if gate_up.dims() != [d, 2 * f] || down.dims() != [f, d] {
            return Err(crate::TpError::Config(format!(
                "ParallelSwiGlu: gate_up {:?} and down {:?} for d_model {d}, d_ff {f} (want \
                 [{d}, {}] and [{f}, {d}])",
                gate_up.dims(),
                down.dims(),
                2 * f
            )));
        }
        let linear = |w: Tensor<2>| burn::nn::Linear {
            weight: burn::module::Param::from_tensor(w.detach()),
            bias: None,
        };
        Ok(ParallelSwiGlu {
            gate_up: ColumnParallelLinear::from_full(
                &linear(gate_up),
                group,
                &ColumnParallelLinearConfig::new(d, 2 * f)
                    .with_bias(false)
                    .with_parts(vec![FusedPart::new(f), FusedPart::new(f)])
                    .with_settings(self.settings),
            )?,
            down: RowParallelLinear::from_full(
                &linear(down),
                group,
                &RowParallelLinearConfig::new(f, d)
                    .with_bias(false)
                    .with_settings(self.settings),
            )?,
            activation: self.activation,
        })
    }
}

impl ParallelSwiGlu {
    /// The gate's activation.
    pub fn activation(&self) -> GluActivation {
        self.activation
    }

    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]`.
    ///
    /// # Panics
    /// As the linears' `forward`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        let y = self.gate_up.try_forward(x)?;
        // One op whose backward keeps only `y` (the activation and the product recomputed).
        let z = <Dispatch as TpBackend>::tp_glu(y.into_dispatch(), self.activation);
        self.down.try_forward(Tensor::from_dispatch(z))
    }
}

crate::reshard::reshard_fields!(ParallelSwiGlu { gate_up, down }, keep: { activation });

impl crate::linear::InMode for ParallelSwiGlu {
    fn in_mode(self, mode: crate::linear::TpMode) -> Self {
        Self {
            gate_up: self.gate_up.in_mode(mode),
            down: self.down.in_mode(mode),
            activation: self.activation,
        }
    }
}
