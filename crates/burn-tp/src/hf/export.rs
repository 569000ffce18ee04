//! Export: the model gathered to its full form, rank 0 writes `config.json` and
//! `model.safetensors` with HF's names and layouts.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn_tp_comm::ProcessGroup;

use super::mapping::{Source, rope_row, sources};
use super::{HfArchitecture, HfConfig, file_error};
use crate::Result;
use crate::attention::LayerType;
use crate::reshard::Reshard;

/// Writes `model` (a [`Llama`](crate::llama::Llama) or a [`Gemma`](crate::gemma::Gemma) at any
/// tp, the `config` it was imported or built with) in Hugging
/// Face's format into `dir`: `config.json` and `model.safetensors` with HF's names and layouts
/// (`[out, in]` weights, separate q / k / v and gate / up, the rotate-half rotary order), in the
/// model's dtype. The model is gathered to its full form on every rank and rank 0 writes.
/// Collective over `group`.
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file for a write that fails; a communication error.
pub fn save<M: Module + Reshard>(
    model: &M,
    config: &HfConfig,
    dir: &Path,
    group: &ProcessGroup,
) -> Result<()> {
    let full = model.to_full_module()?;
    if group.rank() != 0 {
        group.barrier()?;
        return Ok(());
    }
    let written = write_hf(&full, config, dir);
    group.barrier()?;
    written
}

/// transformers' names of layer types.
fn layer_type_names(types: &[LayerType]) -> Vec<&'static str> {
    types
        .iter()
        .map(|t| match t {
            LayerType::Sliding => "sliding_attention",
            LayerType::Full => "full_attention",
        })
        .collect()
}

/// Gemma's own fields: its activation, rotary bases keyed by layer type, layer types, score
/// scale and soft cap.
fn gemma_json(json: &mut serde_json::Value, config: &HfConfig) {
    let types = layer_type_names(&config.layer_types);
    // Gemma 3's bases keyed by layer type, Gemma 2's one.
    let rope = match config.architecture {
        HfArchitecture::Gemma2 => {
            serde_json::json!({"rope_type": "default", "rope_theta": config.rope_theta})
        }
        _ => serde_json::json!({
            "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": config.rope_local_theta.unwrap_or(10_000.0),
            },
        }),
    };
    let fields = serde_json::json!({
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": rope,
        "layer_types": types,
        "sliding_window": config.sliding_window,
        // An integer: transformers' strict config refuses 24.0.
        "query_pre_attn_scalar": config
            .query_pre_attn_scalar
            .map(|s| if s.fract() == 0.0 { serde_json::json!(s as u64) } else { serde_json::json!(s) }),
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "attention_bias": false,
    });
    let (Some(json), Some(fields)) = (json.as_object_mut(), fields.as_object()) else {
        return;
    };
    json.remove("hidden_act");
    json.remove("rope_theta");
    json.extend(fields.clone());
}

fn write_hf<M: Module>(full: &M, config: &HfConfig, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, format!("creating: {e}")))?;
    struct Collect(Vec<(Vec<usize>, Vec<f32>, burn::tensor::DType)>);
    impl burn::module::ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            let dtype = t.dtype();
            let values = t
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap_or_default();
            self.0.push((param.val().dims().to_vec(), values, dtype));
        }
    }
    let mut params = Collect(Vec::new());
    full.visit(&mut params);
    let sources = sources(config);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut dtype = burn::tensor::DType::F32;
    for (source, (shape, values, d)) in sources.iter().zip(params.0) {
        dtype = d;
        match source {
            Source::Rows { parts, transpose } => {
                // HF's rows: ours as they are, or our `[in, out]` transposed.
                let (rows, cols) = if *transpose {
                    (shape[1], shape[0])
                } else {
                    (shape[0], shape[1..].iter().product::<usize>().max(1))
                };
                let hf_rows: Vec<f32> = if *transpose {
                    let mut t = vec![0f32; rows * cols];
                    for i in 0..cols {
                        for o in 0..rows {
                            t[o * cols + i] = values[i * rows + o];
                        }
                    }
                    t
                } else {
                    values
                };
                let mut at = 0;
                for part in parts {
                    let n = if part.rows == 0 { rows } else { part.rows };
                    let mut out = vec![0f32; n * cols];
                    for r in 0..n {
                        // Our row r holds HF row rope_row(r) (q and k), or row r.
                        let hf = part.rope_head_dim.map_or(r, |hd| rope_row(r, hd));
                        out[hf * cols..(hf + 1) * cols]
                            .copy_from_slice(&hf_rows[(at + r) * cols..(at + r + 1) * cols]);
                    }
                    let hf_shape = if shape.len() == 1 && !*transpose {
                        vec![n]
                    } else {
                        vec![n, cols]
                    };
                    match tensors.last_mut() {
                        // The next rows of a fused tensor (Phi-3's), its parts in order.
                        Some((name, shape, values)) if *name == part.name => {
                            shape[0] += n;
                            values.extend(out);
                        }
                        _ => tensors.push((part.name.clone(), hf_shape, out)),
                    }
                    at += n;
                }
            }
            Source::Columns { name } => {
                let (rows, cols) = (shape[0], shape[1]);
                let mut t = vec![0f32; rows * cols];
                for r in 0..rows {
                    for c in 0..cols {
                        t[c * rows + r] = values[r * cols + c];
                    }
                }
                tensors.push((name.clone(), vec![cols, rows], t));
            }
        }
    }
    // In the model's dtype (f32 stays bit exact; bf16 / f16 round as the model did).
    let st_dtype = match dtype {
        burn::tensor::DType::BF16 => safetensors::Dtype::BF16,
        burn::tensor::DType::F16 => safetensors::Dtype::F16,
        _ => safetensors::Dtype::F32,
    };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, shape, values)| {
            let b: Vec<u8> = match st_dtype {
                safetensors::Dtype::BF16 => values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                safetensors::Dtype::F16 => values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            (name, shape, b)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, b)| {
            safetensors::tensor::TensorView::new(st_dtype, shape.clone(), b)
                .map(|v| (name.clone(), v))
                .map_err(|e| file_error(dir, format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = dir.join("model.safetensors");
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata.into_iter().collect()), &path)
        .map_err(|e| file_error(&path, format!("writing: {e}")))?;
    let (arch, model_type) = config.architecture.names();
    let dtype_name = match st_dtype {
        safetensors::Dtype::BF16 => "bfloat16",
        safetensors::Dtype::F16 => "float16",
        _ => "float32",
    };
    let mut json = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype_name,
        "attention_dropout": config.attention_dropout,
    });
    // Always: Qwen3's default (128) is not hidden_size / num_attention_heads.
    json["head_dim"] = serde_json::json!(config.head_size());
    if let Some(r) = config.rope_scaling {
        json["rope_parameters"] = serde_json::json!({
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        });
    }
    let window = serde_json::json!(config.sliding_window);
    let dense = config.architecture.dense();
    match dense {
        HfArchitecture::Qwen2 | HfArchitecture::Qwen3 => {
            // Every layer from the first, or none; or those its layer types say.
            json["use_sliding_window"] = serde_json::json!(config.sliding_window.is_some());
            json["sliding_window"] = window;
            if config.architecture == HfArchitecture::Qwen2Moe && config.sliding_window.is_none() {
                // As transformers writes it (0: none), not null.
                json["sliding_window"] = serde_json::json!(0);
            }
            let first = config
                .layer_types
                .iter()
                .position(|t| *t == LayerType::Sliding)
                .unwrap_or(0);
            json["max_window_layers"] = serde_json::json!(first);
            if !config.layer_types.is_empty() {
                json["layer_types"] = serde_json::json!(layer_type_names(&config.layer_types));
            }
            if dense == HfArchitecture::Qwen3 {
                json["attention_bias"] = serde_json::json!(config.out_bias);
            }
        }
        HfArchitecture::Mistral | HfArchitecture::Phi3 => {
            json["sliding_window"] = window;
            if config.architecture == HfArchitecture::Phi3 {
                json["resid_pdrop"] = serde_json::json!(config.residual_dropout);
            }
        }
        HfArchitecture::Llama => json["attention_bias"] = serde_json::json!(config.out_bias),
        HfArchitecture::Gemma2 | HfArchitecture::Gemma3 => gemma_json(&mut json, config),
        HfArchitecture::Mixtral | HfArchitecture::Qwen2Moe | HfArchitecture::Qwen3Moe => {
            unreachable!("dense() is a dense architecture")
        }
    }
    if let Some(x) = &config.experts {
        super::moe::write(&mut json, config.architecture, x);
    }
    // The imported model's own special ids (a model built here has none: Phi-3's and Gemma's
    // defaults, 32000 and 0..2, could be past a small vocabulary, so null).
    if config.token_ids.is_empty() {
        for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            json[k] = serde_json::Value::Null;
        }
    }
    for (k, v) in &config.token_ids {
        json[k.as_str()] = v.clone();
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&json).map_err(|e| file_error(&path, e.to_string()))?;
    std::fs::write(&path, text).map_err(|e| file_error(&path, format!("writing: {e}")))
}
