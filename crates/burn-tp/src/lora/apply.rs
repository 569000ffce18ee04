//! [`apply_lora`]: the adapters put on a model's parallel linears, everything else frozen.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::quantization::{QuantScheme, QuantValue};

use super::LoraConfig;
use crate::attention::ParallelAttention;
use crate::llama::Llama;
use crate::transformer::ParallelSwiGlu;
use crate::{Result, TpError};

/// A module whose parallel linears can take LoRA adapters.
pub trait ApplyLora: Sized {
    /// The module with adapters on the linears `targets` names (short names: `q`, `k`, `v`,
    /// `o`, `gate`, `up`, `down`), of rank `rank` scaled by `alpha / rank`; the adapters it
    /// took. Collective over the tensor-parallel group.
    ///
    /// # Errors
    /// A communication error.
    fn lora_targets(self, targets: &[&str], rank: usize, alpha: f64) -> Result<(Self, usize)>;

    /// The module with every adapter merged into its weight and removed (PEFT's
    /// `merge_and_unload`): the plain module a Hugging Face export writes. No communication.
    fn merge_lora(self) -> Self;

    /// QLoRA: the frozen weights of the adapted linears held quantized with `scheme` (each
    /// rank its own shard), dequantized at each use. No communication.
    fn quantize_base(self, scheme: &QuantScheme) -> Self;
}

/// `model` for LoRA fine-tuning: every parameter frozen (no gradient, no optimizer state),
/// then adapters on the linears `config` names, the same at every tp (`A` as PEFT draws it,
/// `B` zero: the model's output is unchanged). Collective over the model's tp group.
///
/// # Errors
/// [`TpError::Config`] naming the values: a rank of 0, an unknown target, targets that match
/// no linear of the model (a MoE model's experts take none); a communication error.
pub fn apply_lora<M: ApplyLora + Module>(model: M, config: &LoraConfig) -> Result<M> {
    let targets = config.short_targets()?;
    let model = freeze(model);
    let (model, adapted) = model.lora_targets(&targets, config.rank, config.alpha)?;
    if adapted == 0 {
        return Err(TpError::Config(format!(
            "LoRA: the targets {:?} match no linear of the model",
            config.targets
        )));
    }
    Ok(model)
}

/// QLoRA ([`apply_lora`], then the adapted linears' frozen weights held quantized to `value`:
/// Burn's quantization, symmetric over each rank's own shard, `QuantValue::Q8S` for 8 bits,
/// `Q4S` for 4), dequantized at each use (a transient dense copy, as Burn's own QLoRA). The
/// adapters stay in the model's dtype. Collective over the model's tp group (the draws).
///
/// # Errors
/// As [`apply_lora`].
pub fn apply_qlora<M: ApplyLora + Module>(
    model: M,
    config: &LoraConfig,
    value: QuantValue,
) -> Result<M> {
    quantize_base(apply_lora(model, config)?, value)
}

/// `model` (with adapters: [`apply_lora`], or a PEFT adapter's) with its adapted linears'
/// frozen weights held quantized to `value` (as [`apply_qlora`]). No communication: each rank
/// quantizes its own shard, so data-parallel replicas that hold the same values stay equal.
///
/// # Errors
/// [`TpError::Config`] for a model without parameters.
pub fn quantize_base<M: ApplyLora + Module>(model: M, value: QuantValue) -> Result<M> {
    let device = model
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| TpError::Config("QLoRA: a model without parameters".into()))?;
    let scheme = device.settings().quantization.scheme.with_value(value);
    Ok(model.quantize_base(&scheme))
}

/// `model` with every adapter merged into its weight and removed ([`ApplyLora::merge_lora`]);
/// the parameters frozen as they were.
pub fn merge_lora<M: ApplyLora>(model: M) -> M {
    model.merge_lora()
}

/// `model` with every float parameter frozen (no gradient, no optimizer state).
pub fn freeze<M: Module>(model: M) -> M {
    model.map(&mut Freeze)
}

/// Sets every float parameter's `require_grad` to false.
struct Freeze;

impl ModuleMapper for Freeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.set_require_grad(false)
    }
}

impl ApplyLora for ParallelAttention {
    fn lora_targets(self, targets: &[&str], rank: usize, alpha: f64) -> Result<(Self, usize)> {
        let on = |t: &str| targets.contains(&t);
        let names = ["q", "k", "v"];
        let mut adapted = 0;
        let mut this = self;
        let qkv = std::mem::take(&mut this.qkv);
        this.qkv = match qkv.len() {
            // Fused: one adapter per part.
            1 => {
                let parts: Vec<usize> = (0..3).filter(|&p| on(names[p])).collect();
                adapted += parts.len();
                qkv.into_iter()
                    .map(|l| match parts.is_empty() {
                        true => Ok(l),
                        false => l.with_lora(&parts, rank, alpha),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => qkv
                .into_iter()
                .zip(names)
                .map(|(l, name)| match on(name) {
                    true => {
                        adapted += 1;
                        l.with_lora(&[0], rank, alpha)
                    }
                    false => Ok(l),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if on("o") {
            adapted += 1;
            this.out = this.out.with_lora(rank, alpha)?;
        }
        Ok((this, adapted))
    }

    fn merge_lora(self) -> Self {
        let mut this = self;
        this.qkv = std::mem::take(&mut this.qkv)
            .into_iter()
            .map(|l| l.merge_lora())
            .collect();
        this.out = this.out.merge_lora();
        this
    }

    fn quantize_base(self, scheme: &QuantScheme) -> Self {
        let mut this = self;
        this.qkv = std::mem::take(&mut this.qkv)
            .into_iter()
            .map(|l| match l.lora.is_some() {
                true => l.quantize_base(scheme),
                false => l,
            })
            .collect();
        if this.out.lora.is_some() {
            this.out = this.out.quantize_base(scheme);
        }
        this
    }
}

impl ApplyLora for ParallelSwiGlu {
    fn lora_targets(self, targets: &[&str], rank: usize, alpha: f64) -> Result<(Self, usize)> {
        let on = |t: &str| targets.contains(&t);
        let parts: Vec<usize> = (0..2).filter(|&p| on(["gate", "up"][p])).collect();
        let mut adapted = parts.len();
        let mut this = self;
        if !parts.is_empty() {
            this.gate_up = this.gate_up.with_lora(&parts, rank, alpha)?;
        }
        if on("down") {
            adapted += 1;
            this.down = this.down.with_lora(rank, alpha)?;
        }
        Ok((this, adapted))
    }

    fn merge_lora(self) -> Self {
        let mut this = self;
        this.gate_up = this.gate_up.merge_lora();
        this.down = this.down.merge_lora();
        this
    }

    fn quantize_base(self, scheme: &QuantScheme) -> Self {
        let mut this = self;
        if this.gate_up.lora.is_some() {
            this.gate_up = this.gate_up.quantize_base(scheme);
        }
        if this.down.lora.is_some() {
            this.down = this.down.quantize_base(scheme);
        }
        this
    }
}

impl ApplyLora for Llama {
    fn lora_targets(self, targets: &[&str], rank: usize, alpha: f64) -> Result<(Self, usize)> {
        let mut adapted = 0;
        let mut model = self;
        let blocks = std::mem::take(&mut model.blocks);
        let mut out = Vec::with_capacity(blocks.len());
        // Two parameters (A, B) per adapter, per kind of block: a MoE block's MLP takes none.
        let (mut dense, mut sparse) = (0, 0);
        for block in blocks {
            let (attn, n) = block.attn.lora_targets(targets, rank, alpha)?;
            let (mlp, m) = match block.mlp {
                Some(mlp) => {
                    let (mlp, m) = mlp.lora_targets(targets, rank, alpha)?;
                    (Some(mlp), m)
                }
                None => (None, 0),
            };
            match block.moe.is_some() {
                true => sparse = 2 * n,
                false => dense = 2 * (n + m),
            }
            adapted += n + m;
            out.push(crate::llama::LlamaBlock { attn, mlp, ..block });
        }
        model.blocks = out;
        Ok((model.with_added_block_params(dense, sparse), adapted))
    }

    fn merge_lora(self) -> Self {
        let mut model = self;
        let before = model
            .blocks
            .iter()
            .map(crate::model::count_params)
            .collect::<Vec<_>>();
        let blocks = std::mem::take(&mut model.blocks);
        model.blocks = blocks
            .into_iter()
            .map(|b| crate::llama::LlamaBlock {
                attn: b.attn.merge_lora(),
                mlp: b.mlp.map(ParallelSwiGlu::merge_lora),
                ..b
            })
            .collect();
        // Each kind of block drops what its adapters added.
        let (mut dense, mut sparse) = (0, 0);
        for (b, n) in model.blocks.iter().zip(before) {
            let removed = n - crate::model::count_params(b);
            match b.moe.is_some() {
                true => sparse = removed,
                false => dense = removed,
            }
        }
        model.with_removed_block_params(dense, sparse)
    }

    fn quantize_base(self, scheme: &QuantScheme) -> Self {
        let mut model = self;
        let blocks = std::mem::take(&mut model.blocks);
        model.blocks = blocks
            .into_iter()
            .map(|b| crate::llama::LlamaBlock {
                attn: b.attn.quantize_base(scheme),
                mlp: b.mlp.map(|m| m.quantize_base(scheme)),
                ..b
            })
            .collect();
        model
    }
}
