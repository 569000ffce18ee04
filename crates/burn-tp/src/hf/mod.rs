//! Hugging Face checkpoints of the Llama family (`LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Phi3ForCausalLM`) and the Gemma family
//! (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`): a `config.json` and `model.safetensors` (or
//! shards with `model.safetensors.index.json`) loaded into a [`Llama`](crate::llama::Llama)
//! ([`init_llama`]) or a [`Gemma`](crate::gemma::Gemma) ([`init_gemma`]) at any tp, each rank
//! reading only its own slices. Gemma's blocks add `pre_feedforward_layernorm` and
//! `post_feedforward_layernorm` to the Llama's tensors; its norms' weights are read as stored
//! (`w` of its `1 + w`).
//!
//! What the import maps:
//! - HF's `[out, in]` weights into Burn's `[in, out]`;
//! - the separate `q_proj`, `k_proj`, `v_proj` into the fused QKV projection's contiguous chunks
//!   `[q | k | v]`, and `gate_proj`, `up_proj` into the SwiGLU's `[gate | up]` (Phi-3's fused
//!   `qkv_proj` and `gate_up_proj` hold those chunks' rows in the same order: each rank reads its
//!   rows of each chunk);
//! - HF's rotary convention (rotate-half: feature `i` of a head turns with feature
//!   `i + head_dim / 2`) into Burn's `RotaryEncoding` (which turns features `2i` and `2i + 1`): the
//!   q and k projections' output features are permuted within each head (`2i <- i`,
//!   `2i + 1 <- i + head_dim / 2`), which leaves every attention score, hence the logits,
//!   unchanged;
//! - Qwen2's q, k and v biases (and Llama's `attention_bias`), Qwen3's per-head `q_norm` and
//!   `k_norm` (their features permuted as q's and k's), an explicit `head_dim`, Llama 3's rotary
//!   scaling, a sliding window on every layer (Mistral, Phi-3; Qwen's with
//!   `use_sliding_window`), tied embeddings, any vocabulary (padded to a multiple of tp, the
//!   padding masked out).
//!
//! What it refuses, with an error naming the field: another architecture, rope scaling other than
//! Llama 3's (any for Gemma), a partial rotary factor, an MLP bias, an activation other than SiLU (Gemma's `gelu_pytorch_tanh`).
//!
//! | file        | what                                                                     |
//! |-------------|--------------------------------------------------------------------------|
//! | `arch.rs`   | [`HfArchitecture`]: the architectures read, by their `config.json` names |
//! | `config.rs` | [`HfConfig`]: `config.json` read, checked, and made from a [`LlamaConfig`](crate::llama::LlamaConfig) |
//! | `gemma.rs`  | a Gemma config's own fields: rotary bases per layer type, layer types, refusals |
//! | `mapping.rs`| which HF tensors (names, rows, rotary order) make each of the Llama's parameters |
//! | `import.rs` | [`load`], [`init_llama`], [`init_gemma`]: each rank reads its own slices of the safetensors files |
//! | `export.rs` | [`save`]: the model gathered, rank 0 writes HF's names and layouts        |
//! | `peft.rs`   | [`load_peft`], [`save_peft`]: PEFT's LoRA adapter folders, read at any tp  |

mod arch;
mod config;
mod export;
mod gemma;
mod import;
mod mapping;
mod moe;
mod peft;

use crate::error::file_error;

pub use config::{HfArchitecture, HfConfig};
pub use export::save;
pub use import::{init_gemma, init_llama, init_llama_expert_parallel, load, load_expert_parallel};
pub use peft::{load_peft, save_peft};
