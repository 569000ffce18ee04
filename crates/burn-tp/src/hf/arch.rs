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
    /// `MixtralForCausalLM`: a Mistral whose every MLP is a mixture of experts.
    Mixtral,
    /// `Qwen2MoeForCausalLM`: a Qwen2 with mixtures of experts and a shared expert.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`: a Qwen3 with mixtures of experts.
    Qwen3Moe,
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
            Self::Mixtral => ("MixtralForCausalLM", "mixtral"),
            Self::Qwen2Moe => ("Qwen2MoeForCausalLM", "qwen2_moe"),
            Self::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        }
    }

    /// The dense architecture whose attention, norms and config fields a mixture of experts
    /// shares (Mixtral: Mistral's; Qwen2-MoE: Qwen2's; Qwen3-MoE: Qwen3's); itself otherwise.
    pub fn dense(self) -> Self {
        match self {
            Self::Mixtral => Self::Mistral,
            Self::Qwen2Moe => Self::Qwen2,
            Self::Qwen3Moe => Self::Qwen3,
            other => other,
        }
    }

    /// Whether its MLPs are (some of them) mixtures of experts.
    pub fn is_moe(self) -> bool {
        self.dense() != self
    }

    /// Whether it is a [`Gemma`](crate::gemma::Gemma) (else a [`Llama`](crate::llama::Llama)).
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    pub(super) const ALL: [Self; 10] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Phi3,
        Self::Gemma2,
        Self::Gemma3,
        Self::Mixtral,
        Self::Qwen2Moe,
        Self::Qwen3Moe,
    ];
}
