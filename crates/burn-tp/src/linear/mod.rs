//! Column- and row-parallel linear layers (Megatron), with the overlapped async backward.
//!
//! | layer  | weight shard (Burn row layout) | bias shard        | input               | output              |
//! |--------|--------------------------------|-------------------|---------------------|---------------------|
//! | column | `[d_in, d_out/tp]`             | `[d_out/tp]`      | AR: `[.., d_in]`    | `[.., d_out/tp]`    |
//! |        |                                |                   | RS: `[s/tp, .., d_in]` | `[s, .., d_out/tp]` |
//! | row    | `[d_in/tp, d_out]`             | `[d_out]` (repl.) | AR: `[.., d_in/tp]` | `[.., d_out]`       |
//! |        |                                |                   | RS: `[s, .., d_in/tp]` | `[s/tp, .., d_out]` |
//!
//! AR = [`TpMode::AllReduce`] (activations replicated; the row layer all-reduces its partial
//! sums). RS = [`TpMode::ReduceScatter`] (sequence parallel: activations sharded on dim 0; the
//! column layer all-gathers its input, the row layer reduce-scatters its output). The row bias is
//! added once, after the reduction, by every rank to its own output; its gradient is the sum over
//! the full batch (in RS mode, over every rank's sequence shard), so it stays identical on every
//! rank. The overlap schedule and its diagram are in [`overlap`].

pub mod overlap;

use burn::backend::Dispatch;
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::TpError;
use crate::backend::TpBackend;
use crate::error::check_divisible;
use crate::init::{init_replicated, owned, shard};
use crate::ops::{
    all_gather, copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, reduce_scatter,
};

type Res<T> = crate::Result<T>;
pub use overlap::{Bias, LinearSpec, OverlapSchedule};

/// Burn's `LinearConfig` default gain, `1 / sqrt(3)`.
const INIT_GAIN: f64 = 0.577_350_269_189_625_8;

/// Activation layout of the tensor-parallel region.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum TpMode {
    /// Activations replicated on every rank; row-parallel all-reduces its partial outputs.
    AllReduce,
    /// Sequence parallel: activations sharded on dim 0; column-parallel all-gathers its input,
    /// row-parallel reduce-scatters its output.
    ReduceScatter,
}

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
    /// Initializer of the full weight; the same as Burn's `LinearConfig` default.
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
}

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
    /// Activation layout.
    #[config(default = "TpMode::AllReduce")]
    pub mode: TpMode,
    /// Overlap the communication with compute (custom backward node); otherwise compose the
    /// differentiable primitives.
    #[config(default = true)]
    pub async_communication: bool,
    /// Initializer of the full weight; the same as Burn's `LinearConfig` default.
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Runtime options a parallel linear keeps (not parameters, not saved in records).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelOptions {
    /// Full input features.
    pub d_input: usize,
    /// Full output features.
    pub d_output: usize,
    /// Activation layout.
    pub mode: TpMode,
    /// Use the overlapped backend op.
    pub async_communication: bool,
    /// Column, REDUCE_SCATTER: re-gather the input in backward.
    pub recompute_all_gather: bool,
    /// Column, ALL_REDUCE: gather the output.
    pub gather_output: bool,
    /// Overlap schedule of the async ops.
    pub schedule: OverlapSchedule,
}

impl ParallelOptions {
    fn spec(&self) -> LinearSpec {
        LinearSpec {
            mode: self.mode,
            recompute_all_gather: self.recompute_all_gather,
            schedule: self.schedule,
        }
    }
}

/// Linear layer whose weight is split by output features over the tensor-parallel group.
///
/// `y_r = x @ W[:, r-th block] + b[r-th block]`; see [the module docs](self) for shapes.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// `[d_input, d_output / tp]`: columns `r * d_output/tp ..` of the full weight.
    pub weight: Param<Tensor<2>>,
    /// `[d_output / tp]`.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    options: ParallelOptions,
}

/// Linear layer whose weight is split by input features over the tensor-parallel group.
///
/// `y = reduce(x_r @ W[r-th block, :]) + b`; see [the module docs](self) for shapes.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// `[d_input / tp, d_output]`: rows `r * d_input/tp ..` of the full weight.
    pub weight: Param<Tensor<2>>,
    /// `[d_output]`, replicated on every rank.
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    options: ParallelOptions,
}

/// The full `Linear` that Burn's `LinearConfig::init` gives, drawn on rank 0 and broadcast
/// (see [`init_replicated`]): same draws, same order (weight, then bias).
fn init_full(
    d_input: usize,
    d_output: usize,
    bias: bool,
    initializer: &Initializer,
    group: &ProcessGroup,
    device: &Device,
) -> Res<Linear> {
    let (fan_in, fan_out) = (Some(d_input), Some(d_output));
    let weight = init_replicated(
        initializer,
        [d_input, d_output],
        fan_in,
        fan_out,
        group,
        device,
    )?;
    let bias = bias
        .then(|| init_replicated(initializer, [d_output], fan_in, fan_out, group, device))
        .transpose()?;
    Ok(Linear {
        weight: Param::from_tensor(weight),
        bias: bias.map(Param::from_tensor),
    })
}

impl ColumnParallelLinearConfig {
    fn options(&self) -> ParallelOptions {
        ParallelOptions {
            d_input: self.d_input,
            d_output: self.d_output,
            mode: self.mode,
            async_communication: self.async_communication,
            recompute_all_gather: self.recompute_all_gather,
            gather_output: self.gather_output,
            schedule: OverlapSchedule::Split,
        }
    }

    fn validate(&self, tp: usize) -> Res<()> {
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
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> Res<ColumnParallelLinear> {
        self.validate(group.world_size())?;
        let full = init_full(
            self.d_input,
            self.d_output,
            self.bias,
            &self.initializer,
            group,
            device,
        )?;
        ColumnParallelLinear::from_full_with_options(&full, group, self.options())
    }
}

impl RowParallelLinearConfig {
    fn options(&self) -> ParallelOptions {
        ParallelOptions {
            d_input: self.d_input,
            d_output: self.d_output,
            mode: self.mode,
            async_communication: self.async_communication,
            recompute_all_gather: false,
            gather_output: false,
            schedule: OverlapSchedule::Split,
        }
    }

    /// Initializes this rank's shard: exactly the rows of the weight that `LinearConfig::init`
    /// gives at tp = 1 with the same seed (and the whole bias). Collective over `group`.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `d_input % tp != 0`; a communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> Res<RowParallelLinear> {
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
        RowParallelLinear::from_full_with_options(&full, group, self.options())
    }
}

/// Accessors shared by both layers.
macro_rules! parallel_accessors {
    ($layer:ty) => {
        impl $layer {
            /// The group this layer is sharded over.
            pub fn group(&self) -> &ProcessGroup {
                &self.group
            }

            /// Its options.
            pub fn options(&self) -> ParallelOptions {
                self.options
            }

            /// Sets the overlap schedule of the async path.
            pub fn with_schedule(mut self, schedule: OverlapSchedule) -> Self {
                self.options.schedule = schedule;
                self
            }
        }
    };
}

parallel_accessors!(ColumnParallelLinear);
parallel_accessors!(RowParallelLinear);

fn check_last(op: &'static str, dims: &[usize], want: usize) -> Res<()> {
    if dims.len() < 2 && want > 0 && dims.is_empty() {
        return Err(TpError::Shape {
            op,
            expected: format!("[.., {want}]"),
            got: dims.to_vec(),
        });
    }
    if dims.last() != Some(&want) {
        return Err(TpError::Shape {
            op,
            expected: format!("[.., {want}]"),
            got: dims.to_vec(),
        });
    }
    Ok(())
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
    ) -> Res<Self> {
        config.validate(group.world_size())?;
        Self::from_full_with_options(linear, group, config.options())
    }

    /// Shards `linear` with explicit run-time options (`d_input` / `d_output` are taken from it).
    ///
    /// # Errors
    /// Sizes not divisible by tp.
    pub fn from_full_with_options(
        linear: &Linear,
        group: &ProcessGroup,
        mut options: ParallelOptions,
    ) -> Res<Self> {
        let [d_input, d_output] = linear.weight.val().dims();
        check_divisible(
            "ColumnParallelLinear d_output",
            d_output,
            group.world_size(),
        )?;
        (options.d_input, options.d_output) = (d_input, d_output);
        Ok(Self {
            weight: Param::from_tensor(shard(linear.weight.val(), 1, group)),
            bias: linear
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(shard(b.val(), 0, group))),
            group: group.clone(),
            options,
        })
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> Res<Linear> {
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

    /// Forward pass.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_input] -> [.., d_output / tp]` (`[.., d_output]` with `gather_output`)
    /// - REDUCE_SCATTER: `[s / tp, .., d_input] -> [s, .., d_output / tp]`
    ///
    /// # Errors
    /// [`TpError::Shape`] if the last dim is not `d_input` (or `D < 2` in REDUCE_SCATTER mode);
    /// a communication error.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Res<Tensor<D>> {
        let o = self.options;
        check_last("ColumnParallelLinear", &x.dims(), o.d_input)?;
        if o.mode == TpMode::ReduceScatter && D < 2 {
            return Err(TpError::Shape {
                op: "ColumnParallelLinear",
                expected: "[s / tp, .., d_input]".into(),
                got: x.dims().to_vec(),
            });
        }
        let weight = self.weight.val();
        let bias = self.bias.as_ref().map(|b| b.val());
        let y = if o.async_communication {
            column_parallel_linear(x, weight, bias, o.spec(), &self.group)?
        } else {
            let x = match o.mode {
                TpMode::AllReduce => copy_to_tp_region(x, &self.group),
                TpMode::ReduceScatter => all_gather(x, 0, &self.group)?,
            };
            burn::tensor::module::linear(x, weight, bias)
        };
        if o.gather_output && self.group.world_size() > 1 {
            return gather_from_tp_region(y, D - 1, &self.group);
        }
        Ok(y)
    }
}

impl RowParallelLinear {
    /// Shards a full Burn `Linear` (`weight [d_input, d_output]`) for this rank.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `d_input % tp != 0`.
    pub fn from_full(
        linear: &Linear,
        group: &ProcessGroup,
        config: &RowParallelLinearConfig,
    ) -> Res<Self> {
        Self::from_full_with_options(linear, group, config.options())
    }

    /// Shards `linear` with explicit run-time options (`d_input` / `d_output` are taken from it).
    ///
    /// # Errors
    /// Sizes not divisible by tp.
    pub fn from_full_with_options(
        linear: &Linear,
        group: &ProcessGroup,
        mut options: ParallelOptions,
    ) -> Res<Self> {
        let [d_input, d_output] = linear.weight.val().dims();
        check_divisible("RowParallelLinear d_input", d_input, group.world_size())?;
        (options.d_input, options.d_output) = (d_input, d_output);
        Ok(Self {
            weight: Param::from_tensor(shard(linear.weight.val(), 0, group)),
            bias: linear
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(owned(b.val()))),
            group: group.clone(),
            options,
        })
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> Res<Linear> {
        let weight = owned(all_gather(self.weight.val(), 0, &self.group)?);
        let bias = self.bias.as_ref().map(|b| owned(b.val()));
        Ok(Linear {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
        })
    }

    /// Forward pass.
    ///
    /// # Shapes
    /// - ALL_REDUCE: `[.., d_input / tp] -> [.., d_output]`
    /// - REDUCE_SCATTER: `[s, .., d_input / tp] -> [s / tp, .., d_output]`
    ///
    /// # Errors
    /// [`TpError::Shape`] if the last dim is not `d_input / tp`; [`TpError::NotDivisible`] if
    /// `s % tp != 0` in REDUCE_SCATTER mode; a communication error.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Res<Tensor<D>> {
        let o = self.options;
        let tp = self.group.world_size();
        let dims = x.dims();
        check_last("RowParallelLinear", &dims, o.d_input / tp)?;
        if o.mode == TpMode::ReduceScatter {
            if D < 2 {
                return Err(TpError::Shape {
                    op: "RowParallelLinear",
                    expected: "[s, .., d_input / tp]".into(),
                    got: dims.to_vec(),
                });
            }
            check_divisible(
                "RowParallelLinear: dim 0 (sequence) of the input",
                dims[0],
                tp,
            )?;
        }
        let weight = self.weight.val();
        let bias = self.bias.as_ref().map(|b| b.val());
        if o.async_communication {
            return row_parallel_linear(x, weight, bias, o.spec(), &self.group);
        }
        let partial = x.matmul(weight.unsqueeze::<D>());
        let y = match o.mode {
            TpMode::AllReduce => reduce_from_tp_region(partial, &self.group)?,
            TpMode::ReduceScatter => reduce_scatter(partial, 0, &self.group)?,
        };
        Ok(match bias {
            None => y,
            // In RS mode each rank adds the bias to its own sequence shard; copy_to_tp_region
            // sums the shards' bias gradients so the replicated bias stays identical.
            Some(b) if o.mode == TpMode::ReduceScatter => {
                y + copy_to_tp_region(b, &self.group).unsqueeze::<D>()
            }
            Some(b) => y + b.unsqueeze::<D>(),
        })
    }
}

/// The overlapped column-parallel linear as a function (what [`ColumnParallelLinear`] calls when
/// `async_communication` is on): `weight [d_in, d_out/tp]`, `bias [d_out/tp]`; shapes as
/// [`ColumnParallelLinear::forward`] without `gather_output`. Shapes are not checked here.
///
/// # Errors
/// A communication error.
pub fn column_parallel_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Res<Tensor<D>> {
    let bias = bias.map_or(Bias::None, |b| Bias::Some(b.into_dispatch()));
    let out = <Dispatch as TpBackend>::tp_column_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias,
        spec,
        group.clone(),
    );
    crate::ops::into_tensor(out)
}

/// The overlapped row-parallel linear as a function (what [`RowParallelLinear`] calls when
/// `async_communication` is on): `weight [d_in/tp, d_out]`, `bias [d_out]` (replicated); shapes as
/// [`RowParallelLinear::forward`]. Shapes are not checked here.
///
/// # Errors
/// A communication error.
pub fn row_parallel_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Res<Tensor<D>> {
    let bias = bias.map_or(Bias::None, |b| Bias::Some(b.into_dispatch()));
    let out = <Dispatch as TpBackend>::tp_row_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias,
        spec,
        group.clone(),
    );
    crate::ops::into_tensor(out)
}
