//! Hugging Face Llama-family checkpoints (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`): a `config.json` and `model.safetensors` (or shards with
//! `model.safetensors.index.json`) loaded into a [`Llama`] at any tp, each rank reading only its
//! own slices.
//!
//! What the import maps:
//! - HF's `[out, in]` weights into Burn's `[in, out]`;
//! - the separate `q_proj`, `k_proj`, `v_proj` into the fused QKV projection's contiguous chunks
//!   `[q | k | v]`, and `gate_proj`, `up_proj` into the SwiGLU's `[gate | up]`;
//! - HF's rotary convention (rotate-half: feature `i` of a head turns with feature
//!   `i + head_dim / 2`) into Burn's `RotaryEncoding` (which turns features `2i` and `2i + 1`): the
//!   q and k projections' output features are permuted within each head (`2i <- i`,
//!   `2i + 1 <- i + head_dim / 2`), which leaves every attention score, hence the logits,
//!   unchanged;
//! - Qwen2's q, k and v biases (and Llama's `attention_bias`), tied embeddings, any vocabulary
//!   (padded to a multiple of tp, the padding masked out).
//!
//! What it refuses, with an error naming the field: another architecture, rope scaling, a
//! sliding window in use, a `head_dim` other than `hidden_size / num_attention_heads`, an MLP bias,
//! an activation other than SiLU.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;
use serde_json::Value;

use crate::linear::TpSettings;
use crate::llama::{Llama, LlamaConfig};
use crate::reshard::{ParamLayout, Reshard};
use crate::{Result, TpError};

/// The architectures the import reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArchitecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (without a sliding window in use).
    Mistral,
    /// `Qwen2ForCausalLM` (q, k and v biases).
    Qwen2,
}

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
    /// `rope_theta` (default 10000).
    pub rope_theta: f64,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama's `attention_bias`).
    pub out_bias: bool,
}

fn hf_err(path: &Path, what: impl Into<String>) -> TpError {
    TpError::Checkpoint {
        path: path.display().to_string(),
        what: what.into(),
    }
}

impl HfConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`TpError::Checkpoint`] naming the file and the field: a missing or malformed field, an
    /// architecture or a feature the import does not support.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| hf_err(&path, format!("reading: {e}")))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| hf_err(&path, format!("not JSON: {e}")))?;
        Self::from_json(&v, &path)
    }

    fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let usize_field = |name: &str| -> Result<usize> {
            v.get(name)
                .and_then(Value::as_u64)
                .map(|n| n as usize)
                .ok_or_else(|| hf_err(path, format!("`{name}` is missing or not an integer")))
        };
        let f64_field = |name: &str, default: f64| -> Result<f64> {
            match v.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| hf_err(path, format!("`{name}` is not a number: {x}"))),
            }
        };
        let bool_field = |name: &str| v.get(name).and_then(Value::as_bool).unwrap_or(false);
        let arch = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| hf_err(path, "`architectures` is missing"))?;
        let architecture = match arch {
            "LlamaForCausalLM" => HfArchitecture::Llama,
            "MistralForCausalLM" => HfArchitecture::Mistral,
            "Qwen2ForCausalLM" => HfArchitecture::Qwen2,
            other => {
                return Err(hf_err(
                    path,
                    format!(
                        "architecture {other:?} is not supported (LlamaForCausalLM, \
                         MistralForCausalLM, Qwen2ForCausalLM are)"
                    ),
                ));
            }
        };
        let heads = usize_field("num_attention_heads")?;
        let hidden = usize_field("hidden_size")?;
        let max_pos = usize_field("max_position_embeddings")?;
        // Rotary settings: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
        // (earlier); any scaling but the default is refused.
        let rope = v.get("rope_parameters").filter(|r| !r.is_null());
        for (field, params) in [
            ("rope_parameters", rope),
            ("rope_scaling", v.get("rope_scaling")),
        ] {
            let Some(params) = params.filter(|p| !p.is_null()) else {
                continue;
            };
            let kind = params
                .get("rope_type")
                .or_else(|| params.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if kind != "default" {
                return Err(hf_err(
                    path,
                    format!("`{field}` of type {kind:?} is not supported (rope scaling): {params}"),
                ));
            }
        }
        let rope_theta = match rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
        {
            Some(theta) => theta,
            None => f64_field("rope_theta", 10000.0)?,
        };
        if let Some(hd) = v.get("head_dim").and_then(Value::as_u64)
            && hd as usize * heads != hidden
        {
            return Err(hf_err(
                path,
                format!(
                    "`head_dim` = {hd} is not hidden_size / num_attention_heads = {}",
                    hidden / heads.max(1)
                ),
            ));
        }
        if bool_field("mlp_bias") {
            return Err(hf_err(path, "`mlp_bias` = true is not supported"));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(hf_err(
                path,
                format!("`hidden_act` = {act:?} is not supported (silu is)"),
            ));
        }
        // A sliding window is in use when set below the context (Qwen2 only with its flag).
        let window = v.get("sliding_window").and_then(Value::as_u64);
        let window_on = match architecture {
            HfArchitecture::Qwen2 => bool_field("use_sliding_window"),
            _ => true,
        };
        if let Some(w) = window
            && window_on
            && (w as usize) < max_pos
        {
            return Err(hf_err(
                path,
                format!(
                    "`sliding_window` = {w} below max_position_embeddings = {max_pos} is not \
                     supported"
                ),
            ));
        }
        let attention_bias = bool_field("attention_bias");
        Ok(Self {
            architecture,
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
            rope_theta,
            rms_norm_eps: f64_field("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: bool_field("tie_word_embeddings"),
            qkv_bias: architecture == HfArchitecture::Qwen2 || attention_bias,
            out_bias: attention_bias,
        })
    }

    /// The Hugging Face configuration of a burn-tp Llama (to export it): `LlamaForCausalLM`, or
    /// `Qwen2ForCausalLM` for q, k and v biases without an output bias.
    pub fn from_llama(c: &LlamaConfig) -> Self {
        let qwen2 = c.qkv_bias && !c.out_bias;
        Self {
            architecture: if qwen2 {
                HfArchitecture::Qwen2
            } else {
                HfArchitecture::Llama
            },
            vocab_size: c.n_vocab,
            hidden_size: c.d_model,
            num_attention_heads: c.n_heads,
            num_key_value_heads: c.n_kv_heads,
            intermediate_size: c.d_ff,
            num_hidden_layers: c.n_layers,
            max_position_embeddings: c.max_seq,
            rope_theta: f64::from(c.rope_theta),
            rms_norm_eps: c.norm_eps,
            tie_word_embeddings: c.tie_embeddings,
            qkv_bias: c.qkv_bias,
            out_bias: c.out_bias,
        }
    }

    /// The burn-tp Llama of this configuration.
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
        .with_rope_theta(self.rope_theta as f32)
        .with_norm_eps(self.rms_norm_eps)
        .with_tie_embeddings(self.tie_word_embeddings)
        .with_qkv_bias(self.qkv_bias)
        .with_out_bias(self.out_bias)
        .with_settings(settings)
    }
}

/// The safetensors files of a model folder, memory-mapped as first needed.
struct Weights {
    dir: PathBuf,
    /// Tensor name -> file name.
    file_of: BTreeMap<String, String>,
    maps: BTreeMap<String, memmap2::Mmap>,
}

impl Weights {
    fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let mut file_of = BTreeMap::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| hf_err(&index, format!("reading: {e}")))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| hf_err(&index, format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| hf_err(&index, "`weight_map` is missing"))?;
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| hf_err(&index, format!("{name}: not a file name")))?;
                file_of.insert(name.clone(), file.to_string());
            }
        } else {
            let mut w = Self {
                dir: dir.to_path_buf(),
                file_of,
                maps: BTreeMap::new(),
            };
            let names: Vec<String> = {
                let st = w.tensors("model.safetensors")?;
                st.names().into_iter().map(str::to_string).collect()
            };
            for name in names {
                w.file_of.insert(name, "model.safetensors".into());
            }
            return Ok(w);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            file_of,
            maps: BTreeMap::new(),
        })
    }

    fn tensors(&mut self, file: &str) -> Result<safetensors::SafeTensors<'_>> {
        let path = self.dir.join(file);
        if !self.maps.contains_key(file) {
            let f =
                std::fs::File::open(&path).map_err(|e| hf_err(&path, format!("opening: {e}")))?;
            // Safety: the model's files are not written while they are read.
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| hf_err(&path, format!("mapping: {e}")))?;
            self.maps.insert(file.to_string(), map);
        }
        safetensors::SafeTensors::deserialize(&self.maps[file])
            .map_err(|e| hf_err(&path, format!("a truncated or damaged file: {e}")))
    }

    /// `name`'s shape, from its file's header.
    fn shape(&mut self, name: &str) -> Result<Vec<usize>> {
        let file = self
            .file_of
            .get(name)
            .cloned()
            .ok_or_else(|| hf_err(&self.dir, format!("tensor {name} is missing")))?;
        let path = self.dir.join(&file);
        let st = self.tensors(&file)?;
        let view = st
            .tensor(name)
            .map_err(|e| hf_err(&path, format!("{name}: {e}")))?;
        Ok(view.shape().to_vec())
    }

    /// `name`'s shape, and its rows `rows` (all columns) as f32, read from those rows' bytes only.
    fn rows(&mut self, name: &str, rows: Option<Range<usize>>) -> Result<(Vec<usize>, Vec<f32>)> {
        let file = self
            .file_of
            .get(name)
            .cloned()
            .ok_or_else(|| hf_err(&self.dir, format!("tensor {name} is missing")))?;
        let path = self.dir.join(&file);
        let st = self.tensors(&file)?;
        let view = st
            .tensor(name)
            .map_err(|e| hf_err(&path, format!("{name}: {e}")))?;
        let shape = view.shape().to_vec();
        let n0 = shape.first().copied().unwrap_or(1);
        let row: usize = shape[1..].iter().product();
        let rows = rows.unwrap_or(0..n0);
        if rows.end > n0 {
            return Err(hf_err(&path, format!("{name}: rows {rows:?} of {n0}")));
        }
        let elem = view.dtype().bitsize() / 8;
        let bytes = &view.data()[rows.start * row * elem..rows.end * row * elem];
        let values = match view.dtype() {
            safetensors::Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(hf_err(
                    &path,
                    format!("{name}: dtype {other:?} is not supported"),
                ));
            }
        };
        Ok((shape, values))
    }
}

/// One HF tensor in a concatenation: its name, its rows, and the head size of a rotary
/// permutation to apply to them (q and k).
struct Part {
    name: String,
    rows: usize,
    rope_head_dim: Option<usize>,
}

/// How one of the Llama's parameters comes from the HF tensors.
enum Source {
    /// Our full tensor is the HF tensors' rows concatenated (transposed if `transpose`: a 2-D
    /// `[in, out]` weight from `[out, in]` ones), so our cut dimension is their rows.
    Rows { parts: Vec<Part>, transpose: bool },
    /// Our full `[in, out]` tensor is HF `name` (`[out, in]`) transposed, cut along its columns.
    Columns { name: String },
}

/// Every HF tensor the model needs, with the shape the configuration gives it.
fn expected_shapes(c: &HfConfig) -> Vec<(String, Vec<usize>)> {
    let (d, ff, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let hd = d / c.num_attention_heads;
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, d])];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        out.push((format!("{p}.input_layernorm.weight"), vec![d]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            out.push((format!("{p}.self_attn.{proj}.weight"), vec![rows, d]));
            if c.qkv_bias {
                out.push((format!("{p}.self_attn.{proj}.bias"), vec![rows]));
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q]));
        if c.out_bias {
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![d]));
        }
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![ff, d]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![ff, d]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![d, ff]));
    }
    out.push(("model.norm.weight".into(), vec![d]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![v, d]));
    }
    out
}

/// The Llama's parameters in visiting order, each with where it comes from.
fn sources(c: &HfConfig) -> Vec<Source> {
    let hd = c.hidden_size / c.num_attention_heads;
    let rows = |name: &str, transpose: bool| Source::Rows {
        parts: vec![Part {
            name: name.into(),
            rows: 0,
            rope_head_dim: None,
        }],
        transpose,
    };
    let mut out = vec![rows("model.embed_tokens.weight", false)];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let qkv = |suffix: &str| {
            let part = |proj: &str, heads: usize, rope: bool| Part {
                name: format!("{p}.self_attn.{proj}.{suffix}"),
                rows: heads * hd,
                rope_head_dim: rope.then_some(hd),
            };
            vec![
                part("q_proj", c.num_attention_heads, true),
                part("k_proj", c.num_key_value_heads, true),
                part("v_proj", c.num_key_value_heads, false),
            ]
        };
        out.push(rows(&format!("{p}.input_layernorm.weight"), false));
        out.push(Source::Rows {
            parts: qkv("weight"),
            transpose: true,
        });
        if c.qkv_bias {
            out.push(Source::Rows {
                parts: qkv("bias"),
                transpose: false,
            });
        }
        out.push(Source::Columns {
            name: format!("{p}.self_attn.o_proj.weight"),
        });
        if c.out_bias {
            out.push(rows(&format!("{p}.self_attn.o_proj.bias"), false));
        }
        out.push(rows(&format!("{p}.post_attention_layernorm.weight"), false));
        let ff = c.intermediate_size;
        out.push(Source::Rows {
            parts: ["gate_proj", "up_proj"]
                .map(|proj| Part {
                    name: format!("{p}.mlp.{proj}.weight"),
                    rows: ff,
                    rope_head_dim: None,
                })
                .into(),
            transpose: true,
        });
        out.push(Source::Columns {
            name: format!("{p}.mlp.down_proj.weight"),
        });
    }
    out.push(rows("model.norm.weight", false));
    if !c.tie_word_embeddings {
        out.push(rows("lm_head.weight", true));
    }
    out
}

/// HF's rotate-half order to Burn's interleaved pairs, within each head of `hd` rows:
/// row `2i` of a head takes HF row `i`, row `2i + 1` HF row `i + hd / 2`.
fn rope_row(r: usize, hd: usize) -> usize {
    let (head, i) = (r / hd, r % hd);
    head * hd + if i % 2 == 0 { i / 2 } else { hd / 2 + i / 2 }
}

/// Rows `global` of the concatenation `parts` (each HF tensor `[rows, cols]` or `[rows]`), in
/// Burn's order (the rotary permutation applied), and the number of columns.
fn concat_rows(w: &mut Weights, parts: &[Part], global: Range<usize>) -> Result<(Vec<f32>, usize)> {
    let mut out = Vec::new();
    let mut cols = 1;
    let mut start = 0;
    for part in parts {
        let (n, end) = if part.rows == 0 {
            (usize::MAX, usize::MAX)
        } else {
            (part.rows, start + part.rows)
        };
        let (a, b) = (global.start.max(start), global.end.min(end));
        if a < b {
            let (la, lb) = (a - start, b - start);
            match part.rope_head_dim {
                None => {
                    let (shape, values) = w.rows(&part.name, Some(la..lb))?;
                    cols = shape[1..].iter().product::<usize>().max(1);
                    out.extend(values);
                }
                Some(hd) => {
                    // Whole heads (the pieces are head-aligned): read them, then reorder.
                    let (ha, hb) = (la / hd * hd, lb.div_ceil(hd) * hd);
                    let (shape, values) = w.rows(&part.name, Some(ha..hb))?;
                    cols = shape[1..].iter().product::<usize>().max(1);
                    for r in la..lb {
                        let src = rope_row(r, hd) - ha;
                        out.extend_from_slice(&values[src * cols..(src + 1) * cols]);
                    }
                }
            }
        }
        if n == usize::MAX {
            break;
        }
        start = end;
    }
    Ok((out, cols))
}

/// This rank's local tensor of one parameter (`local_shape`, f32) from `source`.
fn local_values(
    w: &mut Weights,
    source: &Source,
    layout: &ParamLayout,
    local_shape: &[usize],
) -> Result<Vec<f32>> {
    let mut out = vec![0f32; local_shape.iter().product()];
    match source {
        Source::Rows { parts, transpose } => {
            for piece in &layout.pieces {
                let (values, cols) = concat_rows(w, parts, piece.global.clone())?;
                let n = piece.global.len();
                if *transpose {
                    // Our `[cols, n_local]` columns `local` take the rows read, transposed.
                    let width = local_shape[1];
                    for (j, r) in piece.local.clone().enumerate() {
                        for c in 0..cols {
                            out[c * width + r] = values[j * cols + c];
                        }
                    }
                } else {
                    let row = local_shape[1..].iter().product::<usize>().max(1);
                    out[piece.local.start * row..(piece.local.start + n) * row]
                        .copy_from_slice(&values);
                }
            }
        }
        Source::Columns { name } => {
            // Columns of a row-major `[out, in]` tensor are strided: the whole tensor is read.
            let (shape, values) = w.rows(name, None)?;
            let (rows, cols) = (shape[0], shape[1]);
            for piece in &layout.pieces {
                for (j, c) in piece.global.clone().enumerate() {
                    let r_local = piece.local.start + j;
                    for r in 0..rows {
                        out[r_local * rows + r] = values[r * cols + c];
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Loads the Hugging Face model in `dir` into a [`Llama`] at the tp of `group`, running with
/// `settings`. Collective over `group` (the model is built first: its values are then
/// replaced); each rank reads only the slices of the files its shards need (the row-parallel
/// projections' column slices excepted: strided, they are read whole).
///
/// # Errors
/// [`TpError::Checkpoint`] naming the file and the tensor or field: an unsupported
/// configuration, a missing or damaged file, a tensor missing or of another shape; head counts
/// that do not fit tp.
pub fn load_llama(
    dir: &Path,
    settings: TpSettings,
    group: &ProcessGroup,
    device: &Device,
) -> Result<(Llama, HfConfig)> {
    let config = HfConfig::from_dir(dir)?;
    let model = config.llama_config(settings).init(group, device)?;
    Ok((load_into(model, &config, dir, group)?, config))
}

/// Fills `model` (a Llama built at the tp of `group` from `config`, e.g. with another dropout)
/// with the Hugging Face weights in `dir`, each rank reading its own slices. Local: no
/// communication.
///
/// # Errors
/// As [`load_llama`].
pub fn load_into(
    model: Llama,
    config: &HfConfig,
    dir: &Path,
    group: &ProcessGroup,
) -> Result<Llama> {
    let layouts = model.layout(group.rank());
    let sources = sources(config);
    if sources.len() != layouts.len() {
        return Err(hf_err(
            dir,
            format!(
                "{} tensors mapped for {} parameters of the model",
                sources.len(),
                layouts.len()
            ),
        ));
    }
    let mut weights = Weights::open(dir)?;
    // Every tensor's shape checked before any is read: a model of another size is an error,
    // never a silently wrong slice.
    for (name, want) in expected_shapes(config) {
        let got = weights.shape(&name)?;
        if got != want {
            let file = weights.file_of.get(&name).cloned().unwrap_or_default();
            return Err(hf_err(
                &weights.dir.join(file),
                format!("tensor {name} has shape {got:?}, the config gives {want:?}"),
            ));
        }
    }
    let shapes: Vec<Vec<usize>> = crate::checkpoint::param_shapes(&model)
        .into_iter()
        .map(|(shape, _)| shape)
        .collect();
    let mut values = Vec::with_capacity(layouts.len());
    for ((source, layout), shape) in sources.iter().zip(&layouts).zip(&shapes) {
        let v = local_values(&mut weights, source, layout, shape)?;
        values.push(TensorData::new(v, shape.clone()));
    }
    Ok(with_values(model, values))
}

/// Writes `model` (a [`Llama`] at any tp, the `config` it was imported or built with) in Hugging
/// Face's format into `dir`: `config.json` and `model.safetensors` with HF's names and layouts
/// (`[out, in]` weights, separate q / k / v and gate / up, the rotate-half rotary order), in the
/// model's dtype. The model is gathered to its full form on every rank and rank 0 writes.
/// Collective over `group`.
///
/// # Errors
/// [`TpError::Checkpoint`] naming the file for a write that fails; a communication error.
pub fn save_llama(
    model: &Llama,
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

fn write_hf(full: &Llama, config: &HfConfig, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| hf_err(dir, format!("creating: {e}")))?;
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
                    tensors.push((part.name.clone(), hf_shape, out));
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
                .map_err(|e| hf_err(dir, format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = dir.join("model.safetensors");
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata.into_iter().collect()), &path)
        .map_err(|e| hf_err(&path, format!("writing: {e}")))?;
    let (arch, model_type) = match config.architecture {
        HfArchitecture::Llama => ("LlamaForCausalLM", "llama"),
        HfArchitecture::Mistral => ("MistralForCausalLM", "mistral"),
        HfArchitecture::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
    };
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
    });
    match config.architecture {
        HfArchitecture::Qwen2 => json["use_sliding_window"] = serde_json::json!(false),
        _ => json["attention_bias"] = serde_json::json!(config.out_bias),
    }
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&json).map_err(|e| hf_err(&path, e.to_string()))?;
    std::fs::write(&path, text).map_err(|e| hf_err(&path, format!("writing: {e}")))
}

/// `module` with its float parameters' values replaced (in visiting order), in each parameter's
/// dtype, keeping it trainable.
fn with_values<M: Module>(module: M, values: Vec<TensorData>) -> M {
    struct Replace(std::vec::IntoIter<TensorData>);
    impl ModuleMapper for Replace {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.0.next() {
                Some(data) => param.map(|t| {
                    let (device, dtype) = (t.device(), t.dtype());
                    Tensor::<D>::from_data(data.convert_dtype(dtype), (&device, dtype))
                        .set_require_grad(t.is_require_grad())
                }),
                None => param,
            }
        }
    }
    module.map(&mut Replace(values.into_iter()))
}

#[cfg(test)]
mod tests {
    use super::rope_row;

    #[test]
    fn the_rotary_permutation_interleaves_the_two_halves_of_each_head() {
        // A head of 8: Burn's rows 0..8 take HF rows 0, 4, 1, 5, 2, 6, 3, 7; the next head the
        // same, shifted.
        let rows: Vec<usize> = (0..16).map(|r| rope_row(r, 8)).collect();
        assert_eq!(rows, [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]);
    }
}
