//! The MLPs built from the parallel linears: the GPT's ([`ParallelMlp`]) and the gated one of
//! the Llama-class models and of the experts' shared expert ([`ParallelSwiGlu`], `glu.rs`).
//! Their norms are [`crate::norm`], the attention [`crate::attention`].

mod glu;

pub use glu::{GluActivation, ParallelSwiGlu, ParallelSwiGluConfig};

use burn::config::Config;
use burn::module::Module;
use burn::tensor::Device;
use burn::tensor::Tensor;
use burn_tp_comm::ProcessGroup;

use crate::Result as TpResult;
use crate::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};

/// Configuration of a [`ParallelMlp`].
#[derive(Config, Debug)]
pub struct ParallelMlpConfig {
    /// Model width.
    pub d_model: usize,
    /// Hidden width over all ranks (a multiple of tp).
    pub d_hidden: usize,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// Megatron MLP: `ColumnParallelLinear -> GELU -> RowParallelLinear`, one reduction per call.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// `d_model -> d_hidden / tp`.
    pub fc1: ColumnParallelLinear,
    /// `d_hidden / tp -> d_model`.
    pub fc2: RowParallelLinear,
}

impl ParallelMlpConfig {
    /// Initializes this rank's shards. Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `d_hidden % tp != 0`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelMlp> {
        Ok(ParallelMlp {
            fc1: ColumnParallelLinearConfig::new(self.d_model, self.d_hidden)
                .with_settings(self.settings)
                .init(group, device)?,
            fc2: RowParallelLinearConfig::new(self.d_hidden, self.d_model)
                .with_settings(self.settings)
                .init(group, device)?,
        })
    }
}

impl ParallelMlp {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` (sharded on dim 0 in REDUCE_SCATTER mode).
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
        self.fc2
            .try_forward(crate::ops::gelu(self.fc1.try_forward(x)?))
    }
}

impl crate::linear::InMode for ParallelMlp {
    fn in_mode(self, mode: TpMode) -> Self {
        Self {
            fc1: self.fc1.in_mode(mode),
            fc2: self.fc2.in_mode(mode),
        }
    }
}

crate::reshard::reshard_fields!(ParallelMlp { fc1, fc2 });
