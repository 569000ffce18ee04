//! Mixtral's, Qwen2-MoE's and Qwen3-MoE's mixtures of experts: their config fields
//! ([`ExpertsConfig`]) and the names of their tensors.
//!
//! ```text
//!  Mixtral      model.layers.N.block_sparse_moe.gate.weight           [experts, d]
//!               model.layers.N.block_sparse_moe.experts.E.w1|w3|w2    gate | up | down
//!  Qwen*-MoE    model.layers.N.mlp.gate.weight                        [experts, d]
//!               model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj
//!  Qwen2-MoE    model.layers.N.mlp.shared_expert.gate_proj|up_proj|down_proj
//!               model.layers.N.mlp.shared_expert_gate.weight          [1, d]
//! ```

use std::path::Path;

use serde_json::Value;

use super::HfArchitecture;
use crate::Result;
use crate::error::file_error;
use crate::llama::LlamaConfig;
use crate::moe::ExpertsConfig;

/// The names of a MoE layer's tensors under `model.layers.N.`.
pub(super) struct MoeNames {
    /// The layer's module: `block_sparse_moe` (Mixtral) or `mlp`.
    pub module: &'static str,
    /// Each expert's gate, up and down projections.
    pub projections: [&'static str; 3],
}

/// The tensor names of `architecture`'s MoE layers.
pub(super) fn names(architecture: HfArchitecture) -> MoeNames {
    match architecture {
        HfArchitecture::Mixtral => MoeNames {
            module: "block_sparse_moe",
            projections: ["w1", "w3", "w2"],
        },
        _ => MoeNames {
            module: "mlp",
            projections: ["gate_proj", "up_proj", "down_proj"],
        },
    }
}

/// The experts of a MoE architecture's `config.json` (`None` for a dense one).
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the field: a missing or
/// malformed count, `top_k` above the experts.
pub(super) fn experts(
    v: &Value,
    architecture: HfArchitecture,
    path: &Path,
) -> Result<Option<ExpertsConfig>> {
    if !architecture.is_moe() {
        return Ok(None);
    }
    let count = |name: &str| -> Result<usize> {
        v.get(name)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| file_error(path, format!("`{name}` is missing or not an integer")))
    };
    let mixtral = architecture == HfArchitecture::Mixtral;
    // Qwen3-MoE's config writes `num_local_experts` (its `num_experts` an alias); Qwen2-MoE's
    // `num_experts`.
    let n_experts = match v.get("num_local_experts") {
        Some(_) => count("num_local_experts")?,
        None => count("num_experts")?,
    };
    let top_k = count("num_experts_per_tok")?;
    if top_k == 0 || top_k > n_experts {
        return Err(file_error(
            path,
            format!(
                "`num_experts_per_tok` = {top_k} must be between 1 and the {n_experts} experts"
            ),
        ));
    }
    let d_ff = count(if mixtral {
        "intermediate_size"
    } else {
        "moe_intermediate_size"
    })?;
    // Mixtral's training-time noise on the router's input: not modelled, so refused.
    if let Some(noise) = v.get("router_jitter_noise").and_then(Value::as_f64)
        && noise != 0.0
    {
        return Err(file_error(
            path,
            format!("`router_jitter_noise` = {noise} is not supported (0 is)"),
        ));
    }
    // The load-balancing loss counts in the training loss only with `output_router_logits`.
    let aux = match v.get("output_router_logits").and_then(Value::as_bool) {
        Some(true) => v
            .get("router_aux_loss_coef")
            .and_then(Value::as_f64)
            .unwrap_or(0.001),
        _ => 0.0,
    };
    let mut x = ExpertsConfig::new(n_experts, top_k, d_ff)
        .with_norm_topk_prob(
            mixtral
                || v.get("norm_topk_prob")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
        )
        .with_aux_loss_coef(aux);
    if !mixtral {
        x = x
            .with_sparse_step(
                v.get("decoder_sparse_step")
                    .and_then(Value::as_u64)
                    .unwrap_or(1) as usize,
            )
            .with_mlp_only_layers(
                v.get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_u64)
                            .map(|l| l as usize)
                            .collect()
                    })
                    .unwrap_or_default(),
            );
    }
    if architecture == HfArchitecture::Qwen2Moe {
        let shared = v
            .get("shared_expert_intermediate_size")
            .and_then(Value::as_u64)
            .filter(|&w| w > 0);
        x = x.with_shared_expert(shared.map(|w| w as usize));
    }
    Ok(Some(x))
}

/// The HF architecture of a burn-tp Llama with experts: Qwen2-MoE with a shared expert,
/// Qwen3-MoE with q / k norms, else Mixtral.
pub(super) fn architecture(c: &LlamaConfig, x: &ExpertsConfig) -> HfArchitecture {
    if x.shared_expert.is_some() {
        HfArchitecture::Qwen2Moe
    } else if c.qk_norm {
        HfArchitecture::Qwen3Moe
    } else {
        HfArchitecture::Mixtral
    }
}

/// The MoE fields of an exported `config.json`.
pub(super) fn write(json: &mut Value, architecture: HfArchitecture, x: &ExpertsConfig) {
    let set = |json: &mut Value, k: &str, v: Value| json[k] = v;
    set(json, "num_experts_per_tok", x.top_k.into());
    set(json, "router_aux_loss_coef", x.aux_loss_coef.into());
    set(
        json,
        "output_router_logits",
        (x.aux_loss_coef != 0.0).into(),
    );
    if architecture == HfArchitecture::Mixtral {
        set(json, "num_local_experts", x.n_experts.into());
        set(json, "intermediate_size", x.d_ff.into());
        return;
    }
    let experts = match architecture {
        HfArchitecture::Qwen2Moe => "num_experts",
        _ => "num_local_experts",
    };
    set(json, experts, x.n_experts.into());
    set(json, "moe_intermediate_size", x.d_ff.into());
    set(json, "norm_topk_prob", x.norm_topk_prob.into());
    set(json, "decoder_sparse_step", x.sparse_step.into());
    set(
        json,
        "mlp_only_layers",
        serde_json::json!(x.mlp_only_layers),
    );
    if architecture == HfArchitecture::Qwen2Moe {
        set(
            json,
            "shared_expert_intermediate_size",
            x.shared_expert.unwrap_or(0).into(),
        );
    }
}
