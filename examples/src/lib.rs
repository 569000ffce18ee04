#![warn(missing_docs)]
//! The example programs of burn-tp, as a library so the tests can run them end to end.
//!
//! - [`train_gpt`]: a tiny character-level GPT (or Llama, `--arch llama`) trained with tensor
//!   (and data) parallelism; [`model`]: the two architectures behind one trait.
//! - [`checks`]: what the GPU check (`gpu_check`) compares and records with.

pub mod checks;
pub mod corpus;
mod eval;
pub mod model;
pub mod plot;
pub mod train_gpt;
