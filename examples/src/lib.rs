#![warn(missing_docs)]
//! The example programs of burn-tp, as a library so the tests can run them end to end.
//!
//! - [`train_gpt`]: a tiny character-level GPT (or Llama, `--arch llama`) trained with tensor
//!   (and data) parallelism; [`model`]: the two architectures behind one trait.

pub mod corpus;
mod eval;
pub mod model;
pub mod plot;
pub mod train_gpt;
