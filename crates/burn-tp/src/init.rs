//! Parameter initialisation that starts a model identical at every tp and on every
//! data-parallel replica: each rank thread draws from a stream of its own, seeded alike
//! ([`crate::local::set_init_seed`]), and the draws of a tp group are made by its rank 0 and broadcast.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::Initializer;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::rng::splitmix64;
use crate::{Result, TpError};

/// `initializer`'s distribution at these fans (burn-nn's formulas), or `None` where it is not
/// one draw of i.i.d. values (constants; orthogonal, which needs a QR).
fn distribution(
    initializer: &Initializer,
    fan_in: Option<usize>,
    fan_out: Option<usize>,
) -> Option<Distribution> {
    let fan = |fan_out_only: bool| {
        let fan = if fan_out_only { fan_out } else { fan_in };
        let fan = fan.expect(
            "Can't use Kaiming initialization without specifying fan. Use init_with method.",
        );
        1.0 / (fan as f64).sqrt()
    };
    let xavier = || {
        let (Some(i), Some(o)) = (fan_in, fan_out) else {
            panic!("Can't use Xavier initialization without specifying fan in and fan out.");
        };
        (2.0 / (i + o) as f64).sqrt()
    };
    Some(match *initializer {
        Initializer::Uniform { min, max } => Distribution::Uniform(min, max),
        Initializer::Normal { mean, std } => Distribution::Normal(mean, std),
        Initializer::KaimingUniform { gain, fan_out_only } => {
            let a = 3.0f64.sqrt() * gain * fan(fan_out_only);
            Distribution::Uniform(-a, a)
        }
        Initializer::KaimingNormal { gain, fan_out_only } => {
            Distribution::Normal(0.0, gain * fan(fan_out_only))
        }
        Initializer::XavierUniform { gain } => {
            let a = 3.0f64.sqrt() * gain * xavier();
            Distribution::Uniform(-a, a)
        }
        Initializer::XavierNormal { gain } => Distribution::Normal(0.0, gain * xavier()),
        Initializer::Constant { .. }
        | Initializer::Ones
        | Initializer::Zeros
        | Initializer::Orthogonal { .. } => return None,
    })
}

/// `initializer`'s draw of a `shape` tensor: from this thread's stream where it has one
/// ([`crate::local::set_init_seed`]), else from the device's RNG (constants and orthogonal always so).
fn draw<const D: usize>(
    initializer: &Initializer,
    shape: [usize; D],
    fan_in: Option<usize>,
    fan_out: Option<usize>,
    device: &Device,
) -> Tensor<D> {
    let from_stream = distribution(initializer, fan_in, fan_out).and_then(|dist| {
        // Flex's own draw (`float_random`): the same values from the same state.
        crate::local::with_init_stream(|rng| TensorData::random::<f32, _, _>(shape, dist, rng))
    });
    match from_stream {
        Some(data) => Tensor::from_data(data, device),
        None => initializer
            .init_with::<D, _>(shape, fan_in, fan_out, device)
            .val(),
    }
}

/// Draws a full `shape` tensor with `initializer` on rank 0 of `group` and broadcasts it: every
/// rank of the group holds the same values, the draws of the unsharded model (the shards are
/// cut from it). Rank 0 draws from its thread's initialization stream ([`crate::local::set_init_seed`]; the
/// rank threads of [`crate::local::run_ranks`] all have one, seeded alike), so every
/// data-parallel replica's tp rank 0 draws the same values. Collective over `group`.
///
/// This is how a model of one's own initializes a parameter that every tp rank holds whole
/// (a learned position table): [`init_replicated_param`].
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
    if group.world_size() == 1 {
        return Ok(draw(initializer, shape, fan_in, fan_out, device));
    }
    let full = if group.rank() == 0 {
        draw(initializer, shape, fan_in, fan_out, device)
    } else {
        Tensor::zeros(shape, device)
    };
    crate::ops::broadcast(full, 0, group)
}

/// [`init_replicated`] as a trainable parameter: a parameter of a model of one's own that every
/// rank of the tensor-parallel `group` holds whole (`[shape]` on every rank), identical on
/// every rank and every data-parallel replica. Use it inside the tp region through
/// [`crate::norm::replicated_param`] so its gradient is summed where sequence parallelism
/// splits it. Collective over `group`.
///
/// # Errors
/// A communication error.
pub fn init_replicated_param<const D: usize>(
    initializer: &Initializer,
    shape: [usize; D],
    fan_in: Option<usize>,
    fan_out: Option<usize>,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Param<Tensor<D>>> {
    let t = init_replicated(initializer, shape, fan_in, fan_out, group, device)?;
    Ok(Param::from_tensor(t.require_grad()))
}

/// A detached copy of `t` with its own storage: a rank's parameters must not share storage or
/// graph nodes with a tensor another rank holds (graphs that share a node merge and lock together).
pub(crate) fn owned<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    let (device, dtype) = (t.device(), t.dtype());
    // The dtype too: `from_data` with a bare device would convert to the default float type.
    Tensor::from_data(t.detach().to_data(), (&device, dtype))
}

/// A rank-owned copy of chunk `rank` of `dim` (the whole tensor at tp = 1).
pub(crate) fn shard<const D: usize>(t: Tensor<D>, dim: usize, group: &ProcessGroup) -> Tensor<D> {
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
pub(crate) fn broadcast_module_where<M: Module>(
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

/// Each float parameter's module path, in visiting order (burn's record keys).
pub(crate) fn param_paths<M: Module>(model: &M) -> Vec<String> {
    struct Paths(Vec<String>, Vec<String>);
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.1.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
            self.0.push(self.1.join("."));
        }
    }
    let mut paths = Paths(Vec::new(), Vec::new());
    model.visit(&mut paths);
    paths.0
}

/// Which parameters a check compares (by visiting slot and id).
pub(crate) type Picks<'a> = &'a dyn Fn(usize, ParamId) -> bool;

/// Each float parameter's path, id and a 62-bit digest of its shape, dtype and bytes, in
/// visiting order. Local: no communication.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReplicaDigest(Vec<(String, ParamId, i64)>);

impl ReplicaDigest {
    /// The digest of `model`'s float parameters.
    pub(crate) fn of<M: Module>(model: &M) -> Self {
        struct Digest(Vec<(ParamId, i64)>);
        impl ModuleVisitor for Digest {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                let mut h = splitmix64(D as u64);
                for &d in &t.dims() {
                    h = splitmix64(h ^ d as u64);
                }
                let data = t.into_data();
                for b in format!("{:?}", data.dtype()).bytes() {
                    h = splitmix64(h ^ u64::from(b));
                }
                let bytes = data.as_bytes();
                let mut words = bytes.chunks_exact(8);
                for w in &mut words {
                    h = splitmix64(h ^ u64::from_le_bytes(w.try_into().expect("8 bytes")));
                }
                for &b in words.remainder() {
                    h = splitmix64(h ^ u64::from(b));
                }
                // 62 bits: its negation fits too, so one max gives the max and the min.
                self.0.push((param.id, (h >> 2) as i64));
            }
        }
        let mut digest = Digest(Vec::new());
        model.visit(&mut digest);
        let names = param_paths(model).into_iter().enumerate().map(|(k, path)| {
            if path.is_empty() {
                format!("parameter {k}")
            } else {
                path
            }
        });
        Self(names.zip(digest.0).map(|(n, (id, h))| (n, id, h)).collect())
    }

    /// Checks, for each `(group, which)`, that the parameters `which` picks (by visiting slot
    /// and id) are the same on every rank of `group`: one all-reduce per group of more than one
    /// rank. Collective over each group, in order.
    ///
    /// # Errors
    /// [`TpError::ReplicasDiffer`] naming the first parameter that differs and `what` checked;
    /// a communication error.
    pub(crate) fn verify(&self, checks: &[(&ProcessGroup, Picks<'_>)], what: &str) -> Result<()> {
        for (group, which) in checks {
            if group.world_size() <= 1 {
                continue;
            }
            let picked: Vec<_> = self
                .0
                .iter()
                .enumerate()
                .filter(|(slot, (_, id, _))| which(*slot, *id))
                .map(|(_, p)| p)
                .collect();
            let mut both: Vec<i64> = picked.iter().map(|p| p.2).collect();
            both.extend(picked.iter().map(|p| -p.2));
            let max = group.all_reduce(both, ReduceOp::Max)?;
            let n = picked.len();
            if let Some(i) = (0..n).find(|&i| max[i] != -max[n + i]) {
                return Err(TpError::ReplicasDiffer {
                    what: what.to_string(),
                    param: picked[i].0.clone(),
                    ranks: group.world_size(),
                });
            }
        }
        Ok(())
    }
}
