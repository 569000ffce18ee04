//! The CPU kernel's backward: one task per (batch, key / value head), each owning its heads'
//! `dq` rows and its key / value head's `dk`, `dv` rows (no two tasks write one element). A
//! task packs each query tile once ([`QueryTile`]), then walks the key tiles; each visible
//! (query tile, key tile) pair recomputes its probabilities from the log-sum-exp and adds its
//! share to dV, dK and dQ ([`Task::tile`]).

use std::ops::Range;

use super::*;
use crate::backend::fused::cpu_math::simd;

/// What a query tile brings to every key tile's backward, packed `[g * rows, ..]` (the tile's
/// rows of the `g` query heads of one key / value head, stacked).
struct QueryTile {
    /// The queries, scaled by the scores' scale (`1 / sqrt(hd)` unless the spec says).
    q: Vec<f32>,
    /// The upstream gradient dO.
    d_o: Vec<f32>,
    /// `D = rowsum(dO * O)`.
    d: Vec<f32>,
    /// Each row's log-sum-exp.
    lse: Vec<f32>,
}

/// One (batch, key / value head) task's fixed inputs.
struct Task<'a> {
    q: &'a View,
    k: &'a View,
    v: &'a View,
    spec: &'a AttentionSpec,
    bi: usize,
    kh: usize,
    /// Its query heads.
    heads: Range<usize>,
    /// `[s, t]`: queries and keys.
    lengths: [usize; 2],
}

impl Task<'_> {
    /// The query tile `rows`: packed queries (scaled), dO, D and the log-sum-exps.
    #[inline(always)]
    fn query_tile(&self, o: &View, d_o: &View, lse: &[f32], rows: &Range<usize>) -> QueryTile {
        let (hd, hq, s) = (self.q.dims[3], self.q.dims[1], self.lengths[0]);
        let gn = self.heads.len() * rows.len();
        let scale = self.spec.scale_for(hd) as f32;
        let pack = |view: &View, scale: f32| {
            let mut packed = vec![0.0f32; gn * hd];
            view.pack(
                self.bi,
                self.heads.clone(),
                rows.clone(),
                scale,
                &mut packed,
            );
            packed
        };
        let (q, d_o, o) = (pack(self.q, scale), pack(d_o, 1.0), pack(o, 1.0));
        let d = d_o
            .chunks(hd)
            .zip(o.chunks(hd))
            .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum())
            .collect();
        let lse = self
            .heads
            .clone()
            .flat_map(|h| rows.clone().map(move |i| (h, i)))
            .map(|(h, i)| lse[(self.bi * hq + h) * s + i])
            .collect();
        QueryTile { q, d_o, d, lse }
    }

    /// The backward of query tile `rows` (`qt`) against key tile `cols`: its probabilities
    /// recomputed into `p`, then dV += (P * keep)^T dO, dS = P (dO V^T * keep - D) into `dp`
    /// (times the soft cap's slope `1 - tanh^2`, kept in `slope`, where the scores are capped),
    /// dQ += dS K (`dq`, scaled at the end), dK += dS^T (scaled Q) (`dk`, `dv`: the key
    /// tile's rows).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn tile(
        &self,
        qt: &QueryTile,
        rows: &Range<usize>,
        cols: &Range<usize>,
        [p, dp, slope]: [&mut [f32]; 3],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) {
        let (k, v, spec) = (self.k, self.v, self.spec);
        let hd = k.dims[3];
        let (g, mk) = (self.heads.len(), cols.len());
        let gn = g * rows.len();
        let p = &mut p[..gn * mk];
        let capped = spec.softcap.is_some();
        let slope = &mut slope[..if capped { gn * mk } else { 0 }];
        let slopes = capped.then_some(&mut *slope);
        tile_scores(p, slopes, &qt.q, k, [self.bi, self.kh], g, rows, cols, spec);
        for (row, &l) in p.chunks_mut(mk).zip(&qt.lse) {
            exp_shifted(row, l);
        }
        let keep = keep_tile(spec, self.lengths, self.bi, self.heads.clone(), rows, cols);
        // dV += (P * keep)^T dO.
        let pk: std::borrow::Cow<[f32]> = match &keep {
            Some(keep) => p
                .iter()
                .zip(keep)
                .map(|(a, b)| a * b)
                .collect::<Vec<_>>()
                .into(),
            None => (&*p).into(),
        };
        gemm(
            [mk, hd, gn],
            dv.as_mut_ptr(),
            hd as isize,
            true,
            pk.as_ptr(),
            [1, mk as isize],
            qt.d_o.as_ptr(),
            [hd as isize, 1],
            1.0,
        );
        // dP = dO V^T (* keep); dS = P (dP - D).
        let dp = &mut dp[..gn * mk];
        let (kp, vp) = (
            k.at(self.bi, self.kh, cols.start),
            v.at(self.bi, self.kh, cols.start),
        );
        gemm(
            [gn, mk, hd],
            dp.as_mut_ptr(),
            mk as isize,
            false,
            qt.d_o.as_ptr(),
            [hd as isize, 1],
            v.data()[vp..].as_ptr(),
            [v.strides[3], v.strides[2]],
            1.0,
        );
        for (r, (dpr, pr)) in dp.chunks_mut(mk).zip(p.chunks(mk)).enumerate() {
            let keep_row = keep.as_ref().map(|kk| &kk[r * mk..(r + 1) * mk]);
            for (c, (x, pv)) in dpr.iter_mut().zip(pr).enumerate() {
                let d = match keep_row {
                    Some(kr) => *x * kr[c],
                    None => *x,
                };
                *x = pv * (d - qt.d[r]);
            }
        }
        if capped {
            for (x, d) in dp.iter_mut().zip(slope.iter()) {
                *x *= d;
            }
        }
        // dQ += dS K (scaled at the end); dK += dS^T (scale Q).
        gemm(
            [gn, hd, mk],
            dq.as_mut_ptr(),
            hd as isize,
            true,
            dp.as_ptr(),
            [mk as isize, 1],
            k.data()[kp..].as_ptr(),
            [k.strides[2], k.strides[3]],
            1.0,
        );
        gemm(
            [mk, hd, gn],
            dk.as_mut_ptr(),
            hd as isize,
            true,
            dp.as_ptr(),
            [1, mk as isize],
            qt.q.as_ptr(),
            [hd as isize, 1],
            1.0,
        );
    }
}

/// The gradients of q, k and v (in their dtypes) of the kernel's attention, from `d_out`
/// (`[b, hq, s, hd]`), the output and the log-sum-exp the forward returned.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    out: FlexTensor,
    lse: FlexTensor,
    d_out: FlexTensor,
    spec: &AttentionSpec,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let dtypes = (q.dtype(), k.dtype(), v.dtype());
    let (q, k, v) = (View::of(q), View::of(k), View::of(v));
    let (o, d_o) = (View::of(out), View::of(d_out));
    let lse = lse.to_contiguous();
    let lse: &[f32] = lse.storage::<f32>();
    let [b, hq, s, hd] = q.dims;
    let [_, hkv, t, _] = k.dims;
    let g = hq / hkv;
    let scale = spec.scale_for(hd) as f32;
    let q_tiles = tiles(s, spec.tile);
    let k_tiles = tiles(t, spec.tile);
    let mut dq = vec![0.0f32; b * hq * s * hd];
    let mut dk = vec![0.0f32; b * hkv * t * hd];
    let mut dv = vec![0.0f32; b * hkv * t * hd];
    let ptrs = (
        Out(dq.as_mut_ptr()),
        Out(dk.as_mut_ptr()),
        Out(dv.as_mut_ptr()),
    );
    let tasks: Vec<(usize, usize)> = (0..b)
        .flat_map(|bi| (0..hkv).map(move |kh| (bi, kh)))
        .collect();
    // Each task compiled for the CPU's widest vector unit (its row loops inlined into it).
    tasks.into_par_iter().for_each(|(bi, kh)| {
        simd(
            #[inline(always)]
            || {
                let (dq_ptr, dk_ptr, dv_ptr) = ptrs;
                let task = Task {
                    q: &q,
                    k: &k,
                    v: &v,
                    spec,
                    bi,
                    kh,
                    heads: kh * g..(kh + 1) * g,
                    lengths: [s, t],
                };
                let query_tiles: Vec<QueryTile> = q_tiles
                    .iter()
                    .map(|rows| task.query_tile(&o, &d_o, lse, rows))
                    .collect();
                let mut dqp: Vec<Vec<f32>> = q_tiles
                    .iter()
                    .map(|r| vec![0.0f32; g * r.len() * hd])
                    .collect();
                let mut p = vec![0.0f32; g * spec.tile * spec.tile];
                let mut dp = vec![0.0f32; g * spec.tile * spec.tile];
                let slopes = if spec.softcap.is_some() {
                    g * spec.tile * spec.tile
                } else {
                    0
                };
                let mut slope = vec![0.0f32; slopes];
                for cols in &k_tiles {
                    let mk = cols.len();
                    let mut dkb = vec![0.0f32; mk * hd];
                    let mut dvb = vec![0.0f32; mk * hd];
                    for (i, rows) in q_tiles.iter().enumerate() {
                        if spec.visible(rows, cols).0 {
                            let scratch = [&mut p[..], &mut dp[..], &mut slope[..]];
                            task.tile(
                                &query_tiles[i],
                                rows,
                                cols,
                                scratch,
                                &mut dqp[i],
                                &mut dkb,
                                &mut dvb,
                            );
                        }
                    }
                    // Safety: rows `cols` of key / value head (bi, kh) belong to this task only.
                    unsafe {
                        let at = ((bi * hkv + kh) * t + cols.start) * hd;
                        std::ptr::copy_nonoverlapping(dkb.as_ptr(), dk_ptr.get().add(at), mk * hd);
                        std::ptr::copy_nonoverlapping(dvb.as_ptr(), dv_ptr.get().add(at), mk * hd);
                    }
                }
                let heads = task.heads;
                for (rows, tile) in q_tiles.iter().zip(&dqp) {
                    for (r, row) in tile.chunks(hd).enumerate() {
                        let (h, qi) = (heads.start + r / rows.len(), rows.start + r % rows.len());
                        // Safety: query heads `heads` of batch bi belong to this task only.
                        unsafe {
                            let o = dq_ptr.get().add(((bi * hq + h) * s + qi) * hd);
                            for (d, x) in row.iter().enumerate() {
                                *o.add(d) = x * scale;
                            }
                        }
                    }
                }
            },
        )
    });
    let make = |values: Vec<f32>, shape: [usize; 4], dtype: DType| {
        let t = FlexTensor::from_data(TensorData::new(values, Shape::from(shape.to_vec())));
        if dtype == DType::F32 {
            t
        } else {
            Flex::float_cast(t, dtype.into())
        }
    };
    (
        make(dq, [b, hq, s, hd], dtypes.0),
        make(dk, [b, hkv, t, hd], dtypes.1),
        make(dv, [b, hkv, t, hd], dtypes.2),
    )
}
