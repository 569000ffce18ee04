//! Cross-crate tests of burn-tp, one binary (burn links once).

mod attention;
mod checkpoint;
mod collectives;
mod common;
mod context;
mod dp;
mod dtype;
mod embedding;
mod failures;
mod fsdp;
mod fused_ops;
mod gemma;
mod gpt;
mod gpu_check_script;
mod hf;
mod learner;
mod linear;
mod llama;
mod lora;
mod loss;
mod moe;
mod mpi;
mod pipeline;
mod recompute;
mod reference;
mod train_gpt;
