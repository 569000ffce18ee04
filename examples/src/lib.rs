#![warn(missing_docs)]
//! The example programs of burn-tp, as a library so the tests can run them end to end.
//!
//! - [`train_gpt`]: a tiny character-level GPT trained with tensor (and data) parallelism.

pub mod corpus;
mod eval;
pub mod plot;
pub mod train_gpt;
