//! [`MoeLayer`]: route, dispatch over ep, the local experts, combine (the diagram is in
//! [`super`]).

use burn::backend::Dispatch;
use burn::module::{Module, Param};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData, activation::sigmoid};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use super::route::{RouterStats, route};
type Result<T> = std::result::Result<T, crate::TpError>;
use crate::backend::{GluActivation, TpBackend};
use crate::linear::TpMode;
use crate::norm::replicated_param;
use crate::ops::{
    all_gather, all_to_all, copy_to_tp_region, reduce_from_tp_region, reduce_scatter,
};
use crate::transformer::ParallelSwiGlu;

/// What a [`MoeLayer`] keeps of its config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct MoeOptions {
    pub n_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub capacity_factor: Option<f64>,
    pub activation: GluActivation,
    pub mode: TpMode,
}

/// A mixture-of-experts MLP ([`super`]): a replicated router, this rank's `n_experts / ep`
/// experts (each split over tp), and an optional shared expert with its sigmoid gate.
#[derive(Module, Debug)]
pub struct MoeLayer {
    /// The router, `[d_model, n_experts]`, replicated.
    pub router: Param<Tensor<2>>,
    /// This rank's experts (`n_experts / ep`, from expert `ep_rank * n_experts / ep`), each
    /// split over tp: gate / up `[d_model, 2 d_ff / tp]` (`[gate_r | up_r]`), down
    /// `[d_ff / tp, d_model]`. Only their weights are used: the tp reduction is the layer's,
    /// once for all the experts.
    pub experts: Vec<ParallelSwiGlu>,
    /// Qwen2-MoE's shared expert (tensor parallel as the dense MLP).
    pub shared: Option<ParallelSwiGlu>,
    /// The shared expert's gate, `[d_model, 1]`, replicated.
    pub shared_gate: Option<Param<Tensor<2>>>,
    #[module(skip)]
    pub(crate) tp: ProcessGroup,
    #[module(skip)]
    pub(crate) ep: ProcessGroup,
    #[module(skip)]
    pub(crate) options: MoeOptions,
}

fn indices(v: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let v: Vec<i64> = v.iter().map(|&i| i as i64).collect();
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

impl MoeLayer {
    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` (tokens sharded over tp in
    /// sequence-parallel mode, as the dense MLP takes them), and the router's statistics.
    ///
    /// # Panics
    /// On the errors of [`try_forward`](Self::try_forward), with their message.
    pub fn forward(&self, x: Tensor<3>) -> (Tensor<3>, RouterStats) {
        self.try_forward(x).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), returning the error instead of panicking.
    ///
    /// # Errors
    /// A communication error (on every rank).
    pub fn try_forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, RouterStats)> {
        let [a, b, d] = x.dims();
        let (mode, tp) = (self.options.mode, &self.tp);
        let n_tp = tp.world_size();
        let rows = x.clone().reshape([a * b, d]);
        let logits = rows
            .clone()
            .matmul(replicated_param(&self.router, mode, tp));
        let routing = route(logits, self.options.top_k, self.options.norm_topk_prob)?;
        let dtype = x.dtype();
        // The tokens every tp rank runs the experts on (each its columns of every expert), and
        // how their gradients come back: Megatron's `f` for replicated tokens; sequence
        // parallel, the gather whose backward reduce-scatters.
        let sequence_parallel = mode == TpMode::ReduceScatter && n_tp > 1;
        let (tokens, weights, experts, stats) = if sequence_parallel {
            let tokens = all_gather(x.clone(), 0, tp)?.reshape([n_tp * a * b, d]);
            let weights = all_gather(routing.weights, 0, tp)?;
            let mine: Vec<i64> = routing.experts.iter().map(|&e| e as i64).collect();
            let experts = tp
                .all_gather(mine)?
                .into_iter()
                .map(|e| e as usize)
                .collect();
            let s = routing.stats;
            let counts: Vec<i64> = s.counts.iter().map(|&c| c as i64).collect();
            let stats = RouterStats {
                counts: tp
                    .all_reduce(counts, ReduceOp::Sum)?
                    .into_iter()
                    .map(|c| c as usize)
                    .collect(),
                prob_sum: reduce_from_tp_region(s.prob_sum, tp)?,
                z_sum: reduce_from_tp_region(s.z_sum, tp)?,
                tokens: s.tokens * n_tp,
                dropped: 0,
            };
            (tokens, weights, experts, stats)
        } else {
            let tokens = copy_to_tp_region(rows.clone(), tp);
            let weights = copy_to_tp_region(routing.weights, tp);
            (tokens, weights, routing.experts, routing.stats)
        };
        let (y, dropped) = self.experts(tokens, weights.cast(dtype), &experts)?;
        // Of the tp group's tokens, as the counts (every tp rank routed them all).
        let stats = RouterStats { dropped, ..stats };
        let mut y = if sequence_parallel {
            reduce_scatter(y.reshape([n_tp * a, b, d]), 0, tp)?
        } else {
            reduce_from_tp_region(y, tp)?.reshape([a, b, d])
        };
        if let (Some(shared), Some(gate)) = (&self.shared, &self.shared_gate) {
            let g = sigmoid(rows.matmul(replicated_param(gate, mode, tp))).reshape([a, b, 1]);
            y = y + shared.try_forward(x)? * g;
        }
        super::record::log(&stats);
        Ok((y, stats))
    }

    /// The layer with its experts split over `ep`: this rank keeps experts
    /// `ep_rank * n_experts / ep ..` of the whole set it holds (a layer built or loaded at
    /// ep = 1, identical on the ep ranks), the rest is dropped. No communication.
    ///
    /// # Errors
    /// [`TpError::Config`](crate::TpError::Config) if the layer is already split or `ep` does
    /// not divide the experts.
    pub fn keep_experts(self, ep: &ProcessGroup) -> Result<Self> {
        let (e, n_ep) = (self.options.n_experts, ep.world_size());
        if self.experts.len() != e || !e.is_multiple_of(n_ep) {
            return Err(crate::TpError::Config(format!(
                "MoE: keep_experts over ep = {n_ep} of a layer holding {} of its {e} experts \
                 (it needs all of them, and ep must divide them)",
                self.experts.len()
            )));
        }
        let per = e / n_ep;
        let experts = self
            .experts
            .into_iter()
            .skip(ep.rank() * per)
            .take(per)
            .collect();
        Ok(Self {
            experts,
            ep: ep.clone(),
            ..self
        })
    }

    /// The layer with every expert on every ep rank again (the inverse of
    /// [`keep_experts`](Self::keep_experts)): each rank's experts all-gathered over ep, as
    /// new parameters (to save or export the whole layer). Collective over ep.
    ///
    /// # Errors
    /// A communication error.
    pub fn gather_experts(self) -> Result<Self> {
        let n_ep = self.ep.world_size();
        if n_ep == 1 {
            return Ok(self);
        }
        let per = self.experts.len();
        // Local expert j of every ep rank q, whole-layer expert q per + j.
        let gather = |w: Tensor<2>| -> Result<Vec<Tensor<2>>> {
            let dims = w.dims();
            let all = all_gather(w.unsqueeze_dim::<3>(0), 0, &self.ep)?;
            Ok((0..n_ep)
                .map(|q| crate::init::owned(all.clone().narrow(0, q, 1).reshape(dims)))
                .collect())
        };
        let mut slots: Vec<Option<ParallelSwiGlu>> = (0..per * n_ep).map(|_| None).collect();
        for (j, expert) in self.experts.iter().enumerate() {
            let gate_up = gather(expert.gate_up.weight.val())?;
            let down = gather(expert.down.weight.val())?;
            for (q, (gu, dn)) in gate_up.into_iter().zip(down).enumerate() {
                let mut e = expert.clone();
                e.gate_up.weight = Param::from_tensor(gu);
                e.down.weight = Param::from_tensor(dn);
                slots[q * per + j] = Some(e);
            }
        }
        Ok(Self {
            experts: slots.into_iter().map(|e| e.expect("every slot")).collect(),
            ep: crate::reshard::solo(),
            ..self
        })
    }

    /// The routed part of the layer on `x` (`[tokens, d]`), each token's `top_k` experts in
    /// `experts` (`[tokens * top_k]`) weighted by `weights` (`[tokens, top_k]`):
    /// `[tokens, d]`, partial over tp (each rank ran its columns of every expert), and the
    /// assignments the capacity dropped.
    fn experts(
        &self,
        x: Tensor<2>,
        weights: Tensor<2>,
        experts: &[usize],
    ) -> Result<(Tensor<2>, usize)> {
        let [t, d] = x.dims();
        let (k, e) = (self.options.top_k, self.options.n_experts);
        let device = x.device();
        // The assignments sorted by expert (stably: within an expert, in token order), each
        // expert's first `capacity` kept.
        let capacity = self
            .options
            .capacity_factor
            .map(|c| (c * (t * k) as f64 / e as f64).ceil() as usize);
        let mut order: Vec<usize> = (0..t * k).collect();
        order.sort_by_key(|&a| experts[a]);
        let mut counts = vec![0usize; e];
        order.retain(|&a| {
            let x = experts[a];
            let keep = capacity.is_none_or(|c| counts[x] < c);
            counts[x] += usize::from(keep);
            keep
        });
        let dropped = t * k - order.len();
        let token_of: Vec<usize> = order.iter().map(|a| a / k).collect();
        let sorted = x.clone().select(0, indices(&token_of, &device));
        let w = weights.reshape([t * k]).select(0, indices(&order, &device));
        let y = self.dispatch_and_run(sorted, &counts)?;
        let y = y * w.unsqueeze_dim(1);
        let zeros = Tensor::<2>::zeros([t, d], (&device, x.dtype()));
        let y = zeros.select_assign(0, indices(&token_of, &device), y, IndexingUpdateOp::Add);
        Ok((y, dropped))
    }

    /// Rows sorted by expert (`counts[e]` rows of expert `e`) through their experts, wherever
    /// they are: sent over ep, regrouped by local expert, run, and sent back in the same order.
    fn dispatch_and_run(&self, sorted: Tensor<2>, counts: &[usize]) -> Result<Tensor<2>> {
        let ep = &self.ep;
        let (n_ep, q, e) = (ep.world_size(), ep.rank(), self.options.n_experts);
        let per = e / n_ep;
        if n_ep == 1 {
            return Ok(self.run_local(sorted, counts));
        }
        let device = sorted.device();
        let mine: Vec<i64> = counts.iter().map(|&c| c as i64).collect();
        let all = ep.all_gather(mine)?;
        // Rows rank p sends for expert x.
        let c = |p: usize, x: usize| all[p * e + x] as usize;
        let send: Vec<usize> = (0..n_ep)
            .map(|p| counts[p * per..(p + 1) * per].iter().sum())
            .collect();
        let recv: Vec<usize> = (0..n_ep)
            .map(|p| (q * per..(q + 1) * per).map(|x| c(p, x)).sum())
            .collect();
        let received = all_to_all(sorted, &send, &recv, ep)?;
        // Received by source, each source's rows by expert; regroup by expert, then source.
        let mut start = 0;
        let mut at = vec![vec![0usize; per]; n_ep];
        for (p, row) in at.iter_mut().enumerate() {
            for (i, slot) in row.iter_mut().enumerate() {
                *slot = start;
                start += c(p, q * per + i);
            }
        }
        let mut perm = Vec::with_capacity(start);
        let mut local = vec![0usize; per];
        for (i, n) in local.iter_mut().enumerate() {
            for (p, row) in at.iter().enumerate() {
                let rows = c(p, q * per + i);
                perm.extend(row[i]..row[i] + rows);
                *n += rows;
            }
        }
        let mut inverse = vec![0usize; perm.len()];
        perm.iter().enumerate().for_each(|(j, &r)| inverse[r] = j);
        let grouped = received.select(0, indices(&perm, &device));
        let y = self.run_local(grouped, &local);
        let y = y.select(0, indices(&inverse, &device));
        all_to_all(y, &recv, &send, ep)
    }

    /// This rank's experts on rows grouped by local expert (`counts[i]` rows of expert `i`):
    /// one GEMM per expert over its contiguous rows, `[rows, d] -> [rows, d]`, partial over tp.
    fn run_local(&self, x: Tensor<2>, counts: &[usize]) -> Tensor<2> {
        let mut outs = Vec::with_capacity(counts.len());
        let mut idle = Vec::new();
        let mut at = 0;
        for (expert, &n) in self.experts.iter().zip(counts) {
            if n == 0 {
                idle.push(expert);
                continue;
            }
            let xi = x.clone().narrow(0, at, n);
            at += n;
            let h = crate::ops::matmul(xi, expert.gate_up.weight.val());
            let h = Tensor::<2>::from_dispatch(<Dispatch as TpBackend>::tp_glu(
                h.into_dispatch(),
                self.options.activation,
            ));
            outs.push(crate::ops::matmul(h, expert.down.weight.val()));
        }
        // No row here at all: `x` is the empty `[0, d]` output.
        let y = match outs.is_empty() {
            true => x,
            false => Tensor::cat(outs, 0),
        };
        // An expert no token reached still gets a (zero) gradient, so every rank's gradients
        // name the same parameters (the data-parallel reductions go parameter by parameter).
        match idle
            .iter()
            .map(|e| e.gate_up.weight.val().sum() + e.down.weight.val().sum())
            .reduce(|a, b| a + b)
        {
            Some(s) => y + s.mul_scalar(0.0).reshape([1, 1]),
            None => y,
        }
    }
}

crate::reshard::reshard_fields!(
    MoeLayer { router, experts, shared, shared_gate },
    group: tp,
    keep: { ep, options }
);

impl crate::linear::InMode for MoeLayer {
    fn in_mode(self, mode: TpMode) -> Self {
        Self {
            experts: self.experts.into_iter().map(|e| e.in_mode(mode)).collect(),
            shared: self.shared.map(|s| s.in_mode(mode)),
            options: MoeOptions {
                mode,
                ..self.options
            },
            ..self
        }
    }
}
