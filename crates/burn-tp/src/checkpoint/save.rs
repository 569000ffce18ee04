//! Saving: every rank writes its own slices; the index is written last, atomically.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::TensorData;
use burn_tp_comm::ProcessGroup;

use super::format::*;
use super::{CheckpointInfo, INDEX, Sharding, StageMap, file_error};
use crate::Result;
use crate::reshard::{IndexedState, Reshard};

/// Saves this rank's shards of `model` (and of `optim`'s state, if given) into the checkpoint
/// folder `dir`, replacing any checkpoint there atomically (see [the module docs](super)).
/// Collective over `group`, the model's tensor-parallel group; `dp_rank`: this rank's
/// data-parallel replica (only replica 0 writes; the others return at once, and should wait
/// for replica 0, e.g. at a barrier, before reading the checkpoint).
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file for a write that fails or a dtype a checkpoint
/// cannot hold; a communication error.
pub fn save<M: Module + Reshard>(
    model: &M,
    optim: Option<&ModuleOptimizer>,
    dir: &Path,
    info: &CheckpointInfo,
    group: &ProcessGroup,
    dp_rank: usize,
) -> Result<()> {
    let map = StageMap::whole(super::param_shapes(model).len());
    save_stage(model, optim, dir, info, group.rank(), group, dp_rank, &map)
}

/// [`save`] of a pipeline stage's model: its parameters under the whole model's indices
/// (`map`), each written by one stage, so the checkpoint is the whole model's. `tp_rank`: this
/// rank's tensor-parallel rank; collective over `ranks`, every rank of this data-parallel
/// replica (each stage's tp group).
///
/// # Errors
/// As [`save`].
#[allow(clippy::too_many_arguments)]
pub fn save_stage<M: Module + Reshard>(
    model: &M,
    optim: Option<&ModuleOptimizer>,
    dir: &Path,
    info: &CheckpointInfo,
    tp_rank: usize,
    ranks: &ProcessGroup,
    dp_rank: usize,
    map: &StageMap,
) -> Result<()> {
    if dp_rank != 0 {
        return Ok(());
    }
    let sharding = Sharding::of(model, tp_rank, map.clone());
    save_sharded(model, optim, dir, info, &sharding, ranks, true)
}

/// [`save`] of a model whose tensors lie in the whole as `sharding` says (a fully sharded
/// one's rows: [`crate::fsdp::Fsdp::sharding`]), each rank writing its own slices.
/// Collective over `ranks`; only those with `writes` write (one copy of each slice: a
/// replica's ranks, not the other replicas').
///
/// # Errors
/// As [`save`].
pub fn save_sharded<M: Module>(
    model: &M,
    optim: Option<&ModuleOptimizer>,
    dir: &Path,
    info: &CheckpointInfo,
    sharding: &Sharding,
    ranks: &ProcessGroup,
    writes: bool,
) -> Result<()> {
    let group = ranks;
    let map = &sharding.map;
    let (rank, size) = (group.rank(), group.world_size());
    let shards = format!("step-{}", info.step);
    let tmp = dir.join(format!("{shards}.tmp"));
    if rank == 0 {
        std::fs::create_dir_all(dir).map_err(|e| file_error(dir, format!("creating: {e}")))?;
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| file_error(&tmp, format!("creating: {e}")))?;
    }
    group.barrier()?;

    // Ranks that share a process write in turns: each holds a copy of its tensors (and of the
    // optimizer's state) while it writes, and all at once would hold every rank's.
    let turns = if group.shares_process() { size } else { 1 };
    let mut part = Part::default();
    for turn in 0..turns {
        if writes && (turns == 1 || turn == rank) {
            part = write_part(model, optim, (&tmp, &shards), info, sharding, rank)?;
        }
        if turns > 1 {
            group.barrier()?;
        }
    }
    let part_path = tmp.join(format!("rank-{rank:05}.json"));
    write_json(&part_path, &part)?;
    group.barrier()?;

    if rank == 0 {
        // Every rank's part, merged into the index.
        let mut index = Index {
            format: String::new(),
            info: info.clone(),
            shards: shards.clone(),
            params: map.total,
            tensors: BTreeMap::new(),
            scalars: BTreeMap::new(),
            paths: BTreeMap::new(),
        };
        for r in 0..size {
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
        let mut pieces = index.tensors.values().flat_map(|e| &e.pieces);
        index.format = match pieces.any(|p| p.rows.is_some()) {
            true => FORMAT_ROWS.into(),
            false => FORMAT.into(),
        };
        let final_dir = dir.join(&shards);
        let _ = std::fs::remove_dir_all(&final_dir);
        std::fs::rename(&tmp, &final_dir)
            .map_err(|e| file_error(&final_dir, format!("renaming into place: {e}")))?;
        let index_tmp = dir.join(format!("{INDEX}.tmp"));
        write_json(&index_tmp, &index)?;
        let index_path = dir.join(INDEX);
        std::fs::rename(&index_tmp, &index_path)
            .map_err(|e| file_error(&index_path, format!("renaming into place: {e}")))?;
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

/// The first `n` rows (of dim 0) of `data`.
fn first_rows(data: TensorData, n: usize) -> TensorData {
    let mut shape = data.shape().to_vec();
    let (dtype, rows) = (data.dtype(), shape[0].max(1));
    let row = data.as_bytes().len() / rows;
    shape[0] = n;
    let bytes = data.as_bytes()[..n * row].to_vec();
    TensorData::from_bytes_vec(bytes, shape, dtype)
}

/// This rank's tensors written into `tmp` (its file, `shards/rank-{rank}` in the index), and
/// its part of the index.
fn write_part<M: Module>(
    model: &M,
    optim: Option<&ModuleOptimizer>,
    (tmp, shards): (&Path, &str),
    info: &CheckpointInfo,
    sharding: &Sharding,
    rank: usize,
) -> Result<Part> {
    let map = &sharding.map;
    let dir = tmp;
    let layouts = &sharding.layouts;
    let file = format!("rank-{rank:05}.safetensors");
    let mut part = Part::default();
    let mut stored = Vec::new();
    let mut store = |name: String, value: Lazy, k: usize| -> Result<()> {
        let region = sharding.region(k);
        let written: Vec<StoredPiece> = region
            .slices
            .iter()
            .filter(|p| p.writes)
            .map(|p| StoredPiece {
                file: format!("{shards}/{file}"),
                start: p.global.start,
                end: p.global.end,
                offset: p.at,
                rows: region.rows.as_ref().map(|r| [r.start, r.end]),
            })
            .collect();
        if written.is_empty() {
            return Ok(());
        }
        let dtype = dtype_name(value.dtype).ok_or_else(|| {
            file_error(
                dir,
                format!("{name}: dtype {:?} cannot be saved", value.dtype),
            )
        })?;
        part.tensors.insert(
            name.clone(),
            TensorEntry {
                dtype: dtype.into(),
                shape: layouts[k].global_shape.clone(),
                dim: layouts[k].dim,
                pieces: written,
            },
        );
        stored.push(Stored {
            name,
            dtype: safetensors_dtype(dtype).expect("a known dtype"),
            value,
        });
        Ok(())
    };
    {
        let values = dim_first_values(model, sharding, info.frozen_base.is_some());
        for (k, value) in values.into_iter().enumerate() {
            if let (true, Some(value)) = (map.writes[k], value) {
                store(format!("p{}", map.global[k]), value, k)?;
            }
        }
    }
    // The optimizer's state is read back from a scratch file tensor by tensor as the shard
    // file is written (`IndexedState::spilled`), removed once it is.
    let scratch = tmp.join(format!("rank-{rank:05}.optimizer.bpk"));
    if let Some(optim) = optim {
        let state = IndexedState::spilled(optim, model, &scratch)?;
        for ((k, field), data) in state.tensors {
            if !map.writes[k] {
                continue;
            }
            // The state is shaped like its parameter: store it as the parameter is stored.
            let rows = match &sharding.rows[k] {
                Some(rows) if rows.held.is_empty() => continue,
                Some(rows) => Some(rows.held.len()),
                None => None,
            };
            let dim = layouts[k].dim;
            let value = Lazy {
                shape: stored_shape(data.shape(), rows, dim),
                dtype: data.dtype(),
                make: Box::new(move || {
                    let data = data.clone();
                    let data = match rows {
                        Some(n) => first_rows(data, n),
                        None => data,
                    };
                    dim_first(data, dim)
                }),
            };
            store(format!("p{}.{field}", map.global[k]), value, k)?;
        }
        part.scalars = state
            .scalars
            .into_iter()
            .filter_map(|(key, v)| {
                let (k, rest) = key.split_once('.')?;
                let k: usize = k.parse().ok()?;
                map.writes[k].then(|| (format!("{}.{rest}", map.global[k]), v.into()))
            })
            .collect();
        part.paths = state
            .paths
            .into_iter()
            .filter(|(k, _)| map.writes[*k])
            .map(|(k, path)| (map.global[k].to_string(), path))
            .collect();
    }
    if !stored.is_empty() {
        let path = tmp.join(&file);
        safetensors::serialize_to_file(stored.iter().map(|s| (s.name.clone(), s)), None, &path)
            .map_err(|e| file_error(&path, format!("writing: {e}")))?;
    }
    drop(stored);
    let _ = std::fs::remove_file(&scratch);
    Ok(part)
}
