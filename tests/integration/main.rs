//! Cross-crate tests of burn-tp, one binary (burn links once).

mod collectives;
mod common;
mod gpt;
mod linear;
mod linear_checks;
