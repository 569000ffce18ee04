//! Causal attention that never materializes the `[s, t]` score matrix (the FlashAttention-2
//! algorithm, on the backend's tensor ops; every backend's kernel unless its `TpBackend` impl
//! picks its own, as Flex does in `backend/flex.rs`): the forward walks query tiles and, for each, the key
//! tiles it can see, with an online softmax; it keeps only the output and each row's
//! log-sum-exp. The backward walks the same tiles again and recomputes each tile's
//! probabilities from the log-sum-exp.
//!
//! ```text
//!  q [b, hq, s, hd] ─ rows of query tile i, its group's heads stacked per key / value head:
//!                     [b, hkv, g * Bq, hd]          (g = hq / hkv; no repeated keys / values)
//!  k, v [b, hkv, t, hd] ─ key tile j: [b, hkv, Bk, hd]
//!
//!              key tiles j ->
//!  query    ┌────┬────┬────┬────┐   ■ computed in full   ◩ the diagonal: masked inside
//!  tiles i │ ◩  │    │    │    │   (blank) skipped: every key is in the query's future
//!     |     │ ■  │ ◩  │    │    │
//!     v     │ ■  │ ■  │ ◩  │    │   query i sits at position start + i (the KV cache's offset),
//!           │ ■  │ ■  │ ■  │ ◩  │   and sees keys 0 ..= start + i
//!           └────┴────┴────┴────┘
//! ```
//!
//! With a sliding window of `w` keys, query `i` sees keys `start + i + 1 - w ..= start + i`: the
//! tiles left of the band are skipped too, and the band's lower edge is masked like the
//! diagonal.
//!
//! Half inputs are computed in f32 tile by tile (the output is cast back); f32 and f64 in
//! their own precision. Dropout of the
//! probabilities is the logical mask of [`crate::dropout`], regenerated per tile, so it is the
//! same mask as the materialized path's at every tp.

use std::ops::Range;

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Shape, TensorData};
use burn_std::Scalar;

use crate::backend::TpBackend;
use crate::backend::attention::mask::{AttentionDropout, AttentionSpec, tiles};
use crate::backend::collective::host::{slice_dim, widen};
use crate::backend::fused::dropout::dropout_mask_values;

fn dims4(x: &impl TensorMetadata) -> [usize; 4] {
    let s = x.shape();
    [s[0], s[1], s[2], s[3]]
}

/// The geometry of one call: `b`, query heads `hq`, key / value heads `hkv`, `s` queries, `t`
/// keys, head size `hd`.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: usize,
    hq: usize,
    hkv: usize,
    s: usize,
    t: usize,
    hd: usize,
}

impl Geometry {
    fn of<B: Backend>(q: &FloatTensor<B>, k: &FloatTensor<B>) -> Self {
        let [b, hq, s, hd] = dims4(q);
        let [_, hkv, t, _] = dims4(k);
        Self {
            b,
            hq,
            hkv,
            s,
            t,
            hd,
        }
    }

    fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// Query tile `rows` of `x` (`[b, hq, s, c]`) as `[b, hkv, g * rows, c]`, widened (see
    /// [`widen`]).
    fn stack<B: Backend>(&self, x: FloatTensor<B>, rows: Range<usize>) -> FloatTensor<B> {
        let c = x.shape()[3];
        let n = rows.len();
        let x = widen::<B>(slice_dim::<B>(x, 2, rows));
        B::float_reshape(x, Shape::from(vec![self.b, self.hkv, self.group() * n, c]))
    }

    /// The inverse of [`stack`](Self::stack): `[b, hkv, g * n, c] -> [b, hq, n, c]`.
    fn unstack<B: Backend>(&self, x: FloatTensor<B>, n: usize) -> FloatTensor<B> {
        let c = x.shape()[3];
        B::float_reshape(x, Shape::from(vec![self.b, self.hq, n, c]))
    }
}

/// Scores `[b, hkv, g * Bq, Bk]` of the (pre-scaled) stacked queries against key tile `kb`,
/// soft-capped where the spec says (with the cap's slope `1 - tanh^2`, for the backward), the
/// keys a query does not see (its future, those before its window) masked to `-inf`.
fn scores<B: TpBackend>(
    geo: &Geometry,
    spec: &AttentionSpec,
    q: &FloatTensor<B>,
    kb: FloatTensor<B>,
    rows: &Range<usize>,
    cols: &Range<usize>,
    masked: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let s = B::tp_matmul(q.clone(), B::float_swap_dims(kb, 2, 3));
    let (s, slope) = match spec.softcap {
        Some(cap) => {
            let t = B::float_tanh(B::float_div_scalar(s, Scalar::Float(cap)));
            let slope = B::float_neg(B::float_add_scalar(
                B::float_mul(t.clone(), t.clone()),
                Scalar::Float(-1.0),
            ));
            (B::float_mul_scalar(t, Scalar::Float(cap)), Some(slope))
        }
        None => (s, None),
    };
    if !masked {
        return (s, slope);
    }
    let g = geo.group();
    let (n, m) = (rows.len(), cols.len());
    // Per sequence only where some is padded.
    let seqs = if spec.padding.is_empty() && spec.key_lengths.is_empty() && spec.key_mask.is_empty()
    {
        1
    } else {
        geo.b
    };
    let mut hidden = Vec::with_capacity(seqs * g * n * m);
    for b in 0..seqs {
        for _ in 0..g {
            for i in rows.clone() {
                hidden.extend(cols.clone().map(|j| !spec.sees(b, i, j)));
            }
        }
    }
    let device = s.device();
    let mask = B::bool_from_data(TensorData::new(hidden, [seqs, 1, g * n, m]), &device);
    let mask = B::bool_expand(mask, s.shape());
    (
        B::float_mask_fill(s, mask, Scalar::Float(f64::NEG_INFINITY)),
        slope,
    )
}

/// The scaled keep mask (`0` or `1 / (1 - p)`) of tile (`rows`, `cols`), stacked as the scores,
/// in `dtype`.
fn dropout_tile<B: Backend>(
    geo: &Geometry,
    d: &AttentionDropout,
    rows: &Range<usize>,
    cols: &Range<usize>,
    device: &B::Device,
    dtype: burn::tensor::DType,
) -> FloatTensor<B> {
    let ([s, t], rows_at, cols_at) = d.place([geo.s, geo.t], rows, cols);
    let full = [d.batch_total, d.heads_total, s, t];
    let region = [d.batch.clone(), d.heads.clone(), rows_at, cols_at];
    let values = dropout_mask_values(d.key, d.site, full, region, d.p);
    let shape = [geo.b, geo.hkv, geo.group() * rows.len(), cols.len()];
    let mask = B::float_from_data(TensorData::new(values, shape), device);
    if mask.dtype() == dtype {
        mask
    } else {
        B::float_cast(mask, dtype.into())
    }
}

/// The forward: the output `[b, hq, s, hd]` (in q's dtype, laid out as `[s, b, hq, hd]`) and
/// each query tile's log-sum-exp.
///
/// Shapes: `q` `[b, hq, s, hd]`, `k`, `v` `[b, hkv, t, hd]` with `hkv` dividing `hq` (each key
/// / value head serves `hq / hkv` consecutive query heads) and `t >= spec.start + s`.
pub(crate) fn forward<B: TpBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    spec: &AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let geo = Geometry::of::<B>(&q, &k);
    let dtype = q.dtype();
    let scale = spec.scale_for(geo.hd);
    let device = q.device();
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for rows in tiles(geo.s, spec.tile) {
        let qb = B::float_mul_scalar(
            geo.stack::<B>(q.clone(), rows.clone()),
            Scalar::Float(scale),
        );
        let mut state: Option<(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>)> = None;
        for cols in tiles(geo.t, spec.tile) {
            let (seen, masked) = spec.visible(&rows, &cols);
            if !seen {
                continue;
            }
            let masked = masked || spec.padding.iter().any(|&p| p > cols.start);
            let kb = widen::<B>(slice_dim::<B>(k.clone(), 2, cols.clone()));
            let vb = widen::<B>(slice_dim::<B>(v.clone(), 2, cols.clone()));
            let (s, _) = scores::<B>(&geo, spec, &qb, kb, &rows, &cols, masked);
            let tile_max = B::float_max_dim(s.clone(), 3);
            // A row whose window starts after this tile, or whose padding covers it, has no
            // key in it: a finite floor keeps `s - max` at `-inf` (probability 0) instead of
            // `-inf - -inf`.
            let tile_max = if spec.window.is_some()
                || !spec.padding.is_empty()
                || !spec.key_lengths.is_empty()
                || !spec.key_mask.is_empty()
            {
                B::float_clamp_min(tile_max, Scalar::Float(-1e30))
            } else {
                tile_max
            };
            // The running max over the tiles seen so far.
            let m_new = match &state {
                None => tile_max,
                Some((m, _, _)) => B::float_max_dim(B::float_cat(vec![m.clone(), tile_max], 3), 3),
            };
            let p = B::float_exp(B::float_sub(s, m_new.clone()));
            // The normalizer sums the undropped probabilities; the output the kept ones.
            let row_sum = B::float_sum_dim(p.clone(), 3);
            let p = match &spec.dropout {
                Some(d) => {
                    let keep = dropout_tile::<B>(&geo, d, &rows, &cols, &device, p.dtype());
                    B::float_mul(p, keep)
                }
                None => p,
            };
            let pv = B::tp_matmul(p, vb);
            let (l, acc) = match state.take() {
                None => (row_sum, pv),
                Some((m, l, acc)) => {
                    // Earlier tiles' sums and outputs, rescaled to the new max.
                    let alpha = B::float_exp(B::float_sub(m, m_new.clone()));
                    (
                        B::float_add(B::float_mul(l, alpha.clone()), row_sum),
                        B::float_add(B::float_mul(acc, alpha), pv),
                    )
                }
            };
            state = Some((m_new, l, acc));
        }
        let n = rows.len();
        let Some((m, l, acc)) = state else {
            // No key of this call is visible to the tile (a ring step's block outside its
            // window): output 0, log-sum-exp -inf, which the ring's merge weighs 0.
            let wide = widen::<B>(slice_dim::<B>(q.clone(), 2, rows.clone())).dtype();
            let zeros = B::float_zeros(
                Shape::from(vec![geo.b, geo.hq, n, geo.hd]),
                &device,
                dtype.into(),
            );
            outs.push(zeros);
            let lse = B::float_full(
                Shape::from(vec![geo.b, geo.hq, n]),
                Scalar::Float(f64::NEG_INFINITY),
                &device,
                wide.into(),
            );
            lses.push(lse);
            continue;
        };
        // A row that saw no key (its window after the call's keys) has `l = 0` and `acc = 0`:
        // output 0 rather than 0 / 0 (every other row's `l` is at least 1).
        let out = B::float_div(acc, B::float_clamp_min(l.clone(), Scalar::Float(1e-30)));
        outs.push(B::float_cast(geo.unstack::<B>(out, n), dtype.into()));
        let lse = B::float_add(m, B::float_log(l));
        lses.push(B::float_reshape(lse, Shape::from(vec![geo.b, geo.hq, n])));
    }
    // Laid out as `[s, b, hq, hd]` in memory: the attention layer's `permute([2, 0, 1, 3])` and
    // reshape before its output projection are then views, and the projection keeps this same
    // buffer for its backward instead of a second copy of the output.
    let outs = outs
        .into_iter()
        .map(|o| B::float_permute(o, &[2, 0, 1, 3]))
        .collect();
    // The query tiles' log-sum-exps end to end: `[b, hq, s]`, as Flex's kernel's.
    (
        B::float_permute(B::float_cat(outs, 0), &[1, 2, 0, 3]),
        B::float_cat(lses, 2),
    )
}

/// The backward: `(dq, dk, dv)` in the dtypes of q, k and v, from the upstream gradient
/// `d_out` (`[b, hq, s, hd]`) and what the forward kept.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: TpBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    spec: &AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let geo = Geometry::of::<B>(&q, &k);
    let g = geo.group();
    // Each query tile's rows of the log-sum-exps (`[b, hq, s]`), stacked as its scores' rows.
    let lse: Vec<FloatTensor<B>> = tiles(geo.s, spec.tile)
        .into_iter()
        .map(|rows| {
            let n = rows.len();
            let tile = slice_dim::<B>(lse.clone(), 2, rows);
            B::float_reshape(tile, Shape::from(vec![geo.b, geo.hkv, g * n, 1]))
        })
        .collect();
    let (q_dtype, k_dtype, v_dtype) = (q.dtype(), k.dtype(), v.dtype());
    let scale = spec.scale_for(geo.hd);
    let device = q.device();
    let q_tiles: Vec<Range<usize>> = tiles(geo.s, spec.tile);
    // Per query tile: the scaled queries, the upstream gradient, and D = rowsum(dO * O).
    let prepared: Vec<_> = q_tiles
        .iter()
        .map(|rows| {
            let qb = B::float_mul_scalar(
                geo.stack::<B>(q.clone(), rows.clone()),
                Scalar::Float(scale),
            );
            let gb = geo.stack::<B>(d_out.clone(), rows.clone());
            let ob = geo.stack::<B>(out.clone(), rows.clone());
            let d = B::float_sum_dim(B::float_mul(gb.clone(), ob), 3);
            (qb, gb, d)
        })
        .collect();
    let mut dq: Vec<Option<FloatTensor<B>>> = vec![None; q_tiles.len()];
    let mut dks = Vec::new();
    let mut dvs = Vec::new();
    let add = |acc: Option<FloatTensor<B>>, x: FloatTensor<B>| match acc {
        Some(a) => B::float_add(a, x),
        None => x,
    };
    for cols in tiles(geo.t, spec.tile) {
        let kb = widen::<B>(slice_dim::<B>(k.clone(), 2, cols.clone()));
        let vb = widen::<B>(slice_dim::<B>(v.clone(), 2, cols.clone()));
        let (mut dk, mut dv) = (None, None);
        for (i, rows) in q_tiles.iter().enumerate() {
            let (seen, masked) = spec.visible(rows, &cols);
            if !seen {
                continue;
            }
            let masked = masked || spec.padding.iter().any(|&p| p > cols.start);
            let (qb, gb, d) = &prepared[i];
            let (s, slope) = scores::<B>(&geo, spec, qb, kb.clone(), rows, &cols, masked);
            let p = B::float_exp(B::float_sub(s, lse[i].clone()));
            let keep = spec
                .dropout
                .as_ref()
                .map(|dr| dropout_tile::<B>(&geo, dr, rows, &cols, &device, p.dtype()));
            let p_kept = match &keep {
                Some(m) => B::float_mul(p.clone(), m.clone()),
                None => p.clone(),
            };
            dv = Some(add(
                dv,
                B::tp_matmul(B::float_swap_dims(p_kept, 2, 3), gb.clone()),
            ));
            let dp = B::tp_matmul(gb.clone(), B::float_swap_dims(vb.clone(), 2, 3));
            let dp = match keep {
                Some(m) => B::float_mul(dp, m),
                None => dp,
            };
            let ds = B::float_mul(p, B::float_sub(dp, d.clone()));
            // Through the soft cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2.
            let ds = match slope {
                Some(slope) => B::float_mul(ds, slope),
                None => ds,
            };
            dq[i] = Some(add(
                dq[i].take(),
                B::float_mul_scalar(B::tp_matmul(ds.clone(), kb.clone()), Scalar::Float(scale)),
            ));
            dk = Some(add(
                dk,
                B::tp_matmul(B::float_swap_dims(ds, 2, 3), qb.clone()),
            ));
        }
        let zeros = || {
            B::float_zeros(
                Shape::from(vec![geo.b, geo.hkv, cols.len(), geo.hd]),
                &device,
                kb.dtype().into(),
            )
        };
        dks.push(B::float_cast(dk.unwrap_or_else(zeros), k_dtype.into()));
        dvs.push(B::float_cast(dv.unwrap_or_else(zeros), v_dtype.into()));
    }
    let dq = dq
        .into_iter()
        .zip(&q_tiles)
        .map(|(g, rows)| match g {
            Some(g) => B::float_cast(geo.unstack::<B>(g, rows.len()), q_dtype.into()),
            // No key visible to the tile (a ring step's block): no gradient.
            None => B::float_zeros(
                Shape::from(vec![geo.b, geo.hq, rows.len(), geo.hd]),
                &device,
                q_dtype.into(),
            ),
        })
        .collect();
    (
        B::float_cat(dq, 2),
        B::float_cat(dks, 2),
        B::float_cat(dvs, 2),
    )
}
