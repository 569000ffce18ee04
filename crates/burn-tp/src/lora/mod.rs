//! LoRA fine-tuning at tensor parallelism: low-rank adapters on a model's parallel linears, the
//! rest frozen, so that tp n trains what tp 1 does.
//!
//! ```text
//!  Llama block        adapters (targets)                 split over tp
//!  attention qkv      q, k, v: one per fused part         A whole, B this rank's heads' columns
//!  attention out      o                                  A this rank's rows, B whole
//!  MLP gate_up        gate, up: one per fused part        A whole, B this rank's columns
//!  MLP down           down                               A this rank's rows, B whole
//! ```
//!
//! A factor that every rank holds whole starts the same everywhere (drawn on rank 0) and its
//! gradient is summed over tp where each rank sees a part of it; a split factor is its rows or
//! columns of the tp 1 draw (`linear/lora.rs` has the forward and what crosses the ranks).
//!
//! Burn 0.22's own LoRA (`Module::apply_lora`, a `LoraAdapter` on a `Param`) composes the
//! dense `base + scale * A B` inside `Param::val()`: it cannot hold one adapter per fused part
//! (q, k, v in one weight), and the dense composition makes the base's weight gradient every
//! step. The adapters here live beside the weight (`ColumnParallelLinear::lora`,
//! `RowParallelLinear::lora`) with Burn's factor shapes (`A [d_in, r]`, `B [r, d_out]`) and
//! scale (`alpha / r`); the call keeps Burn's shape: `apply_lora(model, &config)`.

mod apply;

pub use apply::{ApplyLora, apply_lora, apply_qlora, freeze, merge_lora, quantize_base};

use burn::config::Config;

use crate::TpError;

/// The modules LoRA adapts, by the names PEFT's `target_modules` gives the Llama family's
/// (`q_proj` or `q`, ...).
pub const TARGETS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// Configuration of LoRA adapters; mirrors Burn's `Lora` (`rank`, `alpha`) and PEFT's
/// `LoraConfig` (`r`, `lora_alpha`, `target_modules`).
#[derive(Config, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of each adapter.
    pub rank: usize,
    /// The adapters' output is scaled by `alpha / rank` (PEFT's `lora_alpha`).
    pub alpha: f64,
    /// The modules adapted: any of `q, k, v, o, gate, up, down` (or PEFT's `q_proj`, ...,
    /// `down_proj`).
    #[config(default = "vec![\"q\".into(), \"v\".into()]")]
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// The targets in this crate's short names (`q_proj` -> `q`).
    ///
    /// # Errors
    /// [`TpError::Config`] naming the values: a rank of 0, no targets, a target that is not a
    /// module of the model.
    pub fn short_targets(&self) -> crate::Result<Vec<&'static str>> {
        if self.rank == 0 {
            return Err(TpError::Config("LoRA: rank 0 (at least 1)".into()));
        }
        if self.targets.is_empty() {
            return Err(TpError::Config(format!(
                "LoRA: no target modules (any of {})",
                TARGETS.join(", ")
            )));
        }
        self.targets
            .iter()
            .map(|t| {
                let short = t.strip_suffix("_proj").unwrap_or(t);
                TARGETS
                    .iter()
                    .copied()
                    .find(|&k| k == short)
                    .ok_or_else(|| {
                        TpError::Config(format!(
                            "LoRA: target module `{t}` is not one of {} (or their `_proj` names)",
                            TARGETS.join(", ")
                        ))
                    })
            })
            .collect()
    }
}
