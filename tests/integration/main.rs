//! Cross-crate tests of burn-tp, one binary (burn links once).

mod checkpoint;
mod collectives;
mod common;
mod dp;
mod dtype;
mod gpt;
mod gpu_check_script;
mod hf;
mod linear;
mod linear_checks;
mod llama;
mod mpi;
mod reference;
