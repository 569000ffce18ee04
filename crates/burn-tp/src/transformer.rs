//! Transformer layers built from the parallel linears: attention, MLP and a layer norm whose
//! replicated parameters stay identical on every rank.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Bool, Device, Tensor};
use burn_tp_comm::ProcessGroup;

use crate::error::check_divisible;
use crate::init::owned;
use crate::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear, RowParallelLinearConfig,
    TpMode, TpSettings,
};
use crate::ops::copy_to_tp_region;
use crate::reshard::{ParamLayout, Reshard, solo};
use crate::{Result as TpResult, TpError};

/// Uses a replicated parameter inside the tensor-parallel region. In REDUCE_SCATTER mode each rank
/// applies it to its own sequence shard only, so its gradient is partial: `copy_to_tp_region`
/// sums it over the group (Megatron's sequence-parallel layer-norm fix), keeping the parameter
/// bitwise identical on every rank. In ALL_REDUCE mode every rank already sees the full gradient.
pub fn replicated_param<const D: usize>(
    p: Tensor<D>,
    mode: TpMode,
    group: &ProcessGroup,
) -> Tensor<D> {
    match mode {
        TpMode::ReduceScatter => copy_to_tp_region(p, group),
        TpMode::AllReduce => p,
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
        let gamma = replicated_param(self.gamma.val(), self.mode, &self.group);
        let beta = replicated_param(self.beta.val(), self.mode, &self.group);
        burn::tensor::module::layer_norm(x, gamma, Some(beta), self.epsilon)
    }
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
    /// [`TpError::NotDivisible`] if `d_hidden % tp != 0`; a communication error.
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

/// Configuration of a [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    /// Model width.
    pub d_model: usize,
    /// Heads over all ranks (a multiple of tp); each rank computes `n_heads / tp` of them.
    pub n_heads: usize,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// One fused QKV projection (`d_model -> 3 d_model`, columns ordered `[head, q|k|v, head_dim]`
    /// so each rank's column block holds its heads' q, k and v) instead of three.
    #[config(default = true)]
    pub fused_qkv: bool,
}

/// Causal self-attention with heads split over the tensor-parallel group: QKV column-parallel,
/// attention per local head, output projection row-parallel.
#[derive(Module, Debug)]
pub struct ParallelAttention {
    /// `[qkv]` (fused, `d_model -> 3 d_model / tp`) or `[q, k, v]` (each `d_model -> d_model / tp`).
    pub qkv: Vec<ColumnParallelLinear>,
    /// `d_model / tp -> d_model`.
    pub out: RowParallelLinear,
    n_local_heads: usize,
    head_dim: usize,
}

impl ParallelAttentionConfig {
    /// Initializes this rank's heads. Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] if `n_heads % tp != 0` or `d_model % n_heads != 0`; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelAttention> {
        let tp = group.world_size();
        check_divisible("ParallelAttention n_heads", self.n_heads, tp)?;
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(TpError::Config(format!(
                "ParallelAttention: d_model = {} is not divisible by n_heads = {}",
                self.d_model, self.n_heads
            )));
        }
        let column = |d_out| {
            ColumnParallelLinearConfig::new(self.d_model, d_out)
                .with_settings(self.settings)
                .init(group, device)
        };
        let qkv = if self.fused_qkv {
            vec![column(3 * self.d_model)?]
        } else {
            vec![
                column(self.d_model)?,
                column(self.d_model)?,
                column(self.d_model)?,
            ]
        };
        let out = RowParallelLinearConfig::new(self.d_model, self.d_model)
            .with_settings(self.settings)
            .init(group, device)?;
        Ok(ParallelAttention {
            qkv,
            out,
            n_local_heads: self.n_heads / tp,
            head_dim: self.d_model / self.n_heads,
        })
    }
}

impl ParallelAttention {
    /// The same attention with other projection layers, at `tp`.
    pub(crate) fn with_layers(
        &self,
        qkv: Vec<ColumnParallelLinear>,
        out: RowParallelLinear,
        tp: usize,
    ) -> Self {
        let current_tp = self.out.group().world_size();
        let n_heads = self.n_local_heads * current_tp;
        Self {
            qkv,
            out,
            n_local_heads: n_heads / tp,
            head_dim: self.head_dim,
        }
    }

    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]`; the attention itself always sees the full
    /// sequence (`[b, heads / tp, s, head_dim]`).
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
        let (h, hd) = (self.n_local_heads, self.head_dim);
        let (q, k, v) = if self.qkv.len() == 1 {
            let y = self.qkv[0].try_forward(x)?; // [s, b, h * 3 * hd]
            let [s, b, _] = y.dims();
            let y = y.reshape([s, b, h, 3, hd]);
            let part = |i: usize| {
                y.clone()
                    .slice([0..s, 0..b, 0..h, i..i + 1, 0..hd])
                    .reshape([s, b, h, hd])
            };
            (part(0), part(1), part(2))
        } else {
            let heads = |l: &ColumnParallelLinear| -> TpResult<Tensor<4>> {
                let y = l.try_forward(x.clone())?;
                let [s, b, _] = y.dims();
                Ok(y.reshape([s, b, h, hd]))
            };
            (
                heads(&self.qkv[0])?,
                heads(&self.qkv[1])?,
                heads(&self.qkv[2])?,
            )
        };
        let [s, b, _, _] = q.dims();
        // [s, b, h, hd] -> [b, h, s, hd]
        let (q, k, v) = (
            q.permute([1, 2, 0, 3]),
            k.permute([1, 2, 0, 3]),
            v.permute([1, 2, 0, 3]),
        );
        let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>();
        let att = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let ctx = att.matmul(v).permute([2, 0, 1, 3]).reshape([s, b, h * hd]);
        self.out.try_forward(ctx)
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

impl Reshard for ParallelAttention {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(self.with_layers(self.qkv.to_full_module()?, self.out.to_full_module()?, 1))
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(full.with_layers(
            Reshard::shard_module(&full.qkv, group)?,
            Reshard::shard_module(&full.out, group)?,
            group.world_size(),
        ))
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        let mut out = self.qkv.layout(rank);
        out.extend(self.out.layout(rank));
        out
    }
}
