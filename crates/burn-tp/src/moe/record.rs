//! The routers' statistics of a forward, collected on the rank's thread for the losses that
//! span the layers (transformers' load-balancing loss sums every layer's counts and
//! probabilities before it multiplies them).

use std::cell::RefCell;

use burn::tensor::Tensor;

use super::route::{RouterStats, aux_loss};

thread_local! {
    /// The statistics of the innermost active [`record`] on this (rank's) thread.
    static LOG: RefCell<Option<Vec<RouterStats>>> = const { RefCell::new(None) };
}

/// Runs `f` and returns, beside its result, the [`RouterStats`] of every MoE layer it ran on
/// this thread, in order. A scope inside another takes its own, which the outer one then sees
/// too (a training loop's record of the model's loss, which records its own).
pub fn record<R>(f: impl FnOnce() -> R) -> (R, Vec<RouterStats>) {
    let outer = LOG.with(|l| l.borrow_mut().replace(Vec::new()));
    let out = f();
    let stats = LOG
        .with(|l| std::mem::replace(&mut *l.borrow_mut(), outer))
        .unwrap_or_default();
    LOG.with(|l| {
        if let Some(outer) = l.borrow_mut().as_mut() {
            outer.extend(stats.iter().cloned());
        }
    });
    (out, stats)
}

/// Keeps `stats` for the active [`record`], if any.
pub(crate) fn log(stats: &RouterStats) {
    LOG.with(|l| {
        if let Some(log) = l.borrow_mut().as_mut() {
            log.push(stats.clone());
        }
    });
}

/// `aux_coef` times transformers' load-balancing loss ([`aux_loss`]) plus `z_coef` times the
/// router z-loss (the mean over tokens and layers of `logsumexp(logits)^2`); `None` if both
/// coefficients are zero or nothing was routed.
pub fn router_loss(stats: &[RouterStats], aux_coef: f64, z_coef: f64) -> Option<Tensor<1>> {
    let aux = (aux_coef != 0.0)
        .then(|| aux_loss(stats))
        .flatten()
        .map(|a| a.mul_scalar(aux_coef));
    let tokens: usize = stats.iter().map(|s| s.tokens).sum();
    let z = (z_coef != 0.0 && tokens > 0)
        .then(|| {
            stats
                .iter()
                .map(|s| s.z_sum.clone())
                .reduce(|a, b| a + b)
                .map(|z| z.mul_scalar(z_coef / tokens as f64))
        })
        .flatten();
    match (aux, z) {
        (Some(a), Some(z)) => Some(a + z),
        (a, z) => a.or(z),
    }
}
