//! A Burn record file in and out of a parallel model: [`load_burn_record`] fills a model built
//! at any tp from the file a plain burn-nn model (or the same model at tp 1) saved with
//! `Module::save_file`, each rank reading only its slices; [`save_burn_record`] writes the
//! model back as such a file, which the plain model loads with `Module::load_file`.
//!
//! Parameters meet by their module path (`fc1.weight`: burn's record key), so a parallel model
//! whose fields are named as its plain twin's (burn-tp's layers keep burn-nn's parameter names:
//! `weight`, `bias`, `gamma`, `beta`) reads the twin's record as it is. Where each rank's slice
//! lies comes from [`Reshard::layout`] (the checkpoints' own map), so a padded vocabulary, fused
//! QKV parts or replicated key / value heads are cut as the sharded checkpoints cut them.
//!
//! The file is burn's burnpack, read through a lazy file view ([`burn_pack::Reader`]): a rank
//! holds one whole parameter at a time, never the whole model.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use burn_tp_comm::ProcessGroup;

use crate::Result;
use crate::error::file_error;
use crate::init::{owned, param_paths};
use crate::reshard::{ParamLayout, Reshard};

/// Fills `model` (built at any tp: its own values are replaced) from the Burn record file `path`
/// (`Module::save_file` of its plain burn-nn twin, or of the same model at tp 1): every float
/// parameter from the record's tensor of the same module path, this rank's slice of it (where
/// [`Reshard::layout`] puts it), in the model's dtype. Local to this rank: no communication.
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file: it cannot be read, a
/// parameter it lacks, a record tensor no parameter takes, a shape other than the full
/// parameter's (both named).
pub fn load_burn_record<M: Module + Reshard>(
    model: M,
    path: &Path,
    group: &ProcessGroup,
) -> Result<M> {
    let err = |what: String| file_error(path, what);
    let reader = burn_pack::Reader::from_file(path).map_err(|e| err(e.to_string()))?;
    let mut tensors: HashMap<String, burn_pack::Tensor> = reader
        .into_tensors()
        .map_err(|e| err(e.to_string()))?
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let paths = param_paths(&model);
    let layouts = model.layout(group.rank());
    if layouts.len() != paths.len() {
        return Err(err(format!(
            "the model's layout has {} entries for {} parameters",
            layouts.len(),
            paths.len()
        )));
    }
    if let Some(missing) = paths.iter().find(|p| !tensors.contains_key(*p)) {
        let mut have: Vec<_> = tensors.keys().cloned().collect();
        have.sort();
        return Err(err(format!(
            "no tensor `{missing}` (the record holds {have:?})"
        )));
    }
    let mut planned = Vec::with_capacity(paths.len());
    for (p, layout) in paths.iter().zip(&layouts) {
        let t = tensors.remove(p).expect("checked above");
        if t.shape.as_slice() != layout.global_shape.as_slice() {
            return Err(err(format!(
                "tensor `{p}` is {:?}, the model's full parameter {:?}",
                t.shape.as_slice(),
                layout.global_shape
            )));
        }
        planned.push((p.clone(), t));
    }
    if !tensors.is_empty() {
        let mut unused: Vec<_> = tensors.into_keys().collect();
        unused.sort();
        return Err(err(format!(
            "tensors no parameter of the model takes: {unused:?}"
        )));
    }
    struct Fill {
        planned: std::vec::IntoIter<(String, burn_pack::Tensor)>,
        layouts: std::vec::IntoIter<ParamLayout>,
        error: Option<String>,
    }
    impl ModuleMapper for Fill {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (Some((name, t)), Some(layout)) = (self.planned.next(), self.layouts.next()) else {
                return param;
            };
            if self.error.is_some() {
                return param;
            }
            let (dtype, shape) = (t.dtype, t.shape.clone());
            let bytes = match t.into_bytes() {
                Ok(b) => b,
                Err(e) => {
                    self.error = Some(format!("tensor `{name}`: {e}"));
                    return param;
                }
            };
            let data = TensorData::from_bytes(bytes, shape, dtype);
            param.map(|local| {
                let requires_grad = local.is_require_grad();
                let (device, dtype) = (local.device(), local.dtype());
                let full = Tensor::<D>::from_data(data, (&device, dtype));
                let mut out = local.detach().zeros_like();
                for piece in &layout.pieces {
                    let part =
                        full.clone()
                            .narrow(layout.dim, piece.global.start, piece.global.len());
                    let mut ranges = out.dims().map(|d| 0..d);
                    ranges[layout.dim] = piece.local.clone();
                    out = out.slice_assign(ranges, part);
                }
                let out = owned(out);
                if requires_grad {
                    out.require_grad()
                } else {
                    out
                }
            })
        }
    }
    let mut fill = Fill {
        planned: planned.into_iter(),
        layouts: layouts.into_iter(),
        error: None,
    };
    let model = model.map(&mut fill);
    match fill.error {
        Some(e) => Err(err(e)),
        None => Ok(model),
    }
}

/// Writes `model` as a Burn record file at `path` (burnpack), which its plain burn-nn twin (or
/// the same model at tp 1) loads with `Module::load_file`: every float parameter whole, under
/// its module path, the padding of a padded vocabulary cut off. Collective over the model's
/// groups; rank 0 of `group` writes (the others return once the gather is done). Every rank
/// holds the whole (unsharded) model while it runs ([`Reshard::to_full_module`], as burn-nn's
/// file holds it): for a model too big for one rank, save the sharded checkpoints
/// ([`super::save`]) instead.
///
/// # Errors
/// [`TpError::Checkpoint`](crate::TpError::Checkpoint) naming the file for a write that fails;
/// a communication error.
pub fn save_burn_record<M: Module + Reshard>(
    model: &M,
    path: &Path,
    group: &ProcessGroup,
) -> Result<()> {
    let full = model.to_full_module()?;
    if group.rank() != 0 {
        return Ok(());
    }
    let paths = param_paths(&full);
    struct Collect {
        layouts: std::vec::IntoIter<ParamLayout>,
        paths: std::vec::IntoIter<String>,
        out: Vec<burn_pack::Tensor>,
    }
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (Some(layout), Some(name)) = (self.layouts.next(), self.paths.next()) else {
                return;
            };
            let t = param.val();
            // The full module holds every piece; a padded dimension's padding is dropped.
            let parts: Vec<Tensor<D>> = layout
                .pieces
                .iter()
                .map(|p| t.clone().narrow(layout.dim, p.local.start, p.local.len()))
                .collect();
            let whole = if parts.len() == 1 {
                parts.into_iter().next().expect("one piece")
            } else {
                Tensor::cat(parts, layout.dim)
            };
            let (bytes, shape, dtype) = whole.into_data().into_parts();
            self.out.push(burn_pack::Tensor::new(
                name,
                dtype,
                shape,
                Some(param.id.val()),
                bytes,
            ));
        }
    }
    let mut collect = Collect {
        layouts: full.layout(0).into_iter(),
        paths: paths.into_iter(),
        out: Vec::new(),
    };
    full.visit(&mut collect);
    burn_pack::Writer::new(collect.out)
        .write_to_file(path)
        .map_err(|e| file_error(path, e.to_string()))
}
