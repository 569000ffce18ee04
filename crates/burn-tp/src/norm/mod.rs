//! The norms of both models, with replicated weights that stay bitwise identical on every rank,
//! and the replicated-parameter machinery they share (layers floor: below the attention, which
//! uses [`TpRmsNorm`] for Qwen3's per-head q / k norms, and below the models).
//!
//! | file            | what                                                                   |
//! |-----------------|------------------------------------------------------------------------|
//! | `replicated.rs` | [`replicated_param`], [`ReplicatedGrads`]: a replicated weight's gradient summed over tp |
//! | `layer_norm.rs` | [`TpLayerNorm`] (the GPT)                                               |
//! | `rms_norm.rs`   | [`TpRmsNorm`] (the Llama family, Qwen3's per-head q / k norms)          |

mod layer_norm;
mod replicated;
mod rms_norm;

use burn::backend::Dispatch;
use burn::tensor::Tensor;

pub use layer_norm::TpLayerNorm;
pub use replicated::{ReplicatedGrads, replicated_param};
pub use rms_norm::TpRmsNorm;

use crate::backend::{NormSpec, TpBackend};

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
