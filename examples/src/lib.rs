#![warn(missing_docs)]
//! The example programs of burn-tp, as a library so the tests can run them end to end.
//!
//! - [`train_gpt`]: a tiny character-level GPT (or Llama, `--arch llama`) trained with tensor
//!   (and data) parallelism, either architecture through `burn_tp::model::LanguageModel`.
//! - [`generate`]: text from a Hugging Face Llama-family model at any tp, with the KV cache.
//! - `learner` (feature `train`): a burn-tp language model as a Burn Learner model
//!   (`learner_llama`), and `learner_llama` itself.
//! - [`checks`]: what the GPU check (`gpu_check`) compares and records with.

pub mod checks;
pub mod corpus;
mod eval;
pub mod generate;
#[cfg(feature = "train")]
pub mod learner;
#[cfg(feature = "train")]
pub mod learner_llama;
pub mod plot;
pub mod train_gpt;

/// The guide's Learner page (`docs/guide/learner.md`), its code compiled as doc tests.
#[cfg(all(doctest, feature = "train"))]
#[doc = include_str!("../../docs/guide/learner.md")]
pub struct GuideLearner;
