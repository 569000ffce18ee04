//! Data parallelism on top of tensor parallelism: average gradients over a data-parallel group,
//! after the backward ([`average_gradients`]) or overlapped with it in buckets
//! ([`GradReducer`]); or shard the optimizer over it ([`DistributedAdamW`], ZeRO stage 1);
//! [`DpOptimizer`]: either, as one gradient-sync-then-step for a training loop.

mod reducer;
mod step;
mod zero;

pub use reducer::GradReducer;
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
    if dp_group.world_size() == 1 {
        return Ok(());
    }
    let _scope = burn_tp_comm::profile::scope("dp gradient (after backward)");
    struct Averager<'a> {
        grads: &'a mut GradientsParams,
        group: &'a ProcessGroup,
        error: Option<TpError>,
    }
    impl ModuleVisitor for Averager<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.error.is_some() {
                return;
            }
            if let Some(g) = self.grads.remove::<D>(param.id) {
                match all_reduce(g, ReduceOp::Avg, self.group) {
                    Ok(avg) => self.grads.register(param.id, avg),
                    Err(e) => self.error = Some(e),
                }
            }
        }
    }
    let mut visitor = Averager {
        grads,
        group: dp_group,
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
