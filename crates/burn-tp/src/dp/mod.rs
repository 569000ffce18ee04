//! Data parallelism on top of tensor parallelism: average gradients over a data-parallel group,
//! after the backward ([`average_gradients`]) or overlapped with it in buckets
//! ([`GradReducer`]); or shard the optimizer over it ([`DistributedAdamW`], ZeRO stage 1);
//! [`DpOptimizer`]: either, as one gradient-sync-then-step for a training loop.

mod clip;
mod reducer;
mod replicas;
mod step;
mod zero;

pub use clip::GradClip;
pub use replicas::{ReplicaPolicy, check_replicas, sync_replicas};

pub use reducer::{GradReducer, ReduceGroups};
pub use step::DpOptimizer;
pub use zero::DistributedAdamW;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::ops::all_reduce;
use crate::{Result, TpError};

/// Averages every gradient of `module` in `grads` over `dp_group` (all-reduce, then / dp), in
/// the module's parameter order, which is the same on every data-parallel rank. With tp x dp,
/// `dp_group` joins the ranks holding the same shard (`ProcessGroup::split(rank % tp, rank)`).
///
/// # Errors
/// The first communication error.
pub fn average_gradients<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    dp_group: &ProcessGroup,
) -> Result<()> {
    average_gradients_with(module, grads, dp_group, None)
}

/// The parameters that expert parallelism splits over the dp ranks (the MoE layers' experts,
/// [`crate::model::LanguageModel::expert_params`]) and the group of ranks holding the same
/// ones ([`crate::mesh::DeviceMesh::expert_groups`]).
///
/// An expert's gradient on a rank already sums every ep rank's tokens routed to it (the
/// all-to-all's backward brought them), so the dp average of the rest is matched by the sum
/// over the expert data-parallel group divided by the whole dp size.
#[derive(Clone, Debug)]
pub struct Experts {
    /// The experts' parameters.
    pub params: std::collections::HashSet<burn::module::ParamId>,
    /// The ranks holding the same experts (`dp / ep` of them).
    pub group: ProcessGroup,
}

/// [`average_gradients`], the experts' gradients summed over their own group and divided by
/// the dp size. Collective over `dp_group` and the experts' group.
///
/// # Errors
/// The first communication error.
pub fn average_gradients_with<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    dp_group: &ProcessGroup,
    experts: Option<&Experts>,
) -> Result<()> {
    if dp_group.world_size() == 1 {
        return Ok(());
    }
    let _scope = burn_tp_comm::profile::scope("dp gradient (after backward)");
    struct Averager<'a> {
        grads: &'a mut GradientsParams,
        group: &'a ProcessGroup,
        experts: Option<&'a Experts>,
        error: Option<TpError>,
    }
    impl ModuleVisitor for Averager<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.error.is_some() {
                return;
            }
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let reduced = match self.experts.filter(|x| x.params.contains(&param.id)) {
                    Some(x) => all_reduce(g, ReduceOp::Sum, &x.group)
                        .map(|s| s.div_scalar(self.group.world_size() as f64)),
                    None => all_reduce(g, ReduceOp::Avg, self.group),
                };
                match reduced {
                    Ok(avg) => self.grads.register(param.id, avg),
                    Err(e) => self.error = Some(e),
                }
            }
        }
    }
    let mut visitor = Averager {
        grads,
        group: dp_group,
        experts,
        error: None,
    };
    module.visit(&mut visitor);
    visitor.error.map_or(Ok(()), Err)
}

/// Copies every parameter of `module` from data-parallel rank 0 to the others, so all replicas
/// start identical (what DDP does at construction). Collective over `dp_group`.
///
/// # Errors
/// The first communication error.
pub fn broadcast_parameters<M: Module>(module: M, dp_group: &ProcessGroup) -> Result<M> {
    crate::init::broadcast_module(module, dp_group)
}

/// [`broadcast_parameters`] with expert parallelism: the experts from the first rank of their
/// own group (the ranks holding the same experts), every other parameter from dp rank 0.
/// Collective over `dp_group` and the experts' group.
///
/// # Errors
/// The first communication error.
pub fn broadcast_parameters_with<M: Module>(
    module: M,
    dp_group: &ProcessGroup,
    experts: &Experts,
) -> Result<M> {
    let module =
        crate::init::broadcast_module_where(module, dp_group, |id| !experts.params.contains(&id))?;
    crate::init::broadcast_module_where(module, &experts.group, |id| experts.params.contains(&id))
}
