//! [`ParallelAttentionConfig`]: the attention's sizes, checked against tp, and its
//! initialisation.

use burn::config::Config;
use burn::nn::RotaryEncoding;
use burn::tensor::Device;
use burn_tp_comm::ProcessGroup;

use super::rotary::{Llama3RopeScaling, rotary};
use super::{Kernel, ParallelAttention};
use crate::error::check_divisible;
use crate::linear::{
    ColumnParallelLinearConfig, FusedPart, RowParallelLinearConfig, TpMode, TpSettings,
};
use crate::norm::TpRmsNorm;
use crate::{Result as TpResult, TpError};

/// A layer's attention: over a sliding window or the whole causal past (transformers'
/// `layer_types` entries `sliding_attention` and `full_attention`): a model's layers may mix
/// them (Gemma; Qwen's `max_window_layers`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Over the last `sliding_window` positions, with the local rotary base.
    Sliding,
    /// Over every position before, with the global rotary base.
    Full,
}

/// Configuration of a [`ParallelAttention`].
#[derive(Config, Debug)]
pub struct ParallelAttentionConfig {
    /// Model width.
    pub d_model: usize,
    /// Query heads (a multiple of tp); each rank computes `n_heads / tp` of them.
    pub n_heads: usize,
    /// Key / value heads: `None` for as many as query heads (multi-head attention); else a
    /// divisor of `n_heads` that is a multiple of tp (sharded) or a divisor of tp (replicated:
    /// each rank keeps the one its query heads use, the gradients summed over those ranks).
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Size of each head: `None` for `d_model / n_heads`; else any (Qwen3, Mistral NeMo: the
    /// projections are `d_model -> n_heads head_dim` and back).
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Rotary positions with this base (Burn's `RotaryEncoding`, over `max_seq` positions); `None`
    /// for none (positions added to the embeddings instead).
    #[config(default = "None")]
    pub rope_theta: Option<f32>,
    /// Longest sequence: the rotary table's length (only with `rope_theta`).
    #[config(default = 0)]
    pub max_seq: usize,
    /// Llama 3's scaling of the rotary frequencies (only with `rope_theta`).
    #[config(default = "None")]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Biases on the q, k and v projections (the GPT's, Qwen2's).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// RMSNorm, with this epsilon, on each head's queries and keys before the rotation (Qwen3's
    /// `q_norm` and `k_norm`: one `[head_dim]` weight each, shared by every head); `None` for none.
    #[config(default = "None")]
    pub qk_norm: Option<f64>,
    /// Added to the q / k norms' weights before they scale (Gemma's `1 + w`: 1); 0 for none.
    #[config(default = 0.0)]
    pub norm_offset: f64,
    /// A sliding window (Mistral's, Phi-3's): each query sees itself and the `window - 1` keys
    /// before it, and the KV cache keeps only those; `None` for the whole causal past.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// The scores' scale: `None` for `1 / sqrt(head_dim)`; Gemma's `query_pre_attn_scalar **
    /// -0.5`.
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Gemma 2's soft cap of the scores, `cap * tanh(s / cap)` (after the scale, before the
    /// softmax), in both kernels' forward and backward; `None` for none.
    #[config(default = "None")]
    pub softcap: Option<f64>,
    /// A bias on the output projection (the GPT's).
    #[config(default = false)]
    pub out_bias: bool,
    /// One fused QKV projection (full columns `[q: n_heads | k: n_kv_heads | v: n_kv_heads] x
    /// head_dim`, parts each sharded on its own) instead of three.
    #[config(default = true)]
    pub fused_qkv: bool,
    /// Dropout of the attention probabilities (with the dropout key of a training step).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Whether each query sees only the positions up to its own (a decoder's self-attention,
    /// the default); `false`: every key (an encoder's, as burn-nn's `MultiHeadAttention`).
    /// Cross-attention ([`super::AttentionInput::cross_attn`]) always sees every key.
    #[config(default = true)]
    pub causal: bool,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

impl ParallelAttentionConfig {
    fn n_kv(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// `head_dim`, or `d_model / n_heads`.
    fn head_size(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Checks the head counts and widths against `tp` (before any communication).
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] / [`TpError::Config`] naming the values.
    pub(crate) fn validate(&self, tp: usize) -> TpResult<()> {
        check_divisible("ParallelAttention n_heads", self.n_heads, tp)?;
        let (h, kv, d) = (self.n_heads, self.n_kv(), self.d_model);
        if kv == 0 || !h.is_multiple_of(kv) {
            return Err(TpError::Config(format!(
                "ParallelAttention: n_kv_heads = {kv} must divide n_heads = {h}"
            )));
        }
        if !(kv.is_multiple_of(tp) || tp.is_multiple_of(kv)) {
            return Err(TpError::Config(format!(
                "ParallelAttention: n_kv_heads = {kv} at tp = {tp}: one must divide the other"
            )));
        }
        if self.head_dim.is_none() && !d.is_multiple_of(h) {
            return Err(TpError::Config(format!(
                "ParallelAttention: d_model = {d} is not divisible by n_heads = {h} (or give \
                 head_dim)"
            )));
        }
        let hd = self.head_size();
        if hd == 0 {
            return Err(TpError::Config("ParallelAttention: head_dim = 0".into()));
        }
        if !self.causal && self.sliding_window.is_some() {
            return Err(TpError::Config(format!(
                "ParallelAttention: a sliding window ({:?}) with causal = false: a window is \
                 a causal past's",
                self.sliding_window
            )));
        }
        if let Some(r) = self.rope_scaling
            && !(r.factor > 0.0
                && r.low_freq_factor > 0.0
                && r.high_freq_factor > r.low_freq_factor
                && r.original_max_position_embeddings > 0)
        {
            return Err(TpError::Config(format!(
                "ParallelAttention: rope_scaling needs factor > 0, 0 < low_freq_factor < \
                 high_freq_factor and original_max_position_embeddings > 0 (got {r:?})"
            )));
        }
        for (name, value) in [("scale", self.scale), ("softcap", self.softcap)] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(TpError::Config(format!(
                    "ParallelAttention: {name} = {v} (must be finite and > 0)"
                )));
            }
        }
        if self.sliding_window == Some(0) {
            return Err(TpError::Config(
                "ParallelAttention: sliding_window = 0 (each query must see itself)".into(),
            ));
        }
        if self.rope_theta.is_some() && (!hd.is_multiple_of(2) || self.max_seq == 0) {
            return Err(TpError::Config(format!(
                "ParallelAttention: rotary positions need an even head_dim (got {hd}) and \
                 max_seq > 0 (got {})",
                self.max_seq
            )));
        }
        Ok(())
    }

    /// Initializes this rank's heads (the full projections Burn's `LinearConfig` gives at
    /// tp = 1, sharded). Collective.
    ///
    /// # Errors
    /// [`TpError::NotDivisible`] / [`TpError::Config`] for head counts that do not fit tp; a
    /// communication error.
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelAttention> {
        self.init_with_rope(group, device, self.rotary_table(device))
    }

    /// The rotary table this config gives (`[max_seq, head_dim]`), with rotary positions: one
    /// a model's layers of the same base can share ([`init_with_rope`](Self::init_with_rope)).
    pub(crate) fn rotary_table(&self, device: &Device) -> Option<RotaryEncoding> {
        let hd = self.head_size();
        self.rope_theta
            .map(|theta| rotary(self.max_seq, hd, theta, self.rope_scaling, device))
    }

    /// [`init`](Self::init) with rotary table `rope` (shared: its tensor is not copied), which
    /// must be [`rotary_table`](Self::rotary_table)'s.
    pub(crate) fn init_with_rope(
        &self,
        group: &ProcessGroup,
        device: &Device,
        rope: Option<RotaryEncoding>,
    ) -> TpResult<ParallelAttention> {
        self.validate(group.world_size())?;
        let (h, kv) = (self.n_heads, self.n_kv());
        let hd = self.head_size();
        let part = |heads: usize| FusedPart::new(heads * hd).with_blocks(Some(heads));
        let column = |parts: Vec<FusedPart>| {
            let width = parts.iter().map(|c| c.width).sum();
            ColumnParallelLinearConfig::new(self.d_model, width)
                .with_bias(self.qkv_bias)
                .with_parts(parts)
                .with_settings(self.settings)
                .init(group, device)
        };
        let qkv = if self.fused_qkv {
            vec![column(vec![part(h), part(kv), part(kv)])?]
        } else {
            vec![
                column(vec![part(h)])?,
                column(vec![part(kv)])?,
                column(vec![part(kv)])?,
            ]
        };
        let out = RowParallelLinearConfig::new(h * hd, self.d_model)
            .with_bias(self.out_bias)
            .with_settings(self.settings)
            .init(group, device)?;
        // Partial gradients in either mode (see the field): the REDUCE_SCATTER norm's rule.
        let head_norm = |eps: f64| {
            TpRmsNorm::new(hd, eps, TpMode::ReduceScatter, group, device)
                .with_offset(self.norm_offset)
        };
        Ok(self.assemble(
            qkv,
            out,
            [self.qk_norm.map(head_norm), self.qk_norm.map(head_norm)],
            rope,
        ))
    }

    /// The attention of these settings around its projections.
    fn assemble(
        &self,
        qkv: Vec<crate::linear::ColumnParallelLinear>,
        out: crate::linear::RowParallelLinear,
        [q_norm, k_norm]: [Option<TpRmsNorm>; 2],
        rope: Option<RotaryEncoding>,
    ) -> ParallelAttention {
        ParallelAttention {
            qkv,
            out,
            q_norm,
            k_norm,
            rope,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv(),
            head_dim: self.head_size(),
            dropout: self.dropout,
            window: self.sliding_window,
            scale: self.scale,
            softcap: self.softcap,
            causal: self.causal,
            kernel: match self.settings.fused_attention {
                true => Kernel::Fused {
                    tile: self.settings.attention_tile,
                },
                false => Kernel::Materialized,
            },
            context: None,
        }
    }
}

impl ParallelAttention {
    /// This rank's heads of burn-nn's `MultiHeadAttention` (its query, key, value and output
    /// projections, biases and dropout), run as `config` says (`causal`, `settings`; burn-nn's
    /// attention sees every key unless a call masks it, so `with_causal(false)` matches it).
    /// The projections stay separate (cross-attention takes them).
    ///
    /// # Errors
    /// [`TpError::Config`] naming what does not carry over: `config`'s sizes other than the
    /// MHA's, a setting burn-nn's attention does not have (rotary positions, q / k norms, a
    /// window, a scale, a soft cap, fewer key / value heads), `quiet_softmax`, biases on some of
    /// q, k, v only; [`TpError::NotDivisible`] for heads that do not split over tp.
    pub fn from_full(
        mha: &burn::nn::attention::MultiHeadAttention,
        group: &ProcessGroup,
        config: &ParallelAttentionConfig,
    ) -> TpResult<Self> {
        let refuse = |what: String| {
            Err(TpError::Config(format!(
                "ParallelAttention::from_full: {what}"
            )))
        };
        if (config.d_model, config.n_heads, config.head_size())
            != (mha.d_model, mha.n_heads, mha.d_k)
        {
            return refuse(format!(
                "the config's d_model {} / n_heads {} / head_dim {} are not the \
                 MultiHeadAttention's {} / {} / {}",
                config.d_model,
                config.n_heads,
                config.head_size(),
                mha.d_model,
                mha.n_heads,
                mha.d_k
            ));
        }
        let unsupported = [
            ("rope_theta", config.rope_theta.is_some()),
            ("qk_norm", config.qk_norm.is_some()),
            ("sliding_window", config.sliding_window.is_some()),
            ("scale", config.scale.is_some()),
            ("softcap", config.softcap.is_some()),
            ("n_kv_heads", config.n_kv() != config.n_heads),
        ];
        if let Some((name, _)) = unsupported.iter().find(|u| u.1) {
            return refuse(format!(
                "`{name}` is set in the config; burn-nn's MultiHeadAttention has none"
            ));
        }
        if mha.quiet_softmax {
            return refuse("quiet_softmax is not supported".into());
        }
        let biases = [&mha.query, &mha.key, &mha.value].map(|l| l.bias.is_some());
        if biases.iter().any(|&b| b != biases[0]) {
            return refuse(format!(
                "biases on some of query / key / value only ({biases:?})"
            ));
        }
        let config = ParallelAttentionConfig {
            qkv_bias: biases[0],
            out_bias: mha.output.bias.is_some(),
            dropout: mha.dropout.prob,
            fused_qkv: false,
            ..config.clone()
        };
        config.validate(group.world_size())?;
        let (h, hd, d) = (config.n_heads, config.head_size(), config.d_model);
        let column = |linear: &burn::nn::Linear| {
            let part = FusedPart::new(h * hd).with_blocks(Some(h));
            crate::linear::ColumnParallelLinear::from_full(
                linear,
                group,
                &ColumnParallelLinearConfig::new(d, h * hd)
                    .with_bias(config.qkv_bias)
                    .with_parts(vec![part])
                    .with_settings(config.settings),
            )
        };
        let qkv = vec![column(&mha.query)?, column(&mha.key)?, column(&mha.value)?];
        let out = crate::linear::RowParallelLinear::from_full(
            &mha.output,
            group,
            &RowParallelLinearConfig::new(h * hd, d)
                .with_bias(config.out_bias)
                .with_settings(config.settings),
        )?;
        Ok(config.assemble(qkv, out, [None, None], None))
    }

    /// As burn-nn's `MultiHeadAttention` (the projections gathered; a fused QKV projection cut
    /// into its three). Collective.
    ///
    /// # Errors
    /// [`TpError::Config`] naming a setting burn-nn's attention does not have (rotary
    /// positions, q / k norms, a window, a scale, a soft cap, fewer key / value heads); a
    /// communication error.
    pub fn to_full(&self) -> TpResult<burn::nn::attention::MultiHeadAttention> {
        let unsupported = [
            ("rotary positions", self.rope.is_some()),
            ("q / k norms", self.q_norm.is_some()),
            ("a sliding window", self.window.is_some()),
            ("a score scale", self.scale.is_some()),
            ("a soft cap", self.softcap.is_some()),
            ("fewer key / value heads", self.n_kv_heads != self.n_heads),
        ];
        if let Some((name, _)) = unsupported.iter().find(|u| u.1) {
            return Err(TpError::Config(format!(
                "ParallelAttention::to_full: {name}, which burn-nn's MultiHeadAttention has not"
            )));
        }
        let (h, hd) = (self.n_heads, self.head_dim);
        let mut full: Vec<burn::nn::Linear> = self
            .qkv
            .iter()
            .map(|c| c.to_full())
            .collect::<TpResult<_>>()?;
        if full.len() == 1 {
            let fused = full.remove(0);
            let cut = |i: usize| burn::nn::Linear {
                weight: burn::module::Param::from_tensor(crate::init::owned(
                    fused.weight.val().narrow(1, i * h * hd, h * hd),
                )),
                bias: fused.bias.as_ref().map(|b| {
                    burn::module::Param::from_tensor(crate::init::owned(b.val().narrow(
                        0,
                        i * h * hd,
                        h * hd,
                    )))
                }),
            };
            full = vec![cut(0), cut(1), cut(2)];
        }
        let [query, key, value]: [burn::nn::Linear; 3] =
            full.try_into().expect("three projections");
        let output = self.out.to_full()?;
        let d_model = output.weight.val().dims()[1];
        let defaults = burn::nn::attention::MultiHeadAttentionConfig::new(d_model, h);
        Ok(burn::nn::attention::MultiHeadAttention {
            query,
            key,
            value,
            output,
            dropout: burn::nn::DropoutConfig::new(self.dropout).init(),
            activation: burn::nn::Gelu::new(),
            d_model,
            n_heads: h,
            d_k: hd,
            min_float: defaults.min_float,
            quiet_softmax: false,
        })
    }
}

/// burn-nn's `MultiHeadAttention`, its heads split over the group (causal as the context says).
impl crate::reshard::Twin<burn::nn::attention::MultiHeadAttention> for ParallelAttention {
    fn from_twin(
        full: &burn::nn::attention::MultiHeadAttention,
        ctx: &crate::reshard::TwinContext,
    ) -> TpResult<Self> {
        let config = ParallelAttentionConfig::new(full.d_model, full.n_heads)
            .with_causal(ctx.causal)
            .with_settings(ctx.settings);
        Self::from_full(full, &ctx.group, &config)
    }
    fn to_twin(&self) -> TpResult<burn::nn::attention::MultiHeadAttention> {
        self.to_full()
    }
}
