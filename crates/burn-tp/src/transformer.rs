//! Transformer layers built from the parallel linears: the GPT's MLP and a layer norm whose
//! replicated parameters stay identical on every rank (the attention of both models is
//! [`crate::attention`]).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use burn::backend::Dispatch;
use burn::config::Config;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::Result as TpResult;
use crate::backend::{NormSpec, TpBackend};
use crate::init::owned;
use crate::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};
use crate::ops::{all_reduce, copy_to_tp_region};
use crate::reshard::{ParamLayout, Reshard, solo};

/// Uses a replicated parameter inside the tensor-parallel region. In REDUCE_SCATTER mode each rank
/// applies it to its own sequence shard only, so its gradient is partial: `copy_to_tp_region`
/// sums it over the group (Megatron's sequence-parallel layer-norm fix), keeping the parameter
/// bitwise identical on every rank, one blocking all-reduce per use in the backward. Inside a
/// [`ReplicatedGrads::scope`] the parameter is used as it is and only marked: the scope's
/// [`finish`](ReplicatedGrads::finish) sums every marked gradient over the group at once after
/// the backward (Megatron's coalesced all-reduce of the layer-norm gradients). In ALL_REDUCE
/// mode every rank already sees the full gradient.
pub fn replicated_param<const D: usize>(
    p: &Param<Tensor<D>>,
    mode: TpMode,
    group: &ProcessGroup,
) -> Tensor<D> {
    match mode {
        TpMode::ReduceScatter => {
            let deferred = DEFERRED.with(|d| {
                d.borrow()
                    .as_ref()
                    .map(|ids| ids.lock().unwrap_or_else(|e| e.into_inner()).insert(p.id))
                    .is_some()
            });
            if deferred {
                p.val()
            } else {
                copy_to_tp_region(p.val(), group)
            }
        }
        TpMode::AllReduce => p.val(),
    }
}

type MarkedIds = Arc<Mutex<BTreeSet<ParamId>>>;

thread_local! {
    /// The marks of the innermost active [`ReplicatedGrads::scope`] on this (rank's) thread.
    static DEFERRED: RefCell<Option<MarkedIds>> = const { RefCell::new(None) };
}

/// One coalesced all-reduce per step for the replicated parameters' gradients in REDUCE_SCATTER
/// mode, in place of one blocking all-reduce per use inside the backward.
///
/// ```ignore
/// let replicated = ReplicatedGrads::new(&tp_group);
/// let loss = replicated.scope(|| model.loss(ids, targets, None))?; // marks, no collective
/// let mut grads = GradientsParams::from_grads(loss.backward(), &model);
/// replicated.finish(&model, &mut grads)?; // every marked gradient summed over tp at once
/// ```
///
/// The sum is linear, so it may come before or after the data-parallel average
/// ([`crate::dp::average_gradients`], [`crate::dp::GradReducer::finish`]); not with
/// [`crate::dp::DistributedAdamW`], whose gradients are reduced inside the backward. Call
/// `finish` after every backward of a scope: until then the marked gradients are partial.
#[derive(Debug)]
pub struct ReplicatedGrads {
    ids: MarkedIds,
    group: ProcessGroup,
}

impl ReplicatedGrads {
    /// For the tensor-parallel group `tp_group`.
    pub fn new(tp_group: &ProcessGroup) -> Self {
        Self {
            ids: Arc::default(),
            group: tp_group.clone(),
        }
    }

    /// Runs `f` (a forward) on this thread with the replicated parameters' gradient sums
    /// deferred to [`finish`](Self::finish).
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<MarkedIds>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                DEFERRED.with(|d| *d.borrow_mut() = previous);
            }
        }
        let _restore = Restore(DEFERRED.with(|d| d.borrow_mut().replace(self.ids.clone())));
        f()
    }

    /// Sums the gradients of every parameter marked since the last call over the tensor-parallel
    /// group, in one all-reduce of their concatenation (in the model's visiting order, the same on
    /// every rank), in place in `grads`.
    ///
    /// # Errors
    /// A communication error.
    pub fn finish<M: Module>(&self, model: &M, grads: &mut GradientsParams) -> TpResult<()> {
        let marked = std::mem::take(&mut *self.ids.lock().unwrap_or_else(|e| e.into_inner()));
        if marked.is_empty() || self.group.world_size() == 1 {
            return Ok(());
        }
        struct Gather<'a> {
            marked: &'a BTreeSet<ParamId>,
            grads: &'a GradientsParams,
            flat: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Gather<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.marked.contains(&param.id)
                    && let Some(g) = self.grads.get::<D>(param.id)
                {
                    self.flat.push(g.flatten(0, D - 1));
                }
            }
        }
        let mut gather = Gather {
            marked: &marked,
            grads,
            flat: Vec::new(),
        };
        model.visit(&mut gather);
        if gather.flat.is_empty() {
            return Ok(());
        }
        let _scope = burn_tp_comm::profile::scope("replicated gradients (coalesced)");
        let summed = all_reduce(Tensor::cat(gather.flat, 0), ReduceOp::Sum, &self.group)?;
        struct Scatter<'a> {
            marked: &'a BTreeSet<ParamId>,
            grads: &'a mut GradientsParams,
            summed: Tensor<1>,
            at: usize,
        }
        impl ModuleVisitor for Scatter<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.marked.contains(&param.id)
                    && let Some(own) = self.grads.remove::<D>(param.id)
                {
                    let n = own.shape().num_elements();
                    let g: Tensor<D> = self
                        .summed
                        .clone()
                        .narrow(0, self.at, n)
                        .reshape(own.shape());
                    self.at += n;
                    self.grads.register(param.id, g);
                }
            }
        }
        model.visit(&mut Scatter {
            marked: &marked,
            grads,
            summed,
            at: 0,
        });
        Ok(())
    }
}

/// Layer norm over the last dim with replicated `gamma`, `beta` (see [`replicated_param`]).
#[derive(Module, Debug)]
pub struct TpLayerNorm {
    /// `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// `[d_model]`.
    pub beta: Param<Tensor<1>>,
    #[module(skip)]
    group: ProcessGroup,
    #[module(skip)]
    mode: TpMode,
    epsilon: f64,
}

impl TpLayerNorm {
    /// Ones and zeros, like Burn's `LayerNormConfig::init` (epsilon 1e-5).
    pub fn new(d_model: usize, mode: TpMode, group: &ProcessGroup, device: &Device) -> Self {
        Self {
            gamma: Param::from_tensor(Tensor::ones([d_model], device)),
            beta: Param::from_tensor(Tensor::zeros([d_model], device)),
            group: group.clone(),
            mode,
            epsilon: 1e-5,
        }
    }

    /// From a Burn `LayerNorm` (its `gamma` and `beta`).
    pub fn from_full(norm: &LayerNorm, mode: TpMode, group: &ProcessGroup) -> Self {
        let gamma = norm.gamma.val();
        let beta = norm
            .beta
            .as_ref()
            .map_or_else(|| gamma.zeros_like(), |b| b.val());
        Self {
            gamma: Param::from_tensor(owned(gamma)),
            beta: Param::from_tensor(owned(beta)),
            group: group.clone(),
            mode,
            epsilon: 1e-5,
        }
    }

    /// As a Burn `LayerNorm` (detached copies).
    pub fn to_full(&self) -> LayerNorm {
        let gamma = self.gamma.val();
        let mut norm = LayerNormConfig::new(gamma.dims()[0]).init(&gamma.device());
        norm.gamma = Param::from_tensor(owned(gamma));
        norm.beta = Some(Param::from_tensor(owned(self.beta.val())));
        norm
    }

    /// Activation layout.
    pub fn mode(&self) -> TpMode {
        self.mode
    }

    /// `[.., d_model] -> [.., d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let gamma = replicated_param(&self.gamma, self.mode, &self.group);
        let beta = replicated_param(&self.beta, self.mode, &self.group);
        let spec = NormSpec {
            rms: false,
            epsilon: self.epsilon,
        };
        norm(x, gamma, Some(beta), spec)
    }
}

/// Layer norm or RMSNorm over the last dim as one backend op ([`TpBackend::tp_norm`]), whose
/// backward keeps only `x` and `gamma`: `[.., d] -> [.., d]`.
pub(crate) fn norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    spec: NormSpec,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.map(Tensor::into_dispatch).into(),
        spec,
    ))
}

/// Configuration of a [`ParallelMlp`].
#[derive(Config, Debug)]
pub struct ParallelMlpConfig {
    /// Model width.
    pub d_model: usize,
    /// Hidden width over all ranks (a multiple of tp).
    pub d_hidden: usize,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// Megatron MLP: `ColumnParallelLinear -> GELU -> RowParallelLinear`, one reduction per call.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// `d_model -> d_hidden / tp`.
    pub fc1: ColumnParallelLinear,
    /// `d_hidden / tp -> d_model`.
    pub fc2: RowParallelLinear,
}

impl ParallelMlpConfig {
    /// Initializes this rank's shards. Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`](crate::TpError::NotDivisible) if `d_hidden % tp != 0`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelMlp> {
        Ok(ParallelMlp {
            fc1: ColumnParallelLinearConfig::new(self.d_model, self.d_hidden)
                .with_settings(self.settings)
                .init(group, device)?,
            fc2: RowParallelLinearConfig::new(self.d_hidden, self.d_model)
                .with_settings(self.settings)
                .init(group, device)?,
        })
    }
}

impl ParallelMlp {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` (sharded on dim 0 in REDUCE_SCATTER mode).
    ///
    /// # Panics
    /// As the linears' `forward`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        self.fc2.try_forward(gelu(self.fc1.try_forward(x)?))
    }
}

impl crate::linear::InMode for TpLayerNorm {
    fn in_mode(mut self, mode: TpMode) -> Self {
        self.mode = mode;
        self
    }
}

impl crate::linear::InMode for ParallelMlp {
    fn in_mode(self, mode: TpMode) -> Self {
        Self {
            fc1: self.fc1.in_mode(mode),
            fc2: self.fc2.in_mode(mode),
        }
    }
}

impl Reshard for TpLayerNorm {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(Self::from_full(&self.to_full(), self.mode(), &solo()))
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(Self::from_full(&full.to_full(), full.mode(), group))
    }
    fn layout(&self, _rank: usize) -> Vec<ParamLayout> {
        let r = self.group.rank();
        vec![
            ParamLayout::replicated(self.gamma.val().dims().to_vec(), r),
            ParamLayout::replicated(self.beta.val().dims().to_vec(), r),
        ]
    }
}

crate::reshard::reshard_fields!(ParallelMlp { fc1, fc2 });
