//! [`HfConfig`]: a Hugging Face `config.json` of the Llama or the Gemma family, read and
//! checked, and the burn-tp model it describes (both ways).

use std::path::Path;

use serde_json::Value;

pub use super::arch::HfArchitecture;
use super::gemma::{gemma_checks, gemma_layer_types, gemma_rope};
use crate::Result;
use crate::attention::LayerType;
use crate::attention::Llama3RopeScaling;
use crate::error::file_error;
use crate::gemma::GemmaConfig;
use crate::linear::TpSettings;
use crate::llama::LlamaConfig;
use crate::moe::ExpertsConfig;

/// A Hugging Face `config.json` of the Llama family, read and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The architecture.
    pub architecture: HfArchitecture,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (defaults to `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `head_dim` where it is not `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// `rope_theta` (default 10000; Gemma's full-attention layers', default 1,000,000).
    pub rope_theta: f64,
    /// Gemma's rotary base of its sliding layers (`rope_parameters.sliding_attention`, or
    /// `rope_local_base_freq`; default 10000); `None` for the Llama family.
    pub rope_local_theta: Option<f64>,
    /// Gemma's layer types (`layer_types`, or every `sliding_window_pattern`-th layer full);
    /// empty for the Llama family, whose `sliding_window` is every layer's.
    pub layer_types: Vec<LayerType>,
    /// Gemma's `query_pre_attn_scalar` (the scores scaled by its `** -0.5`).
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma's `final_logit_softcapping`.
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 2's `attn_logit_softcapping`.
    pub attn_logit_softcapping: Option<f64>,
    /// Llama 3's rotary scaling (`rope_parameters` / `rope_scaling` of type `llama3`).
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub out_bias: bool,
    /// RMSNorm on each head's queries and keys (Qwen3's `q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// The sliding window of every layer (`sliding_window` where in use), if below the context;
    /// Gemma's: that of its sliding layers.
    pub sliding_window: Option<usize>,
    /// `attention_dropout` (every family; 0 when absent): dropout of the attention
    /// probabilities while training.
    pub attention_dropout: f64,
    /// Dropout of each residual branch while training: Phi-3's `resid_pdrop`, else
    /// `hidden_dropout` where a config has it, else 0 (Llama, Mistral and Qwen have none).
    pub residual_dropout: f64,
    /// `bos_token_id`, `eos_token_id` and `pad_token_id` as the config gives them (a number, a
    /// list, or null; absent ones left out), written back as they were by the export; empty
    /// for a model built in burn-tp.
    pub token_ids: Vec<(String, Value)>,
    /// The mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; [`crate::moe`]); `None` for a
    /// dense model.
    pub experts: Option<ExpertsConfig>,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file and the field: a missing or malformed field, an
    /// architecture or a feature the import does not support.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| file_error(&path, format!("reading: {e}")))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| file_error(&path, format!("not JSON: {e}")))?;
        Self::from_json(&v, &path)
    }

    fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let usize_field = |name: &str| -> Result<usize> {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|n| n as usize)
                .ok_or_else(|| file_error(path, format!("`{name}` is missing or not an integer")))
        };
        let f64_field = |name: &str, default: f64| -> Result<f64> {
            match v.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| file_error(path, format!("`{name}` is not a number: {x}"))),
            }
        };
        let bool_field = |name: &str| v.get(name).and_then(Value::as_bool).unwrap_or(false);
        let arch = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| file_error(path, "`architectures` is missing"))?;
        let Some(architecture) = HfArchitecture::ALL
            .into_iter()
            .find(|a| a.names().0 == arch)
        else {
            let known: Vec<&str> = HfArchitecture::ALL.iter().map(|a| a.names().0).collect();
            return Err(file_error(
                path,
                format!(
                    "architecture {arch:?} is not supported ({} are)",
                    known.join(", ")
                ),
            ));
        };
        let heads = usize_field("num_attention_heads")?;
        let hidden = usize_field("hidden_size")?;
        let max_pos = usize_field("max_position_embeddings")?;
        // Rotary settings: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
        // (earlier); the default or Llama 3's scaling, any other refused.
        let rope = v.get("rope_parameters").filter(|r| !r.is_null());
        let gemma = architecture.is_gemma();
        let mut rope_scaling = None;
        let gemma_rope = if gemma {
            Some(gemma_rope(v, architecture, path)?)
        } else {
            None
        };
        for (field, params) in [
            // Gemma's are per layer type, read above.
            ("rope_parameters", rope),
            ("rope_scaling", v.get("rope_scaling")),
        ] {
            let Some(params) = params.filter(|p| !p.is_null() && !gemma) else {
                continue;
            };
            let kind = params
                .get("rope_type")
                .or_else(|| params.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "llama3" => rope_scaling = Some(llama3_scaling(params, field, path)?),
                _ => {
                    return Err(file_error(
                        path,
                        format!(
                            "`{field}` of type {kind:?} is not supported (rope scaling: default \
                             and llama3 are): {params}"
                        ),
                    ));
                }
            }
        }
        let rope_theta = match (gemma_rope, rope.and_then(|r| r.get("rope_theta"))) {
            (Some((full, _)), _) => full,
            (None, Some(theta)) => theta.as_f64().ok_or_else(|| {
                file_error(
                    path,
                    format!("`rope_parameters.rope_theta` is not a number: {theta}"),
                )
            })?,
            (None, None) => f64_field("rope_theta", 10000.0)?,
        };
        // An explicit head size (Qwen3, Mistral NeMo); kept only where it differs from
        // hidden_size / num_attention_heads.
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map(|hd| hd as usize)
            .filter(|&hd| hd * heads != hidden);
        if bool_field("mlp_bias") {
            return Err(file_error(path, "`mlp_bias` = true is not supported"));
        }
        // Gemma's GeGLU takes the tanh GELU, the Llama family's SwiGLU SiLU.
        let want = if gemma { "gelu_pytorch_tanh" } else { "silu" };
        for field in ["hidden_act", "hidden_activation"] {
            if let Some(act) = v.get(field).and_then(Value::as_str)
                && act != want
            {
                return Err(file_error(
                    path,
                    format!("`{field}` = {act:?} is not supported ({want} is)"),
                ));
            }
        }
        let layers = usize_field("num_hidden_layers")?;
        let experts = super::moe::experts(v, architecture, path)?;
        // A mixture of experts reads as its dense architecture but for its MLPs.
        let architecture_moe = architecture;
        let architecture = architecture.dense();
        let (sliding_window, layer_types) = if gemma {
            gemma_checks(v, path)?;
            let window = v.get("sliding_window").and_then(Value::as_u64);
            let pattern = match architecture {
                HfArchitecture::Gemma2 => 2,
                _ => 6,
            };
            let types = gemma_layer_types(v, layers, pattern, path)?;
            (window.map(|w| w as usize), types)
        } else {
            let (window, types) = sliding_window(v, architecture, layers);
            match window.filter(|&w| w < max_pos) {
                Some(w) => (Some(w), types),
                None => (None, Vec::new()),
            }
        };
        // Phi-3's (and Phi-4's) rotation of part of each head only.
        for partial in [
            v.get("partial_rotary_factor"),
            rope.and_then(|r| r.get("partial_rotary_factor")),
        ]
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        {
            if partial != 1.0 {
                return Err(file_error(
                    path,
                    format!("`partial_rotary_factor` = {partial} is not supported (1.0 is)"),
                ));
            }
        }
        let attention_bias = bool_field("attention_bias");
        let dropout = |names: &[&str]| -> Result<f64> {
            let Some(name) = names
                .iter()
                .find(|n| v.get(**n).is_some_and(|x| !x.is_null()))
            else {
                return Ok(0.0);
            };
            let p = f64_field(name, 0.0)?;
            if !(0.0..1.0).contains(&p) {
                return Err(file_error(
                    path,
                    format!("`{name}` must be in [0, 1), got {p}"),
                ));
            }
            Ok(p)
        };
        let softcap = |name: &str, gemma2_default: f64| -> Result<Option<f64>> {
            match v.get(name) {
                _ if !gemma => Ok(None),
                None if architecture == HfArchitecture::Gemma2 => Ok(Some(gemma2_default)),
                None | Some(Value::Null) => Ok(None),
                Some(_) => match f64_field(name, 0.0)? {
                    cap if cap.is_finite() && cap > 0.0 => Ok(Some(cap)),
                    cap => Err(file_error(
                        path,
                        format!("`{name}` = {cap} (a soft cap must be > 0)"),
                    )),
                },
            }
        };
        let attention_dropout = dropout(&["attention_dropout"])?;
        let residual_dropout = dropout(&["resid_pdrop", "hidden_dropout"])?;
        Ok(Self {
            architecture: architecture_moe,
            vocab_size: usize_field("vocab_size")?,
            hidden_size: hidden,
            num_attention_heads: heads,
            num_key_value_heads: v
                .get("num_key_value_heads")
                .and_then(Value::as_u64)
                .map_or(heads, |n| n as usize),
            intermediate_size: usize_field("intermediate_size")?,
            num_hidden_layers: usize_field("num_hidden_layers")?,
            max_position_embeddings: max_pos,
            head_dim,
            rope_theta,
            rope_local_theta: gemma_rope.map(|(_, local)| local),
            layer_types,
            query_pre_attn_scalar: match gemma {
                true => Some(f64_field("query_pre_attn_scalar", 256.0)?),
                false => None,
            },
            // Gemma 2's caps default to 30 and 50 where its config leaves them out (null: none).
            final_logit_softcapping: softcap("final_logit_softcapping", 30.0)?,
            attn_logit_softcapping: softcap("attn_logit_softcapping", 50.0)?,
            rope_scaling,
            rms_norm_eps: f64_field("rms_norm_eps", 1e-6)?,
            // Gemma ties by default (transformers' Gemma3TextConfig), the others do not.
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(gemma),
            qkv_bias: architecture == HfArchitecture::Qwen2 || attention_bias,
            out_bias: attention_bias,
            qk_norm: matches!(architecture, HfArchitecture::Qwen3 | HfArchitecture::Gemma3),
            sliding_window,
            attention_dropout,
            residual_dropout,
            token_ids: ["bos_token_id", "eos_token_id", "pad_token_id"]
                .into_iter()
                .filter_map(|k| Some((k.to_string(), v.get(k)?.clone())))
                .collect(),
            experts,
        })
    }

    /// The Hugging Face configuration of a burn-tp Llama (to export it): `Qwen3ForCausalLM` for
    /// q / k norms, `Qwen2ForCausalLM` for q, k and v biases without an output bias,
    /// `MistralForCausalLM` for a sliding window, else `LlamaForCausalLM`.
    pub fn from_llama(c: &LlamaConfig) -> Self {
        let architecture = if let Some(x) = &c.experts {
            super::moe::architecture(c, x)
        } else if c.qk_norm {
            HfArchitecture::Qwen3
        } else if c.qkv_bias && !c.out_bias {
            HfArchitecture::Qwen2
        } else if c.sliding_window.is_some() && !c.qkv_bias {
            HfArchitecture::Mistral
        } else {
            HfArchitecture::Llama
        };
        Self {
            architecture,
            vocab_size: c.n_vocab,
            hidden_size: c.d_model,
            num_attention_heads: c.n_heads,
            num_key_value_heads: c.n_kv_heads,
            intermediate_size: c.d_ff,
            num_hidden_layers: c.n_layers,
            max_position_embeddings: c.max_seq,
            head_dim: c.head_dim.filter(|&hd| hd * c.n_heads != c.d_model),
            rope_theta: f64::from(c.rope_theta),
            rope_local_theta: None,
            layer_types: c.layer_types.clone(),
            query_pre_attn_scalar: None,
            final_logit_softcapping: None,
            attn_logit_softcapping: None,
            rope_scaling: c.rope_scaling,
            rms_norm_eps: c.norm_eps,
            tie_word_embeddings: c.tie_embeddings,
            qkv_bias: c.qkv_bias,
            out_bias: c.out_bias,
            qk_norm: c.qk_norm,
            sliding_window: c.sliding_window,
            attention_dropout: c.attention_dropout.unwrap_or(c.dropout),
            residual_dropout: c.dropout,
            token_ids: Vec::new(),
            experts: c.experts.clone(),
        }
    }

    /// The burn-tp Llama of this configuration, its dropout the config's own
    /// ([`attention_dropout`](Self::attention_dropout), [`residual_dropout`](Self::residual_dropout)).
    pub fn llama_config(&self, settings: TpSettings) -> LlamaConfig {
        LlamaConfig::new(
            self.vocab_size,
            self.max_position_embeddings,
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.num_hidden_layers,
            self.intermediate_size,
        )
        .with_head_dim(self.head_dim)
        .with_rope_theta(self.rope_theta as f32)
        .with_rope_scaling(self.rope_scaling)
        .with_norm_eps(self.rms_norm_eps)
        .with_tie_embeddings(self.tie_word_embeddings)
        .with_qkv_bias(self.qkv_bias)
        .with_out_bias(self.out_bias)
        .with_qk_norm(self.qk_norm)
        .with_sliding_window(self.sliding_window)
        .with_layer_types(self.layer_types.clone())
        .with_dropout(self.residual_dropout)
        .with_attention_dropout(Some(self.attention_dropout))
        .with_experts(self.experts.clone())
        .with_settings(settings)
    }
}

impl HfConfig {
    /// The Hugging Face configuration of a burn-tp Gemma (to export it): `Gemma3ForCausalLM`
    /// with q / k norms, else `Gemma2ForCausalLM`.
    ///
    /// # Errors
    /// [`TpError::Config`](crate::TpError::Config) for `layer_types` of another length than
    /// `n_layers`; a Gemma 2 (no q / k norms) whose two rotary bases differ (Gemma 2 has one).
    pub fn from_gemma(c: &GemmaConfig) -> Result<Self> {
        let architecture = match c.qk_norm {
            true => HfArchitecture::Gemma3,
            false => HfArchitecture::Gemma2,
        };
        if architecture == HfArchitecture::Gemma2 && c.rope_theta != c.rope_local_theta {
            return Err(crate::TpError::Config(format!(
                "Gemma without q / k norms is a Gemma 2, whose layers share one rotary base: \
                 rope_theta = {} and rope_local_theta = {} differ",
                c.rope_theta, c.rope_local_theta
            )));
        }
        Ok(Self {
            architecture,
            vocab_size: c.n_vocab,
            hidden_size: c.d_model,
            num_attention_heads: c.n_heads,
            num_key_value_heads: c.n_kv_heads,
            intermediate_size: c.d_ff,
            num_hidden_layers: c.n_layers,
            max_position_embeddings: c.max_seq,
            head_dim: Some(c.head_dim),
            rope_theta: f64::from(c.rope_theta),
            rope_local_theta: Some(f64::from(c.rope_local_theta)),
            layer_types: c.layer_kinds()?,
            query_pre_attn_scalar: Some(c.query_pre_attn_scalar.unwrap_or(c.head_dim as f64)),
            final_logit_softcapping: c.final_logit_softcap,
            attn_logit_softcapping: c.attn_logit_softcap,
            rope_scaling: None,
            rms_norm_eps: c.norm_eps,
            tie_word_embeddings: c.tie_embeddings,
            qkv_bias: false,
            out_bias: false,
            qk_norm: c.qk_norm,
            sliding_window: c.sliding_window,
            attention_dropout: c.attention_dropout.unwrap_or(c.dropout),
            residual_dropout: c.dropout,
            token_ids: Vec::new(),
            experts: None,
        })
    }

    /// The burn-tp Gemma of this configuration (a Gemma architecture's), its dropout the
    /// config's own.
    ///
    /// # Errors
    /// [`TpError::Config`](crate::TpError::Config) naming the architecture for one of the
    /// Llama family ([`llama_config`](Self::llama_config) builds those).
    pub fn gemma_config(&self, settings: TpSettings) -> Result<GemmaConfig> {
        if !self.architecture.is_gemma() {
            return Err(crate::TpError::Config(format!(
                "{} is of the Llama family: build it with HfConfig::llama_config (hf::init_llama)",
                self.architecture.names().0
            )));
        }
        Ok(GemmaConfig::new(
            self.vocab_size,
            self.max_position_embeddings,
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.num_hidden_layers,
            self.intermediate_size,
            self.head_size(),
        )
        .with_query_pre_attn_scalar(self.query_pre_attn_scalar)
        .with_rope_theta(self.rope_theta as f32)
        .with_rope_local_theta(self.rope_local_theta.unwrap_or(10_000.0) as f32)
        .with_sliding_window(self.sliding_window)
        .with_layer_types(self.layer_types.clone())
        .with_norm_eps(self.rms_norm_eps)
        .with_qk_norm(self.qk_norm)
        .with_final_logit_softcap(self.final_logit_softcapping)
        .with_attn_logit_softcap(self.attn_logit_softcapping)
        .with_tie_embeddings(self.tie_word_embeddings)
        .with_dropout(self.residual_dropout)
        .with_attention_dropout(Some(self.attention_dropout))
        .with_settings(settings))
    }
}

/// The fields of a `llama3` rotary scaling in `params` (of config field `field`).
fn llama3_scaling(params: &Value, field: &str, path: &Path) -> Result<Llama3RopeScaling> {
    let number = |name: &str| {
        params.get(name).and_then(Value::as_f64).ok_or_else(|| {
            file_error(
                path,
                format!("`{field}` of type \"llama3\" needs a number `{name}`: {params}"),
            )
        })
    };
    let scaling = Llama3RopeScaling {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
    };
    if !(scaling.factor > 0.0 && scaling.high_freq_factor > scaling.low_freq_factor) {
        return Err(file_error(
            path,
            format!(
                "`{field}` of type \"llama3\": factor must be > 0 and high_freq_factor > \
                 low_freq_factor: {params}"
            ),
        ));
    }
    Ok(scaling)
}

impl HfConfig {
    /// The size of each attention head.
    pub fn head_size(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
}

/// The sliding window of the Llama family and the layers it is on: Mistral's and Phi-3's
/// `sliding_window` on every layer; Qwen2's and Qwen3's only with `use_sliding_window`, on the
/// layers `layer_types` (or `max_window_layers`, the first layer with one) gives it; Llama has
/// none. The types are empty where every layer is the same.
fn sliding_window(
    v: &Value,
    architecture: HfArchitecture,
    layers: usize,
) -> (Option<usize>, Vec<LayerType>) {
    let window = v.get("sliding_window").and_then(Value::as_u64);
    let window = match architecture {
        HfArchitecture::Llama | HfArchitecture::Gemma2 | HfArchitecture::Gemma3 => None,
        HfArchitecture::Mistral | HfArchitecture::Phi3 | HfArchitecture::Mixtral => window,
        HfArchitecture::Qwen2
        | HfArchitecture::Qwen3
        | HfArchitecture::Qwen2Moe
        | HfArchitecture::Qwen3Moe => {
            let on = v.get("use_sliding_window").and_then(Value::as_bool) == Some(true);
            window.filter(|_| on)
        }
    };
    let Some(w) = window else {
        return (None, Vec::new());
    };
    let sliding: Vec<bool> = match v.get("layer_types").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .map(|t| t.as_str() == Some("sliding_attention"))
            .collect(),
        None => match architecture.dense() {
            HfArchitecture::Qwen2 | HfArchitecture::Qwen3 => {
                let from = v
                    .get("max_window_layers")
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize;
                (0..layers).map(|i| i >= from).collect()
            }
            _ => vec![true; layers],
        },
    };
    match (sliding.iter().all(|&x| x), sliding.iter().any(|&x| x)) {
        (true, _) => (Some(w as usize), Vec::new()),
        (false, false) => (None, Vec::new()),
        _ => (
            Some(w as usize),
            sliding
                .iter()
                .map(|&s| match s {
                    true => LayerType::Sliding,
                    false => LayerType::Full,
                })
                .collect(),
        ),
    }
}
