//! [`RowParallelLinear`]: the weight split by input features.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::{INIT_GAIN, LinearSpec, OverlapSchedule, TpSettings, init_full, row_parallel_linear};
use crate::error::check_divisible;
use crate::init::{owned, shard};
use crate::ops::all_gather;
use crate::reshard::{ParamLayout, Reshard, solo};

/// Configuration of a [`RowParallelLinear`]; mirrors Burn's `LinearConfig`.
#[derive(Config, Debug)]
pub struct RowParallelLinearConfig {
    /// Input features over all ranks; each rank holds `d_input / tp` of them.
    pub d_input: usize,
    /// Output features (full).
    pub d_output: usize,
    /// Whether to add a (replicated) bias.
    #[config(default = true)]
    pub bias: bool,
    /// How the layer runs (mode, async communication, schedule; `recompute_all_gather` is the
    /// column layer's).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// Initializer of the full weight; the same as Burn's `LinearConfig` default.
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Linear layer whose weight is split by input features over the tensor-parallel group.
///
/// `y = reduce(x_r @ W[r-th block, :]) + b`; see [the module docs](super) for shapes.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// `[d_input / tp, d_output]`: rows `r * d_input/tp ..` of the full weight.
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`, replicated on every rank.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    pub(super) spec: LinearSpec,
}

impl RowParallelLinearConfig {
    /// The settings the layer runs with.
    pub fn spec(&self) -> LinearSpec {
        LinearSpec::new(self.settings)
    }

    /// Initializes this rank's shard: exactly the rows of the weight that `LinearConfig::init`
    /// gives at tp = 1 with the same seed (and the whole bias). Collective over `group`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `d_input % tp != 0`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> crate::Result<RowParallelLinear> {
        check_divisible(
            "RowParallelLinear d_input",
            self.d_input,
            group.world_size(),
        )?;
        let full = init_full(
            self.d_input,
            self.d_output,
            self.bias,
            &self.initializer,
            group,
            device,
        )?;
        RowParallelLinear::shard(&full, group, self.spec())
    }
}

impl RowParallelLinear {
    /// Shards a full Burn `Linear` (`weight [d_input, d_output]`) for this rank.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `d_input % tp != 0`.
    pub fn from_full(
        linear: &Linear,
        group: &ProcessGroup,
        config: &RowParallelLinearConfig,
    ) -> crate::Result<Self> {
        Self::shard(linear, group, config.spec())
    }

    fn shard(linear: &Linear, group: &ProcessGroup, spec: LinearSpec) -> crate::Result<Self> {
        let [d_input, _] = linear.weight.val().dims();
        check_divisible("RowParallelLinear d_input", d_input, group.world_size())?;
        Ok(Self {
            weight: Param::from_tensor(shard(linear.weight.val(), 0, group)),
            bias: linear
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(owned(b.val()))),
            group: group.clone(),
            spec,
        })
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> crate::Result<Linear> {
        let weight = owned(all_gather(self.weight.val(), 0, &self.group)?);
        let bias = self.bias.as_ref().map(|b| owned(b.val()));
        Ok(Linear {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
        })
    }

    /// Forward pass, panicking with the [`TpError`](crate::TpError) message on misuse or a
    /// failed collective (Burn's convention); [`try_forward`](Self::try_forward) returns it.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_input / tp] -> [.., d_output]`
    /// - REDUCE_SCATTER: `[s, .., d_input / tp] -> [s / tp, .., d_output]`
    ///
    /// # Panics
    /// [`TpError::Shape`](crate::TpError::Shape) if the last dim is not `d_input / tp`;
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `s % tp != 0` in
    /// REDUCE_SCATTER mode; a communication error.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }
}

impl RowParallelLinear {
    fn compute_weights(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        (self.weight.val(), self.bias.as_ref().map(|b| b.val()))
    }
}

impl Reshard for RowParallelLinear {
    fn to_full_module(&self) -> crate::Result<Self> {
        Self::shard(&self.to_full()?, &solo(), self.spec)
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> crate::Result<Self> {
        Self::shard(&full.to_full()?, group, full.spec)
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let (r, tp) = (self.group.rank(), self.group.world_size());
        let [local, d_output] = self.weight.dims();
        let weight = ParamLayout::block(vec![local * tp, d_output], 0, r, tp);
        let bias = self
            .bias
            .as_ref()
            .map(|_| ParamLayout::replicated(vec![d_output], r));
        std::iter::once(weight).chain(bias).collect()
    }
}

impl RowParallelLinear {
    /// The group this layer is sharded over.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The settings it runs with.
    pub fn spec(&self) -> LinearSpec {
        self.spec
    }

    /// Sets the overlap schedule of the async path.
    pub fn with_schedule(mut self, schedule: OverlapSchedule) -> Self {
        self.spec.settings.schedule = schedule;
        self
    }

    /// Turns the overlapped (async) path on or off, as the config's `async_communication`. A
    /// clone with another setting shares the weights.
    pub fn with_async_communication(mut self, on: bool) -> Self {
        self.spec.settings.async_communication = on;
        self
    }

    /// Forward pass, returning the error instead of panicking (this crate's fallible twin of
    /// [`forward`](Self::forward)). Shapes as `forward`.
    ///
    /// # Errors
    /// As `forward`'s panics.
    pub fn try_forward<const D: usize>(&self, x: Tensor<D>) -> crate::Result<Tensor<D>> {
        let (weight, bias) = self.compute_weights();
        row_parallel_linear(x, weight, bias, self.spec, &self.group)
    }
}
