//! Parameter initialisation that starts a model identical at every tp.

use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::{Result, TpError};

/// Draws a full `shape` tensor with `initializer` on rank 0 and broadcasts it, so only rank 0
/// uses the device RNG: seeded once before the rank threads start, the draws are exactly those
/// of the unsharded model at tp = 1 (Flex has one device, hence one RNG for every rank thread).
///
/// # Errors
/// A communication error.
pub fn init_replicated<const D: usize>(
    initializer: &Initializer,
    shape: [usize; D],
    fan_in: Option<usize>,
    fan_out: Option<usize>,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Tensor<D>> {
    let draw = || {
        initializer
            .init_with::<D, _>(shape, fan_in, fan_out, device)
            .val()
    };
    if group.world_size() == 1 {
        return Ok(draw());
    }
    let full = if group.rank() == 0 {
        draw()
    } else {
        Tensor::zeros(shape, device)
    };
    crate::ops::broadcast(full, 0, group)
}

/// A detached copy of `t` with its own storage: a rank's parameters must not share storage or
/// graph nodes with a tensor another rank holds (graphs that share a node merge and lock together).
pub fn owned<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let (device, dtype) = (t.device(), t.dtype());
    // The dtype too: `from_data` with a bare device would convert to the default float type.
    Tensor::from_data(t.detach().to_data(), (&device, dtype))
}

/// A rank-owned copy of chunk `rank` of `dim` (the whole tensor at tp = 1).
pub fn shard<const D: usize>(t: Tensor<D>, dim: usize, group: &ProcessGroup) -> Tensor<D> {
    let (r, n) = (group.rank(), group.world_size());
    owned(if n == 1 {
        t
    } else {
        t.chunk(n, dim).swap_remove(r)
    })
}

/// Copies every parameter of `module` from rank 0 of `group` to the others (a data-parallel
/// group's replicas, an expert-parallel group's shared parameters). Collective over `group`.
///
/// # Errors
/// The first communication error.
pub fn broadcast_module<M: Module>(module: M, group: &ProcessGroup) -> Result<M> {
    broadcast_module_where(module, group, |_| true)
}

/// [`broadcast_module`] of the parameters `which` picks (by id, the same on every rank).
///
/// # Errors
/// The first communication error.
pub fn broadcast_module_where<M: Module>(
    module: M,
    group: &ProcessGroup,
    which: impl Fn(burn::module::ParamId) -> bool,
) -> Result<M> {
    if group.world_size() == 1 {
        return Ok(module);
    }
    struct Broadcaster<'a, F> {
        group: &'a ProcessGroup,
        which: F,
        error: Option<TpError>,
    }
    impl<F: Fn(burn::module::ParamId) -> bool> burn::module::ModuleMapper for Broadcaster<'_, F> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            // An empty parameter (a pipeline stage's unused copy) has nothing to send.
            if self.error.is_some()
                || !(self.which)(param.id)
                || param.val().shape().num_elements() == 0
            {
                return param;
            }
            let group = self.group;
            let mut error = None;
            let param = param.map(|t| {
                let requires_grad = t.is_require_grad();
                match crate::ops::broadcast(t.clone(), 0, group) {
                    Ok(b) => {
                        let b = owned(b);
                        if requires_grad { b.require_grad() } else { b }
                    }
                    Err(e) => {
                        error = Some(e);
                        t
                    }
                }
            });
            self.error = error;
            param
        }
    }
    let mut mapper = Broadcaster {
        group,
        which,
        error: None,
    };
    let module = module.map(&mut mapper);
    mapper.error.map_or(Ok(module), Err)
}
