//! PEFT's LoRA adapters of a Llama-family model (`adapter_config.json`,
//! `adapter_model.safetensors`): read into a model at any tp ([`load_peft`]), written from a
//! gathered one ([`save_peft`]).
//!
//! ```text
//!  PEFT (layer N, module m: self_attn.q_proj ... mlp.down_proj)          burn-tp ([in, out])
//!  base_model.model.model.layers.N.m.lora_A.weight  [r, d_in]            A = lora_A^T  [d_in, r]
//!  base_model.model.model.layers.N.m.lora_B.weight  [d_out, r]           B = lora_B^T  [r, d_out]
//!  q_proj / k_proj: B's columns in the weight's rotary order (the import's permutation)
//!  scale = lora_alpha / r
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use serde_json::Value;

use super::mapping::rope_row;
use super::{HfConfig, file_error};
use crate::llama::Llama;
use crate::lora::freeze;
use crate::model::LanguageModel;
use crate::{Result, TpError};

/// The PEFT name of layer `layer`'s module `short` (`q` -> `self_attn.q_proj`).
fn module_name(layer: usize, short: &str) -> String {
    let m = match short {
        "q" | "k" | "v" | "o" => format!("self_attn.{short}_proj"),
        _ => format!("mlp.{short}_proj"),
    };
    format!("base_model.model.model.layers.{layer}.{m}")
}

/// `config`'s r, lora_alpha and target modules (short names).
///
/// # Errors
/// A setting this reader does not model, named.
fn read_config(path: &Path) -> Result<(usize, f64, BTreeSet<String>)> {
    let text =
        std::fs::read_to_string(path).map_err(|e| file_error(path, format!("reading: {e}")))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| file_error(path, format!("not JSON: {e}")))?;
    let peft_type = v.get("peft_type").and_then(Value::as_str).unwrap_or("");
    if peft_type != "LORA" {
        return Err(file_error(
            path,
            format!("`peft_type` = {peft_type:?}: only LORA adapters are read"),
        ));
    }
    for (key, off) in [
        ("use_rslora", Value::Bool(false)),
        ("use_dora", Value::Bool(false)),
        ("fan_in_fan_out", Value::Bool(false)),
    ] {
        if let Some(x) = v.get(key).filter(|x| !x.is_null() && **x != off) {
            return Err(file_error(path, format!("`{key}` = {x} is not supported")));
        }
    }
    if let Some(b) = v
        .get("bias")
        .and_then(Value::as_str)
        .filter(|b| *b != "none")
    {
        return Err(file_error(path, format!("`bias` = {b:?} is not supported")));
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if v.get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(file_error(path, format!("`{key}` is not supported")));
        }
    }
    for key in ["layers_to_transform", "modules_to_save"] {
        if v.get(key).is_some_and(|x| !x.is_null()) {
            return Err(file_error(path, format!("`{key}` is not supported")));
        }
    }
    let r = v
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| file_error(path, "`r` is missing or not a positive integer"))?
        as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| file_error(path, "`lora_alpha` is missing"))?;
    let targets = v
        .get("target_modules")
        .and_then(Value::as_array)
        .ok_or_else(|| file_error(path, "`target_modules` is not a list of module names"))?
        .iter()
        .map(|t| {
            let t = t.as_str().unwrap_or("");
            let short = t.strip_suffix("_proj").unwrap_or(t);
            match crate::lora::TARGETS.contains(&short) {
                true => Ok(short.to_string()),
                false => Err(file_error(
                    path,
                    format!("target module {t:?} is not one of the Llama family's projections"),
                )),
            }
        })
        .collect::<Result<_>>()?;
    Ok((r, alpha, targets))
}

/// Tensors by name: shape and f32 values.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Every tensor of `path`, as f32, by name.
fn read_tensors(path: &Path) -> Result<Tensors> {
    let bytes = std::fs::read(path).map_err(|e| file_error(path, format!("reading: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| file_error(path, format!("a truncated or damaged file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let values = match view.dtype() {
            safetensors::Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(file_error(
                    path,
                    format!("{name}: dtype {other:?} is not supported"),
                ));
            }
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// Reads one adapter's factors in Burn's layout, the tensors it used taken out of `tensors`.
struct Reader<'a> {
    tensors: Tensors,
    path: &'a Path,
    rank: usize,
    head_dim: usize,
    device: burn::tensor::Device,
    dtype: burn::tensor::DType,
}

impl Reader<'_> {
    /// Layer `layer`'s adapter of module `short` (`d_in -> d_out`): `A [d_in, r]`,
    /// `B [r, d_out]` (q / k columns in rotary order).
    fn factors(
        &mut self,
        layer: usize,
        short: &str,
        d_in: usize,
        d_out: usize,
    ) -> Result<(Tensor<2>, Tensor<2>)> {
        let m = module_name(layer, short);
        let r = self.rank;
        let mut take = |name: String, want: [usize; 2]| -> Result<Vec<f32>> {
            let (shape, values) = self
                .tensors
                .remove(&name)
                .ok_or_else(|| file_error(self.path, format!("tensor {name} is missing")))?;
            if shape != want {
                return Err(file_error(
                    self.path,
                    format!("tensor {name} has shape {shape:?}, the base model needs {want:?}"),
                ));
            }
            Ok(values)
        };
        let a_hf = take(format!("{m}.lora_A.weight"), [r, d_in])?;
        let b_hf = take(format!("{m}.lora_B.weight"), [d_out, r])?;
        // A = lora_A^T; B = lora_B^T, its columns in the weight's rotary order for q and k.
        let a = transpose(&a_hf, r, d_in);
        let rows = b_rows(short, d_out, self.head_dim);
        let permuted: Vec<f32> = rows
            .iter()
            .flat_map(|&row| b_hf[row * r..(row + 1) * r].iter().copied())
            .collect();
        let b = transpose(&permuted, d_out, r);
        let tensor = |v: Vec<f32>, shape: [usize; 2]| {
            Tensor::<2>::from_data(TensorData::new(v, shape), &self.device).cast(self.dtype)
        };
        Ok((tensor(a, [d_in, r]), tensor(b, [r, d_out])))
    }
}

/// `model` (a Llama-family model built from `hf`, at any tp, its blocks the whole model's or a
/// pipeline stage's) with the PEFT LoRA adapter in `dir` on it, each rank keeping its slices;
/// every other parameter frozen. Local: no communication.
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file and the field or
/// tensor: a setting not modelled (DoRA, rsLoRA, bias, per-module ranks, `modules_to_save`), a
/// tensor missing, of a shape the base does not have, or left unused (an adapter on a module
/// this model has not: an embedding, a mixture of experts' experts).
pub fn load_peft(model: Llama, dir: &Path, hf: &HfConfig) -> Result<Llama> {
    let (rank, alpha, targets) = read_config(&dir.join("adapter_config.json"))?;
    let path = dir.join("adapter_model.safetensors");
    let weight = model.embedding_weight().val();
    let mut reader = Reader {
        tensors: read_tensors(&path)?,
        path: &path,
        rank,
        head_dim: hf.head_size(),
        device: weight.device(),
        dtype: weight.dtype(),
    };
    let scale = alpha / rank as f64;
    let on = |t: &str| targets.contains(t);
    let (d, hd) = (hf.hidden_size, hf.head_size());
    let widths = [
        hf.num_attention_heads * hd,
        hf.num_key_value_heads * hd,
        hf.num_key_value_heads * hd,
    ];
    let mut model = freeze(model);
    let ids = model.block_ids().to_vec();
    let blocks = std::mem::take(&mut model.blocks);
    let mut out = Vec::with_capacity(blocks.len());
    let (mut dense, mut sparse) = (0, 0);
    for (mut block, layer) in blocks.into_iter().zip(ids) {
        let mut adapters = 0;
        let names = ["q", "k", "v"];
        let qkv = std::mem::take(&mut block.attn.qkv);
        block.attn.qkv = match qkv.len() {
            1 => qkv
                .into_iter()
                .map(|l| {
                    let parts: Vec<usize> = (0..3).filter(|&p| on(names[p])).collect();
                    if parts.is_empty() {
                        return Ok(l);
                    }
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    for &p in &parts {
                        let (fa, fb) = reader.factors(layer, names[p], d, widths[p])?;
                        a.push(fa);
                        b.push(fb);
                    }
                    adapters += parts.len();
                    l.with_lora_factors(parts, a, b, scale)
                })
                .collect::<Result<Vec<_>>>()?,
            _ => qkv
                .into_iter()
                .enumerate()
                .map(|(p, l)| match on(names[p]) {
                    true => {
                        let (a, b) = reader.factors(layer, names[p], d, widths[p])?;
                        adapters += 1;
                        l.with_lora_factors(vec![0], vec![a], vec![b], scale)
                    }
                    false => Ok(l),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if on("o") {
            let (a, b) = reader.factors(layer, "o", widths[0], d)?;
            block.attn.out = block.attn.out.with_lora_factors(a, b, scale)?;
            adapters += 1;
        }
        let attention = adapters;
        if let Some(mut mlp) = block.mlp.take() {
            let f = hf.intermediate_size;
            let parts: Vec<usize> = (0..2).filter(|&p| on(["gate", "up"][p])).collect();
            if !parts.is_empty() {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for &p in &parts {
                    let (fa, fb) = reader.factors(layer, ["gate", "up"][p], d, f)?;
                    a.push(fa);
                    b.push(fb);
                }
                adapters += parts.len();
                mlp.gate_up = mlp.gate_up.with_lora_factors(parts, a, b, scale)?;
            }
            if on("down") {
                let (a, b) = reader.factors(layer, "down", f, d)?;
                mlp.down = mlp.down.with_lora_factors(a, b, scale)?;
                adapters += 1;
            }
            block.mlp = Some(mlp);
        }
        match block.moe.is_some() {
            true => sparse = 2 * attention,
            false => dense = 2 * adapters,
        }
        out.push(block);
    }
    model.blocks = out;
    // A pipeline stage reads its layers' tensors only; the whole model must use them all.
    let held: BTreeSet<String> = model
        .block_ids()
        .iter()
        .map(|l| format!("base_model.model.model.layers.{l}."))
        .collect();
    if let Some(name) = reader.tensors.keys().find(|n| {
        !n.starts_with("base_model.model.model.layers.")
            || held.iter().any(|prefix| n.starts_with(prefix))
    }) {
        return Err(file_error(
            &path,
            format!("tensor {name} is on a module this model does not adapt"),
        ));
    }
    Ok(model.with_added_block_params(dense, sparse))
}

/// Writes `model`'s adapters (a whole model at tp 1: gather a sharded one with
/// `Reshard::to_full_module` first) as a PEFT folder in `dir` (`adapter_config.json` naming
/// `base` as the base model, `adapter_model.safetensors` in f32), so
/// `PeftModel.from_pretrained(base, dir)` loads it.
///
/// # Errors
/// [`TpError::Config`] for a sharded model, one without adapters, or adapters of different
/// ranks or scales; a file that cannot be written.
pub fn save_peft(model: &Llama, dir: &Path, hf: &HfConfig, base: Option<&str>) -> Result<()> {
    if model.group().world_size() != 1 {
        return Err(TpError::Config(format!(
            "save_peft: a model sharded over tp {}: gather it first (Reshard::to_full_module)",
            model.group().world_size()
        )));
    }
    let hd = hf.head_size();
    // (name, shape, values) of every factor, in PEFT's layout; the ranks and scales seen.
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut targets = BTreeSet::new();
    let mut shapes = BTreeSet::new();
    let mut put = |layer: usize, short: &str, a: Tensor<2>, b: Tensor<2>, scale: f64| {
        let [d_in, r] = a.dims();
        let [_, d_out] = b.dims();
        let a = host(a);
        let b = host(b);
        let a_hf = transpose(&a, d_in, r);
        let bt = transpose(&b, r, d_out);
        let mut b_hf = vec![0f32; d_out * r];
        for (c, row) in b_rows(short, d_out, hd).into_iter().enumerate() {
            b_hf[row * r..(row + 1) * r].copy_from_slice(&bt[c * r..(c + 1) * r]);
        }
        let m = module_name(layer, short);
        tensors.push((format!("{m}.lora_A.weight"), vec![r, d_in], a_hf));
        tensors.push((format!("{m}.lora_B.weight"), vec![d_out, r], b_hf));
        targets.insert(format!("{short}_proj"));
        shapes.insert((r, scale.to_bits()));
    };
    let names = ["q", "k", "v"];
    for (block, &layer) in model.blocks.iter().zip(model.block_ids()) {
        let fused = block.attn.qkv.len() == 1;
        for (i, l) in block.attn.qkv.iter().enumerate() {
            if let Some(lora) = &l.lora {
                for ((a, b), &p) in lora.a.iter().zip(&lora.b).zip(lora.parts()) {
                    let short = if fused { names[p] } else { names[i] };
                    put(layer, short, a.val(), b.val(), lora.scale());
                }
            }
        }
        if let Some(lora) = &block.attn.out.lora {
            put(layer, "o", lora.a.val(), lora.b.val(), lora.scale());
        }
        if let Some(mlp) = &block.mlp {
            if let Some(lora) = &mlp.gate_up.lora {
                for ((a, b), &p) in lora.a.iter().zip(&lora.b).zip(lora.parts()) {
                    put(layer, ["gate", "up"][p], a.val(), b.val(), lora.scale());
                }
            }
            if let Some(lora) = &mlp.down.lora {
                put(layer, "down", lora.a.val(), lora.b.val(), lora.scale());
            }
        }
    }
    let (r, scale) = match shapes.iter().collect::<Vec<_>>()[..] {
        [&(r, scale)] => (r, f64::from_bits(scale)),
        [] => {
            return Err(TpError::Config(
                "save_peft: the model has no adapters".into(),
            ));
        }
        _ => {
            return Err(TpError::Config(
                "save_peft: adapters of different ranks or scales (PEFT's rank_pattern is not \
                 written)"
                    .into(),
            ));
        }
    };
    std::fs::create_dir_all(dir).map_err(|e| file_error(dir, format!("creating: {e}")))?;
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                .map(|v| (name.clone(), v))
                .map_err(|e| file_error(dir, format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let path = dir.join("adapter_model.safetensors");
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata.into_iter().collect()), &path)
        .map_err(|e| file_error(&path, format!("writing: {e}")))?;
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": scale * r as f64,
        "target_modules": targets.into_iter().collect::<Vec<_>>(),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let path = dir.join("adapter_config.json");
    let text = serde_json::to_string_pretty(&json).expect("a JSON value");
    std::fs::write(&path, text).map_err(|e| file_error(&path, format!("writing: {e}")))
}

/// `v` (`[rows, cols]`, row-major) transposed: `[cols, rows]`.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = v[i * cols + j];
        }
    }
    out
}

/// Per column `c` of Burn's B (module `short`, `d_out` columns): the row of PEFT's `lora_B`
/// it is, the q / k projections' in the rotary order the import gives their weights.
fn b_rows(short: &str, d_out: usize, head_dim: usize) -> Vec<usize> {
    let rope = matches!(short, "q" | "k");
    (0..d_out)
        .map(|c| if rope { rope_row(c, head_dim) } else { c })
        .collect()
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values")
}
