//! The CPU kernel's forward: one task per (batch, key / value head, query tile), its key tiles
//! walked with an online softmax (the running maximum and sum rescaled as the maximum grows).

use super::*;
use crate::backend::fused::cpu_math::simd;

/// The forward: the output `[b, hq, s, hd]` laid out as `[s, b, hq, hd]`, in q's dtype, and
/// each row's log-sum-exp `[b, hq, s]` (f32).
pub(crate) fn forward(
    q: FlexTensor,
    k: FlexTensor,
    v: FlexTensor,
    spec: &AttentionSpec,
) -> (FlexTensor, FlexTensor) {
    let dtype = q.dtype();
    let (q, k, v) = (View::of(q), View::of(k), View::of(v));
    let [b, hq, s, hd] = q.dims;
    let [_, hkv, t, _] = k.dims;
    let g = hq / hkv;
    let scale = spec.scale_for(hd) as f32;
    let q_tiles = tiles(s, spec.tile);
    let k_tiles = tiles(t, spec.tile);
    let nq = q_tiles.len();
    let mut out = vec![0.0f32; s * b * hq * hd];
    let mut lse = vec![0.0f32; b * hq * s];
    let (out_ptr, lse_ptr) = (Out(out.as_mut_ptr()), Out(lse.as_mut_ptr()));
    let tasks: Vec<(usize, usize, usize)> = (0..b)
        .flat_map(|bi| (0..hkv).flat_map(move |kh| (0..nq).map(move |i| (bi, kh, i))))
        .collect();
    // Each task compiled for the CPU's widest vector unit (its row loops inlined into it).
    tasks.into_par_iter().for_each(|(bi, kh, i)| {
        simd(
            #[inline(always)]
            || {
                let rows = q_tiles[i].clone();
                let n = rows.len();
                let gn = g * n;
                let heads = kh * g..(kh + 1) * g;
                let mut qp = vec![0.0f32; gn * hd];
                q.pack(bi, heads.clone(), rows.clone(), scale, &mut qp);
                let mut acc = vec![0.0f32; gn * hd];
                let mut m = vec![f32::NEG_INFINITY; gn];
                let mut l = vec![0.0f32; gn];
                let mut sc = vec![0.0f32; gn * spec.tile];
                let vd = v.data();
                for cols in &k_tiles {
                    if !spec.visible(&rows, cols).0 {
                        continue;
                    }
                    let mk = cols.len();
                    let tile = &mut sc[..gn * mk];
                    tile_scores(tile, None, &qp, &k, [bi, kh], g, &rows, cols, spec);
                    let keep = keep_tile(spec, [s, t], bi, heads.clone(), &rows, cols);
                    for (r, row) in tile.chunks_mut(mk).enumerate() {
                        let new_max = m[r].max(max(row));
                        if new_max == f32::NEG_INFINITY {
                            // The row's window starts after this tile: nothing seen yet.
                            row.fill(0.0);
                            continue;
                        }
                        exp_shifted(row, new_max);
                        let sum = sum(row);
                        if let Some(keep) = &keep {
                            for (x, k) in row.iter_mut().zip(&keep[r * mk..(r + 1) * mk]) {
                                *x *= k;
                            }
                        }
                        let alpha = exp(m[r] - new_max);
                        if alpha != 1.0 {
                            for a in &mut acc[r * hd..(r + 1) * hd] {
                                *a *= alpha;
                            }
                        }
                        l[r] = l[r] * alpha + sum;
                        m[r] = new_max;
                    }
                    let vp = v.at(bi, kh, cols.start);
                    gemm(
                        [gn, hd, mk],
                        acc.as_mut_ptr(),
                        hd as isize,
                        true,
                        tile.as_ptr(),
                        [mk as isize, 1],
                        vd[vp..].as_ptr(),
                        [v.strides[2], v.strides[3]],
                        1.0,
                    );
                }
                for r in 0..gn {
                    let (h, qi) = (heads.start + r / n, rows.start + r % n);
                    // A row that saw no key (its window after the call's keys: a ring step's
                    // block) has `l = 0`: output 0, log-sum-exp -inf.
                    let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
                    // Safety: row (qi, bi, h) of the output and of the lse belong to this task only.
                    unsafe {
                        let o = out_ptr.get().add(((qi * b + bi) * hq + h) * hd);
                        for d in 0..hd {
                            *o.add(d) = acc[r * hd + d] * inv;
                        }
                        *lse_ptr.get().add((bi * hq + h) * s + qi) = m[r] + l[r].ln();
                    }
                }
            },
        )
    });
    let out = FlexTensor::from_data(TensorData::new(out, [s, b, hq, hd]));
    let mut out = out;
    if dtype != DType::F32 {
        out = Flex::float_cast(out, dtype.into());
    }
    let lse = FlexTensor::from_data(TensorData::new(lse, [b, hq, s]));
    (Flex::float_permute(out, &[1, 2, 0, 3]), lse)
}
