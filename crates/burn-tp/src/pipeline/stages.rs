//! A stage's model: where its parameters sit in the whole model ([`stage_map`]), the ends it
//! does not use dropped ([`drop_unused_ends`]), its held blocks cut into virtual stages.

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use burn_tp_comm::ReduceOp;

use super::Pipeline;
use crate::model::LanguageModel;
use crate::{Result, TpError};

/// Where stage `stage`'s model (of `stages`; `model`, holding its blocks of a whole model of
/// `n_layers` blocks) keeps each parameter in the whole model, for the checkpoints: the blocks
/// under their own indices, the embedding (and the GPT's positions) written by the first stage,
/// the final norm and the head by the last. Parameters the stage does not use
/// ([`drop_unused_ends`]) are neither read nor written.
///
/// # Errors
/// [`TpError::Config`] naming both if `stage >= stages`.
pub fn stage_map<M: LanguageModel>(
    model: &M,
    n_layers: usize,
    stage: usize,
    stages: usize,
) -> Result<crate::checkpoint::StageMap> {
    check_stage("stage_map", stage, stages)?;
    let [pre, _, post] = model.param_sections();
    // Where each block of the whole model starts.
    let mut start = Vec::with_capacity(n_layers + 1);
    start.push(pre);
    for b in 0..n_layers {
        start.push(start[b] + model.block_params(b));
    }
    let held = model.held_layers();
    let mut global = Vec::new();
    let mut writes = Vec::new();
    global.extend(0..pre);
    writes.extend(std::iter::repeat_n(stage == 0, pre));
    for (&b, block) in held.iter().zip(held_block_params(model)) {
        if block != start[b + 1] - start[b] {
            return Err(TpError::Config(format!(
                "stage_map: block {b} holds {block} parameters, the whole model's {} (a MoE \
                 block's experts split over ep: gather them first)",
                start[b + 1] - start[b]
            )));
        }
        global.extend(start[b]..start[b + 1]);
        writes.extend(std::iter::repeat_n(true, block));
    }
    let after = start[n_layers];
    global.extend(after..after + post);
    writes.extend(std::iter::repeat_n(stage + 1 == stages, post));
    Ok(crate::checkpoint::StageMap {
        global,
        writes,
        held: used_params(model, stage, stages),
        total: after + post,
    })
}

/// Stage `stage`'s model (of `stages`) without the parameters the stage never uses: the
/// embedding (and the GPT's positions) but on the first stage, and the table on the last when
/// the head is tied to it; the final norm and the head but on the last stage. Each is left
/// empty (its first dimension 0) and frozen, so a middle stage holds its blocks only (Megatron's
/// stages do not build them), and no optimizer state or gradient bucket waits for them.
/// [`stage_map`] neither reads nor writes them. A model with one stage is returned as it is.
///
/// # Errors
/// [`TpError::Config`] naming both if `stage >= stages`.
pub fn drop_unused_ends<M: LanguageModel>(model: M, stage: usize, stages: usize) -> Result<M> {
    check_stage("drop_unused_ends", stage, stages)?;
    struct Emptier {
        used: Vec<bool>,
        slot: usize,
    }
    impl ModuleMapper for Emptier {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let used = self.used.get(self.slot).copied().unwrap_or(true);
            self.slot += 1;
            if used {
                return param;
            }
            param
                .map(|t| {
                    let mut dims = t.dims();
                    dims[0] = 0;
                    Tensor::<D>::zeros(dims, &t.device()).cast(t.dtype())
                })
                .set_require_grad(false)
        }
    }
    let used = used_params(&model, stage, stages);
    Ok(model.map(&mut Emptier { used, slot: 0 }))
}

/// `stage` of `stages` names a stage.
fn check_stage(what: &str, stage: usize, stages: usize) -> Result<()> {
    match stage < stages {
        true => Ok(()),
        false => Err(TpError::Config(format!(
            "{what}: stage {stage} of {stages} stages (stages count from 0)"
        ))),
    }
}

/// Per parameter (visiting order): whether stage `stage` of `stages` uses it.
fn used_params<M: LanguageModel>(model: &M, stage: usize, stages: usize) -> Vec<bool> {
    struct Find {
        id: burn::module::ParamId,
        slot: usize,
        at: Option<usize>,
    }
    impl ModuleVisitor for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.id == self.id {
                self.at.get_or_insert(self.slot);
            }
            self.slot += 1;
        }
    }
    let [pre, _, post] = model.param_sections();
    let (first, last) = (stage == 0, stage + 1 == stages);
    let mut find = Find {
        id: model.embedding_weight().id,
        slot: 0,
        at: None,
    };
    model.visit(&mut find);
    let table = find.at;
    let tied = model.tied_head();
    let mut used: Vec<bool> = (0..pre)
        .map(|k| first || (last && tied && Some(k) == table))
        .collect();
    let blocks: usize = held_block_params(model).into_iter().sum();
    used.extend(std::iter::repeat_n(true, blocks));
    used.extend(std::iter::repeat_n(last, post));
    used
}

/// The blocks of each of the model's `v` virtual stages: its held blocks (the whole model's indices)
/// cut into their contiguous runs.
pub(super) fn virtual_stage_runs<M: LanguageModel>(model: &M, v: usize) -> Result<Vec<Vec<usize>>> {
    let held = model.held_layers();
    if v == 1 {
        return Ok(vec![held]);
    }
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for l in held.iter().copied() {
        match runs.last_mut() {
            Some(run) if run.last() == Some(&(l.wrapping_sub(1))) => run.push(l),
            _ => runs.push(vec![l]),
        }
    }
    if runs.len() != v {
        return Err(TpError::Config(format!(
            "pipeline: {v} virtual stages but this stage holds blocks {held:?} ({} ranges: see \
             virtual_stage_layers)",
            runs.len()
        )));
    }
    Ok(runs)
}

/// The parameters of each block held, in order.
fn held_block_params<M: LanguageModel>(model: &M) -> Vec<usize> {
    model
        .blocks()
        .iter()
        .map(crate::model::count_params)
        .collect()
}

/// The embedding's gradient summed over the first and last stages (zeros where a stage has
/// none), so both copies of the table take the same update.
pub(super) fn sum_embedding_grad<M: LanguageModel>(
    model: &M,
    pipe: &Pipeline,
    total: &mut GradientsParams,
) -> Result<()> {
    let Some(ends) = &pipe.ends else {
        return Ok(());
    };
    // Untied, the last stage does not use the table.
    if !model.tied_head() {
        return Ok(());
    }
    let weight: &Param<Tensor<2>> = model.embedding_weight();
    let w = weight.val();
    let (dims, device) = (w.dims(), w.device());
    let g = total
        .remove::<2>(weight.id)
        .unwrap_or_else(|| Tensor::<2>::zeros(dims, &device).inner());
    let values: Vec<f32> = g
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| TpError::Config(format!("pipeline: reading a gradient: {e:?}")))?;
    let summed = ends.all_reduce(values, ReduceOp::Sum)?;
    let g = Tensor::<2>::from_data(TensorData::new(summed, dims), &device);
    total.register(weight.id, g.inner());
    Ok(())
}
