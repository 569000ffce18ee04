//! The fused attention's blocks as one CPU kernel on Flex's storage (f32; half inputs widened to
//! f32): the same algorithm as [`super::flash`] (the diagram there), with each block's scores in
//! a scratch tile between two GEMM calls (the `gemm` crate Flex's matmul runs on) instead of a
//! chain of tensor ops, each a pass over memory. Work is split over (batch, key / value head,
//! query block) in the forward and over (batch, key / value head) in the backward (each task
//! owns its heads' `dq` rows: no two tasks write one element), on the calling rank's rayon pool.
//!
//! q, k, v and `dO` are read in place through their strides; the output is written as
//! `[s, b, hq, hd]` (the layout the layer's output projection reads as a view).

use std::any::Any;

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::dropout::dropout_mask_values;
use super::mask::AttentionSpec;

/// `t` as a Flex tensor, if `B` is Flex.
fn to_flex<B: Backend>(t: FloatTensor<B>) -> Result<FlexTensor, FloatTensor<B>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<FlexTensor>() {
        Ok(f) => Ok(*f),
        Err(b) => Err(*b
            .downcast::<FloatTensor<B>>()
            .expect("the tensor boxed above")),
    }
}

/// A Flex tensor as `B`'s (only called where [`to_flex`] succeeded for `B`).
fn from_flex<B: Backend>(t: FlexTensor) -> FloatTensor<B> {
    let boxed: Box<dyn Any> = Box::new(t);
    *boxed
        .downcast::<FloatTensor<B>>()
        .unwrap_or_else(|_| panic!("from_flex on a backend that is not Flex"))
}

/// Whether the kernel runs these inputs: Flex tensors in f32 or a half dtype.
pub(crate) fn supports<B: Backend>(q: &FloatTensor<B>) -> bool {
    let flex = (q as &dyn Any).is::<FlexTensor>();
    flex && matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// A 4-d f32 view: storage, offset and strides in elements.
struct View {
    tensor: FlexTensor,
    offset: usize,
    strides: [isize; 4],
    dims: [usize; 4],
}

impl View {
    /// `t` widened to f32, read through its strides (a contiguous copy only for negative strides).
    fn of<B: Backend>(t: FloatTensor<B>) -> Self {
        let t = match t.dtype() {
            DType::F32 => t,
            _ => B::float_cast(t, FloatDType::F32),
        };
        let mut tensor = to_flex::<B>(t).unwrap_or_else(|_| panic!("supports() checked Flex"));
        if tensor.layout().strides().iter().any(|&s| s < 0) {
            tensor = tensor.to_contiguous();
        }
        let l = tensor.layout();
        let s = l.strides();
        let d = l.shape();
        Self {
            offset: l.start_offset(),
            strides: [s[0], s[1], s[2], s[3]],
            dims: [d[0], d[1], d[2], d[3]],
            tensor,
        }
    }

    fn data(&self) -> &[f32] {
        self.tensor.storage::<f32>()
    }

    /// Offset of element `[i0, i1, i2, 0]`.
    fn at(&self, i0: usize, i1: usize, i2: usize) -> usize {
        (self.offset as isize
            + i0 as isize * self.strides[0]
            + i1 as isize * self.strides[1]
            + i2 as isize * self.strides[2]) as usize
    }

    /// Rows `rows` of heads `heads` of batch `bi`, as `[heads * rows, hd]` row-major in `dst`,
    /// times `scale`.
    fn pack(
        &self,
        bi: usize,
        heads: std::ops::Range<usize>,
        rows: std::ops::Range<usize>,
        scale: f32,
        dst: &mut [f32],
    ) {
        let (data, hd, sd) = (self.data(), self.dims[3], self.strides[3]);
        let mut r = 0;
        for h in heads {
            for i in rows.clone() {
                let at = self.at(bi, h, i);
                let out = &mut dst[r * hd..(r + 1) * hd];
                if sd == 1 {
                    for (o, x) in out.iter_mut().zip(&data[at..at + hd]) {
                        *o = x * scale;
                    }
                } else {
                    for (d, o) in out.iter_mut().enumerate() {
                        *o = data[(at as isize + d as isize * sd) as usize] * scale;
                    }
                }
                r += 1;
            }
        }
    }
}

/// `e^x`, vectorizable (Cephes' `expf`: `2^n e^r` with `|r| <= ln 2 / 2`, a degree-5
/// polynomial; relative error ~1e-7); 0 for `x` below -87.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    // Round to nearest through the 1.5 * 2^23 trick (no SSE4.1 `round` needed).
    let n = (xc * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_66;
    let p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scaled = e * f32::from_bits(((n as i32 + 127) << 23) as u32);
    if x < -87.0 { 0.0 } else { scaled }
}

/// Eight lanes, so the reductions below vectorize (a single f32 accumulator is a chain the
/// compiler may not reorder).
const LANES: usize = 8;

/// The largest element (`-inf` for none).
fn max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |a, &x| if x > a { x } else { a })
}

fn sum(row: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    tail.iter().chain(&acc).sum()
}

/// `row[i] = e^(row[i] - shift)`.
fn exp_shifted(row: &mut [f32], shift: f32) {
    for x in row.iter_mut() {
        *x = exp(*x - shift);
    }
}

/// `dst = beta * lhs @ rhs (+ dst when accumulate)`, row / column strides in elements.
#[allow(clippy::too_many_arguments)]
fn gemm(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    dst_rs: isize,
    accumulate: bool,
    lhs: *const f32,
    [lhs_rs, lhs_cs]: [isize; 2],
    rhs: *const f32,
    [rhs_rs, rhs_cs]: [isize; 2],
    beta: f32,
) {
    // Safety: every caller passes pointers into live buffers holding the strided matrices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs,
            accumulate,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A pointer the tasks write disjoint elements through.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// Safety: each task writes only elements no other task writes (the module doc).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so closures capture the `Send` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn blocks(n: usize, block: usize) -> Vec<std::ops::Range<usize>> {
    (0..n.div_ceil(block))
        .map(|i| i * block..((i + 1) * block).min(n))
        .collect()
}

/// The scores of one block with the keys a query does not see (its future, those before its
/// window) set to `-inf`.
fn mask_hidden(
    s: &mut [f32],
    [bi, g]: [usize; 2],
    rows: &std::ops::Range<usize>,
    cols: &std::ops::Range<usize>,
    spec: &AttentionSpec,
) {
    let m = cols.len();
    let pad = spec.pad(bi);
    for (r, row) in s.chunks_mut(m).enumerate().take(g * rows.len()) {
        let i = rows.start + r % rows.len();
        let query = spec.start + i;
        // `spec.sees`, a row at a time: outside the query's keys, then the padding.
        let keys = spec.keys(i);
        row[keys.end.saturating_sub(cols.start).min(m)..].fill(f32::NEG_INFINITY);
        row[..keys.start.saturating_sub(cols.start).min(m)].fill(f32::NEG_INFINITY);
        // The sequence's padding, but for the query's own position.
        for (c, x) in row
            .iter_mut()
            .enumerate()
            .take(pad.saturating_sub(cols.start).min(m))
        {
            if cols.start + c != query {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The scores of block (`rows`, `cols`) of key / value head `kh` of batch `bi` into `tile`
/// (`[g * rows, cols]`): the packed, scaled queries `qp` times the block's keys, with the keys
/// a query does not see at `-inf`.
#[allow(clippy::too_many_arguments)]
fn block_scores(
    tile: &mut [f32],
    qp: &[f32],
    k: &View,
    [bi, kh]: [usize; 2],
    g: usize,
    rows: &std::ops::Range<usize>,
    cols: &std::ops::Range<usize>,
    spec: &AttentionSpec,
) {
    let (hd, mk) = (k.dims[3], cols.len());
    let kp = k.at(bi, kh, cols.start);
    gemm(
        [g * rows.len(), mk, hd],
        tile.as_mut_ptr(),
        mk as isize,
        false,
        qp.as_ptr(),
        [hd as isize, 1],
        k.data()[kp..].as_ptr(),
        [k.strides[3], k.strides[2]],
        1.0,
    );
    if spec.visible(rows, cols).1 || spec.pad(bi) > cols.start {
        mask_hidden(tile, [bi, g], rows, cols, spec);
    }
}

/// The keep mask (scaled) of block (`rows`, `cols`) for batch `bi`'s heads `heads` (local).
fn keep_block(
    spec: &AttentionSpec,
    [s, t]: [usize; 2],
    bi: usize,
    heads: std::ops::Range<usize>,
    rows: &std::ops::Range<usize>,
    cols: &std::ops::Range<usize>,
) -> Option<Vec<f32>> {
    let d = spec.dropout.as_ref()?;
    let full = [d.batch_total, d.heads_total, s, t];
    let b0 = d.batch.start + bi;
    let h0 = d.heads.start + heads.start;
    let region = [b0..b0 + 1, h0..h0 + heads.len(), rows.clone(), cols.clone()];
    Some(dropout_mask_values(d.key, d.site, full, region, d.p))
}

/// The forward: the output `[b, hq, s, hd]` laid out as `[s, b, hq, hd]`, in q's dtype, and
/// each row's log-sum-exp `[b, hq, s]` (f32).
pub(crate) fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    spec: &AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = q.dtype();
    let (q, k, v) = (View::of::<B>(q), View::of::<B>(k), View::of::<B>(v));
    let [b, hq, s, hd] = q.dims;
    let [_, hkv, t, _] = k.dims;
    let g = hq / hkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let q_blocks = blocks(s, spec.block);
    let k_blocks = blocks(t, spec.block);
    let nq = q_blocks.len();
    let mut out = vec![0.0f32; s * b * hq * hd];
    let mut lse = vec![0.0f32; b * hq * s];
    let (out_ptr, lse_ptr) = (Out(out.as_mut_ptr()), Out(lse.as_mut_ptr()));
    let tasks: Vec<(usize, usize, usize)> = (0..b)
        .flat_map(|bi| (0..hkv).flat_map(move |kh| (0..nq).map(move |i| (bi, kh, i))))
        .collect();
    tasks.into_par_iter().for_each(|(bi, kh, i)| {
        let rows = q_blocks[i].clone();
        let n = rows.len();
        let gn = g * n;
        let heads = kh * g..(kh + 1) * g;
        let mut qp = vec![0.0f32; gn * hd];
        q.pack(bi, heads.clone(), rows.clone(), scale, &mut qp);
        let mut acc = vec![0.0f32; gn * hd];
        let mut m = vec![f32::NEG_INFINITY; gn];
        let mut l = vec![0.0f32; gn];
        let mut sc = vec![0.0f32; gn * spec.block];
        let vd = v.data();
        for cols in &k_blocks {
            if !spec.visible(&rows, cols).0 {
                continue;
            }
            let mk = cols.len();
            let tile = &mut sc[..gn * mk];
            block_scores(tile, &qp, &k, [bi, kh], g, &rows, cols, spec);
            let keep = keep_block(spec, [s, t], bi, heads.clone(), &rows, cols);
            for (r, row) in tile.chunks_mut(mk).enumerate() {
                let new_max = m[r].max(max(row));
                if new_max == f32::NEG_INFINITY {
                    // The row's window starts after this block: nothing seen yet.
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
            let inv = 1.0 / l[r];
            // Safety: row (qi, bi, h) of the output and of the lse belong to this task only.
            unsafe {
                let o = out_ptr.get().add(((qi * b + bi) * hq + h) * hd);
                for d in 0..hd {
                    *o.add(d) = acc[r * hd + d] * inv;
                }
                *lse_ptr.get().add((bi * hq + h) * s + qi) = m[r] + l[r].ln();
            }
        }
    });
    let out = FlexTensor::from_data(TensorData::new(out, [s, b, hq, hd]));
    let mut out = from_flex::<B>(out);
    if dtype != DType::F32 {
        out = B::float_cast(out, dtype.into());
    }
    let lse = from_flex::<B>(FlexTensor::from_data(TensorData::new(lse, [b, hq, s])));
    (B::float_permute(out, &[1, 2, 0, 3]), lse)
}

/// The backward: `(dq, dk, dv)` in the dtypes of q, k and v, from the upstream gradient `d_out`
/// (`[b, hq, s, hd]`), the output and the log-sum-exp the forward returned.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    spec: &AttentionSpec,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtypes = (q.dtype(), k.dtype(), v.dtype());
    let (q, k, v) = (View::of::<B>(q), View::of::<B>(k), View::of::<B>(v));
    let (o, d_o) = (View::of::<B>(out), View::of::<B>(d_out));
    let lse = to_flex::<B>(lse).unwrap_or_else(|_| panic!("the forward's lse is Flex"));
    let lse = lse.to_contiguous();
    let lse: &[f32] = lse.storage::<f32>();
    let [b, hq, s, hd] = q.dims;
    let [_, hkv, t, _] = k.dims;
    let g = hq / hkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let q_blocks = blocks(s, spec.block);
    let k_blocks = blocks(t, spec.block);
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
    tasks.into_par_iter().for_each(|(bi, kh)| {
        let (dq_ptr, dk_ptr, dv_ptr) = ptrs;
        let heads = kh * g..(kh + 1) * g;
        // Per query block: the scaled queries, dO, D = rowsum(dO * O), the log-sum-exps.
        let prepared: Vec<_> = q_blocks
            .iter()
            .map(|rows| {
                let gn = g * rows.len();
                let mut qp = vec![0.0f32; gn * hd];
                q.pack(bi, heads.clone(), rows.clone(), scale, &mut qp);
                let mut gp = vec![0.0f32; gn * hd];
                d_o.pack(bi, heads.clone(), rows.clone(), 1.0, &mut gp);
                let mut op = vec![0.0f32; gn * hd];
                o.pack(bi, heads.clone(), rows.clone(), 1.0, &mut op);
                let dd: Vec<f32> = gp
                    .chunks(hd)
                    .zip(op.chunks(hd))
                    .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum())
                    .collect();
                let ls: Vec<f32> = heads
                    .clone()
                    .flat_map(|h| rows.clone().map(move |i| (h, i)))
                    .map(|(h, i)| lse[(bi * hq + h) * s + i])
                    .collect();
                (qp, gp, dd, ls)
            })
            .collect();
        let mut dqp: Vec<Vec<f32>> = q_blocks
            .iter()
            .map(|r| vec![0.0f32; g * r.len() * hd])
            .collect();
        let mut p = vec![0.0f32; g * spec.block * spec.block];
        let mut dp = vec![0.0f32; g * spec.block * spec.block];
        let (kd, vd) = (k.data(), v.data());
        for cols in &k_blocks {
            let mk = cols.len();
            let mut dkb = vec![0.0f32; mk * hd];
            let mut dvb = vec![0.0f32; mk * hd];
            let (kp, vp) = (k.at(bi, kh, cols.start), v.at(bi, kh, cols.start));
            for (i, rows) in q_blocks.iter().enumerate() {
                if !spec.visible(rows, cols).0 {
                    continue;
                }
                let gn = g * rows.len();
                let (qp, gp, dd, ls) = &prepared[i];
                let p = &mut p[..gn * mk];
                block_scores(p, qp, &k, [bi, kh], g, rows, cols, spec);
                for (row, &l) in p.chunks_mut(mk).zip(ls) {
                    exp_shifted(row, l);
                }
                let keep = keep_block(spec, [s, t], bi, heads.clone(), rows, cols);
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
                    dvb.as_mut_ptr(),
                    hd as isize,
                    true,
                    pk.as_ptr(),
                    [1, mk as isize],
                    gp.as_ptr(),
                    [hd as isize, 1],
                    1.0,
                );
                // dP = dO V^T (* keep); dS = P (dP - D).
                let dp = &mut dp[..gn * mk];
                gemm(
                    [gn, mk, hd],
                    dp.as_mut_ptr(),
                    mk as isize,
                    false,
                    gp.as_ptr(),
                    [hd as isize, 1],
                    vd[vp..].as_ptr(),
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
                        *x = pv * (d - dd[r]);
                    }
                }
                // dQ += dS K (scaled at the end); dK += dS^T (scale Q).
                gemm(
                    [gn, hd, mk],
                    dqp[i].as_mut_ptr(),
                    hd as isize,
                    true,
                    dp.as_ptr(),
                    [mk as isize, 1],
                    kd[kp..].as_ptr(),
                    [k.strides[2], k.strides[3]],
                    1.0,
                );
                gemm(
                    [mk, hd, gn],
                    dkb.as_mut_ptr(),
                    hd as isize,
                    true,
                    dp.as_ptr(),
                    [1, mk as isize],
                    qp.as_ptr(),
                    [hd as isize, 1],
                    1.0,
                );
            }
            // Safety: rows `cols` of key / value head (bi, kh) belong to this task only.
            unsafe {
                let at = ((bi * hkv + kh) * t + cols.start) * hd;
                std::ptr::copy_nonoverlapping(dkb.as_ptr(), dk_ptr.get().add(at), mk * hd);
                std::ptr::copy_nonoverlapping(dvb.as_ptr(), dv_ptr.get().add(at), mk * hd);
            }
        }
        for (rows, block) in q_blocks.iter().zip(&dqp) {
            for (r, row) in block.chunks(hd).enumerate() {
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
    });
    let make = |values: Vec<f32>, shape: [usize; 4], dtype: DType| {
        let t = from_flex::<B>(FlexTensor::from_data(TensorData::new(
            values,
            Shape::from(shape.to_vec()),
        )));
        if dtype == DType::F32 {
            t
        } else {
            B::float_cast(t, dtype.into())
        }
    };
    (
        make(dq, [b, hq, s, hd], dtypes.0),
        make(dk, [b, hkv, t, hd], dtypes.1),
        make(dv, [b, hkv, t, hd], dtypes.2),
    )
}
