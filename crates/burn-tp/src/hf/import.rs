//! Import: each rank reads only the slices of the safetensors files its shards need.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;
use serde_json::Value;

use super::mapping::{Ep, Part, Source, expected_shapes, rope_row, sources_at};
use super::{HfConfig, file_error};
use crate::Result;
use crate::gemma::Gemma;
use crate::linear::TpSettings;
use crate::llama::Llama;
use crate::reshard::{ParamLayout, Reshard};

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
                .map_err(|e| file_error(&index, format!("reading: {e}")))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| file_error(&index, format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| file_error(&index, "`weight_map` is missing"))?;
            for (name, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| file_error(&index, format!("{name}: not a file name")))?;
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
            let f = std::fs::File::open(&path)
                .map_err(|e| file_error(&path, format!("opening: {e}")))?;
            // Safety: the model's files are not written while they are read.
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| file_error(&path, format!("mapping: {e}")))?;
            self.maps.insert(file.to_string(), map);
        }
        safetensors::SafeTensors::deserialize(&self.maps[file])
            .map_err(|e| file_error(&path, format!("a truncated or damaged file: {e}")))
    }

    /// `name`'s shape, from its file's header.
    fn shape(&mut self, name: &str) -> Result<Vec<usize>> {
        let file = self
            .file_of
            .get(name)
            .cloned()
            .ok_or_else(|| file_error(&self.dir, format!("tensor {name} is missing")))?;
        let path = self.dir.join(&file);
        let st = self.tensors(&file)?;
        let view = st
            .tensor(name)
            .map_err(|e| file_error(&path, format!("{name}: {e}")))?;
        Ok(view.shape().to_vec())
    }

    /// `name`'s shape, and its rows `rows` (all columns) as f32, read from those rows' bytes only.
    fn rows(&mut self, name: &str, rows: Option<Range<usize>>) -> Result<(Vec<usize>, Vec<f32>)> {
        let file = self
            .file_of
            .get(name)
            .cloned()
            .ok_or_else(|| file_error(&self.dir, format!("tensor {name} is missing")))?;
        let path = self.dir.join(&file);
        let st = self.tensors(&file)?;
        let view = st
            .tensor(name)
            .map_err(|e| file_error(&path, format!("{name}: {e}")))?;
        let shape = view.shape().to_vec();
        let n0 = shape.first().copied().unwrap_or(1);
        let row: usize = shape[1..].iter().product();
        let rows = rows.unwrap_or(0..n0);
        if rows.end > n0 {
            return Err(file_error(&path, format!("{name}: rows {rows:?} of {n0}")));
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
                return Err(file_error(
                    &path,
                    format!("{name}: dtype {other:?} is not supported"),
                ));
            }
        };
        Ok((shape, values))
    }
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
            let off = part.offset;
            match part.rope_head_dim {
                None => {
                    let (shape, values) = w.rows(&part.name, Some(off + la..off + lb))?;
                    cols = shape[1..].iter().product::<usize>().max(1);
                    out.extend(values);
                }
                Some(hd) => {
                    // Whole heads (the pieces are head-aligned): read them, then reorder.
                    let (ha, hb) = (la / hd * hd, lb.div_ceil(hd) * hd);
                    let (shape, values) = w.rows(&part.name, Some(off + ha..off + hb))?;
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

/// Builds the Hugging Face model in `dir` as a [`Llama`] at the tp of `group`, running with
/// `settings`. Collective over `group` (the model is built first: its values are then
/// replaced); each rank reads only the slices of the files its shards need (the row-parallel
/// projections' column slices excepted: strided, they are read whole).
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file and the tensor or field: an unsupported
/// configuration, a missing or damaged file, a tensor missing or of another shape; head counts
/// that do not fit tp.
pub fn init_llama(
    dir: &Path,
    settings: TpSettings,
    group: &ProcessGroup,
    device: &Device,
) -> Result<(Llama, HfConfig)> {
    let config = HfConfig::from_dir(dir)?;
    if config.architecture.is_gemma() {
        return Err(file_error(
            &dir.join("config.json"),
            format!(
                "{} is a Gemma: import it with hf::init_gemma",
                config.architecture.names().0
            ),
        ));
    }
    let model = config.llama_config(settings).init(group, device)?;
    Ok((load_with(model, &config, dir, group, Ep::WHOLE)?, config))
}

/// [`init_llama`] of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE) with its
/// experts split over `ep` as well: the rank builds and reads only its `n_experts / ep`
/// experts of each MoE layer (`experts.{ep_rank * n / ep ..}`), never the others'. Collective
/// over `group` (tp) and `ep`; `ep` of size 1 is [`init_llama`].
///
/// # Errors
/// As [`init_llama`]; experts that `ep` does not divide.
pub fn init_llama_expert_parallel(
    dir: &Path,
    settings: TpSettings,
    group: &ProcessGroup,
    ep: &ProcessGroup,
    device: &Device,
) -> Result<(Llama, HfConfig)> {
    let config = HfConfig::from_dir(dir)?;
    if config.architecture.is_gemma() {
        return init_llama(dir, settings, group, device);
    }
    let llama = config.llama_config(settings);
    let layers: Vec<usize> = (0..llama.n_layers).collect();
    let model = llama.init_expert_parallel(group, ep, device, &layers)?;
    Ok((load_expert_parallel(model, dir, group, ep)?, config))
}

/// [`load`] into a model whose experts are split over `ep` (built by
/// `LlamaConfig::init_expert_parallel`): this rank reads only its `n_experts / ep` experts of
/// each MoE layer. Collective over `group` (tp).
///
/// # Errors
/// As [`load`].
pub fn load_expert_parallel<M: Module + Reshard>(
    model: M,
    dir: &Path,
    group: &ProcessGroup,
    ep: &ProcessGroup,
) -> Result<M> {
    let config = HfConfig::from_dir(dir)?;
    let at = Ep {
        rank: ep.rank(),
        size: ep.world_size(),
    };
    load_with(model, &config, dir, group, at)
}

/// Builds the Hugging Face Gemma in `dir` (`Gemma3ForCausalLM`) as a [`Gemma`] at the tp of
/// `group`, as [`init_llama`] does a Llama.
///
/// # Errors
/// As [`init_llama`]; a `dir` of the Llama family.
pub fn init_gemma(
    dir: &Path,
    settings: TpSettings,
    group: &ProcessGroup,
    device: &Device,
) -> Result<(Gemma, HfConfig)> {
    let config = HfConfig::from_dir(dir)?;
    let gemma = config
        .gemma_config(settings)
        .map_err(|e| file_error(&dir.join("config.json"), e.to_string()))?;
    let model = gemma.init(group, device)?;
    Ok((load_with(model, &config, dir, group, Ep::WHOLE)?, config))
}

/// Fills `model` (a [`Llama`] or a [`Gemma`] built at the tp of `group` from `dir`'s
/// configuration, e.g. with another dropout) with the Hugging Face weights in `dir`, each rank
/// reading its own slices. Local: no communication.
///
/// # Errors
/// As [`init_llama`].
pub fn load<M: Module + Reshard>(model: M, dir: &Path, group: &ProcessGroup) -> Result<M> {
    let config = HfConfig::from_dir(dir)?;
    load_with(model, &config, dir, group, Ep::WHOLE)
}

/// `model`'s values from `dir`: those of expert-parallel rank `ep`'s experts.
fn load_with<M: Module + Reshard>(
    model: M,
    config: &HfConfig,
    dir: &Path,
    group: &ProcessGroup,
    ep: Ep,
) -> Result<M> {
    let layouts = model.layout(group.rank());
    let sources = sources_at(config, ep);
    if sources.len() != layouts.len() {
        return Err(file_error(
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
            return Err(file_error(
                &weights.dir.join(file),
                format!("tensor {name} has shape {got:?}, the config gives {want:?}"),
            ));
        }
    }
    let shapes: Vec<Vec<usize>> = crate::checkpoint::param_shapes(&model)
        .into_iter()
        .map(|(shape, _)| shape)
        .collect();
    let mut load = Load {
        weights: &mut weights,
        parts: sources
            .iter()
            .zip(&layouts)
            .zip(shapes)
            .collect::<Vec<_>>()
            .into_iter(),
        error: None,
    };
    let model = model.map(&mut load);
    match load.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// Replaces each float parameter (in visiting order) by its values read from the files just
/// then, in the parameter's dtype, keeping it trainable: the drawn tensor goes as its
/// replacement comes, so an import holds the model and one parameter's values, not a second
/// model (the first error is kept and the rest left as drawn).
struct Load<'a> {
    weights: &'a mut Weights,
    parts: std::vec::IntoIter<((&'a Source, &'a ParamLayout), Vec<usize>)>,
    error: Option<crate::TpError>,
}

impl ModuleMapper for Load<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let Some(((source, layout), shape)) = self.parts.next() else {
            return param;
        };
        match local_values(self.weights, source, layout, &shape) {
            Ok(values) => param.map(|t| {
                let (device, dtype) = (t.device(), t.dtype());
                let data = TensorData::new(values, shape).convert_dtype(dtype);
                Tensor::<D>::from_data(data, (&device, dtype)).set_require_grad(t.is_require_grad())
            }),
            Err(e) => {
                self.error = Some(e);
                param
            }
        }
    }
}
