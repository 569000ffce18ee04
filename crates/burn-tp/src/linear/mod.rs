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
//! rank. The overlap schedule and its diagram are in `crates/burn-tp/src/backend/matmul/overlap.rs`.
//!
//! - `column.rs`, `row.rs`: config, module, its [`Reshard`](crate::reshard::Reshard) impl;
//! - `parts.rs`: a column layer's parts of a fused projection ([`FusedPart`]: fused q / k / v of
//!   grouped-query attention, gate / up of SwiGLU), each sharded on its own;
//! - `functional.rs`: [`column_parallel_linear`] / [`row_parallel_linear`] on tensors, the one
//!   forward both modules (and the tied lm-head of the GPT) run;
//! - `lora.rs`: their low-rank adapters ([`ColumnLora`], [`RowLora`]): which factor is split
//!   where, and what crosses the ranks.

mod column;
mod functional;
mod lora;
mod parts;
mod row;

use burn::module::Param;
use burn::nn::{Initializer, Linear};
use burn::tensor::Device;
use burn_tp_comm::ProcessGroup;

use crate::Result;
use crate::init::init_replicated;

pub use crate::backend::types::{LinearSpec, OverlapSchedule, TpMode, TpSettings};
pub use column::{ColumnParallelLinear, ColumnParallelLinearConfig};
pub use functional::{column_parallel_linear, row_parallel_linear};
pub use lora::{ColumnLora, RowLora};
pub use parts::FusedPart;
pub use row::{RowParallelLinear, RowParallelLinearConfig};

/// A module run in another activation layout, with the same weights (shared: a clone): how a
/// sequence-parallel model generates (ALL_REDUCE mode). Crate-internal; the models expose it as
/// `with_mode`.
pub(crate) trait InMode: Sized {
    fn in_mode(self, mode: TpMode) -> Self;
}

impl<T: InMode> InMode for Vec<T> {
    fn in_mode(self, mode: TpMode) -> Self {
        self.into_iter().map(|m| m.in_mode(mode)).collect()
    }
}

impl<T: InMode> InMode for Option<T> {
    fn in_mode(self, mode: TpMode) -> Self {
        self.map(|m| m.in_mode(mode))
    }
}

impl InMode for ColumnParallelLinear {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.spec.settings.mode = mode;
        self
    }
}

impl InMode for RowParallelLinear {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.spec.settings.mode = mode;
        self
    }
}

/// Burn's `LinearConfig` default gain, `1 / sqrt(3)`.
pub(crate) const INIT_GAIN: f64 = 0.577_350_269_189_625_8;

/// How a LoRA `A` is drawn: PEFT's `kaiming_uniform_(a = sqrt(5))` of `lora_A`, bound
/// `1 / sqrt(d_input)` (Burn's Kaiming-uniform of gain `1 / sqrt(3)` over the fan-in).
pub(crate) fn lora_init() -> Initializer {
    Initializer::KaimingUniform {
        gain: INIT_GAIN,
        fan_out_only: false,
    }
}

/// The full `Linear` that Burn's `LinearConfig::init` gives, drawn on rank 0 and broadcast
/// (see [`init_replicated`]): same draws, same order (weight, then bias).
pub(crate) fn init_full(
    d_input: usize,
    d_output: usize,
    bias: bool,
    initializer: &Initializer,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Linear> {
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
