//! Optimizer state across tp sizes: a [`ModuleOptimizer`]'s per-parameter state (AdamW's two
//! moments, its step count, ...) is elementwise over each parameter, so it shards exactly like
//! the parameter. It is gathered into the full (tp = 1) layout by running each state field
//! through the model's own [`Reshard`] as if it were the parameters, and sharded back the same
//! way at any tp. Parameters are matched by their order in the module, not by their ids (which a
//! fresh or resharded model does not share with the one that was saved).
//!
//! Burn keys an optimizer record by parameter id: tensors `"{id}.{field}"`, scalars
//! `"{id}.{key}"`, and the parameter's path as metadata `"{id}"` (burnpack). The saved file uses
//! the same layout keyed by the parameter's index instead.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::tensor::{Tensor, TensorData};
use burn_pack::{Reader, Scalar, Writer};
use burn_tp_comm::ProcessGroup;

use super::Reshard;
use crate::error::file_error;
use crate::{Result, TpError};

fn err(what: &str, e: impl std::fmt::Debug) -> TpError {
    TpError::Config(format!("optimizer state: {what}: {e:?}"))
}

/// Ids of a module's float parameters, in module order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<u64> {
    struct Ids(Vec<u64>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id.val());
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// A module's float parameters' tensor ranks, in module order.
fn param_ranks<M: Module>(module: &M) -> Vec<usize> {
    struct Ranks(Vec<usize>);
    impl ModuleVisitor for Ranks {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.0.push(D);
        }
    }
    let mut ranks = Ranks(Vec::new());
    module.visit(&mut ranks);
    ranks.0
}

/// A module's float parameters' values, in module order.
fn param_values<M: Module>(module: &M) -> Vec<TensorData> {
    struct Values(Vec<TensorData>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().into_data());
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

/// `module` with parameter `k` replaced by `values[k]` (kept where `None`).
fn with_values<M: Module>(module: M, values: Vec<Option<TensorData>>) -> M {
    struct Replace(std::vec::IntoIter<Option<TensorData>>);
    impl ModuleMapper for Replace {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.0.next().flatten() {
                Some(data) => param.map(|t| {
                    let (device, dtype) = (t.device(), data.dtype());
                    Tensor::from_data(data, (&device, dtype))
                }),
                None => param,
            }
        }
    }
    module.map(&mut Replace(values.into_iter()))
}

/// An optimizer's per-parameter state keyed by each parameter's index in its module (not its
/// id, which a fresh or resharded model does not share): what moves between models.
#[derive(Debug, Default)]
pub(crate) struct IndexedState {
    /// `(param index, field)` -> the state tensor, shaped like its parameter.
    pub(crate) tensors: BTreeMap<(usize, String), TensorData>,
    /// `"{param index}.{key}"` -> value (step counts, the parameter's rank).
    pub(crate) scalars: BTreeMap<String, Scalar>,
    /// `param index` -> the parameter's path (for parameter groups).
    pub(crate) paths: BTreeMap<usize, String>,
}

impl IndexedState {
    /// `optim`'s state of `model`'s parameters.
    ///
    /// # Errors
    /// A record in a layout this does not know.
    pub(crate) fn of<M: Module>(optim: &ModuleOptimizer, model: &M) -> Result<Self> {
        let bytes = optim
            .to_record()
            .into_bytes()
            .map_err(|e| err("encoding", e))?;
        let reader = Reader::from_bytes(bytes).map_err(|e| err("decoding", e))?;
        Self::read(reader, model)
    }

    /// [`of`](Self::of), the state written to the scratch file `path` first and its tensors
    /// left there, each read when it is first used (a clone reads its own copy): what a
    /// checkpoint's save holds is then one tensor at a time, not the record and its encoding
    /// (two copies of the whole state). Remove `path` once the tensors are used.
    ///
    /// # Errors
    /// As [`of`](Self::of); [`TpError::Checkpoint`] naming `path` where writing or reading it
    /// fails.
    pub(crate) fn spilled<M: Module>(
        optim: &ModuleOptimizer,
        model: &M,
        path: &Path,
    ) -> Result<Self> {
        optim
            .to_record()
            .save(path)
            .map_err(|e| file_error(path, format!("writing the optimizer state: {e}")))?;
        let reader = Reader::from_file_exact(path)
            .map_err(|e| file_error(path, format!("reading the optimizer state: {e}")))?;
        Self::read(reader, model)
    }

    /// The state in `reader`, keyed by `model`'s parameter indices.
    fn read<M: Module>(reader: Reader, model: &M) -> Result<Self> {
        let index: BTreeMap<u64, usize> = param_ids(model)
            .into_iter()
            .enumerate()
            .map(|(k, id)| (id, k))
            .collect();
        let key = |id: &str| {
            id.parse::<u64>()
                .ok()
                .and_then(|id| index.get(&id).copied())
        };
        let mut state = Self::default();
        for (name, value) in reader.scalars() {
            if let Some((id, rest)) = name.split_once('.')
                && let Some(k) = key(id)
            {
                state.scalars.insert(format!("{k}.{rest}"), *value);
            }
        }
        for (id, path) in reader.metadata() {
            if let Some(k) = key(id) {
                state.paths.insert(k, path.clone());
            }
        }
        for tensor in reader.into_tensors().map_err(|e| err("reading", e))? {
            let (name, dtype, shape, param_id, bytes) =
                tensor.into_parts().map_err(|e| err("reading", e))?;
            let k = param_id.and_then(|id| index.get(&id).copied());
            let (Some(k), Some((_, field))) = (k, name.split_once('.')) else {
                return Err(err("a tensor of no parameter of this model", name));
            };
            state.tensors.insert(
                (k, field.to_string()),
                TensorData::from_bytes(bytes, shape, dtype),
            );
        }
        Ok(state)
    }

    /// The optimizer record of this state for `model`, whose parameters its tensors are shaped
    /// like (keyed by `model`'s parameter ids); load it with [`ModuleOptimizer::load_record`].
    ///
    /// # Errors
    /// A key of no parameter of `model`.
    pub(crate) fn record<M: Module>(self, model: &M) -> Result<OptimizerRecord> {
        let ids = param_ids(model);
        let id = |k: usize| {
            ids.get(k)
                .copied()
                .ok_or_else(|| err("a parameter index past the model's", k))
        };
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for ((k, field), data) in self.tensors {
            let (bytes, shape, dtype) = data.into_parts();
            let id = id(k)?;
            tensors.push(burn_pack::Tensor::new(
                format!("{id}.{field}"),
                dtype,
                shape,
                Some(id),
                bytes,
            ));
        }
        let mut writer = Writer::new(tensors);
        for (name, value) in &self.scalars {
            let (k, rest) = name
                .split_once('.')
                .and_then(|(k, rest)| Some((k.parse::<usize>().ok()?, rest)))
                .ok_or_else(|| err("a scalar key", name))?;
            writer = writer.with_scalar(&format!("{}.{rest}", id(k)?), *value);
        }
        for (k, path) in &self.paths {
            if let Some(id) = ids.get(*k) {
                writer = writer.with_metadata(&id.to_string(), path);
            }
        }
        let bytes = writer.into_bytes().map_err(|e| err("encoding", e))?;
        OptimizerRecord::from_bytes(bytes).map_err(|e| err("decoding", e))
    }
}

/// `optim`'s state of `model` for `moved`, the model `move_model` makes of it with other
/// parameters (a MoE model's experts gathered over ep, or split over it): each state field run
/// through `move_model` as if it were the parameters, and the per-parameter scalars (AdamW's
/// step count) given to every moved parameter. Collective as `move_model` is.
///
/// # Errors
/// A parameter without state, scalars that differ between parameters, or `move_model`'s.
pub fn move_optimizer_state<M: Module + Clone>(
    optim: &ModuleOptimizer,
    model: &M,
    moved: &M,
    move_model: impl Fn(M) -> Result<M>,
) -> Result<OptimizerRecord> {
    let local = IndexedState::of(optim, model)?;
    let n = param_ids(model).len();
    let mut fields: BTreeMap<String, Vec<Option<TensorData>>> = BTreeMap::new();
    for ((k, field), data) in local.tensors {
        fields.entry(field).or_insert_with(|| vec![None; n])[k] = Some(data);
    }
    // Each parameter's scalars by key: the same for all (AdamW's step count) but its tensor
    // rank (`__rank`), which each moved parameter takes from its own shape.
    const RANK: &str = "__rank";
    let mut scalars: BTreeMap<usize, BTreeMap<String, Scalar>> = BTreeMap::new();
    for (name, value) in local.scalars {
        if let Some((k, rest)) = name.split_once('.')
            && let Ok(k) = k.parse::<usize>()
            && rest != RANK
        {
            scalars
                .entry(k)
                .or_default()
                .insert(rest.to_string(), value);
        }
    }
    let first = scalars.values().next().cloned().unwrap_or_default();
    if scalars.values().any(|s| *s != first) {
        return Err(err(
            "moving the state needs the same scalars for every parameter",
            scalars,
        ));
    }
    let m = param_ids(moved).len();
    let mut state = IndexedState::default();
    let (frozen, moved_frozen) = (frozen_params(model), frozen_params(moved));
    // A frozen parameter (a pipeline stage's unused ends) has no state: it moves as zeros and
    // gets none back.
    for (field, mut values) in fields {
        let like = values.iter().flatten().next().map(|d| d.dtype());
        for ((k, v), shape) in values.iter_mut().enumerate().zip(param_shapes(model)) {
            match (v.is_none(), frozen[k], like) {
                (false, _, _) => {}
                (true, true, Some(dtype)) => {
                    let zeros = TensorData::zeros::<f32, _>(shape).convert_dtype(dtype);
                    *v = Some(zeros);
                }
                _ => return Err(err("a parameter without state", &field)),
            }
        }
        let carried = move_model(with_values(model.clone(), values))?;
        for (k, data) in param_values(&carried).into_iter().enumerate() {
            if !moved_frozen[k] {
                state.tensors.insert((k, field.clone()), data);
            }
        }
    }
    for (k, rank) in param_ranks(moved).into_iter().enumerate().take(m) {
        if moved_frozen[k] {
            continue;
        }
        for (rest, value) in &first {
            state.scalars.insert(format!("{k}.{rest}"), *value);
        }
        state
            .scalars
            .insert(format!("{k}.{RANK}"), Scalar::UInt(rank as u64));
    }
    state.record(moved)
}

/// The state of a sharded model's optimizer in the full (tp = 1) layout, keyed by parameter index.
#[derive(Debug, Default)]
pub struct FullOptimizerState(IndexedState);

impl FullOptimizerState {
    /// Gathers `optim`'s state of the sharded `model` into the full layout, on every rank.
    /// Collective over the model's tensor-parallel group.
    ///
    /// # Errors
    /// A communication error, or a record in a layout this does not know.
    pub fn gather<M: Module + Reshard + Clone>(optim: &ModuleOptimizer, model: &M) -> Result<Self> {
        let local = IndexedState::of(optim, model)?;
        let n = param_ids(model).len();
        // Field -> the sharded state tensor of each parameter that has one.
        let mut fields: BTreeMap<String, Vec<Option<TensorData>>> = BTreeMap::new();
        for ((k, field), data) in local.tensors {
            fields.entry(field).or_insert_with(|| vec![None; n])[k] = Some(data);
        }
        let mut full = IndexedState {
            scalars: local.scalars,
            paths: local.paths,
            ..Default::default()
        };
        // Each field through the model's own resharding, as if it were the parameters. Every
        // rank has state for the same parameters (the same steps ran everywhere).
        for (field, values) in fields {
            let present: Vec<bool> = values.iter().map(Option::is_some).collect();
            let gathered = with_values(model.clone(), values).to_full_module()?;
            for (k, data) in param_values(&gathered).into_iter().enumerate() {
                if present[k] {
                    full.tensors.insert((k, field.clone()), data);
                }
            }
        }
        Ok(Self(full))
    }

    /// The optimizer record of this state for `sharded`, this rank's shard of `full` (the full
    /// model the state belongs to), at any tp and with any parameter ids; load it with
    /// [`ModuleOptimizer::load_record`].
    ///
    /// # Errors
    /// Sizes not divisible by the group's size; a state that does not fit the model.
    pub fn shard<M: Module + Reshard + Clone>(
        &self,
        full: &M,
        sharded: &M,
        group: &ProcessGroup,
    ) -> Result<OptimizerRecord> {
        let n = param_ids(sharded).len();
        let fields: BTreeSet<&String> = self.0.tensors.keys().map(|(_, f)| f).collect();
        let mut state = IndexedState {
            scalars: self.0.scalars.clone(),
            paths: self.0.paths.clone(),
            ..Default::default()
        };
        for field in fields {
            let values: Vec<Option<TensorData>> = (0..n)
                .map(|k| self.0.tensors.get(&(k, field.clone())).cloned())
                .collect();
            let present: Vec<bool> = values.iter().map(Option::is_some).collect();
            let shard = M::shard_module(&with_values(full.clone(), values), group)?;
            for (k, data) in param_values(&shard).into_iter().enumerate() {
                if present[k] {
                    state.tensors.insert((k, field.clone()), data);
                }
            }
        }
        state.record(sharded)
    }

    /// Writes the state to `path` (burnpack).
    ///
    /// # Errors
    /// The file error.
    pub fn save(&self, path: &Path) -> Result<()> {
        let tensors = self
            .0
            .tensors
            .iter()
            .map(|((k, field), data)| {
                let (bytes, shape, dtype) = data.clone().into_parts();
                burn_pack::Tensor::new(format!("{k}.{field}"), dtype, shape, None, bytes)
            })
            .collect();
        let mut writer = Writer::new(tensors);
        for (name, value) in &self.0.scalars {
            writer = writer.with_scalar(name, *value);
        }
        for (k, path) in &self.0.paths {
            writer = writer.with_metadata(&k.to_string(), path);
        }
        writer
            .auto_extension(false)
            .write_to_file(path)
            .map_err(|e| err(&format!("writing {}", path.display()), e))
    }

    /// Reads a state written by [`save`](Self::save).
    ///
    /// # Errors
    /// The file error, or a file of another layout.
    pub fn load(path: &Path) -> Result<Self> {
        let what = format!("reading {}", path.display());
        let reader = Reader::from_file(path).map_err(|e| err(&what, e))?;
        let mut state = IndexedState {
            scalars: reader.scalars().clone(),
            ..Default::default()
        };
        for (k, p) in reader.metadata() {
            let k = k.parse().map_err(|e| err(&what, e))?;
            state.paths.insert(k, p.clone());
        }
        for tensor in reader.into_tensors().map_err(|e| err(&what, e))? {
            let (name, dtype, shape, _, bytes) = tensor.into_parts().map_err(|e| err(&what, e))?;
            let (k, field) = name.split_once('.').ok_or_else(|| err(&what, &name))?;
            let k = k.parse().map_err(|e| err(&what, e))?;
            state.tensors.insert(
                (k, field.to_string()),
                TensorData::from_bytes(bytes, shape, dtype),
            );
        }
        Ok(Self(state))
    }
}

/// Per parameter (visiting order): whether it is frozen (no gradient, no optimizer state).
fn frozen_params<M: Module>(module: &M) -> Vec<bool> {
    struct Frozen(Vec<bool>);
    impl ModuleVisitor for Frozen {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(!param.val().is_require_grad());
        }
    }
    let mut f = Frozen(Vec::new());
    module.visit(&mut f);
    f.0
}

/// Per parameter (visiting order): its shape.
fn param_shapes<M: Module>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().shape().to_vec());
        }
    }
    let mut s = Shapes(Vec::new());
    module.visit(&mut s);
    s.0
}
