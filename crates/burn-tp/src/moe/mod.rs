//! Mixture of experts with expert parallelism (Mixtral, Qwen2-MoE, Qwen3-MoE).
//!
//! A router (`[d_model, experts]`, replicated) sends each token to its `top_k` experts, gated
//! MLPs of their own width; the token's output is the routing-weighted sum of theirs (plus, for
//! Qwen2-MoE, a shared expert behind a sigmoid gate). Expert parallelism splits the experts over
//! an `ep` group (carved out of the data-parallel ranks, [`crate::mesh`]): rank `q` of ep holds
//! experts `q E / ep .. (q + 1) E / ep`, and every expert's MLP is split over tp as the dense
//! MLP is (column-parallel gate / up, row-parallel down).
//!
//! ```text
//!  tokens [T, d] --router--> top-k (expert, weight) per token          (replicated router)
//!     | sort the T k assignments by expert; rows for ep rank q are contiguous
//!     v
//!  dispatch: all-to-all over ep, send_rows[q] = assignments to q's experts
//!     |   received: [from rank 0: e0 rows, e1 rows | from rank 1: e0 rows, e1 rows | ...]
//!     v   regrouped by local expert: [e0: from 0, from 1, .. | e1: from 0, from 1, ..]
//!  experts: per local expert, its rows through gate_up -> act(gate) * up -> down
//!     |   (one GEMM per expert over its contiguous rows; [d, 2 f / tp] and [f / tp, d])
//!     v
//!  combine: back to source order, reverse all-to-all, times the routing weight, summed
//!           into each token (index add); then the tp reduction (all-reduce, or
//!           reduce-scatter in sequence-parallel mode) as the dense MLP's row layer does
//! ```
//!
//! Dropless: every token reaches its `top_k` experts, whatever the load. The router's
//! statistics ([`RouterStats`]) give transformers' load-balancing loss ([`aux_loss`]) and the
//! router z-loss, and the per-expert token counts.
//!
//! | file | what |
//! |---|---|
//! | `config.rs` | [`MoeConfig`], the checks, the draws of the experts' weights |
//! | `route.rs` | the router: softmax, top-k, weights, [`RouterStats`], [`aux_loss`] |
//! | `record.rs` | the routers' statistics of a forward ([`record`]) and [`router_loss`] |
//! | `layer.rs` | [`MoeLayer`]: dispatch, the experts, combine |

mod config;
mod layer;
mod record;
mod route;

pub use config::{ExpertsConfig, MoeConfig, MoeWeights};
pub use layer::MoeLayer;
pub use record::{record, router_loss};
pub use route::{RouterStats, aux_loss};
