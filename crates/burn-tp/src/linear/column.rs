//! [`ColumnParallelLinear`]: the weight split by output features.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, Linear};
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::lora::{ColumnLora, dense};
use super::parts::{
    FusedPart, PartPlacement, place, replica_group, shard_columns, unshard_columns, with_replicas,
};
use super::{
    INIT_GAIN, LinearSpec, OverlapSchedule, TpMode, TpSettings, column_parallel_linear, init_full,
};
use crate::TpError;
use crate::init::{owned, shard};
use crate::ops::all_gather;
use crate::reshard::{ParamLayout, Piece, Reshard, solo};

mod adapters;

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
    /// How the layer runs (mode, async communication, schedule, recomputed gather).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// ALL_REDUCE mode only: all-gather the output along the last dim (`[.., d_output]`).
    #[config(default = false)]
    pub gather_output: bool,
    /// Initializer of the full weight; the same as Burn's `LinearConfig` default.
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
    /// Contiguous parts of the output features, each sharded on its own (a fused projection of
    /// parts of different widths); empty: one part. See [`FusedPart`].
    #[config(default = "Vec::new()")]
    pub parts: Vec<FusedPart>,
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
    /// Low-rank adapters, if any ([`with_lora`](Self::with_lora)).
    pub lora: Option<ColumnLora>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    pub(super) spec: LinearSpec,
    /// The parts of the full output features (empty: one).
    #[module(skip)]
    parts: Vec<FusedPart>,
    /// This rank's columns of each part.
    #[module(skip)]
    placement: Vec<PartPlacement>,
    /// The ranks holding the same replicated blocks, if a part is replicated.
    #[module(skip)]
    replicas: Option<ProcessGroup>,
}

impl ColumnParallelLinearConfig {
    /// The settings the layer runs with.
    pub fn spec(&self) -> LinearSpec {
        LinearSpec {
            settings: self.settings,
            gather_output: self.gather_output,
        }
    }

    fn validate(&self, tp: usize) -> crate::Result<()> {
        place(&self.parts, self.d_output, tp, 0)?;
        if self.gather_output && self.settings.mode == TpMode::ReduceScatter {
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
        ColumnParallelLinear::shard(&full, group, self.spec(), &self.parts)
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
        Self::shard(linear, group, config.spec(), &config.parts)
    }

    fn shard(
        linear: &Linear,
        group: &ProcessGroup,
        spec: LinearSpec,
        parts: &[FusedPart],
    ) -> crate::Result<Self> {
        let [_, d_output] = linear.weight.val().dims();
        let (tp, r) = (group.world_size(), group.rank());
        let placement = place(parts, d_output, tp, r)?;
        let cut = |t, dim| {
            if parts.is_empty() {
                shard(t, dim, group)
            } else {
                owned(shard_columns(t, dim, &placement))
            }
        };
        Ok(Self {
            weight: Param::from_tensor(cut(linear.weight.val(), 1)),
            bias: linear
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(cut_bias(b.val(), &placement, parts, group))),
            lora: None,
            group: group.clone(),
            spec,
            parts: parts.to_vec(),
            replicas: replica_group(parts, group)?,
            placement,
        })
    }

    /// The contiguous parts of the output features (empty: one).
    pub fn parts(&self) -> &[FusedPart] {
        &self.parts
    }

    /// Where part `p` starts in the full output features.
    fn part_start(&self, p: usize) -> usize {
        self.parts[..p.min(self.parts.len())]
            .iter()
            .map(|c| c.width)
            .sum()
    }

    /// Part `p`'s width (`d_output` for an unfused layer).
    fn part_width(&self, p: usize, d_output: usize) -> usize {
        self.parts.get(p).map_or(d_output, |c| c.width)
    }

    fn compute_weights(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        let (weight, bias) = (
            dense(self.weight.val()),
            self.bias.as_ref().map(|b| b.val()),
        );
        match &self.replicas {
            None => (weight, bias),
            Some(replicas) => (
                with_replicas(weight, 1, &self.placement, replicas),
                bias.map(|b| with_replicas(b, 0, &self.placement, replicas)),
            ),
        }
    }

    /// Every rank's placement (for gathering).
    fn placements(&self) -> crate::Result<Vec<Vec<PartPlacement>>> {
        let tp = self.group.world_size();
        let d_output = self.parts.iter().map(|c| c.width).sum();
        (0..tp)
            .map(|r| place(&self.parts, d_output, tp, r))
            .collect()
    }

    /// Gathers the shards into the full Burn `Linear` on every rank (detached). Collective.
    ///
    /// # Errors
    /// A communication error.
    pub fn to_full(&self) -> crate::Result<Linear> {
        let placements = (!self.parts.is_empty())
            .then(|| self.placements())
            .transpose()?;
        let weight = gather_columns(
            dense(self.weight.val()),
            1,
            &self.group,
            placements.as_deref(),
        )?;
        let bias = self
            .bias
            .as_ref()
            .map(|b| gather_columns(b.val(), 0, &self.group, placements.as_deref()))
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

/// The full tensor from every rank's columns along `dim` (detached, owned).
fn gather_columns<const D: usize>(
    t: Tensor<D>,
    dim: usize,
    group: &ProcessGroup,
    placements: Option<&[Vec<PartPlacement>]>,
) -> crate::Result<Tensor<D>> {
    let all = all_gather(t, dim, group)?;
    Ok(owned(match placements {
        None => all,
        Some(p) => unshard_columns(all, dim, p),
    }))
}

/// The rank's shard of a full bias `[d_output]`.
fn cut_bias(
    b: Tensor<1>,
    placement: &[PartPlacement],
    parts: &[FusedPart],
    group: &ProcessGroup,
) -> Tensor<1> {
    if parts.is_empty() {
        shard(b, 0, group)
    } else {
        owned(shard_columns(b, 0, placement))
    }
}

/// burn-nn's `Linear` (`weight [d_input, d_output]`), its columns split over the group.
impl crate::reshard::Twin<Linear> for ColumnParallelLinear {
    fn from_twin(full: &Linear, ctx: &crate::reshard::TwinContext) -> crate::Result<Self> {
        let [d_input, d_output] = full.weight.val().dims();
        let config = ColumnParallelLinearConfig::new(d_input, d_output)
            .with_bias(full.bias.is_some())
            .with_settings(ctx.settings);
        Self::from_full(full, &ctx.group, &config)
    }
    fn to_twin(&self) -> crate::Result<Linear> {
        self.to_full()
    }
}

impl Reshard for ColumnParallelLinear {
    fn to_full_module(&self) -> crate::Result<Self> {
        let full = Self::shard(&self.to_full()?, &solo(), self.spec, &self.parts)?;
        Ok(match self.full_lora()? {
            Some((a, b, parts, scale)) => {
                let lora = full.shard_lora(a, b, parts, scale);
                full.frozen().with_adapters(lora)
            }
            None => full,
        })
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> crate::Result<Self> {
        let shard = Self::shard(&full.to_full()?, group, full.spec, &full.parts)?;
        Ok(match full.full_lora()? {
            Some((a, b, parts, scale)) => {
                let lora = shard.shard_lora(a, b, parts, scale);
                shard.frozen().with_adapters(lora)
            }
            None => shard,
        })
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let (r, tp) = (self.group.rank(), self.group.world_size());
        let [d_input, _] = self.weight.dims();
        let d_output = if self.parts.is_empty() {
            self.weight.dims()[1] * tp
        } else {
            self.parts.iter().map(|c| c.width).sum()
        };
        // A replicated block is written by the lowest rank holding it.
        let before = (r > 0)
            .then(|| place(&self.parts, d_output, tp, r - 1).ok())
            .flatten();
        let pieces: Vec<Piece> = self
            .placement
            .iter()
            .enumerate()
            .map(|(c, p)| Piece {
                local: p.local.clone(),
                global: p.full.clone(),
                writes: !p.replicated || before.as_ref().is_none_or(|b| b[c].full != p.full),
            })
            .collect();
        let weight = ParamLayout {
            global_shape: vec![d_input, d_output],
            dim: 1,
            pieces: pieces.clone(),
        };
        let bias = self.bias.as_ref().map(|_| ParamLayout {
            global_shape: vec![d_output],
            dim: 0,
            pieces: pieces.clone(),
        });
        // Each adapter: A whole, B this rank's columns of its part (of the part's own columns).
        let pieces = &pieces;
        let lora = self.lora.iter().flat_map(|l| {
            let rank = l.rank();
            let a = l
                .parts
                .iter()
                .map(move |_| ParamLayout::replicated(vec![d_input, rank], r));
            let b = l.parts.iter().map(move |&p| {
                let start = self.part_start(p);
                let piece = &pieces[p];
                ParamLayout {
                    global_shape: vec![rank, self.part_width(p, d_output)],
                    dim: 1,
                    pieces: vec![Piece {
                        local: 0..piece.local.len(),
                        global: piece.global.start - start..piece.global.end - start,
                        writes: piece.writes,
                    }],
                }
            });
            a.chain(b).collect::<Vec<_>>()
        });
        std::iter::once(weight).chain(bias).chain(lora).collect()
    }
}

impl ColumnParallelLinear {
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
            return column_parallel_linear(x, weight, bias, self.spec, &self.group);
        };
        let y = column_parallel_linear(x.clone(), weight, bias, self.spec, &self.group)?;
        let term = lora.term(
            x,
            y.dims(),
            self.spec.settings.mode,
            &self.group,
            &self.placement,
            self.replicas.as_ref(),
        )?;
        Ok(y + term)
    }
}
