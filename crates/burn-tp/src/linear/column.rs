//! [`ColumnParallelLinear`]: the weight split by output features.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::{INIT_GAIN, LinearSpec, OverlapSchedule, TpMode, column_parallel_linear, init_full};
use crate::TpError;
use crate::error::check_divisible;
use crate::init::{owned, shard};
use crate::ops::all_gather;
use crate::reshard::{Reshard, solo};

/// Configuration of a [`ColumnParallelLinear`]; mirrors Burn's `LinearConfig`.
#[derive(Config, Debug)]
pub struct ColumnParallelLinearConfig {
    /// Input features (full, every rank sees them all).
    pub d_input: usize,
    /// Output features over all ranks; each rank computes `d_output / tp` of them.
    pub d_output: usize,
    /// Whether to add a (sharded) bias.
    #[config(default = true)]
    pub bias: bool,
    /// Activation layout.
    #[config(default = "TpMode::AllReduce")]
    pub mode: TpMode,
    /// Overlap the communication with compute (custom backward node); otherwise compose the
    /// differentiable primitives.
    #[config(default = true)]
    pub async_communication: bool,
    /// REDUCE_SCATTER mode: keep only the local input shard and re-gather it in backward.
    #[config(default = true)]
    pub recompute_all_gather: bool,
    /// ALL_REDUCE mode only: all-gather the output along the last dim (`[.., d_output]`).
    #[config(default = false)]
    pub gather_output: bool,
    /// How the async path overlaps the all-gather of the input with the matmul.
    #[config(default = "OverlapSchedule::Ring")]
    pub schedule: OverlapSchedule,
    /// Initializer of the full weight; the same as Burn's `LinearConfig` default.
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Linear layer whose weight is split by output features over the tensor-parallel group.
///
/// `y_r = x @ W[:, r-th block] + b[r-th block]`; see [the module docs](super) for shapes.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// `[d_input, d_output / tp]`: columns `r * d_output/tp ..` of the full weight.
    pub weight: Param<Tensor<2>>,
    /// `[d_output / tp]`.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    spec: LinearSpec,
}

impl ColumnParallelLinearConfig {
    /// The settings the layer runs with.
    pub fn spec(&self) -> LinearSpec {
        LinearSpec {
            mode: self.mode,
            async_communication: self.async_communication,
            recompute_all_gather: self.recompute_all_gather,
            gather_output: self.gather_output,
            schedule: self.schedule,
        }
    }

    fn validate(&self, tp: usize) -> crate::Result<()> {
        check_divisible("ColumnParallelLinear d_output", self.d_output, tp)?;
        if self.gather_output && self.mode == TpMode::ReduceScatter {
            return Err(TpError::Config(
                "ColumnParallelLinear: gather_output needs TpMode::AllReduce".into(),
            ));
        }
        Ok(())
    }

    /// Initializes this rank's shard: exactly the columns of the weight that
    /// `LinearConfig::init` gives at tp = 1 with the same seed. Collective over `group`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `d_output % tp != 0`; [`TpError::Config`] for
    /// `gather_output` in REDUCE_SCATTER mode; a communication error.
    pub fn init(
        &self,
        group: &ProcessGroup,
        device: &Device,
    ) -> crate::Result<ColumnParallelLinear> {
        self.validate(group.world_size())?;
        let full = init_full(
            self.d_input,
            self.d_output,
            self.bias,
            &self.initializer,
            group,
            device,
        )?;
        ColumnParallelLinear::shard(&full, group, self.spec())
    }
}

impl ColumnParallelLinear {
    /// Shards a full Burn `Linear` (`weight [d_input, d_output]`) for this rank.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `d_output % tp != 0`; [`TpError::Config`] for an invalid
    /// combination of options.
    pub fn from_full(
        linear: &Linear,
        group: &ProcessGroup,
        config: &ColumnParallelLinearConfig,
    ) -> crate::Result<Self> {
        config.validate(group.world_size())?;
        Self::shard(linear, group, config.spec())
    }

    fn shard(linear: &Linear, group: &ProcessGroup, spec: LinearSpec) -> crate::Result<Self> {
        let [_, d_output] = linear.weight.val().dims();
        check_divisible(
            "ColumnParallelLinear d_output",
            d_output,
            group.world_size(),
        )?;
        Ok(Self {
            weight: Param::from_tensor(shard(linear.weight.val(), 1, group)),
            bias: linear
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(shard(b.val(), 0, group))),
            group: group.clone(),
            spec,
        })
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> crate::Result<Linear> {
        let weight = owned(all_gather(self.weight.val(), 1, &self.group)?);
        let bias = self
            .bias
            .as_ref()
            .map(|b| all_gather(b.val(), 0, &self.group).map(owned))
            .transpose()?;
        Ok(Linear {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
        })
    }

    /// Forward pass, panicking with the [`TpError`](crate::TpError) message on misuse or a
    /// failed collective (Burn's convention); [`try_forward`](Self::try_forward) returns it.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_input] -> [.., d_output / tp]` (`[.., d_output]` with `gather_output`)
    /// - REDUCE_SCATTER: `[s / tp, .., d_input] -> [s, .., d_output / tp]`
    ///
    /// # Panics
    /// [`TpError::Shape`] if the last dim is not `d_input` (or `D < 2` in REDUCE_SCATTER mode);
    /// a communication error.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }
}

super::parallel_linear_common!(ColumnParallelLinear, column_parallel_linear);
