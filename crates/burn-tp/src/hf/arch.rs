//! [`HfArchitecture`]: the architectures the import reads, by their `config.json` names.

/// The architectures the import reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArchitecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (a sliding window on every layer, or none).
    Mistral,
    /// `Qwen2ForCausalLM` (q, k and v biases).
    Qwen2,
    /// `Qwen3ForCausalLM` (RMSNorm on each head's queries and keys, an explicit `head_dim`).
    Qwen3,
    /// `Phi3ForCausalLM` (fused `qkv_proj` and `gate_up_proj` tensors, a sliding window).
    Phi3,
    /// `Gemma2ForCausalLM`: a [`Gemma`](crate::gemma::Gemma) with soft caps, alternating
    /// sliding and full layers, one rotary base, no q / k norms.
    Gemma2,
    /// `Gemma3ForCausalLM` (`gemma3_text`): a [`Gemma`](crate::gemma::Gemma).
    Gemma3,
}

impl HfArchitecture {
    /// The `architectures` entry and the `model_type`.
    pub fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Llama => ("LlamaForCausalLM", "llama"),
            Self::Mistral => ("MistralForCausalLM", "mistral"),
            Self::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Self::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Self::Phi3 => ("Phi3ForCausalLM", "phi3"),
            Self::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
            Self::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        }
    }

    /// Whether it is a [`Gemma`](crate::gemma::Gemma) (else a [`Llama`](crate::llama::Llama)).
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    pub(super) const ALL: [Self; 7] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Phi3,
        Self::Gemma2,
        Self::Gemma3,
    ];
}
