//! The router: softmax over the experts' logits, the top `k`, their weights, and the statistics
//! of transformers' load-balancing loss.

use burn::tensor::{DType, Int, Tensor, TensorData};

type Result<T> = std::result::Result<T, crate::TpError>;

/// What one MoE layer's router saw, for the auxiliary losses and the load-balance profile.
/// Sums over this rank's tokens (all of the tp group's tokens, in sequence-parallel mode too).
#[derive(Clone, Debug)]
pub struct RouterStats {
    /// Assignments to each expert (`[experts]`, no gradient): `top_k` per token.
    pub counts: Vec<usize>,
    /// Each expert's routing probability summed over the tokens (`[experts]`, f32 for a
    /// half-precision model).
    pub prob_sum: Tensor<1>,
    /// `logsumexp(logits)^2` summed over the tokens (`[1]`): the router z-loss's sum.
    pub z_sum: Tensor<1>,
    /// Tokens routed.
    pub tokens: usize,
    /// Assignments the experts' capacity dropped (0 dropless), of the same tokens as
    /// `counts`.
    pub dropped: usize,
}

impl RouterStats {
    /// The statistics of an untracked forward (a module's `valid()` view) as constants of the
    /// tracked one.
    pub fn from_inner(self) -> Self {
        Self {
            prob_sum: Tensor::from_inner(self.prob_sum),
            z_sum: Tensor::from_inner(self.z_sum),
            ..self
        }
    }
}

/// transformers' `load_balancing_loss_func` over the layers' statistics:
/// `experts * sum_e (assignments_e / N) (prob_sum_e / N)`, `N` the tokens over all layers, each
/// layer's counts and probabilities summed first (as transformers accumulates them). `None`
/// without layers or tokens.
pub fn aux_loss(stats: &[RouterStats]) -> Option<Tensor<1>> {
    let first = stats.first()?;
    let experts = first.counts.len();
    let n: usize = stats.iter().map(|s| s.tokens).sum();
    if n == 0 {
        return None;
    }
    let device = first.prob_sum.device();
    let mut counts = vec![0f32; experts];
    for s in stats {
        counts
            .iter_mut()
            .zip(&s.counts)
            .for_each(|(c, &x)| *c += x as f32);
    }
    let probs = stats
        .iter()
        .map(|s| s.prob_sum.clone())
        .reduce(|a, b| a + b)?;
    let dtype = first.prob_sum.dtype();
    let counts = Tensor::<1>::from_data(
        TensorData::new(counts, [experts]).convert_dtype(dtype),
        (&device, dtype),
    );
    let n = n as f64;
    Some(
        (counts.div_scalar(n) * probs.div_scalar(n))
            .sum()
            .mul_scalar(experts as f64),
    )
}

/// One layer's routing of `tokens` rows: each token's `top_k` experts (host, `[tokens * top_k]`)
/// and their weights (`[tokens, top_k]`, differentiable).
pub(crate) struct Routing {
    pub experts: Vec<usize>,
    pub weights: Tensor<2>,
    pub stats: RouterStats,
}

/// Softmax (in f32 for half-precision logits) of `logits` (`[tokens, experts]`), the `top_k` largest probabilities
/// (ties to the lower expert), renormalized to sum to one if `norm`.
pub(crate) fn route(logits: Tensor<2>, top_k: usize, norm: bool) -> Result<Routing> {
    let [tokens, n_experts] = logits.dims();
    // Half-precision logits are routed in f32, as transformers does; f32 and f64 as they are.
    let logits = match logits.dtype() {
        DType::F16 | DType::BF16 => logits.cast(DType::F32),
        _ => logits,
    };
    let probs = burn::tensor::activation::softmax(logits.clone(), 1);
    let host: Vec<f32> = probs
        .clone()
        .detach()
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| crate::TpError::Config(format!("MoE router: reading probabilities: {e:?}")))?;
    let mut experts = Vec::with_capacity(tokens * top_k);
    let mut counts = vec![0usize; n_experts];
    let mut order: Vec<usize> = (0..n_experts).collect();
    for row in host.chunks_exact(n_experts.max(1)) {
        // Largest first; the sort is stable, so equal probabilities keep the lower expert first.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for &e in &order[..top_k] {
            experts.push(e);
            counts[e] += 1;
        }
        order.sort_unstable();
    }
    let device = probs.device();
    let idx: Vec<i64> = experts.iter().map(|&e| e as i64).collect();
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [tokens, top_k]), &device);
    let mut weights = probs.clone().gather(1, idx);
    if norm {
        let sum = weights.clone().sum_dim(1);
        weights = weights / sum;
    }
    let lse = logsumexp_rows(logits);
    let stats = RouterStats {
        counts,
        prob_sum: probs.sum_dim(0).reshape([n_experts]),
        z_sum: lse.powi_scalar(2).sum(),
        tokens,
        dropped: 0,
    };
    Ok(Routing {
        experts,
        weights,
        stats,
    })
}

/// `log(sum(exp(x)))` of each row (`[rows, n] -> [rows]`), shifted by the row maximum.
fn logsumexp_rows(x: Tensor<2>) -> Tensor<1> {
    let rows = x.dims()[0];
    let max = x.clone().max_dim(1).detach();
    let lse = (x - max.clone()).exp().sum_dim(1).log() + max;
    lse.reshape([rows])
}
