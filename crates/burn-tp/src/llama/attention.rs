//! Grouped-query attention with rotary positions, heads split over the tensor-parallel group.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{RotaryEncoding, RotaryEncodingConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor};
use burn_tp_comm::ProcessGroup;

use super::dropout::{DropoutKey, tp_dropout};
use crate::error::check_divisible;
use crate::linear::{
    ColumnChunk, ColumnParallelLinear, ColumnParallelLinearConfig, RowParallelLinear,
    RowParallelLinearConfig, TpSettings,
};
use crate::reshard::{ParamLayout, Reshard};
use crate::{Result as TpResult, TpError};

/// Configuration of a [`ParallelGqa`].
#[derive(Config, Debug)]
pub struct ParallelGqaConfig {
    /// Model width.
    pub d_model: usize,
    /// Query heads (a multiple of tp).
    pub n_heads: usize,
    /// Key / value heads: divides `n_heads`; a multiple of tp (sharded) or a divisor of tp
    /// (replicated: each rank keeps the one its query heads use).
    pub n_kv_heads: usize,
    /// Longest sequence (the rotary table's length).
    pub max_seq: usize,
    /// Rotary base.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// Dropout of the attention probabilities.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// How the parallel layers run (mode, async communication, schedule).
    #[config(default = "TpSettings::new()")]
    pub settings: TpSettings,
}

/// Causal grouped-query self-attention with rotary positions (Burn's `RotaryEncoding`): one fused
/// QKV column-parallel projection whose q, k and v are contiguous chunks each sharded on its own
/// (full columns `[q: n_heads | k: n_kv_heads | v: n_kv_heads] x head_dim`, no bias), attention
/// per local head, output projection row-parallel (no bias). Query head `h` uses key / value
/// head `h / (n_heads / n_kv_heads)`.
#[derive(Module, Debug)]
pub struct ParallelGqa {
    /// `d_model -> (n_heads + 2 n_kv_heads) head_dim`, this rank's heads of each chunk.
    pub qkv: ColumnParallelLinear,
    /// `n_heads head_dim / tp -> d_model`.
    pub out: RowParallelLinear,
    /// Rotary table `[max_seq, head_dim]` (a constant).
    pub rope: RotaryEncoding,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    dropout: f64,
}

/// The chunks of the fused QKV projection.
fn qkv_chunks(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Vec<ColumnChunk> {
    vec![
        ColumnChunk::new(n_heads * head_dim).with_blocks(Some(n_heads)),
        ColumnChunk::new(n_kv_heads * head_dim).with_blocks(Some(n_kv_heads)),
        ColumnChunk::new(n_kv_heads * head_dim).with_blocks(Some(n_kv_heads)),
    ]
}

impl ParallelGqaConfig {
    pub(crate) fn validate(&self, tp: usize) -> TpResult<()> {
        check_divisible("ParallelGqa n_heads", self.n_heads, tp)?;
        let (h, kv, d) = (self.n_heads, self.n_kv_heads, self.d_model);
        if kv == 0 || !h.is_multiple_of(kv) {
            return Err(TpError::Config(format!(
                "ParallelGqa: n_kv_heads = {kv} must divide n_heads = {h}"
            )));
        }
        if !(kv.is_multiple_of(tp) || tp.is_multiple_of(kv)) {
            return Err(TpError::Config(format!(
                "ParallelGqa: n_kv_heads = {kv} at tp = {tp}: one must divide the other"
            )));
        }
        if !d.is_multiple_of(h) || !(d / h).is_multiple_of(2) {
            return Err(TpError::Config(format!(
                "ParallelGqa: d_model = {d} must be n_heads = {h} times an even head_dim"
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
    pub fn init(&self, group: &ProcessGroup, device: &Device) -> TpResult<ParallelGqa> {
        self.validate(group.world_size())?;
        let hd = self.d_model / self.n_heads;
        let qkv = ColumnParallelLinearConfig::new(
            self.d_model,
            (self.n_heads + 2 * self.n_kv_heads) * hd,
        )
        .with_bias(false)
        .with_chunks(qkv_chunks(self.n_heads, self.n_kv_heads, hd))
        .with_settings(self.settings)
        .init(group, device)?;
        let out = RowParallelLinearConfig::new(self.n_heads * hd, self.d_model)
            .with_bias(false)
            .with_settings(self.settings)
            .init(group, device)?;
        Ok(ParallelGqa {
            qkv,
            out,
            rope: RotaryEncodingConfig::new(self.max_seq, hd)
                .with_theta(self.rope_theta)
                .init(device),
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: hd,
            dropout: self.dropout,
        })
    }
}

impl ParallelGqa {
    /// Query heads over all ranks.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Key / value heads over all ranks.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// `[s(/tp), b, d_model] -> [s(/tp), b, d_model]` without dropout.
    ///
    /// # Panics
    /// As the linears' `forward`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.try_forward(x, None, 0)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Forward; with `dropout = Some(key)`, the attention probabilities are dropped with the
    /// logical mask of site `site` (`[global batch, n_heads, s, s]`: this rank's sequences and
    /// heads).
    ///
    /// # Errors
    /// As [`forward`](Self::forward)'s panics.
    pub fn try_forward(
        &self,
        x: Tensor<3>,
        dropout: Option<DropoutKey>,
        site: u64,
    ) -> TpResult<Tensor<3>> {
        let tp = self.out.group().world_size();
        let rank = self.out.group().rank();
        let hd = self.head_dim;
        let hq = self.n_heads / tp;
        let hkv = if self.n_kv_heads >= tp {
            self.n_kv_heads / tp
        } else {
            1
        };
        let y = self.qkv.try_forward(x)?; // [s, b, (hq + 2 hkv) hd], the full sequence
        let [s, b, _] = y.dims();
        let heads = |from: usize, n: usize| {
            y.clone()
                .narrow(2, from * hd, n * hd)
                .reshape([s, b, n, hd])
                .permute([1, 2, 0, 3]) // [b, n, s, hd]
        };
        // The rotation in the rotary table's dtype (f32; it is a constant, not a parameter, so a
        // bf16 copy of the model keeps it), back to the activations' dtype after.
        let rotate = |t: Tensor<4>| {
            let dtype = t.dtype();
            self.rope
                .forward(t.cast(self.rope.freq_complex.dtype()))
                .cast(dtype)
        };
        let q = rotate(heads(0, hq));
        let k = rotate(heads(hq, hkv));
        let v = heads(hq + hkv, hkv);
        // Each local key / value head serves `hq / hkv` consecutive local query heads.
        let group = hq / hkv;
        let expand = |t: Tensor<4>| {
            t.unsqueeze_dim::<5>(2)
                .expand([b, hkv, group, s, hd])
                .reshape([b, hq, s, hd])
        };
        let (k, v) = (expand(k), expand(v));
        let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>();
        let att = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        let (b_total, batch) = dropout.map_or((b, 0..b), |k| k.batch(b));
        let att = tp_dropout(
            att,
            self.dropout,
            dropout,
            site,
            [b_total, self.n_heads, s, s],
            [batch, rank * hq..(rank + 1) * hq, 0..s, 0..s],
        );
        let ctx = att.matmul(v).permute([2, 0, 1, 3]).reshape([s, b, hq * hd]);
        self.out.try_forward(ctx)
    }
}

impl Reshard for ParallelGqa {
    fn to_full_module(&self) -> TpResult<Self> {
        Ok(Self {
            qkv: self.qkv.to_full_module()?,
            out: self.out.to_full_module()?,
            rope: self.rope.clone(),
            ..*self
        })
    }
    fn shard_module(full: &Self, group: &ProcessGroup) -> TpResult<Self> {
        Ok(Self {
            qkv: Reshard::shard_module(&full.qkv, group)?,
            out: Reshard::shard_module(&full.out, group)?,
            rope: full.rope.clone(),
            ..*full
        })
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        // The rotary table is a constant, not a parameter.
        let mut out = self.qkv.layout(rank);
        out.extend(self.out.layout(rank));
        out
    }
}
