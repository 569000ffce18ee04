//! Ring attention (context parallelism, `crate::context`): each rank of the ring holds its
//! chunks of every sequence (queries, keys and values), computes its queries against the key /
//! value block it holds while it passes the block on to the next rank, and merges the partial
//! results by their log-sum-exps. The backward passes the blocks around again, each followed
//! by its gradients' partial sums, which arrive back at the block's owner complete.
//!
//! ```text
//!  cp = 4, load-balanced: the sequence in 2 cp = 8 chunks, rank r holding r and 7 - r
//!    chunks  0  1  2  3  4  5  6  7
//!    rank    0  1  2  3  3  2  1  0
//!
//!  step i: rank r holds the key / value block of rank r - i (its own at step 0), computes
//!  each (query chunk, key chunk) pair it sees, and meanwhile sends the block to r + 1:
//!
//!            step 0        step 1        step 2        step 3
//!  rank 0    kv 0  ─┐      kv 3  ─┐      kv 2          kv 1
//!  rank 1    kv 1   └──>   kv 0   └──>   kv 3          kv 2
//!  rank 2    kv 2          kv 1          kv 0          kv 3
//!  rank 3    kv 3          kv 2          kv 1          kv 0
//!
//!  a pair (query chunk at position qs, key chunk at ks): ks > qs: skipped (the future);
//!  ks = qs: causal (the kernel from `start` 0); ks < qs: every key seen (`start = qs - ks`).
//!  Merge: lse = log(e^lse_a + e^lse_b), out = (e^lse_a out_a + e^lse_b out_b) / e^lse.
//! ```
//!
//! With a sliding window the pairs wholly before a query chunk's window are skipped, and the
//! ring stops after the last step any rank needs: those blocks are not even sent. Every pair
//! is one call of the backend's attention kernel (`tp_attention_kernel`, its backward with the
//! merged output and log-sum-exp), so Flex runs its CPU kernel per pair.

use std::cell::Cell;
use std::time::Instant;

use burn::backend::{TensorMetadata, tensor::FloatTensor};
use burn::tensor::Shape;
use burn_std::Scalar;
use burn_tp_comm::{CommError, ProcessGroup, RingLinks};

use crate::backend::TpBackend;
use crate::backend::attention::mask::{AttentionSpec, MaskPositions};
use crate::backend::collective::host::{slice_dim, widen};
use crate::backend::collective::shift;

/// What this thread's ring attention did since [`reset_ring_stats`]: seconds in the kernel
/// (each rank's share of the attention: its balance), seconds waiting for a transfer (what the
/// compute did not hide), and what it sent. For the benches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RingStats {
    /// Seconds in the attention kernel's calls, forward and backward.
    pub compute_s: f64,
    /// Seconds waiting for a block or its gradients to arrive.
    pub wait_s: f64,
    /// Transfers sent.
    pub transfers: usize,
    /// Bytes sent.
    pub bytes: usize,
}

thread_local! {
    static STATS: Cell<RingStats> = const {
        Cell::new(RingStats { compute_s: 0.0, wait_s: 0.0, transfers: 0, bytes: 0 })
    };
}

/// This thread's [`RingStats`] since the last reset.
pub fn ring_stats() -> RingStats {
    STATS.with(Cell::get)
}

/// Starts this thread's [`RingStats`] from zero.
pub fn reset_ring_stats() {
    STATS.with(|s| s.set(RingStats::default()));
}

fn count(f: impl FnOnce(&mut RingStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}

/// `f`, its seconds counted as compute.
fn computing<T>(f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    count(|s| s.compute_s += t.elapsed().as_secs_f64());
    out
}

/// Posts `x` to the next rank (and the previous one's receive), labelled in the communication
/// profile.
fn post<B: TpBackend>(x: FloatTensor<B>, spec: &RingSpec) -> Result<shift::Shift, CommError> {
    let _scope = burn_tp_comm::profile::scope("ring attention");
    let bytes = x.shape().num_elements() * x.dtype().size();
    count(|s| {
        s.transfers += 1;
        s.bytes += bytes;
    });
    shift::start::<B>(x, &spec.links).map_err(|e| spec.fail(e))
}

/// Waits for a posted shift, its seconds counted as waiting.
fn arrive<B: TpBackend>(
    pending: shift::Shift,
    spec: &RingSpec,
    device: &B::Device,
) -> Result<FloatTensor<B>, CommError> {
    let _scope = burn_tp_comm::profile::scope("ring attention");
    let t = Instant::now();
    let out = pending.finish::<B>(device).map_err(|e| spec.fail(e));
    count(|s| s.wait_s += t.elapsed().as_secs_f64());
    out
}

/// One ring attention call: the ring, where every rank's chunks sit in the sequence, and the
/// attention of each step.
#[derive(Clone, Debug)]
pub struct RingSpec {
    /// The context-parallel group (its failure aborts it).
    pub group: ProcessGroup,
    /// This rank's links to its neighbours in the group.
    pub links: RingLinks,
    /// Each rank's chunks' first positions, in the order its q, k and v hold them.
    pub chunks: Vec<Vec<usize>>,
    /// Positions per chunk.
    pub chunk: usize,
    /// The scale, soft cap, window, dropout (placed per pair) and tile of every step; its
    /// `start` 0 and no padding.
    pub attention: AttentionSpec,
}

impl RingSpec {
    fn rank(&self) -> usize {
        self.links.rank()
    }

    fn size(&self) -> usize {
        self.links.size()
    }

    /// The rank whose block this rank holds at step `i`.
    fn source(&self, i: usize) -> usize {
        (self.rank() + self.size() - i % self.size()) % self.size()
    }

    /// The kernel's spec for query chunk `a` of `rank` against key chunk `b` of `src`, or
    /// `None` where no query of it sees a key of it.
    fn pair(&self, rank: usize, a: usize, src: usize, b: usize) -> Option<AttentionSpec> {
        let (qs, ks, c) = (self.chunks[rank][a], self.chunks[src][b], self.chunk);
        if ks > qs {
            return None;
        }
        let start = qs - ks;
        // The last key before the first query's window.
        if let Some(w) = self.attention.window
            && ks + c < (qs + 1).saturating_sub(w) + 1
        {
            return None;
        }
        let mut spec = AttentionSpec {
            start,
            ..self.attention.clone()
        };
        if let Some(d) = &mut spec.dropout {
            d.positions = Some(MaskPositions {
                queries: qs,
                keys: ks,
                length: self.chunks.len() * self.chunks[0].len() * c,
            });
        }
        Some(spec)
    }

    /// Steps the ring runs: one past the farthest block any rank's queries see.
    fn steps(&self) -> usize {
        let n = self.size();
        let parts = self.chunks[0].len();
        (0..n)
            .rev()
            .find(|&i| {
                (0..n).any(|r| {
                    let src = (r + n - i) % n;
                    (0..parts).any(|a| (0..parts).any(|b| self.pair(r, a, src, b).is_some()))
                })
            })
            .map_or(1, |i| i + 1)
    }

    /// Aborts the group with `e` (so every rank hears now) and returns it.
    fn fail(&self, e: CommError) -> CommError {
        self.group.abort(&e);
        e
    }
}

/// Chunk `a` (of `chunk` positions) of dim 2.
fn part<B: TpBackend>(x: &FloatTensor<B>, a: usize, chunk: usize) -> FloatTensor<B> {
    slice_dim::<B>(x.clone(), 2, a * chunk..(a + 1) * chunk)
}

/// k and v of a block travelling as one tensor (`[2 b, ..]`: k's batch rows, then v's).
fn halves<B: TpBackend>(kv: &FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let b = kv.shape()[0] / 2;
    (
        slice_dim::<B>(kv.clone(), 0, 0..b),
        slice_dim::<B>(kv.clone(), 0, b..2 * b),
    )
}

/// `x` `[b, h, s]` as `[b, h, s, 1]`.
fn column<B: TpBackend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let s = x.shape();
    B::float_reshape(x, Shape::from(vec![s[0], s[1], s[2], 1]))
}

/// The merge of two partial results `(out [b, h, s, hd], lse [b, h, s])` over disjoint keys. A
/// row neither saw (both log-sum-exps `-inf`) stays output 0, `-inf`.
fn merge<B: TpBackend>(
    (o1, l1): (FloatTensor<B>, FloatTensor<B>),
    (o2, l2): (FloatTensor<B>, FloatTensor<B>),
) -> (FloatTensor<B>, FloatTensor<B>) {
    let m = B::float_max_dim(
        B::float_cat(vec![column::<B>(l1.clone()), column::<B>(l2.clone())], 3),
        3,
    );
    let m = B::float_clamp_min(B::float_reshape(m, l1.shape()), Scalar::Float(-1e30));
    let (w1, w2) = (
        B::float_exp(B::float_sub(l1, m.clone())),
        B::float_exp(B::float_sub(l2, m.clone())),
    );
    let total = B::float_add(w1.clone(), w2.clone());
    let out = B::float_add(
        B::float_mul(o1, column::<B>(w1)),
        B::float_mul(o2, column::<B>(w2)),
    );
    let out = B::float_div(
        out,
        column::<B>(B::float_clamp_min(total.clone(), Scalar::Float(1e-30))),
    );
    (out, B::float_add(m, B::float_log(total)))
}

/// The forward: this rank's output `[b, hq, s, hd]` (q's dtype; `s` its chunks' positions) and
/// its log-sum-exps `[b, hq, s]` over the whole sequence's keys.
///
/// # Errors
/// A transfer's failure (the group aborted).
pub(crate) fn forward<B: TpBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    spec: &RingSpec,
) -> Result<(FloatTensor<B>, FloatTensor<B>), CommError> {
    let (dtype, device) = (q.dtype(), q.device());
    let (r, c, parts) = (spec.rank(), spec.chunk, spec.chunks[0].len());
    let steps = spec.steps();
    let mut acc: Vec<Option<(FloatTensor<B>, FloatTensor<B>)>> = vec![None; parts];
    // k and v travel as one tensor.
    let mut kv = B::float_cat(vec![k, v], 0);
    for i in 0..steps {
        let next = (i + 1 < steps)
            .then(|| post::<B>(kv.clone(), spec))
            .transpose()?;
        let src = spec.source(i);
        let (k, v) = halves::<B>(&kv);
        for (a, acc) in acc.iter_mut().enumerate() {
            for b in 0..parts {
                let Some(pair) = spec.pair(r, a, src, b) else {
                    continue;
                };
                let (o, l) = computing(|| {
                    B::tp_attention_kernel(
                        part::<B>(&q, a, c),
                        part::<B>(&k, b, c),
                        part::<B>(&v, b, c),
                        pair,
                    )
                });
                let new = (widen::<B>(o), l);
                *acc = Some(match acc.take() {
                    None => new,
                    Some(old) => merge::<B>(old, new),
                });
            }
        }
        if let Some(next) = next {
            kv = arrive::<B>(next, spec, &device)?;
        }
    }
    let (outs, lses): (Vec<_>, Vec<_>) = acc
        .into_iter()
        .map(|a| a.expect("a query chunk sees its own diagonal"))
        .unzip();
    let out = B::float_cat(outs, 2);
    let out = if out.dtype() == dtype {
        out
    } else {
        B::float_cast(out, dtype.into())
    };
    Ok((out, B::float_cat(lses, 2)))
}

/// `(dq, dk, dv)`.
type Grads<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// The backward: `(dq, dk, dv)` of this rank's chunks (in q's, k's and v's dtypes), from the
/// upstream gradient `d_out` and what [`forward`] returned.
///
/// Each step's block is followed around the ring by its gradients' partial sums: this rank
/// adds its share and passes them on; after the ring's steps they travel on (without compute)
/// until they reach the block's owner, `cp` transfers after they left it.
///
/// # Errors
/// A transfer's failure (the group aborted).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<B: TpBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    d_out: FloatTensor<B>,
    spec: &RingSpec,
) -> Result<Grads<B>, CommError> {
    let (q_dtype, k_dtype, v_dtype) = (q.dtype(), k.dtype(), v.dtype());
    let device = q.device();
    let (r, n, c, parts) = (spec.rank(), spec.size(), spec.chunk, spec.chunks[0].len());
    let steps = spec.steps();
    let mut dq: Vec<Option<FloatTensor<B>>> = vec![None; parts];
    let mut kv = B::float_cat(vec![k, v], 0);
    // The gradients of the block held: k's then v's, widened (they are sums).
    let zeros = |like: &FloatTensor<B>| {
        let like = widen::<B>(like.clone());
        B::float_zeros(like.shape(), &device, like.dtype().into())
    };
    let mut incoming: Option<shift::Shift> = None;
    let mut dkv = zeros(&kv);
    for i in 0..steps {
        let next = (i + 1 < steps)
            .then(|| post::<B>(kv.clone(), spec))
            .transpose()?;
        let src = spec.source(i);
        let (k, v) = halves::<B>(&kv);
        let mut dk: Vec<Option<FloatTensor<B>>> = vec![None; parts];
        let mut dv: Vec<Option<FloatTensor<B>>> = vec![None; parts];
        for (a, dq) in dq.iter_mut().enumerate() {
            for b in 0..parts {
                let Some(pair) = spec.pair(r, a, src, b) else {
                    continue;
                };
                let (gq, gk, gv) = computing(|| {
                    B::tp_attention_kernel_backward(
                        part::<B>(&q, a, c),
                        part::<B>(&k, b, c),
                        part::<B>(&v, b, c),
                        part::<B>(&out, a, c),
                        part::<B>(&lse, a, c),
                        part::<B>(&d_out, a, c),
                        pair,
                    )
                });
                let add = |acc: &mut Option<FloatTensor<B>>, g: FloatTensor<B>| {
                    let g = widen::<B>(g);
                    *acc = Some(match acc.take() {
                        None => g,
                        Some(x) => B::float_add(x, g),
                    });
                };
                add(dq, gq);
                add(&mut dk[b], gk);
                add(&mut dv[b], gv);
            }
        }
        // This step's share of the block's gradients, `[2 b, hkv, parts c, hd]` as kv.
        let mine: Vec<FloatTensor<B>> = dk
            .into_iter()
            .chain(dv)
            .enumerate()
            .map(|(j, g)| g.unwrap_or_else(|| zeros(&part::<B>(&k, j % parts, c))))
            .collect();
        let (dk_mine, dv_mine) = mine.split_at(parts);
        let mine = B::float_cat(
            vec![
                B::float_cat(dk_mine.to_vec(), 2),
                B::float_cat(dv_mine.to_vec(), 2),
            ],
            0,
        );
        dkv = match incoming.take() {
            // The block's partial sums from the ranks it visited before.
            Some(prev) => B::float_add(arrive::<B>(prev, spec, &device)?, mine),
            None => B::float_add(dkv, mine),
        };
        if n > 1 {
            incoming = Some(post::<B>(dkv.clone(), spec)?);
        }
        if let Some(next) = next {
            kv = arrive::<B>(next, spec, &device)?;
        }
    }
    // The partial sums travel on to their owners: `cp` hops after they left them in all (the
    // one in flight holds block `r - steps`'s).
    for _ in steps..n {
        let held = incoming.take().expect("a shift is in flight");
        let held = arrive::<B>(held, spec, &device)?;
        incoming = Some(post::<B>(held, spec)?);
    }
    if let Some(last) = incoming {
        dkv = arrive::<B>(last, spec, &device)?;
    }
    let cast = |x: FloatTensor<B>, dtype: burn::tensor::DType| {
        if x.dtype() == dtype {
            x
        } else {
            B::float_cast(x, dtype.into())
        }
    };
    let dq = B::float_cat(
        dq.into_iter()
            .enumerate()
            .map(|(a, g)| g.unwrap_or_else(|| zeros(&part::<B>(&q, a, c))))
            .collect(),
        2,
    );
    let (dk, dv) = halves::<B>(&dkv);
    Ok((cast(dq, q_dtype), cast(dk, k_dtype), cast(dv, v_dtype)))
}
