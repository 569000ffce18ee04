//! The checkpoint's format: the index and its entries, the stored dtypes, the cut dimension
//! stored first.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::Sharding;
use crate::Result;
use crate::error::file_error;
use crate::reshard::ParamLayout;

/// The index's file name.
pub const INDEX: &str = "index.json";
pub(super) const FORMAT: &str = "burn-tp-sharded/1";
/// The format of a checkpoint with a slice of some rows of dim 0 ([`StoredPiece::rows`]: a
/// fully sharded run's); a reader of [`FORMAT`] alone would misread it.
pub(super) const FORMAT_ROWS: &str = "burn-tp-sharded/2";

/// What a checkpoint records about the run that saved it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Training steps done.
    pub step: u64,
    /// Tensor-parallel size of the run that saved it (any tp loads it).
    pub tp: usize,
    /// Data-parallel size of the run that saved it.
    pub dp: usize,
    /// Pipeline stages of the run that saved it (any number loads it).
    #[serde(default = "one")]
    pub pp: usize,
    /// The model's configuration, as JSON, without its `settings` (how the layers run: a
    /// checkpoint resumes in any mode or schedule): [`load`](super::load) refuses a checkpoint of
    /// another configuration.
    pub config: serde_json::Value,
    /// Where the frozen parameters come from when the checkpoint holds only the trainable ones
    /// (a LoRA run's: the adapters and their optimizer state, not the base), e.g. the Hugging
    /// Face folder the run started from; [`load`](super::load) then keeps the model's own
    /// values of its frozen parameters. `None`: every parameter is in the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_base: Option<String>,
}

/// `config` as JSON, without a top-level `settings` (burn-tp's configs keep how the layers run
/// there: not part of what the model is).
pub(super) fn model_json(config: &impl Serialize) -> serde_json::Value {
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
            pp: 1,
            config: model_json(config),
            frozen_base: None,
        }
    }

    /// The same, holding only the trainable parameters (and their optimizer state): the frozen
    /// ones are `base`'s (a description for the reader, e.g. the folder they were imported
    /// from), not saved, and a load keeps the model's own.
    pub fn with_frozen_base(self, base: impl Into<String>) -> Self {
        Self {
            frozen_base: Some(base.into()),
            ..self
        }
    }

    /// The same, saved by a run of `pp` pipeline stages.
    pub fn with_pp(self, pp: usize) -> Self {
        Self { pp, ..self }
    }
}

fn one() -> usize {
    1
}

/// One stored slice of a tensor: rows `offset..offset + (end - start)` (along the stored tensor's
/// first dimension) of `name` in `file` hold indices `start..end` of the full tensor's `dim`,
/// and of dim 0 (where it is not `dim`) the indices `rows` (all of them where `None`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct StoredPiece {
    pub(super) file: String,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) offset: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) rows: Option<[usize; 2]>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct TensorEntry {
    pub(super) dtype: String,
    pub(super) shape: Vec<usize>,
    pub(super) dim: usize,
    pub(super) pieces: Vec<StoredPiece>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub(super) enum ScalarValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Part {
    pub(super) tensors: BTreeMap<String, TensorEntry>,
    pub(super) scalars: BTreeMap<String, ScalarValue>,
    pub(super) paths: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Index {
    pub(super) format: String,
    pub(super) info: CheckpointInfo,
    /// The folder of the shard files, relative to the checkpoint's.
    pub(super) shards: String,
    /// Float parameters of the model.
    pub(super) params: usize,
    pub(super) tensors: BTreeMap<String, TensorEntry>,
    pub(super) scalars: BTreeMap<String, ScalarValue>,
    pub(super) paths: BTreeMap<String, String>,
}

pub(super) fn dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        _ => return None,
    })
}

pub(super) fn safetensors_dtype(name: &str) -> Option<safetensors::Dtype> {
    Some(match name {
        "F64" => safetensors::Dtype::F64,
        "F32" => safetensors::Dtype::F32,
        "F16" => safetensors::Dtype::F16,
        "BF16" => safetensors::Dtype::BF16,
        _ => return None,
    })
}

/// A tensor as a rank stores it (its dimension `dim` first, row-major), made only when its
/// bytes are written: the file is written one tensor at a time, so a save holds one tensor's
/// copy, not a copy of every tensor the rank writes.
pub(super) struct Lazy {
    /// The stored shape (the cut dimension first).
    pub(super) shape: Vec<usize>,
    pub(super) dtype: DType,
    pub(super) make: Box<dyn Fn() -> TensorData>,
}

impl Lazy {
    /// The bytes it stores.
    pub(super) fn len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// [`Lazy`] under its name in the rank's file.
pub(super) struct Stored {
    pub(super) name: String,
    pub(super) dtype: safetensors::Dtype,
    pub(super) value: Lazy,
}

impl safetensors::View for &Stored {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.value.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let data = (self.value.make)();
        // The header already says where each tensor ends: a wrong length would shift the
        // ones after it.
        assert_eq!(
            (data.shape().to_vec(), data.dtype()),
            (self.value.shape.clone(), self.value.dtype),
            "checkpoint: {} made unlike its header",
            self.name
        );
        let (bytes, _, _) = data.into_parts();
        std::borrow::Cow::Owned(bytes.try_into_vec::<u8>().unwrap_or_else(|b| b.to_vec()))
    }
    fn data_len(&self) -> usize {
        self.value.len()
    }
}

/// `shape` with `rows` rows of dim 0 (where given) and then `dim` moved first.
pub(super) fn stored_shape(shape: &[usize], rows: Option<usize>, dim: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    if let Some(rows) = rows {
        shape[0] = rows;
    }
    shape.swap(0, dim);
    shape
}

/// The float parameters of a module with `dim` of each moved first, in visiting order (a fully
/// sharded one's held rows alone, its padding cut off), each made when it is written; with
/// `trainable_only`, `None` for a frozen one (not even read: a quantized base stays packed).
pub(super) fn dim_first_values<M: Module>(
    module: &M,
    sharding: &Sharding,
    trainable_only: bool,
) -> Vec<Option<Lazy>> {
    struct Collect<'a>(Vec<Option<Lazy>>, &'a Sharding, bool);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let k = self.0.len();
            let dim = self.1.layouts.get(k).map_or(0, |l| l.dim);
            let t = param.val();
            let mut skip = self.2 && !t.is_require_grad();
            let t = match self.1.rows.get(k) {
                // A rank past the rows (at fsdp above them) holds padding alone.
                Some(Some(rows)) if rows.held.is_empty() => {
                    skip = true;
                    t
                }
                Some(Some(rows)) => t.narrow(0, 0, rows.held.len()),
                _ => t,
            };
            let value = (!skip).then(|| Lazy {
                shape: stored_shape(&t.dims(), None, dim),
                dtype: t.dtype(),
                make: Box::new(move || t.clone().swap_dims(0, dim).into_data()),
            });
            self.0.push(value);
        }
    }
    let mut c = Collect(Vec::new(), sharding, trainable_only);
    module.visit(&mut c);
    c.0
}

/// `module` with parameter `k` replaced by `values[k]`, given with its dim `layouts[k].dim`
/// first (kept where `None`).
pub(super) fn with_dim_first_values<M: Module>(
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

/// `data` with `dim` swapped with the first (its own inverse), on the host.
pub(super) fn dim_first(data: TensorData, dim: usize) -> TensorData {
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

pub(super) fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| file_error(path, format!("encoding: {e}")))?;
    std::fs::write(path, text).map_err(|e| file_error(path, format!("writing: {e}")))
}

pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text =
        std::fs::read_to_string(path).map_err(|e| file_error(path, format!("reading: {e}")))?;
    serde_json::from_str(&text).map_err(|e| file_error(path, format!("not a valid index: {e}")))
}
