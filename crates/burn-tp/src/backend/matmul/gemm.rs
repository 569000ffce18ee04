//! How a row-major product `C = A · B` (with strides, transposed views, batches) maps onto a
//! column-major BLAS call (cuBLAS's `gemm` / `gemm_strided_batched`), without a GPU: the arguments
//! only. The CUDA backend's GEMM hook (issue 36) calls cuBLAS with them; a layout they cannot
//! express is a [`Fallback`] naming why, and the backend's own matmul runs instead.
//!
//! cuBLAS reads column-major matrices. A row-major `X [r, c]` whose rows are `ld` apart is, read
//! column-major, `X^T [c, r]` with leading dimension `ld`. So the row-major product is computed as
//! its transpose, `C^T = B^T · A^T`, in column-major: cuBLAS's first operand is our `B`, its second
//! our `A`, and its `m, n` are our `N, M`. An operand stored column by column (a transposed view:
//! `X^T` row-major) is read with the transpose flag instead of a copy.
//!
//! ```text
//!  row-major                     column-major (what cuBLAS computes)
//!  C [M, N] = A [M, K] · B [K, N]  <=>  C^T [N, M] = op(B) [N, K] · op(A) [K, M]
//!  X rows `ld` apart (cols 1)      ->  op = N, ld
//!  X cols `ld` apart (rows 1)      ->  op = T, ld
//!  anything else                   ->  Fallback
//! ```

/// A BLAS operand flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read as stored.
    N,
    /// Read transposed.
    T,
}

/// One operand of a row-major product: `[batch, rows, cols]` (`batch = 1` for a plain matrix)
/// with element strides for each dimension (a batch stride of 0 broadcasts it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `[batch, rows, cols]`.
    pub shape: [usize; 3],
    /// Element strides of `[batch, rows, cols]`.
    pub strides: [usize; 3],
}

impl Layout {
    /// A dense row-major `[batch, rows, cols]`.
    pub fn dense(batch: usize, rows: usize, cols: usize) -> Self {
        Self {
            shape: [batch, rows, cols],
            strides: [rows * cols, cols, 1],
        }
    }

    /// Its transpose as a view (no copy): `[batch, cols, rows]` over the same elements.
    pub fn transposed(self) -> Self {
        let [b, r, c] = self.shape;
        let [sb, sr, sc] = self.strides;
        Self {
            shape: [b, c, r],
            strides: [sb, sc, sr],
        }
    }
}

/// The arguments of a column-major strided-batched GEMM computing a row-major product:
/// `C_i = alpha · op(first)_i · op(second)_i + beta · C_i` for `i < batch`, where `first` is the
/// product's `B` and `second` its `A` (see the module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    /// Flag of the first operand (the product's `B`).
    pub op_first: Op,
    /// Flag of the second operand (the product's `A`).
    pub op_second: Op,
    /// Rows of `C^T` (the product's `N`).
    pub m: usize,
    /// Columns of `C^T` (the product's `M`, times the batch when it is flattened into it).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Leading dimension of the first operand.
    pub ld_first: usize,
    /// Leading dimension of the second operand.
    pub ld_second: usize,
    /// Leading dimension of `C^T`.
    pub ld_out: usize,
    /// Products in the batch (1: a plain GEMM).
    pub batch: usize,
    /// Element strides between batch items of the first, second and output operands.
    pub batch_strides: [usize; 3],
}

/// Why a product does not map onto one BLAS call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fallback(pub String);

/// An operand's flag and leading dimension, read column-major (see the module), or why not.
fn op_ld(name: &str, l: &Layout) -> Result<(Op, usize), Fallback> {
    let [_, r, c] = l.shape;
    let [_, sr, sc] = l.strides;
    // A dimension of size 1 has no stride that matters: take the densest reading.
    let sc = if c == 1 { 1 } else { sc };
    let sr = if r == 1 { c.max(1) } else { sr };
    if sc == 1 && sr >= c.max(1) {
        Ok((Op::N, sr))
    } else if sr == 1 && sc >= r.max(1) {
        Ok((Op::T, sc))
    } else {
        Err(Fallback(format!(
            "{name} {:?} with strides {:?}: neither its rows nor its columns are contiguous",
            l.shape, l.strides
        )))
    }
}

/// The BLAS call of the row-major `out [batch, M, N] = a [batch, M, K] · b [batch, K, N]`.
///
/// A batch of `a` whose items follow each other row after row (and one shared `b`, batch stride
/// 0 or batch 1) is flattened into `M`: one plain GEMM. Otherwise a strided batch.
///
/// # Errors
/// [`Fallback`] naming the operand and its layout: inner sizes that differ, an operand whose rows
/// and columns are both strided, an output not stored row by row, batches that differ.
pub fn gemm_args(a: &Layout, b: &Layout, out: &Layout) -> Result<GemmArgs, Fallback> {
    let ([ba, m, k], [bb, kb, n], [bo, mo, no]) = (a.shape, b.shape, out.shape);
    if k != kb || (mo, no) != (m, n) {
        return Err(Fallback(format!(
            "shapes a {:?} · b {:?} -> out {:?} do not chain",
            a.shape, b.shape, out.shape
        )));
    }
    let batch = ba.max(bb);
    if bo != batch || (ba != batch && ba != 1) || (bb != batch && bb != 1) {
        return Err(Fallback(format!(
            "batches a {ba}, b {bb}, out {bo} differ (only 1 broadcasts)"
        )));
    }
    let (op_out, ld_out) = op_ld("out", out)?;
    if op_out != Op::N {
        return Err(Fallback(format!(
            "out {:?} with strides {:?} is not stored row by row",
            out.shape, out.strides
        )));
    }
    let (op_a, ld_a) = op_ld("a", a)?;
    let (op_b, ld_b) = op_ld("b", b)?;
    let stride = |l: &Layout, items: usize| if items == 1 { 0 } else { l.strides[0] };
    let (sa, sb, so) = (stride(a, ba), stride(b, bb), out.strides[0]);
    // The batch folded into M: a's items row after row, one b for all, out likewise.
    let flat = batch > 1 && op_a == Op::N && sb == 0 && sa == m * ld_a && so == m * ld_out;
    Ok(if flat || batch == 1 {
        GemmArgs {
            op_first: op_b,
            op_second: op_a,
            m: n,
            n: m * if flat { batch } else { 1 },
            k,
            ld_first: ld_b,
            ld_second: ld_a,
            ld_out,
            batch: 1,
            batch_strides: [0, 0, 0],
        }
    } else {
        GemmArgs {
            op_first: op_b,
            op_second: op_a,
            m: n,
            n: m,
            k,
            ld_first: ld_b,
            ld_second: ld_a,
            ld_out,
            batch,
            batch_strides: [sb, sa, so],
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The column-major reference BLAS: `C_i = alpha op(A_i) op(B_i) + beta C_i`, each matrix at
    /// `offset + i * stride` of its buffer, element `(r, c)` at `r + c * ld` (after the flag).
    #[allow(clippy::too_many_arguments)]
    fn reference_gemm(
        g: &GemmArgs,
        alpha: f64,
        first: &[f64],
        second: &[f64],
        beta: f64,
        out: &mut [f64],
    ) {
        for i in 0..g.batch {
            let (fa, fb, fc) = (
                i * g.batch_strides[0],
                i * g.batch_strides[1],
                i * g.batch_strides[2],
            );
            for r in 0..g.m {
                for c in 0..g.n {
                    let mut acc = 0.0;
                    for p in 0..g.k {
                        let x = match g.op_first {
                            Op::N => first[fa + r + p * g.ld_first],
                            Op::T => first[fa + p + r * g.ld_first],
                        };
                        let y = match g.op_second {
                            Op::N => second[fb + p + c * g.ld_second],
                            Op::T => second[fb + c + p * g.ld_second],
                        };
                        acc += x * y;
                    }
                    let o = &mut out[fc + r + c * g.ld_out];
                    *o = alpha * acc + beta * *o;
                }
            }
        }
    }

    fn at(l: &Layout, buf: &[f64], i: usize, r: usize, c: usize) -> f64 {
        let [sb, sr, sc] = l.strides;
        let i = if l.shape[0] == 1 { 0 } else { i };
        buf[i * sb + r * sr + c * sc]
    }

    /// A buffer large enough for `l`, its elements distinct.
    fn buffer(l: &Layout, seed: u64) -> Vec<f64> {
        let [b, r, c] = l.shape;
        let [sb, sr, sc] = l.strides;
        let len = (b - 1) * sb + (r - 1) * sr + (c - 1) * sc + 1;
        (0..len)
            .map(|i| ((i as u64 * 2_654_435_761 + seed) % 97) as f64 / 13.0 - 3.0)
            .collect()
    }

    /// Maps `a · b -> out`, runs the column-major reference on the buffers, and checks every
    /// element against the row-major product (with beta = 1: the old output added).
    fn check(a: Layout, b: Layout, out: Layout, beta: f64) -> GemmArgs {
        let g = gemm_args(&a, &b, &out).unwrap_or_else(|e| panic!("{a:?} {b:?} {out:?}: {e:?}"));
        let (xa, xb) = (buffer(&a, 1), buffer(&b, 2));
        let mut xo = buffer(&out, 3);
        let before = xo.clone();
        reference_gemm(&g, 1.0, &xb, &xa, beta, &mut xo);
        let [batch, m, n] = out.shape;
        let k = a.shape[2];
        for i in 0..batch {
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| at(&a, &xa, i, r, p) * at(&b, &xb, i, p, c))
                        .sum::<f64>()
                        + beta * at(&out, &before, i, r, c);
                    let got = at(&out, &xo, i, r, c);
                    assert!(
                        (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                        "{a:?} · {b:?} -> {out:?} via {g:?}: [{i}, {r}, {c}] = {got}, want {want}"
                    );
                }
            }
        }
        g
    }

    #[test]
    fn every_layout_maps_to_a_blas_call_that_computes_the_product() {
        let pitched = |b, r, c, ld| Layout {
            shape: [b, r, c],
            strides: [r * ld, ld, 1],
        };
        // Dense, odd sizes.
        let g = check(
            Layout::dense(1, 7, 5),
            Layout::dense(1, 5, 3),
            Layout::dense(1, 7, 3),
            0.0,
        );
        assert_eq!((g.m, g.n, g.k, g.batch), (3, 7, 5, 1));
        assert_eq!((g.op_first, g.op_second), (Op::N, Op::N));
        // Pitched rows (cubecl pads rows): the pitch is the leading dimension.
        let g = check(
            pitched(1, 6, 5, 8),
            pitched(1, 5, 3, 4),
            pitched(1, 6, 3, 7),
            0.0,
        );
        assert_eq!((g.ld_first, g.ld_second, g.ld_out), (4, 8, 7));
        // Transposed views: flags, no copies (the dgrad's W^T, the wgrad's X^T).
        let g = check(
            Layout::dense(1, 5, 6).transposed(),
            Layout::dense(1, 3, 5).transposed(),
            Layout::dense(1, 6, 3),
            0.0,
        );
        assert_eq!((g.op_first, g.op_second), (Op::T, Op::T));
        check(
            Layout::dense(1, 6, 5),
            pitched(1, 3, 5, 9).transposed(),
            Layout::dense(1, 6, 3),
            0.0,
        );
        // wgrad accumulated block by block: beta = 1.
        check(
            Layout::dense(1, 9, 4).transposed(),
            Layout::dense(1, 9, 5),
            Layout::dense(1, 4, 5),
            1.0,
        );
        // A batch of activations against one weight, row after row: flattened into one GEMM.
        let g = check(
            Layout::dense(3, 4, 5),
            Layout::dense(1, 5, 2),
            Layout::dense(3, 4, 2),
            0.0,
        );
        assert_eq!((g.batch, g.n), (1, 12));
        // Broadcast weight with a batch stride of 0: flattened too.
        let shared = Layout {
            shape: [3, 5, 2],
            strides: [0, 2, 1],
        };
        let g = check(Layout::dense(3, 4, 5), shared, Layout::dense(3, 4, 2), 0.0);
        assert_eq!(g.batch, 1);
        // A pitched batch whose items follow each other still flattens.
        let g = check(
            pitched(3, 4, 5, 6),
            Layout::dense(1, 5, 2),
            Layout::dense(3, 4, 2),
            0.0,
        );
        assert_eq!((g.batch, g.n, g.ld_second), (1, 12, 6));
        // Batches that cannot flatten (gaps between a's items, both operands batched): strided.
        let gaps = Layout {
            shape: [3, 4, 5],
            strides: [30, 6, 1],
        };
        let g = check(gaps, Layout::dense(1, 5, 2), Layout::dense(3, 4, 2), 0.0);
        assert_eq!((g.batch, g.batch_strides), (3, [0, 30, 8]));
        let g = check(
            Layout::dense(2, 3, 4),
            Layout::dense(2, 4, 5),
            Layout::dense(2, 3, 5),
            1.0,
        );
        assert_eq!((g.batch, g.batch_strides), (2, [20, 12, 15]));
        // Attention's blocks: q [h, s, d] · k^T [h, d, t].
        check(
            Layout::dense(4, 6, 8),
            Layout::dense(4, 7, 8).transposed(),
            Layout::dense(4, 6, 7),
            0.0,
        );
        // Size-1 dimensions: any stride.
        check(
            Layout::dense(1, 1, 5),
            Layout::dense(1, 5, 1),
            Layout::dense(1, 1, 1),
            0.0,
        );
        check(
            Layout::dense(1, 8191, 100),
            Layout::dense(1, 100, 1),
            Layout::dense(1, 8191, 1),
            0.0,
        );
    }

    #[test]
    fn layouts_blas_cannot_read_fall_back_naming_why() {
        // Both strides > 1 (every other column of every other row).
        let gappy = Layout {
            shape: [1, 3, 4],
            strides: [24, 8, 2],
        };
        let e = gemm_args(&gappy, &Layout::dense(1, 4, 2), &Layout::dense(1, 3, 2)).unwrap_err();
        assert!(
            e.0.contains("a [1, 3, 4]") && e.0.contains("[24, 8, 2]"),
            "{e:?}"
        );
        // An output stored column by column.
        let e = gemm_args(
            &Layout::dense(1, 3, 4),
            &Layout::dense(1, 4, 2),
            &Layout::dense(1, 2, 3).transposed(),
        )
        .unwrap_err();
        assert!(e.0.contains("not stored row by row"), "{e:?}");
        // Shapes that do not chain; batches that differ.
        let e = gemm_args(
            &Layout::dense(1, 3, 4),
            &Layout::dense(1, 5, 2),
            &Layout::dense(1, 3, 2),
        );
        assert!(e.unwrap_err().0.contains("do not chain"));
        let e = gemm_args(
            &Layout::dense(2, 3, 4),
            &Layout::dense(3, 4, 2),
            &Layout::dense(3, 3, 2),
        );
        assert!(e.unwrap_err().0.contains("batches a 2, b 3"));
    }
}
