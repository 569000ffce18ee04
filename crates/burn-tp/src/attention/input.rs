//! [`AttentionInput`]: what one attention call attends (self- or cross-attention, burn-nn's
//! key padding mask), and [`ParallelAttention::try_forward_input`], which runs it.

use burn::tensor::{Bool, Tensor};

use super::ParallelAttention;
use crate::dropout::DropoutKey;
use crate::{Result as TpResult, TpError};

/// What one call of [`ParallelAttention::try_forward_input`] attends: self-attention of `x`, or
/// cross-attention of `x`'s queries over `memory`'s keys and values, with burn-nn's key padding
/// mask (`mask_pad`). Sequence first, as every burn-tp layer (`[seq, batch, d_model]`; burn-nn's
/// `MhaInput` is batch first).
#[derive(Clone, Debug)]
pub struct AttentionInput {
    x: Tensor<3>,
    memory: Option<Tensor<3>>,
    mask_pad: Option<Tensor<2, Bool>>,
}

impl AttentionInput {
    /// Self-attention of `x`: `[s(/tp), b, d_model]` (this rank's sequence shard in
    /// REDUCE_SCATTER mode).
    pub fn self_attn(x: Tensor<3>) -> Self {
        Self {
            x,
            memory: None,
            mask_pad: None,
        }
    }

    /// Cross-attention: the queries of `x` (`[s(/tp), b, d_model]`) over the keys and values
    /// of `memory` (`[t(/tp), b, d_model]`, sharded as `x` in REDUCE_SCATTER mode), every key
    /// seen (no causal mask), without rotary positions. Needs the separate q, k and v
    /// projections (`fused_qkv = false`).
    pub fn cross_attn(x: Tensor<3>, memory: Tensor<3>) -> Self {
        Self {
            x,
            memory: Some(memory),
            mask_pad: None,
        }
    }

    /// Key padding, burn-nn's `mask_pad`: `[batch, t]`, `true` where a key is padding (whole
    /// sequences on every rank, whatever the mode), anywhere in a row (right padding, the
    /// common case, lets the kernels skip the tiles past a row's keys); every row needs a real
    /// key.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }
}

impl ParallelAttention {
    /// [`try_forward_input`](Self::try_forward_input) without dropout.
    ///
    /// # Panics
    /// As [`try_forward_input`](Self::try_forward_input)'s errors.
    pub fn forward_input(&self, input: AttentionInput) -> Tensor<3> {
        self.try_forward_input(input, None, 0)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Self- or cross-attention with key padding ([`AttentionInput`]): `[s(/tp), b, d_model]`
    /// out, as [`try_forward`](Self::try_forward), on the fused kernels (or the materialized
    /// path, as the layer's setting says).
    ///
    /// # Errors
    /// [`TpError::Shape`] naming the shapes: a `mask_pad` not `[batch, t]`, a row of it all
    /// padding, a memory of another batch or width; [`TpError::Config`]:
    /// cross-attention with a fused QKV projection or rotary positions, key padding or
    /// cross-attention under context parallelism; as [`try_forward`](Self::try_forward).
    pub fn try_forward_input(
        &self,
        input: AttentionInput,
        dropout: Option<DropoutKey>,
        site: u64,
    ) -> TpResult<Tensor<3>> {
        let AttentionInput {
            x,
            memory,
            mask_pad,
        } = input;
        if memory.is_none() && mask_pad.is_none() {
            return self.try_forward(x, dropout, site);
        }
        if let Some(ctx) = &self.context {
            return Err(TpError::Config(format!(
                "ParallelAttention: key padding or cross-attention over a sequence split over \
                 cp {} ranks is not supported (ring attention is causal self-attention)",
                ctx.size()
            )));
        }
        let cross = memory.is_some();
        if let Some(m) = &memory {
            let ([_, b, d], [_, mb, md]) = (x.dims(), m.dims());
            if mb != b || md != d {
                return Err(TpError::Shape {
                    op: "ParallelAttention::try_forward_input",
                    expected: format!("memory [t, batch = {b}, d_model = {d}]"),
                    got: m.dims().to_vec(),
                });
            }
            if self.qkv.len() != 3 {
                return Err(TpError::Config(
                    "ParallelAttention: cross-attention needs the separate q, k and v \
                     projections (ParallelAttentionConfig::with_fused_qkv(false))"
                        .into(),
                ));
            }
            if self.rope.is_some() {
                return Err(TpError::Config(
                    "ParallelAttention: cross-attention with rotary positions is not supported \
                     (queries and keys of different sequences)"
                        .into(),
                ));
            }
        }
        let (q, k, v) = self.project_from(x, memory, 0)?;
        let [b, _, _, _] = q.dims();
        let t = k.dims()[2];
        let (key_lengths, key_mask) = match mask_pad {
            Some(mask) => key_padding(mask, [b, t])?,
            None => (Vec::new(), Vec::new()),
        };
        let mut spec = self.spec(b, dropout, site, 0, None);
        spec.causal = self.causal && !cross;
        spec.key_lengths = key_lengths;
        spec.key_mask = key_mask;
        self.attend_with(q, k, v, spec, dropout, site)
    }
}

/// burn-nn's key padding mask (`[b, t]`, `true` where padding) as the kernels take it: each
/// row's real keys where every row is right padding (its real keys first: the kernels skip the
/// tiles past them), else the mask itself. Every row needs a real key.
fn key_padding(
    mask: Tensor<2, Bool>,
    [b, t]: [usize; 2],
) -> TpResult<(Vec<usize>, Vec<Vec<bool>>)> {
    let bad = |why: String| TpError::Shape {
        op: "ParallelAttention::try_forward_input",
        expected: format!("mask_pad [batch = {b}, t = {t}] with a real key in every row: {why}"),
        got: mask.dims().to_vec(),
    };
    if mask.dims() != [b, t] {
        return Err(bad("another shape".into()));
    }
    let values = mask
        .clone()
        .into_data()
        .convert::<bool>()
        .try_to_vec::<bool>()
        .map_err(|e| bad(format!("{e:?}")))?;
    let rows: Vec<&[bool]> = values.chunks(t).collect();
    if let Some(row) = rows.iter().position(|m| m.iter().all(|&p| p)) {
        return Err(bad(format!("row {row} is all padding")));
    }
    let lengths: Option<Vec<usize>> = rows
        .iter()
        .map(|m| {
            let len = m.iter().position(|&p| p).unwrap_or(t);
            m[len..].iter().all(|&p| p).then_some(len)
        })
        .collect();
    Ok(match lengths {
        Some(lengths) => (lengths, Vec::new()),
        None => (Vec::new(), rows.iter().map(|m| m.to_vec()).collect()),
    })
}
