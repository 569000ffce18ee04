//! [`MoeConfig`]: the experts, the router, the checks, and the draws that make a layer the same at
//! every tp x ep.

use burn::config::Config;
use burn::module::Param;
use burn::nn::Initializer;
use burn::tensor::{Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::layer::{MoeLayer, MoeOptions};
use crate::TpError;
use crate::init::{broadcast_module, init_replicated, owned};
use crate::linear::TpSettings;
use crate::transformer::{GluActivation, ParallelSwiGlu, ParallelSwiGluConfig};

type TpResult<T> = std::result::Result<T, TpError>;

/// Burn's `LinearConfig` default gain (`1 / sqrt(3)`), as the parallel linears use.
const INIT_GAIN: f64 = 0.577_350_269_189_625_8;

/// The experts of a model whose MLPs are (some of them) mixtures of experts: what a
/// Llama-class config carries (Mixtral's, Qwen2-MoE's and Qwen3-MoE's fields).
#[derive(Config, Debug, PartialEq)]
pub struct ExpertsConfig {
    /// Experts per MoE layer (`num_local_experts`, `num_experts`).
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's hidden width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub d_ff: usize,
    /// Renormalize the chosen experts' weights (`norm_topk_prob`; Mixtral always).
    #[config(default = true)]
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert width (`shared_expert_intermediate_size`), if any.
    #[config(default = "None")]
    pub shared_expert: Option<usize>,
    /// Every `sparse_step`-th layer is a MoE layer (`decoder_sparse_step`: layer `i` when
    /// `(i + 1) % sparse_step == 0`).
    #[config(default = 1)]
    pub sparse_step: usize,
    /// Layers kept dense (`mlp_only_layers`).
    #[config(default = "Vec::new()")]
    pub mlp_only_layers: Vec<usize>,
    /// Weight of the load-balancing loss in the training loss (`router_aux_loss_coef` when
    /// `output_router_logits`; 0: off).
    #[config(default = 0.0)]
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss (0: off).
    #[config(default = 0.0)]
    pub z_loss_coef: f64,
    /// Each expert takes at most `capacity_factor * tokens * top_k / n_experts` (rounded up)
    /// of a rank's assignments, the first in token order (Megatron's
    /// `--moe-expert-capacity-factor` with the position drop policy); the others are dropped
    /// (the token keeps its residual) and counted ([`super::RouterStats::dropped`]). `None`:
    /// dropless.
    #[config(default = "None")]
    pub capacity_factor: Option<f64>,
}

impl ExpertsConfig {
    /// Whether layer `layer` is a MoE layer (else dense).
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_step > 0
            && (layer + 1).is_multiple_of(self.sparse_step)
            && !self.mlp_only_layers.contains(&layer)
    }

    /// The MoE layer of a model of width `d_model`.
    pub fn layer(&self, d_model: usize, settings: TpSettings) -> MoeConfig {
        MoeConfig::new(d_model, self.n_experts, self.top_k, self.d_ff)
            .with_norm_topk_prob(self.norm_topk_prob)
            .with_shared_expert(self.shared_expert)
            .with_capacity_factor(self.capacity_factor)
            .with_settings(settings)
    }
}

/// Configuration of a [`MoeLayer`].
#[derive(Config, Debug)]
pub struct MoeConfig {
    /// Model width.
    pub d_model: usize,
    /// Experts over all ep ranks (`num_local_experts`, `num_experts`).
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's hidden width over all tp ranks (`moe_intermediate_size`).
    pub d_ff: usize,
    /// Renormalize the chosen experts' weights to sum to 1 (Mixtral always; Qwen's
    /// `norm_topk_prob`).
    #[config(default = true)]
    pub norm_topk_prob: bool,
    /// Width of Qwen2-MoE's shared expert (with its sigmoid gate), if any.
    #[config(default = "None")]
    pub shared_expert: Option<usize>,
    /// The experts' capacity ([`ExpertsConfig::capacity_factor`]); `None`: dropless.
    #[config(default = "None")]
    pub capacity_factor: Option<f64>,
    /// The experts' activation (SwiGLU's SiLU).
    #[config(default = "GluActivation::Silu")]
    pub activation: GluActivation,
    /// How the parallel layers run (mode: the tokens replicated or sharded over tp).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
    /// Initializer of the router and of each expert's full weights (Burn's `LinearConfig`
    /// default).
    #[config(default = "Initializer::KaimingUniform{gain: INIT_GAIN, fan_out_only:false}")]
    pub initializer: Initializer,
}

impl MoeConfig {
    /// Checks the config against `tp` and `ep` ranks.
    ///
    /// # Errors
    /// [`TpError::Config`] naming the values: experts not divisible by ep, `top_k` of zero or
    /// above the experts, an expert width or shared width not divisible by tp, a capacity
    /// factor that is not a positive number.
    pub fn validate(&self, tp: usize, ep: usize) -> TpResult<()> {
        let fail = |m: String| Err(TpError::Config(format!("MoE: {m}")));
        if self.n_experts == 0 || !self.n_experts.is_multiple_of(ep) {
            return fail(format!(
                "{} experts cannot be split evenly over ep = {ep} ranks",
                self.n_experts
            ));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return fail(format!(
                "top_k = {} must be between 1 and the {} experts",
                self.top_k, self.n_experts
            ));
        }
        if !self.d_ff.is_multiple_of(tp) {
            return fail(format!(
                "the experts' width {} is not divisible by tp = {tp}",
                self.d_ff
            ));
        }
        if let Some(c) = self.capacity_factor
            && !(c.is_finite() && c > 0.0)
        {
            return fail(format!(
                "capacity_factor = {c} must be a positive number (None: dropless)"
            ));
        }
        if let Some(w) = self.shared_expert
            && !w.is_multiple_of(tp)
        {
            return fail(format!(
                "the shared expert's width {w} is not divisible by tp = {tp}"
            ));
        }
        Ok(())
    }

    /// Initializes this rank's router, its `n_experts / ep` experts (each split over tp) and
    /// the shared expert. Every weight is drawn by one rank (rank 0 of tp and of ep), which
    /// draws first, then broadcast, so the same seed gives the same layer at every tp x ep.
    /// Collective over `tp` and `ep`.
    ///
    /// # Errors
    /// [`validate`](Self::validate)'s; a communication error.
    pub fn init(
        &self,
        tp: &ProcessGroup,
        ep: &ProcessGroup,
        device: &Device,
    ) -> TpResult<MoeLayer> {
        self.validate(tp.world_size(), ep.world_size())?;
        let (d, e, f) = (self.d_model, self.n_experts, self.d_ff);
        let first = ep.rank() == 0;
        // Drawn on every ep rank (each tp rank 0 from its own initialization stream, so every
        // ep rank's stream stays in step for the layers after this one), then ep rank 0's
        // broadcast over ep (the same values where the streams agree; the guarantee where a
        // process's were seeded otherwise).
        let draw = |shape: Vec<usize>, fan_in: usize, fan_out: usize| -> TpResult<Tensor<3>> {
            let shape: [usize; 3] = shape.try_into().expect("three dims");
            let t = init_replicated(
                &self.initializer,
                shape,
                Some(fan_in),
                Some(fan_out),
                tp,
                device,
            )?;
            broadcast_over(t, ep)
        };
        let router = draw(vec![1, d, e], d, e)?.reshape([d, e]);
        let gate_up = draw(vec![e, d, 2 * f], d, 2 * f)?;
        let down = draw(vec![e, f, d], f, d)?;
        let shared = |tp: &ProcessGroup| -> TpResult<_> {
            let Some(width) = self.shared_expert else {
                return Ok(None);
            };
            let mlp = ParallelSwiGluConfig::new(d, width)
                .with_activation(self.activation)
                .with_settings(self.settings)
                .init(tp, device)?;
            let gate = init_replicated(&self.initializer, [d, 1], Some(d), Some(1), tp, device)?;
            Ok(Some((mlp, gate)))
        };
        let shared = if first {
            let s = shared(tp)?;
            ep.barrier()?;
            s
        } else {
            ep.barrier()?;
            shared(tp)?
        };
        let shared = shared
            .map(|(mlp, gate)| -> TpResult<_> {
                Ok((broadcast_module(mlp, ep)?, broadcast_over(gate, ep)?))
            })
            .transpose()?;
        let full = MoeWeights {
            router,
            gate_up,
            down,
        };
        self.init_with(full, shared, tp, ep)
    }

    /// A layer from the full weights (each rank keeps its experts, each split over tp) and, if the config has one, the shared expert with its full gate `[d_model, 1]`.
    ///
    /// # Errors
    /// [`validate`](Self::validate)'s; [`TpError::Config`] for weights of other shapes.
    pub fn init_with(
        &self,
        full: MoeWeights,
        shared: Option<(ParallelSwiGlu, Tensor<2>)>,
        tp: &ProcessGroup,
        ep: &ProcessGroup,
    ) -> TpResult<MoeLayer> {
        let (n_tp, n_ep) = (tp.world_size(), ep.world_size());
        self.validate(n_tp, n_ep)?;
        let (d, e, f) = (self.d_model, self.n_experts, self.d_ff);
        let want = ([d, e], [e, d, 2 * f], [e, f, d]);
        let got = (full.router.dims(), full.gate_up.dims(), full.down.dims());
        if got != want || shared.is_some() != self.shared_expert.is_some() {
            return Err(TpError::Config(format!(
                "MoE: weights of shapes {got:?} (shared expert: {}) for a config that needs \
                 {want:?} (shared expert: {})",
                shared.is_some(),
                self.shared_expert.is_some()
            )));
        }
        // This rank's experts, each split over tp as the dense gated MLP is.
        let per = e / n_ep;
        let expert = ParallelSwiGluConfig::new(d, f)
            .with_activation(self.activation)
            .with_settings(self.settings);
        let experts = (ep.rank() * per..(ep.rank() + 1) * per)
            .map(|x| {
                let gate_up = full.gate_up.clone().narrow(0, x, 1).reshape([d, 2 * f]);
                let down = full.down.clone().narrow(0, x, 1).reshape([f, d]);
                expert.init_from(gate_up, down, tp)
            })
            .collect::<TpResult<Vec<_>>>()?;
        let (shared, shared_gate) = match shared {
            Some((mlp, gate)) => (Some(mlp), Some(Param::from_tensor(owned(gate)))),
            None => (None, None),
        };
        Ok(MoeLayer {
            router: Param::from_tensor(owned(full.router)),
            experts,
            shared,
            shared_gate,
            tp: tp.clone(),
            ep: ep.clone(),
            options: MoeOptions {
                n_experts: e,
                top_k: self.top_k,
                norm_topk_prob: self.norm_topk_prob,
                capacity_factor: self.capacity_factor,
                activation: self.activation,
                mode: self.settings.mode,
            },
        })
    }
}

/// The full weights of a MoE layer, in Burn's `[in, out]` layout.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[d_model, n_experts]`.
    pub router: Tensor<2>,
    /// Each expert's gate and up, `[n_experts, d_model, 2 d_ff]` (`[gate | up]`).
    pub gate_up: Tensor<3>,
    /// Each expert's down, `[n_experts, d_ff, d_model]`.
    pub down: Tensor<3>,
}

/// `t` from rank 0 of `group` (itself on a group of one).
fn broadcast_over<const D: usize>(t: Tensor<D>, group: &ProcessGroup) -> TpResult<Tensor<D>> {
    if group.world_size() == 1 {
        Ok(t)
    } else {
        crate::ops::broadcast(t, 0, group)
    }
}
