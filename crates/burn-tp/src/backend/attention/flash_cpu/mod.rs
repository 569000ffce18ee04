//! Flex's attention kernel (picked in `backend/flex.rs`, Flex tensors in and out): the fused
//! attention's tiles as one CPU kernel on Flex's storage (f32; half inputs widened to f32): the same algorithm as [`crate::backend::attention::flash`] (the diagram there), with each tile's scores in
//! a scratch tile between two GEMM calls (the `gemm` crate Flex's matmul runs on) instead of a
//! chain of tensor ops, each a pass over memory. Work is split over (batch, key / value head,
//! query tile) in the forward and over (batch, key / value head) in the backward (each task
//! owns its heads' `dq` rows: no two tasks write one element), on the calling rank's rayon pool.
//!
//! q, k, v and `dO` are read in place through their strides; the output is written as
//! `[s, b, hq, hd]` (the layout the layer's output projection reads as a view).
//!
//! | file          | what                                                                  |
//! |---------------|-----------------------------------------------------------------------|
//! | `mod.rs`      | the Flex views, the row helpers, the GEMM call, a tile's scores and mask |
//! | `forward.rs`  | the forward: per (batch, key / value head, query tile), online softmax |
//! | `backward.rs` | the backward: per (batch, key / value head), each visible tile's share |

use burn::backend::Flex;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::backend::attention::mask::{AttentionSpec, tiles};
use crate::backend::fused::cpu_math::exp;
use crate::backend::fused::dropout::dropout_mask_values;

/// A 4-d f32 view: storage, offset and strides in elements.
struct View {
    tensor: FlexTensor,
    offset: usize,
    strides: [isize; 4],
    dims: [usize; 4],
}

impl View {
    /// `t` widened to f32, read through its strides (a contiguous copy only for negative strides).
    fn of(t: FlexTensor) -> Self {
        let mut tensor = match t.dtype() {
            DType::F32 => t,
            _ => Flex::float_cast(t, FloatDType::F32),
        };
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
    #[inline(always)]
    fn at(&self, i0: usize, i1: usize, i2: usize) -> usize {
        (self.offset as isize
            + i0 as isize * self.strides[0]
            + i1 as isize * self.strides[1]
            + i2 as isize * self.strides[2]) as usize
    }

    /// Rows `rows` of heads `heads` of batch `bi`, as `[heads * rows, hd]` row-major in `dst`,
    /// times `scale`.
    #[inline(always)]
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

/// Eight lanes, so the reductions below vectorize (a single f32 accumulator is a chain the
/// compiler may not reorder).
const LANES: usize = 8;

/// The largest element (`-inf` for none).
#[inline(always)]
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

#[inline(always)]
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
#[inline(always)]
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

/// The scores of one tile with the keys a query does not see (its future, those before its
/// window) set to `-inf`.
#[inline(always)]
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
        let end = keys.end.min(spec.key_len(bi));
        row[end.saturating_sub(cols.start).min(m)..].fill(f32::NEG_INFINITY);
        row[..keys.start.saturating_sub(cols.start).min(m)].fill(f32::NEG_INFINITY);
        // Keys the sequence's mask hides anywhere.
        if let Some(hidden) = spec.key_mask.get(bi) {
            for (c, x) in row.iter_mut().enumerate() {
                if hidden.get(cols.start + c).copied().unwrap_or(false) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
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

/// The scores of tile (`rows`, `cols`) of key / value head `kh` of batch `bi` into `tile`
/// (`[g * rows, cols]`): the packed, scaled queries `qp` times the tile's keys, soft-capped
/// where the spec says (then, with `slope`, each capped score's derivative `1 - tanh^2` into
/// it, for the backward), with the keys a query does not see at `-inf`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_scores(
    tile: &mut [f32],
    slope: Option<&mut [f32]>,
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
    if let Some(cap) = spec.softcap {
        let cap = cap as f32;
        match slope {
            Some(slope) => {
                for (x, d) in tile.iter_mut().zip(slope.iter_mut()) {
                    let t = (*x / cap).tanh();
                    *x = cap * t;
                    *d = 1.0 - t * t;
                }
            }
            None => {
                for x in tile.iter_mut() {
                    *x = cap * (*x / cap).tanh();
                }
            }
        }
    }
    if spec.visible(rows, cols).1 || spec.pad(bi) > cols.start {
        mask_hidden(tile, [bi, g], rows, cols, spec);
    }
}

/// The keep mask (scaled) of tile (`rows`, `cols`) for batch `bi`'s heads `heads` (local).
fn keep_tile(
    spec: &AttentionSpec,
    [s, t]: [usize; 2],
    bi: usize,
    heads: std::ops::Range<usize>,
    rows: &std::ops::Range<usize>,
    cols: &std::ops::Range<usize>,
) -> Option<Vec<f32>> {
    let d = spec.dropout.as_ref()?;
    let ([s, t], rows_at, cols_at) = d.place([s, t], rows, cols);
    let full = [d.batch_total, d.heads_total, s, t];
    let b0 = d.batch.start + bi;
    let h0 = d.heads.start + heads.start;
    let region = [b0..b0 + 1, h0..h0 + heads.len(), rows_at, cols_at];
    Some(dropout_mask_values(d.key, d.site, full, region, d.p))
}

mod backward;
mod forward;

pub(crate) use backward::backward;
pub(crate) use forward::forward;
