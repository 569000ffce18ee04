//! Sharded checkpoints: every rank writes only the slices it owns, and any tp reads back only the
//! slices it needs. No rank ever holds a full parameter, so checkpointing a model costs each
//! rank its own shard's memory, not the whole model's (what
//! [`FullOptimizerState`](crate::reshard::FullOptimizerState) and `to_full_module` cost).
//!
//! # Format
//! A checkpoint is a folder:
//! - `index.json`: the format, the run's [`CheckpointInfo`] (steps, tp, dp, the model's config),
//!   and for every tensor (`p{k}` for parameter `k` in visiting order, `p{k}.{field}` for its
//!   optimizer state, AdamW's moments) its dtype, full shape, the dimension it is cut along and
//!   which file holds which slice; the optimizer's scalars. Written last, atomically (a
//!   temporary file renamed over the old one): a folder without it is not a checkpoint.
//! - `step-{N}/rank-{r}.safetensors`: tensor-parallel rank `r`'s tensors, each stored with the
//!   dimension it is cut along first, so that a slice of it is one contiguous byte range. The
//!   shard folder is written under a temporary name and renamed into place before the index
//!   points at it; the folders of older saves are removed after.
//!
//! A crash at any point leaves the previous `index.json` pointing at its own intact shards.
//! Data-parallel replicas hold the same tensors: only replica 0 writes.
//!
//! # Loading
//! [`load_sharded`] fills a model built at any tp (and [`load_sharded_optimizer`] its optimizer)
//! from a checkpoint saved at any other: each rank computes where its own shards lie ([`Reshard::layout`]) and copies each
//! overlapping slice out of the memory-mapped files, touching only those pages.
//!
//! ```no_run
//! # use burn_tp::checkpoint::{CheckpointInfo, load_sharded, save_sharded};
//! # use burn_tp::gpt::GptConfig;
//! # fn demo(group: &burn_tp::ProcessGroup, device: &burn::tensor::Device) -> burn_tp::Result<()> {
//! let config = GptConfig::new(64, 32, 64, 4, 2);
//! let model = config.init(group, device)?;
//! let info = CheckpointInfo::new(100, group.world_size(), 1, &config);
//! save_sharded(&model, None, "out/checkpoint".as_ref(), &info, group, 0)?;
//! // Later, at any tp: a freshly built model takes the saved values.
//! let model = config.init(group, device)?;
//! let (model, info) = load_sharded(model, "out/checkpoint".as_ref(), Some(&config), group)?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;
use serde::{Deserialize, Serialize};

use crate::reshard::{IndexedState, ParamLayout, Reshard};
use crate::{Result, TpError};

/// The index's file name.
pub const INDEX: &str = "index.json";
const FORMAT: &str = "burn-tp-sharded/1";

/// What a checkpoint records about the run that saved it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Training steps done.
    pub step: u64,
    /// Tensor-parallel size of the run that saved it (any tp loads it).
    pub tp: usize,
    /// Data-parallel size of the run that saved it.
    pub dp: usize,
    /// The model's configuration, as JSON, without its `settings` (how the layers run: a
    /// checkpoint resumes in any mode or schedule): [`load_sharded`] refuses a checkpoint of
    /// another configuration.
    pub config: serde_json::Value,
}

/// `config` as JSON, without a top-level `settings` (burn-tp's configs keep how the layers run
/// there: not part of what the model is).
fn model_json(config: &impl Serialize) -> serde_json::Value {
    let mut value = serde_json::to_value(config).unwrap_or(serde_json::Value::Null);
    if let Some(object) = value.as_object_mut() {
        object.remove("settings");
    }
    value
}

impl CheckpointInfo {
    /// The info of a save after `step` steps of a run at `tp` x `dp` of the model `config`.
    pub fn new(step: u64, tp: usize, dp: usize, config: &impl Serialize) -> Self {
        Self {
            step,
            tp,
            dp,
            config: model_json(config),
        }
    }
}

/// One stored slice of a tensor: rows `offset..offset + (end - start)` (along the stored tensor's
/// first dimension) of `name` in `file` hold indices `start..end` of the full tensor's `dim`.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct StoredPiece {
    file: String,
    start: usize,
    end: usize,
    offset: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<usize>,
    dim: usize,
    pieces: Vec<StoredPiece>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
enum ScalarValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Part {
    tensors: BTreeMap<String, TensorEntry>,
    scalars: BTreeMap<String, ScalarValue>,
    paths: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Index {
    format: String,
    info: CheckpointInfo,
    /// The folder of the shard files, relative to the checkpoint's.
    shards: String,
    /// Float parameters of the model.
    params: usize,
    tensors: BTreeMap<String, TensorEntry>,
    scalars: BTreeMap<String, ScalarValue>,
    paths: BTreeMap<String, String>,
}

fn ckpt_err(path: &Path, what: impl Into<String>) -> TpError {
    TpError::Checkpoint {
        path: path.display().to_string(),
        what: what.into(),
    }
}

fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        _ => return None,
    })
}

fn safetensors_dtype(name: &str) -> Option<safetensors::Dtype> {
    Some(match name {
        "F64" => safetensors::Dtype::F64,
        "F32" => safetensors::Dtype::F32,
        "F16" => safetensors::Dtype::F16,
        "BF16" => safetensors::Dtype::BF16,
        _ => return None,
    })
}

/// A tensor as a rank stores it: its dimension `dim` first, row-major.
struct Stored {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for &Stored {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The float parameters of a module with `dim` of each moved first, in visiting order.
fn dim_first_values<M: Module>(module: &M, layouts: &[ParamLayout]) -> Vec<TensorData> {
    struct Collect<'a>(Vec<TensorData>, &'a [ParamLayout]);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dim = self.1.get(self.0.len()).map_or(0, |l| l.dim);
            self.0.push(param.val().swap_dims(0, dim).into_data());
        }
    }
    let mut c = Collect(Vec::new(), layouts);
    module.visit(&mut c);
    c.0
}

/// `module` with parameter `k` replaced by `values[k]`, given with its dim `layouts[k].dim`
/// first (kept where `None`).
fn with_dim_first_values<M: Module>(
    module: M,
    values: Vec<Option<TensorData>>,
    layouts: &[ParamLayout],
) -> M {
    struct Replace<'a>(
        std::vec::IntoIter<Option<TensorData>>,
        &'a [ParamLayout],
        usize,
    );
    impl ModuleMapper for Replace<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dim = self.1.get(self.2).map_or(0, |l| l.dim);
            self.2 += 1;
            match self.0.next().flatten() {
                Some(data) => param.map(|t| {
                    let (device, dtype) = (t.device(), data.dtype());
                    // A fresh tensor is not tracked: keep the parameter trainable as it was.
                    Tensor::<D>::from_data(data, (&device, dtype))
                        .swap_dims(0, dim)
                        .set_require_grad(t.is_require_grad())
                }),
                None => param,
            }
        }
    }
    module.map(&mut Replace(values.into_iter(), layouts, 0))
}

impl From<burn_pack::Scalar> for ScalarValue {
    fn from(v: burn_pack::Scalar) -> Self {
        match v {
            burn_pack::Scalar::Int(v) => Self::Int(v),
            burn_pack::Scalar::UInt(v) => Self::UInt(v),
            burn_pack::Scalar::Float(v) => Self::Float(v),
            burn_pack::Scalar::Bool(v) => Self::Bool(v),
        }
    }
}

impl From<ScalarValue> for burn_pack::Scalar {
    fn from(v: ScalarValue) -> Self {
        match v {
            ScalarValue::Int(v) => Self::Int(v),
            ScalarValue::UInt(v) => Self::UInt(v),
            ScalarValue::Float(v) => Self::Float(v),
            ScalarValue::Bool(v) => Self::Bool(v),
        }
    }
}

/// Saves this rank's shards of `model` (and of `optim`'s state, if given) into the checkpoint
/// folder `dir`, replacing any checkpoint there atomically (see [the module docs](self)).
/// Collective over `group`, the model's tensor-parallel group; `dp_rank`: this rank's
/// data-parallel replica (only replica 0 writes; the others return at once, and should wait
/// for replica 0, e.g. at a barrier, before reading the checkpoint).
///
/// # Errors
/// [`TpError::Checkpoint`] naming the file for a write that fails or a dtype a checkpoint
/// cannot hold; a communication error.
pub fn save_sharded<M: Module + Reshard>(
    model: &M,
    optim: Option<&ModuleOptimizer>,
    dir: &Path,
    info: &CheckpointInfo,
    group: &ProcessGroup,
    dp_rank: usize,
) -> Result<()> {
    if dp_rank != 0 {
        return Ok(());
    }
    let (rank, tp) = (group.rank(), group.world_size());
    let shards = format!("step-{}", info.step);
    let tmp = dir.join(format!("{shards}.tmp"));
    if rank == 0 {
        std::fs::create_dir_all(dir).map_err(|e| ckpt_err(dir, format!("creating: {e}")))?;
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| ckpt_err(&tmp, format!("creating: {e}")))?;
    }
    group.barrier()?;

    let layouts = model.layout(rank);
    let file = format!("rank-{rank:05}.safetensors");
    let mut part = Part::default();
    let mut stored = Vec::new();
    let mut store = |name: String, data: TensorData, layout: &ParamLayout| -> Result<()> {
        let written: Vec<StoredPiece> = layout
            .pieces
            .iter()
            .filter(|p| p.writes)
            .map(|p| StoredPiece {
                file: format!("{shards}/{file}"),
                start: p.global.start,
                end: p.global.end,
                offset: p.local.start,
            })
            .collect();
        if written.is_empty() {
            return Ok(());
        }
        let dtype = dtype_name(data.dtype()).ok_or_else(|| {
            ckpt_err(
                dir,
                format!("{name}: dtype {:?} cannot be saved", data.dtype()),
            )
        })?;
        part.tensors.insert(
            name.clone(),
            TensorEntry {
                dtype: dtype.into(),
                shape: layout.global_shape.clone(),
                dim: layout.dim,
                pieces: written,
            },
        );
        stored.push(Stored {
            name,
            dtype: safetensors_dtype(dtype).expect("a known dtype"),
            shape: data.shape().to_vec(),
            bytes: data.as_bytes().to_vec(),
        });
        Ok(())
    };
    for (k, data) in dim_first_values(model, &layouts).into_iter().enumerate() {
        store(format!("p{k}"), data, &layouts[k])?;
    }
    if let Some(optim) = optim {
        let state = IndexedState::of(optim, model)?;
        for ((k, field), data) in state.tensors {
            let layout = &layouts[k];
            // The state is shaped like its parameter: store it with the same dim first.
            let data = dim_first(data, layout.dim);
            store(format!("p{k}.{field}"), data, layout)?;
        }
        part.scalars = state
            .scalars
            .into_iter()
            .map(|(key, v)| (key, v.into()))
            .collect();
        part.paths = state
            .paths
            .into_iter()
            .map(|(k, path)| (k.to_string(), path))
            .collect();
    }
    let path = tmp.join(&file);
    safetensors::serialize_to_file(stored.iter().map(|s| (s.name.clone(), s)), None, &path)
        .map_err(|e| ckpt_err(&path, format!("writing: {e}")))?;
    let part_path = tmp.join(format!("rank-{rank:05}.json"));
    write_json(&part_path, &part)?;
    group.barrier()?;

    if rank == 0 {
        // Every rank's part, merged into the index.
        let mut index = Index {
            format: FORMAT.into(),
            info: info.clone(),
            shards: shards.clone(),
            params: layouts.len(),
            tensors: BTreeMap::new(),
            scalars: BTreeMap::new(),
            paths: BTreeMap::new(),
        };
        for r in 0..tp {
            let p = tmp.join(format!("rank-{r:05}.json"));
            let part: Part = read_json(&p)?;
            for (name, entry) in part.tensors {
                match index.tensors.get_mut(&name) {
                    Some(e) => e.pieces.extend(entry.pieces),
                    None => {
                        index.tensors.insert(name, entry);
                    }
                }
            }
            index.scalars.extend(part.scalars);
            index.paths.extend(part.paths);
            let _ = std::fs::remove_file(&p);
        }
        let final_dir = dir.join(&shards);
        let _ = std::fs::remove_dir_all(&final_dir);
        std::fs::rename(&tmp, &final_dir)
            .map_err(|e| ckpt_err(&final_dir, format!("renaming into place: {e}")))?;
        let index_tmp = dir.join(format!("{INDEX}.tmp"));
        write_json(&index_tmp, &index)?;
        let index_path = dir.join(INDEX);
        std::fs::rename(&index_tmp, &index_path)
            .map_err(|e| ckpt_err(&index_path, format!("renaming into place: {e}")))?;
        // The shards of older saves: nothing points at them any more.
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("step-") && name != shards {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    group.barrier()?;
    Ok(())
}

/// `data` with `dim` swapped with the first (its own inverse), on the host.
fn dim_first(data: TensorData, dim: usize) -> TensorData {
    if dim == 0 {
        return data;
    }
    let (device, dtype) = (&burn::tensor::Device::flex(), data.dtype());
    match data.shape().len() {
        2 => Tensor::<2>::from_data(data, (device, dtype))
            .swap_dims(0, dim)
            .into_data(),
        3 => Tensor::<3>::from_data(data, (device, dtype))
            .swap_dims(0, dim)
            .into_data(),
        _ => Tensor::<4>::from_data(data, (device, dtype))
            .swap_dims(0, dim)
            .into_data(),
    }
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| ckpt_err(path, format!("encoding: {e}")))?;
    std::fs::write(path, text).map_err(|e| ckpt_err(path, format!("writing: {e}")))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text =
        std::fs::read_to_string(path).map_err(|e| ckpt_err(path, format!("reading: {e}")))?;
    serde_json::from_str(&text).map_err(|e| ckpt_err(path, format!("not a valid index: {e}")))
}

/// The memory-mapped shard files of a checkpoint, opened as they are first needed.
struct Files {
    dir: PathBuf,
    maps: BTreeMap<String, memmap2::Mmap>,
}

impl Files {
    fn bytes(&mut self, file: &str) -> Result<&[u8]> {
        if !self.maps.contains_key(file) {
            let path = self.dir.join(file);
            let f =
                std::fs::File::open(&path).map_err(|e| ckpt_err(&path, format!("opening: {e}")))?;
            // Safety: the checkpoint's files are not written while it is loaded (a save writes a
            // new shard folder and renames it into place).
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| ckpt_err(&path, format!("mapping: {e}")))?;
            self.maps.insert(file.to_string(), map);
        }
        Ok(&self.maps[file])
    }

    /// Rows `rows` (of the stored tensor's first dimension) of `name` in `file`, as bytes.
    fn rows(&mut self, file: &str, name: &str, rows: std::ops::Range<usize>) -> Result<Vec<u8>> {
        let path = self.dir.join(file);
        let bytes = self.bytes(file)?;
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| ckpt_err(&path, format!("a truncated or damaged shard: {e}")))?;
        let view = st
            .tensor(name)
            .map_err(|e| ckpt_err(&path, format!("{name}: {e}")))?;
        let n0 = view.shape().first().copied().unwrap_or(1).max(1);
        let row = view.data().len() / n0;
        if rows.end > n0 {
            return Err(ckpt_err(&path, format!("{name}: rows {rows:?} of {n0}")));
        }
        Ok(view.data()[rows.start * row..rows.end * row].to_vec())
    }
}

/// This rank's tensor `name` for `layout` (its dim first, `local_rows` x `row_elems` of `dtype`),
/// assembled from the stored slices that overlap its pieces; rows of no piece (padding) are
/// zero.
fn assemble(
    files: &mut Files,
    entry: &TensorEntry,
    name: &str,
    layout: &ParamLayout,
    local_shape_dim_first: &[usize],
    dtype: DType,
) -> Result<TensorData> {
    let elem = dtype.size();
    let row_elems: usize = local_shape_dim_first[1..].iter().product();
    let row_bytes = row_elems * elem;
    let mut out = vec![0u8; local_shape_dim_first[0] * row_bytes];
    for piece in &layout.pieces {
        let mut covered = 0;
        for s in &entry.pieces {
            let (a, b) = (piece.global.start.max(s.start), piece.global.end.min(s.end));
            if a >= b {
                continue;
            }
            let src = s.offset + (a - s.start)..s.offset + (b - s.start);
            let bytes = files.rows(&s.file, name, src)?;
            if bytes.len() != (b - a) * row_bytes {
                return Err(ckpt_err(
                    &files.dir.join(&s.file),
                    format!(
                        "{name}: a row of {} bytes, the model needs {row_bytes}",
                        bytes.len() / (b - a)
                    ),
                ));
            }
            let dst = piece.local.start + (a - piece.global.start);
            out[dst * row_bytes..(dst + b - a) * row_bytes].copy_from_slice(&bytes);
            covered += b - a;
        }
        if covered != piece.global.len() {
            return Err(ckpt_err(
                &files.dir,
                format!(
                    "{name}: indices {:?} of dim {} are in no shard",
                    piece.global, layout.dim
                ),
            ));
        }
    }
    Ok(TensorData::from_bytes_vec(
        out,
        local_shape_dim_first.to_vec(),
        dtype,
    ))
}

/// The local shapes and dtypes of a module's float parameters, in visiting order.
pub(crate) fn param_shapes<M: Module>(module: &M) -> Vec<(Vec<usize>, DType)> {
    struct Collect(Vec<(Vec<usize>, DType)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0.push((t.dims().to_vec(), t.dtype()));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// A checkpoint's index, with this rank's layouts and the model's local shapes and dtypes.
type Opened = (Index, Vec<ParamLayout>, Vec<(Vec<usize>, DType)>);

/// Reads and checks the index of the checkpoint in `dir` against `model`'s layout.
fn open_index<M: Module + Reshard>(
    model: &M,
    dir: &Path,
    config: Option<&serde_json::Value>,
    group: &ProcessGroup,
) -> Result<Opened> {
    let index_path = dir.join(INDEX);
    if !index_path.exists() {
        return Err(ckpt_err(
            &index_path,
            "no index: not a checkpoint, or one whose save did not complete",
        ));
    }
    let index: Index = read_json(&index_path)?;
    if index.format != FORMAT {
        return Err(ckpt_err(
            &index_path,
            format!("format {:?}, not {FORMAT:?}", index.format),
        ));
    }
    if let Some(want) = config
        && *want != index.info.config
    {
        return Err(ckpt_err(
            &index_path,
            format!(
                "saved for another configuration: {} (this model: {want})",
                index.info.config
            ),
        ));
    }
    let layouts = model.layout(group.rank());
    if index.params != layouts.len() {
        return Err(ckpt_err(
            &index_path,
            format!(
                "{} parameters, this model has {}: another model",
                index.params,
                layouts.len()
            ),
        ));
    }
    Ok((index, layouts, param_shapes(model)))
}

/// The index's entry `name`, checked against this rank's layout and dtype.
fn entry_for(
    index: &Index,
    index_path: &Path,
    name: &str,
    layout: &ParamLayout,
    dtype: DType,
) -> Result<TensorEntry> {
    let entry = index
        .tensors
        .get(name)
        .ok_or_else(|| ckpt_err(index_path, format!("{name} is missing")))?;
    if entry.shape != layout.global_shape || entry.dim != layout.dim {
        return Err(ckpt_err(
            index_path,
            format!(
                "{name}: saved with shape {:?} cut along dim {}, this model's is {:?} along dim {}",
                entry.shape, entry.dim, layout.global_shape, layout.dim
            ),
        ));
    }
    if Some(entry.dtype.as_str()) != dtype_name(dtype) {
        return Err(ckpt_err(
            index_path,
            format!(
                "{name}: saved in {}, this model holds {dtype:?}",
                entry.dtype
            ),
        ));
    }
    Ok(entry.clone())
}

/// Fills `model` (built at any tp: its own values are replaced) from the checkpoint in `dir`,
/// reading only this rank's slices. With `config`, a checkpoint of another configuration is
/// refused. Returns the model and the checkpoint's info. Local to this rank: no communication.
///
/// # Errors
/// [`TpError::Checkpoint`] naming the file and the tensor: no index (an incomplete save), a
/// missing or truncated shard, a dtype or shape that does not fit the model, an index of another
/// model or configuration.
pub fn load_sharded<M: Module + Reshard>(
    model: M,
    dir: &Path,
    config: Option<&impl Serialize>,
    group: &ProcessGroup,
) -> Result<(M, CheckpointInfo)> {
    let config = config.map(model_json);
    let (index, layouts, shapes) = open_index(&model, dir, config.as_ref(), group)?;
    let index_path = dir.join(INDEX);
    let mut files = Files {
        dir: dir.to_path_buf(),
        maps: BTreeMap::new(),
    };
    let mut values = Vec::with_capacity(layouts.len());
    for (k, (layout, (shape, dtype))) in layouts.iter().zip(&shapes).enumerate() {
        let name = format!("p{k}");
        let entry = entry_for(&index, &index_path, &name, layout, *dtype)?;
        let mut dim_first_shape = shape.clone();
        dim_first_shape.swap(0, layout.dim);
        values.push(Some(assemble(
            &mut files,
            &entry,
            &name,
            layout,
            &dim_first_shape,
            *dtype,
        )?));
    }
    Ok((with_dim_first_values(model, values, &layouts), index.info))
}

/// `optim` with the state the checkpoint in `dir` saved (see [`save_sharded`]), resharded for
/// `model`, this rank's shard at any tp (with any parameter ids). Local: no communication.
///
/// # Errors
/// As [`load_sharded`]; a checkpoint saved without optimizer state gives `optim` unchanged.
pub fn load_sharded_optimizer<M: Module + Reshard>(
    optim: ModuleOptimizer,
    model: &M,
    dir: &Path,
    group: &ProcessGroup,
) -> Result<ModuleOptimizer> {
    let (index, layouts, shapes) = open_index(model, dir, None, group)?;
    let index_path = dir.join(INDEX);
    let mut files = Files {
        dir: dir.to_path_buf(),
        maps: BTreeMap::new(),
    };
    let mut state = IndexedState::default();
    for (name, entry) in &index.tensors {
        let Some((k, field)) = name
            .strip_prefix('p')
            .and_then(|n| n.split_once('.'))
            .and_then(|(k, f)| Some((k.parse::<usize>().ok()?, f)))
        else {
            continue;
        };
        let (Some(layout), Some((shape, _))) = (layouts.get(k), shapes.get(k)) else {
            return Err(ckpt_err(
                &index_path,
                format!("{name}: a parameter past the model's"),
            ));
        };
        let dtype = match entry.dtype.as_str() {
            "F64" => DType::F64,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            _ => DType::F32,
        };
        let entry = entry_for(&index, &index_path, name, layout, dtype)?;
        let mut dim_first_shape = shape.clone();
        dim_first_shape.swap(0, layout.dim);
        let data = assemble(&mut files, &entry, name, layout, &dim_first_shape, dtype)?;
        // Back to the parameter's own layout.
        state
            .tensors
            .insert((k, field.to_string()), dim_first(data, layout.dim));
    }
    if state.tensors.is_empty() && index.scalars.is_empty() {
        return Ok(optim);
    }
    state.scalars = index
        .scalars
        .iter()
        .map(|(key, v)| (key.clone(), (*v).into()))
        .collect();
    for (k, path) in &index.paths {
        let k = k
            .parse::<usize>()
            .map_err(|e| ckpt_err(&index_path, format!("optimizer path key {k}: {e}")))?;
        state.paths.insert(k, path.clone());
    }
    let record = state
        .record(model)
        .map_err(|e| ckpt_err(&index_path, format!("optimizer state: {e}")))?;
    Ok(optim.load_record(record))
}
