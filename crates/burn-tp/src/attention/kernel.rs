//! [`fused_attention`]: the attention kernel on `Tensor`s, checked (the backend's
//! `tp_attention`: the tensor-op tiles of `backend/attention/flash.rs`, or Flex's CPU kernel).

use burn::backend::Dispatch;
use burn::tensor::Tensor;

use crate::backend::{AttentionSpec, TpBackend};
use crate::{Result as TpResult, TpError};

/// Attention without the `[s, t]` score matrix (FlashAttention-2, the backend's
/// `tp_attention`; its backward recomputes each block's probabilities): `q` `[b, hq, s, hd]`
/// over `k`, `v` `[b, hkv, t, hd]`, query `i` at position `spec.start + i` seeing keys
/// `0 ..= spec.start + i`; each key / value head serves `hq / hkv` consecutive query heads
/// (never repeated in memory). Returns `[b, hq, s, hd]` in q's dtype (computed in f32).
///
/// # Errors
/// [`TpError::Shape`] naming the shapes: other batch or head sizes, `hkv` not dividing `hq`,
/// fewer keys than `spec.start + s`.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    spec: AttentionSpec,
) -> TpResult<Tensor<4>> {
    let ([b, hq, s, hd], [kb, hkv, t, khd], vd) = (q.dims(), k.dims(), v.dims());
    if kb != b
        || khd != hd
        || vd != [b, hkv, t, hd]
        || hkv == 0
        || !hq.is_multiple_of(hkv)
        || (spec.causal && t < spec.start + s)
        || spec.tile == 0
        || !(spec.padding.is_empty() || spec.padding.len() == b)
        || !(spec.key_lengths.is_empty() || spec.key_lengths.len() == b)
        || spec.key_lengths.iter().any(|&l| l == 0 || l > t)
        || !(spec.key_mask.is_empty() || spec.key_mask.len() == b)
        || spec
            .key_mask
            .iter()
            .any(|m| m.len() != t || m.iter().all(|&h| h))
    {
        return Err(TpError::Shape {
            op: "fused_attention",
            expected: format!(
                "q [b, hq, s, hd], k and v [b, hkv, t, hd] with hkv dividing hq and (causal) t >= \
                 start + s = {}, one padding, one key length in 1..=t and one key mask of t with a \
                 real key per sequence or none (k {:?}, v {vd:?}, tile {}, padding {:?}, key \
                 lengths {:?})",
                spec.start + s,
                k.dims(),
                spec.tile,
                spec.padding,
                spec.key_lengths
            ),
            got: q.dims().to_vec(),
        });
    }
    Ok(Tensor::from_dispatch(
        <Dispatch as TpBackend>::tp_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            spec,
        ),
    ))
}
