//! Loading at any tp: each rank reads only the slices its shards overlap, from the
//! memory-mapped shard files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;
use serde::Serialize;

use super::format::*;
use super::sharding::Region;
use super::{CheckpointInfo, INDEX, Sharding, StageMap, file_error};
use crate::Result;
use crate::reshard::{IndexedState, ParamLayout, Reshard};

/// The memory-mapped shard files of a checkpoint, opened as they are first needed.
struct Files {
    dir: PathBuf,
    maps: BTreeMap<String, memmap2::Mmap>,
}

impl Files {
    fn bytes(&mut self, file: &str) -> Result<&[u8]> {
        if !self.maps.contains_key(file) {
            let path = self.dir.join(file);
            let f = std::fs::File::open(&path)
                .map_err(|e| file_error(&path, format!("opening: {e}")))?;
            // Safety: the checkpoint's files are not written while it is loaded (a save writes a
            // new shard folder and renames it into place).
            let map = unsafe { memmap2::Mmap::map(&f) }
                .map_err(|e| file_error(&path, format!("mapping: {e}")))?;
            self.maps.insert(file.to_string(), map);
        }
        Ok(&self.maps[file])
    }

    /// Rows `rows` (of the stored tensor's first dimension) of `name` in `file`, as bytes.
    fn rows(&mut self, file: &str, name: &str, rows: std::ops::Range<usize>) -> Result<Vec<u8>> {
        let path = self.dir.join(file);
        let bytes = self.bytes(file)?;
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| file_error(&path, format!("a truncated or damaged shard: {e}")))?;
        let view = st
            .tensor(name)
            .map_err(|e| file_error(&path, format!("{name}: {e}")))?;
        let n0 = view.shape().first().copied().unwrap_or(1).max(1);
        let row = view.data().len() / n0;
        if rows.end > n0 {
            return Err(file_error(&path, format!("{name}: rows {rows:?} of {n0}")));
        }
        Ok(view.data()[rows.start * row..rows.end * row].to_vec())
    }
}

/// This rank's tensor `name` (`out_shape`: its cut dimension first, of `dtype`) holding
/// `region` of the whole, assembled from the stored slices that overlap it; what no slice
/// covers (padding) is zero.
///
/// Along each of the tensor's rows (one index of the cut dimension), dim 0 (where it is not
/// the cut) sits at position `dim`: `outer` blocks of a window of dim-0 rows of `inner`
/// elements each, the window all rows or those a fully sharded rank holds.
fn assemble(
    files: &mut Files,
    entry: &TensorEntry,
    name: &str,
    region: &Region,
    out_shape: &[usize],
    dtype: DType,
) -> Result<TensorData> {
    let elem = dtype.size();
    let dim = entry.dim;
    let whole_rows = entry.shape.first().copied().unwrap_or(1);
    // With dim 0 cut, a row is one block.
    let (outer, inner, out_extent, out_window): (usize, usize, usize, _) = match dim {
        0 => (1, out_shape[1..].iter().product(), 1, 0..1),
        _ => (
            out_shape[1..dim].iter().product(),
            out_shape[dim + 1..].iter().product(),
            out_shape[dim],
            region.rows.clone().unwrap_or(0..whole_rows),
        ),
    };
    let out_row = outer * out_extent * inner;
    let mut out = vec![0u8; out_shape[0] * out_row * elem];
    for want in &region.slices {
        let mut covered = 0;
        for s in &entry.pieces {
            let (a, b) = (want.global.start.max(s.start), want.global.end.min(s.end));
            if a >= b {
                continue;
            }
            let window = match (dim, s.rows) {
                (0, _) => 0..1,
                (_, Some([r0, r1])) => r0..r1,
                (_, None) => 0..whole_rows,
            };
            let (ra, rb) = (
                out_window.start.max(window.start),
                out_window.end.min(window.end),
            );
            if ra >= rb {
                continue;
            }
            let src = s.offset + (a - s.start)..s.offset + (b - s.start);
            let bytes = files.rows(&s.file, name, src)?;
            let row = outer * window.len() * inner * elem;
            if bytes.len() != (b - a) * row {
                return Err(file_error(
                    &files.dir.join(&s.file),
                    format!(
                        "{name}: a row of {} bytes, the model needs {row}",
                        bytes.len() / (b - a)
                    ),
                ));
            }
            let first = want.at + (a - want.global.start);
            let (n, from, to) = (
                (rb - ra) * inner * elem,
                ra - window.start,
                ra - out_window.start,
            );
            if window == out_window && out_window.len() == out_extent {
                // The same rows on both sides: one copy.
                out[first * row..(first + b - a) * row].copy_from_slice(&bytes);
            } else {
                for i in 0..b - a {
                    for o in 0..outer {
                        let src = i * row + (o * window.len() + from) * inner * elem;
                        let dst = ((first + i) * out_row + (o * out_extent + to) * inner) * elem;
                        out[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
                    }
                }
            }
            covered += (b - a) * (rb - ra);
        }
        if covered != want.global.len() * out_window.len() {
            let rows = match &region.rows {
                Some(r) => format!(" (rows {r:?} of dim 0)"),
                None => String::new(),
            };
            return Err(file_error(
                &files.dir,
                format!(
                    "{name}: indices {:?} of dim {dim}{rows} are in no shard",
                    want.global
                ),
            ));
        }
    }
    Ok(TensorData::from_bytes_vec(out, out_shape.to_vec(), dtype))
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

/// A checkpoint's index, with the model's local shapes and dtypes.
type Opened = (Index, Vec<(Vec<usize>, DType)>);

/// Reads and checks the index of the checkpoint in `dir` against `model`'s `sharding`.
fn open_index<M: Module>(
    model: &M,
    dir: &Path,
    config: Option<&serde_json::Value>,
    sharding: &Sharding,
) -> Result<Opened> {
    let map = &sharding.map;
    let index_path = dir.join(INDEX);
    if !index_path.exists() {
        return Err(file_error(
            &index_path,
            "no index: not a checkpoint, or one whose save did not complete",
        ));
    }
    let index: Index = read_json(&index_path)?;
    if index.format != FORMAT && index.format != FORMAT_ROWS {
        return Err(file_error(
            &index_path,
            format!(
                "format {:?}, not {FORMAT:?} or {FORMAT_ROWS:?}",
                index.format
            ),
        ));
    }
    if let Some(want) = config
        && *want != index.info.config
    {
        return Err(file_error(
            &index_path,
            format!(
                "saved for another configuration: {} (this model: {want})",
                index.info.config
            ),
        ));
    }
    let shapes = param_shapes(model);
    let lengths = [
        map.global.len(),
        sharding.layouts.len(),
        sharding.rows.len(),
    ];
    if index.params != map.total || lengths.iter().any(|&n| n != shapes.len()) {
        return Err(file_error(
            &index_path,
            format!(
                "{} parameters, this model has {}: another model",
                index.params, map.total
            ),
        ));
    }
    Ok((index, shapes))
}

/// The index's entry `name`, checked against this rank's layout and dtype.
fn entry_for(
    index: &Index,
    index_path: &Path,
    name: &str,
    layout: &ParamLayout,
    dtype: DType,
) -> Result<TensorEntry> {
    let entry = index.tensors.get(name).ok_or_else(|| {
        let why = match &index.info.frozen_base {
            Some(base) => format!(
                "{name} is missing: the checkpoint holds the trainable parameters alone (the \
                 frozen ones are {base}'s), and this model trains {name}"
            ),
            None => format!("{name} is missing"),
        };
        file_error(index_path, why)
    })?;
    if entry.shape != layout.global_shape || entry.dim != layout.dim {
        return Err(file_error(
            index_path,
            format!(
                "{name}: saved with shape {:?} cut along dim {}, this model's is {:?} along dim {}",
                entry.shape, entry.dim, layout.global_shape, layout.dim
            ),
        ));
    }
    if Some(entry.dtype.as_str()) != dtype_name(dtype) {
        return Err(file_error(
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
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file and the tensor: no index (an incomplete save), a
/// missing or truncated shard, a dtype or shape that does not fit the model, an index of another
/// model or configuration.
pub fn load<M: Module + Reshard>(
    model: M,
    dir: &Path,
    config: Option<&impl Serialize>,
    group: &ProcessGroup,
) -> Result<(M, CheckpointInfo)> {
    let map = StageMap::whole(param_shapes(&model).len());
    load_stage(model, dir, config, group.rank(), &map)
}

/// [`load`] into a pipeline stage's model: its parameters read under the whole model's indices
/// (`map`), from a checkpoint saved at any number of stages. `tp_rank`: this rank's
/// tensor-parallel rank. Local: no communication.
///
/// # Errors
/// As [`load`].
pub fn load_stage<M: Module + Reshard>(
    model: M,
    dir: &Path,
    config: Option<&impl Serialize>,
    tp_rank: usize,
    map: &StageMap,
) -> Result<(M, CheckpointInfo)> {
    let sharding = Sharding::of(&model, tp_rank, map.clone());
    load_sharded(model, dir, config, &sharding)
}

/// [`load`] into a model whose tensors lie in the whole as `sharding` says (a fully sharded
/// one's rows: [`crate::fsdp::Fsdp::sharding`]), from a checkpoint saved at any layout, with
/// or without fsdp. Local: no communication.
///
/// # Errors
/// As [`load`].
pub fn load_sharded<M: Module>(
    model: M,
    dir: &Path,
    config: Option<&impl Serialize>,
    sharding: &Sharding,
) -> Result<(M, CheckpointInfo)> {
    let config = config.map(model_json);
    let (index, shapes) = open_index(&model, dir, config.as_ref(), sharding)?;
    let (map, layouts) = (&sharding.map, &sharding.layouts);
    let index_path = dir.join(INDEX);
    let mut files = Files {
        dir: dir.to_path_buf(),
        maps: BTreeMap::new(),
    };
    // A checkpoint of the trainable parameters alone: the frozen ones keep the model's values
    // (the base it was built from).
    let trainable = crate::reshard::trainable(&model);
    let mut values = Vec::with_capacity(layouts.len());
    for (k, (layout, (shape, dtype))) in layouts.iter().zip(&shapes).enumerate() {
        let name = format!("p{}", map.global[k]);
        let frozen_kept =
            index.info.frozen_base.is_some() && !trainable[k] && !index.tensors.contains_key(&name);
        if !map.held[k] || frozen_kept {
            values.push(None);
            continue;
        }
        let entry = entry_for(&index, &index_path, &name, layout, *dtype)?;
        let mut dim_first_shape = shape.clone();
        dim_first_shape.swap(0, layout.dim);
        let region = sharding.region(k);
        values.push(Some(assemble(
            &mut files,
            &entry,
            &name,
            &region,
            &dim_first_shape,
            *dtype,
        )?));
    }
    Ok((with_dim_first_values(model, values, layouts), index.info))
}

/// `optim` with the state the checkpoint in `dir` saved (see [`save`](super::save)), resharded for
/// `model`, this rank's shard at any tp (with any parameter ids). Local: no communication.
///
/// # Errors
/// As [`load`]; a checkpoint saved without optimizer state gives `optim` unchanged.
pub fn load_optimizer<M: Module + Reshard>(
    optim: ModuleOptimizer,
    model: &M,
    dir: &Path,
    group: &ProcessGroup,
) -> Result<ModuleOptimizer> {
    let map = StageMap::whole(param_shapes(model).len());
    load_optimizer_stage(optim, model, dir, group.rank(), &map)
}

/// [`load_optimizer`] for a pipeline stage's model (see [`load_stage`]).
///
/// # Errors
/// As [`load`].
pub fn load_optimizer_stage<M: Module + Reshard>(
    optim: ModuleOptimizer,
    model: &M,
    dir: &Path,
    tp_rank: usize,
    map: &StageMap,
) -> Result<ModuleOptimizer> {
    let sharding = Sharding::of(model, tp_rank, map.clone());
    load_optimizer_sharded(optim, model, dir, &sharding)
}

/// [`load_optimizer`] for a model whose tensors lie in the whole as `sharding` says (see
/// [`load_sharded`]).
///
/// # Errors
/// As [`load`].
pub fn load_optimizer_sharded<M: Module>(
    optim: ModuleOptimizer,
    model: &M,
    dir: &Path,
    sharding: &Sharding,
) -> Result<ModuleOptimizer> {
    let (index, shapes) = open_index(model, dir, None, sharding)?;
    let (map, layouts) = (&sharding.map, &sharding.layouts);
    // The whole model's index -> this model's.
    let local: BTreeMap<usize, usize> = map
        .global
        .iter()
        .enumerate()
        .filter(|&(k, _)| map.held[k])
        .map(|(k, &g)| (g, k))
        .collect();
    let index_path = dir.join(INDEX);
    let mut files = Files {
        dir: dir.to_path_buf(),
        maps: BTreeMap::new(),
    };
    let mut state = IndexedState::default();
    for (name, entry) in &index.tensors {
        let Some((g, field)) = name
            .strip_prefix('p')
            .and_then(|n| n.split_once('.'))
            .and_then(|(k, f)| Some((k.parse::<usize>().ok()?, f)))
        else {
            continue;
        };
        // Another stage's parameter.
        let Some(&k) = local.get(&g) else {
            continue;
        };
        let (Some(layout), Some((shape, _))) = (layouts.get(k), shapes.get(k)) else {
            return Err(file_error(
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
        let region = sharding.region(k);
        let data = assemble(&mut files, &entry, name, &region, &dim_first_shape, dtype)?;
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
        .filter_map(|(key, v)| {
            let (g, rest) = key.split_once('.')?;
            let k = local.get(&g.parse::<usize>().ok()?)?;
            Some((format!("{k}.{rest}"), (*v).into()))
        })
        .collect();
    for (g, path) in &index.paths {
        let g = g
            .parse::<usize>()
            .map_err(|e| file_error(&index_path, format!("optimizer path key {g}: {e}")))?;
        if let Some(&k) = local.get(&g) {
            state.paths.insert(k, path.clone());
        }
    }
    let record = state
        .record(model)
        .map_err(|e| file_error(&index_path, format!("optimizer state: {e}")))?;
    Ok(optim.load_record(record))
}
