//! [`RowParallelLinear`]: the weight split by input features.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::lora::{RowLora, dense, merged_param, quantized_param};
use super::{INIT_GAIN, LinearSpec, OverlapSchedule, TpSettings, init_full, row_parallel_linear};
use crate::error::check_divisible;
use crate::init::{init_replicated, owned, shard};
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
    /// A low-rank adapter, if any ([`with_lora`](Self::with_lora)).
    pub lora: Option<RowLora>,
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
            lora: None,
            group: group.clone(),
            spec,
        })
    }

    /// The layer with a low-rank adapter of rank `rank` scaled by `alpha / rank`: `A` drawn as
    /// PEFT draws `lora_A` (Kaiming-uniform over `d_input`) whole on rank 0, each rank keeping
    /// its rows, so tp n starts from tp 1's adapter; `B` zero, so the output is unchanged. The
    /// weight and bias are frozen. Collective over the layer's group.
    ///
    /// # Errors
    /// [`TpError::Config`](crate::TpError::Config) for a rank of 0; a communication error.
    pub fn with_lora(self, rank: usize, alpha: f64) -> crate::Result<Self> {
        if rank == 0 {
            return Err(crate::TpError::Config(
                "RowParallelLinear LoRA: rank 0 (at least 1)".into(),
            ));
        }
        let [local, d_output] = self.weight.dims();
        let d_input = local * self.group.world_size();
        let device = self.weight.device();
        let dtype = dense(self.weight.val()).dtype();
        let a = init_replicated(
            &super::lora_init(),
            [d_input, rank],
            Some(d_input),
            Some(rank),
            &self.group,
            &device,
        )?
        .cast(dtype);
        let b = Tensor::<2>::zeros([rank, d_output], (&device, dtype));
        let lora = self.shard_lora(a, b, alpha / rank as f64);
        Ok(self.frozen().with_adapter(lora))
    }

    /// The layer with an adapter of the given full factors (`A [d_input, r]`, `B [r,
    /// d_output]`: a PEFT adapter read from disk), this rank keeping its rows of A; the weight
    /// and bias frozen. No communication.
    ///
    /// # Errors
    /// [`TpError::Config`](crate::TpError::Config) naming the shapes: factors that do not fit.
    pub fn with_lora_factors(self, a: Tensor<2>, b: Tensor<2>, scale: f64) -> crate::Result<Self> {
        let [local, d_output] = self.weight.dims();
        let d_input = local * self.group.world_size();
        let rank = a.dims()[1];
        if rank == 0 || a.dims() != [d_input, rank] || b.dims() != [rank, d_output] {
            return Err(crate::TpError::Config(format!(
                "RowParallelLinear LoRA: factors {:?} and {:?} for a layer [{d_input} -> \
                 {d_output}] (A [{d_input}, r], B [r, {d_output}])",
                a.dims(),
                b.dims()
            )));
        }
        let lora = self.shard_lora(a, b, scale);
        Ok(self.frozen().with_adapter(lora))
    }

    /// This layer's adapter from the full factors (`A [d_input, r]`, `B [r, d_output]`).
    fn shard_lora(&self, a: Tensor<2>, b: Tensor<2>, scale: f64) -> RowLora {
        RowLora {
            a: Param::from_tensor(shard(a, 0, &self.group)),
            b: Param::from_tensor(owned(b)),
            scale,
        }
    }

    /// The adapter's full factors (A's rows gathered over tp) and scale, detached. Collective.
    fn full_lora(&self) -> crate::Result<Option<(Tensor<2>, Tensor<2>, f64)>> {
        let Some(l) = &self.lora else {
            return Ok(None);
        };
        let a = owned(all_gather(l.a.val(), 0, &self.group)?);
        Ok(Some((a, owned(l.b.val()), l.scale)))
    }

    /// The layer with its adapter merged into its weight (`W + scale * A B`, this rank's rows)
    /// and removed: a plain layer (the weight frozen as it was). No communication.
    pub fn merge_lora(self) -> Self {
        let Some(lora) = &self.lora else {
            return self;
        };
        let delta = lora
            .a
            .val()
            .detach()
            .matmul(lora.b.val().detach())
            .mul_scalar(lora.scale);
        let merged = dense(self.weight.val()).detach() + delta;
        Self {
            weight: merged_param(&self.weight, merged),
            lora: None,
            ..self
        }
    }

    /// QLoRA: the frozen weight held quantized with `scheme` (this rank's shard over its own
    /// range), dequantized at each use; the adapters stay as they are. No communication.
    pub fn quantize_base(self, scheme: &burn::tensor::quantization::QuantScheme) -> Self {
        Self {
            weight: quantized_param(self.weight, scheme),
            ..self
        }
    }

    /// The layer with its weight and bias frozen (no gradient, no optimizer state).
    fn frozen(self) -> Self {
        Self {
            weight: self.weight.set_require_grad(false),
            bias: self.bias.map(|b| b.set_require_grad(false)),
            ..self
        }
    }

    fn with_adapter(self, lora: RowLora) -> Self {
        Self {
            lora: Some(lora),
            ..self
        }
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> crate::Result<Linear> {
        let weight = owned(all_gather(dense(self.weight.val()), 0, &self.group)?);
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
        (
            dense(self.weight.val()),
            self.bias.as_ref().map(|b| b.val()),
        )
    }
}

/// burn-nn's `Linear` (`weight [d_input, d_output]`), its rows split over the group.
impl crate::reshard::Twin<Linear> for RowParallelLinear {
    fn from_twin(full: &Linear, ctx: &crate::reshard::TwinContext) -> crate::Result<Self> {
        let [d_input, d_output] = full.weight.val().dims();
        let config = RowParallelLinearConfig::new(d_input, d_output)
            .with_bias(full.bias.is_some())
            .with_settings(ctx.settings);
        Self::from_full(full, &ctx.group, &config)
    }
    fn to_twin(&self) -> crate::Result<Linear> {
        self.to_full()
    }
}

impl Reshard for RowParallelLinear {
    fn to_full_module(&self) -> crate::Result<Self> {
        let full = Self::shard(&self.to_full()?, &solo(), self.spec)?;
        Ok(match self.full_lora()? {
            Some((a, b, scale)) => {
                let lora = full.shard_lora(a, b, scale);
                full.frozen().with_adapter(lora)
            }
            None => full,
        })
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> crate::Result<Self> {
        let shard = Self::shard(&full.to_full()?, group, full.spec)?;
        Ok(match full.full_lora()? {
            Some((a, b, scale)) => {
                let lora = shard.shard_lora(a, b, scale);
                shard.frozen().with_adapter(lora)
            }
            None => shard,
        })
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let (r, tp) = (self.group.rank(), self.group.world_size());
        let [local, d_output] = self.weight.dims();
        let weight = ParamLayout::block(vec![local * tp, d_output], 0, r, tp);
        let bias = self
            .bias
            .as_ref()
            .map(|_| ParamLayout::replicated(vec![d_output], r));
        // The adapter: A this rank's rows, B whole.
        let lora = self.lora.iter().flat_map(|l| {
            let rank = l.rank();
            [
                ParamLayout::block(vec![local * tp, rank], 0, r, tp),
                ParamLayout::replicated(vec![rank, d_output], r),
            ]
        });
        std::iter::once(weight).chain(bias).chain(lora).collect()
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
        let Some(lora) = &self.lora else {
            return row_parallel_linear(x, weight, bias, self.spec, &self.group);
        };
        let y = row_parallel_linear(x.clone(), weight, bias, self.spec, &self.group)?;
        let term = lora.term(x, y.dims(), self.spec.settings.mode, &self.group)?;
        Ok(y + term)
    }
}
