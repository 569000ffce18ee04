//! Checking gradients by finite differences, collectively over a group (ranks as threads run by
//! [`crate::local`]).
//!
//! ```no_run
//! use burn::tensor::{Device, DType, Tensor, TensorData};
//! use burn_tp::local::run_local;
//! use burn_tp::testing::{LossKind, gradcheck};
//!
//! // d/dx sum(all_gather(x)^2) on 2 ranks, checked against central differences in f64.
//! run_local(2, |group| {
//!     let device = Device::flex().autodiff();
//!     let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f64, -1.0, 2.0], [1, 3]), (&device, DType::F64));
//!     let report = gradcheck(&group, &[x], LossKind::Sharded, Default::default(), |xs| {
//!         let g = burn_tp::ops::all_gather(xs[0].clone(), 0, &group).unwrap();
//!         (g.clone() * g).sum()
//!     })
//!     .unwrap();
//!     assert!(report.max_abs_error < 1e-6);
//! })
//! .unwrap();
//! ```

use burn::tensor::{DType, Tensor, TensorData};
use burn_tp_comm::{ProcessGroup, ReduceOp};

/// The values of `t` in logical (row-major) order, as `f64`.
pub fn to_f64<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    t.into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .expect("converted to f64")
}

/// How the per-rank losses of a tensor-parallel function make up the one logical loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    /// Every rank holds the same loss (after a `reduce_from_tp_region`, a vocab-parallel
    /// cross-entropy): it counts once.
    Replicated,
    /// Each rank holds its part; the logical loss is their sum (a loss on sequence-sharded outputs).
    Sharded,
}

/// Options of [`gradcheck`].
#[derive(Clone, Copy, Debug)]
pub struct GradcheckOptions {
    /// Central-difference step.
    pub eps: f64,
    /// Allowed absolute error.
    pub atol: f64,
    /// Allowed error relative to the numerical gradient.
    pub rtol: f64,
    /// Every rank holds the same logical inputs (replicated activations or parameters): each
    /// element is perturbed on every rank at once, and every rank's gradient must match.
    pub replicated_inputs: bool,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        Self {
            eps: 1e-6,
            atol: 1e-7,
            rtol: 1e-5,
            replicated_inputs: false,
        }
    }
}

/// What [`gradcheck`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Number of input elements checked on this rank.
    pub checked: usize,
    /// Largest |analytic - numerical| on this rank.
    pub max_abs_error: f64,
}

/// Checks autodiff gradients of a (possibly tensor-parallel) scalar loss against central finite
/// differences. Collective: every rank of `group` calls it with its own inputs, the same `f` and
/// options. Use `f64` inputs on an autodiff device (`Device::flex().autodiff()`).
///
/// The numerical derivative for an element of rank `r`'s input is that of the logical loss
/// (see [`LossKind`]): rank `r` perturbs it, every rank re-evaluates `f`, and the losses are
/// combined over the group. The analytic one is each rank's own autodiff gradient, so the check
/// covers the backward collectives as well as the local ops.
///
/// # Errors
/// A message naming the rank, input, element and both values of the first gradient outside
/// tolerance, or a communication failure.
pub fn gradcheck<const D: usize>(
    group: &ProcessGroup,
    inputs: &[Tensor<D>],
    kind: LossKind,
    options: GradcheckOptions,
    f: impl Fn(&[Tensor<D>]) -> Tensor<1>,
) -> Result<GradcheckReport, String> {
    let dtype = DType::F64;
    let tracked: Vec<Tensor<D>> = inputs
        .iter()
        .map(|x| x.clone().detach().require_grad())
        .collect();
    let grads = f(&tracked).backward();
    let analytic: Vec<Vec<f64>> = tracked
        .iter()
        .map(|x| match x.grad(&grads) {
            Some(g) => to_f64(g),
            None => vec![0.0; x.shape().num_elements()],
        })
        .collect();

    let values: Vec<Vec<f64>> = inputs.iter().map(|x| to_f64(x.clone())).collect();
    // Every rank walks every (rank, input, element) in the same order, so the collectives inside
    // `f` line up across ranks.
    let counts: Vec<i64> = values.iter().map(|v| v.len() as i64).collect();
    let all_counts = group
        .all_gather(counts.clone())
        .map_err(|e| e.to_string())?;
    let n_inputs = counts.len();
    let loss = |xs: &[Tensor<D>]| -> Result<f64, String> {
        let local = to_f64(f(xs))[0];
        match kind {
            LossKind::Sharded => Ok(group
                .all_reduce(vec![local], ReduceOp::Sum)
                .map_err(|e| e.to_string())?[0]),
            LossKind::Replicated => Ok(local),
        }
    };
    let make = |k: usize, vals: &[f64]| {
        let x = &inputs[k];
        Tensor::<D>::from_data(
            TensorData::new(vals.to_vec(), x.shape()),
            (&x.device(), dtype),
        )
    };
    let base: Vec<Tensor<D>> = (0..n_inputs).map(|k| make(k, &values[k])).collect();
    let mut max_abs_error = 0.0f64;
    // Replicated inputs are one logical variable: rank 0's walk covers them, every rank perturbing.
    let owners = if options.replicated_inputs {
        1
    } else {
        group.world_size()
    };
    for r in 0..owners {
        let mine = options.replicated_inputs || r == group.rank();
        for k in 0..n_inputs {
            for i in 0..all_counts[r * n_inputs + k] as usize {
                let eval = |delta: f64| -> Result<f64, String> {
                    if !mine {
                        return loss(&base);
                    }
                    let mut xs = base.clone();
                    let mut v = values[k].clone();
                    v[i] += delta;
                    xs[k] = make(k, &v);
                    loss(&xs)
                };
                let numeric = (eval(options.eps)? - eval(-options.eps)?) / (2.0 * options.eps);
                if mine {
                    let a = analytic[k][i];
                    let err = (a - numeric).abs();
                    max_abs_error = max_abs_error.max(err);
                    if err > options.atol + options.rtol * numeric.abs() {
                        return Err(format!(
                            "gradcheck: rank {}, input {k}, element {i}: autodiff {a:e} vs finite difference {numeric:e}",
                            group.rank()
                        ));
                    }
                }
            }
        }
    }
    Ok(GradcheckReport {
        checked: values.iter().map(Vec::len).sum(),
        max_abs_error,
    })
}
