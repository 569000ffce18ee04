//! Context parallelism: every sequence split over a group of `cp` ranks, each holding its
//! chunks of every activation, so the longest sequence grows with the ranks (Megatron-Core's
//! `--context-parallel-size`, torchtitan's context parallel). Only the attention needs the
//! other chunks: it passes the keys and values around the group's ring
//! ([`ContextParallel::attention`], the ring of `backend/attention/ring.rs`); everything else
//! is per position.
//!
//! The chunks, in Megatron's load-balanced layout (the default): the sequence in `2 cp` chunks,
//! rank `i` holding chunks `i` and `2 cp - 1 - i`, so every rank has as many causal (query, key)
//! pairs to compute:
//!
//! ```text
//!  cp = 2, seq 8:  positions  0 1 | 2 3 | 4 5 | 6 7
//!                  chunk        0     1     2     3
//!                  rank         0     1     1     0      rank 0: [0 1 6 7], rank 1: [2 3 4 5]
//!  contiguous:     rank         0     0     1     1      rank 0: [0 1 2 3]   (rank cp - 1 has
//!                                                          cp times rank 0's attention work)
//! ```
//!
//! The model gives each position its global position (rotary angles, learned positions), the
//! data loader gives each rank its chunks ([`ContextParallel::split`]), and the loss is each
//! rank's mean over its tokens, the same count on every rank, so the data-parallel mean over the
//! ranks that carve `cp` out of dp ([`crate::mesh::DeviceMesh::context_group`]) is the whole
//! sequence's mean.

use std::ops::Range;

use burn::backend::Dispatch;
use burn::tensor::Tensor;
use burn::tensor::kind::Basic;
use burn_tp_comm::{ProcessGroup, RingLinks};

use crate::backend::{AttentionSpec, RingSpec, TpBackend};
use crate::ops::into_tensor;
use crate::{Result, TpError};

/// How a sequence's positions are dealt to the ranks of a context-parallel group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpLayout {
    /// `2 cp` chunks, rank `i` holding chunks `i` and `2 cp - 1 - i` (Megatron's): the causal
    /// attention's work the same on every rank.
    #[default]
    LoadBalanced,
    /// `cp` chunks, rank `i` holding chunk `i`.
    Contiguous,
}

/// A context-parallel group and its ring: which chunks of a sequence this rank holds, and the
/// attention over the whole sequence from them.
#[derive(Clone, Debug)]
pub struct ContextParallel {
    group: ProcessGroup,
    links: RingLinks,
    layout: CpLayout,
}

impl ContextParallel {
    /// The ring of `group` (its links made once: collective over the group).
    ///
    /// # Errors
    /// A communication error.
    pub fn new(group: ProcessGroup, layout: CpLayout) -> Result<Self> {
        let links = group.ring_links()?;
        Ok(Self {
            group,
            links,
            layout,
        })
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Ranks in the group (`cp`).
    pub fn size(&self) -> usize {
        self.group.world_size()
    }

    /// This rank's index in it.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The layout.
    pub fn layout(&self) -> CpLayout {
        self.layout
    }

    /// Chunks per rank: 2 load-balanced, 1 contiguous.
    fn parts(&self) -> usize {
        match self.layout {
            CpLayout::LoadBalanced => 2,
            CpLayout::Contiguous => 1,
        }
    }

    /// The positions of `rank`'s chunks of a sequence of `seq` (each `seq / (parts cp)` long).
    fn chunks_of(&self, rank: usize, seq: usize) -> Vec<Range<usize>> {
        let (n, parts) = (self.size(), self.parts());
        let c = seq / (parts * n);
        let ids: Vec<usize> = match self.layout {
            CpLayout::LoadBalanced => vec![rank, 2 * n - 1 - rank],
            CpLayout::Contiguous => vec![rank],
        };
        ids.into_iter().map(|i| i * c..(i + 1) * c).collect()
    }

    /// The positions of this rank's chunks of a sequence of `seq` positions, in the order its
    /// tensors hold them.
    ///
    /// # Errors
    /// [`TpError::Config`] naming both when `seq` is not a multiple of the chunks (`2 cp`
    /// load-balanced, `cp` contiguous).
    pub fn chunks(&self, seq: usize) -> Result<Vec<Range<usize>>> {
        let chunks = self.parts() * self.size();
        if seq == 0 || !seq.is_multiple_of(chunks) {
            return Err(TpError::Config(format!(
                "context parallelism: a sequence of {seq} positions does not split into {chunks} \
                 equal chunks (cp {} x {} per rank, {:?})",
                self.size(),
                self.parts(),
                self.layout
            )));
        }
        Ok(self.chunks_of(self.rank(), seq))
    }

    /// This rank's positions of a sequence of `seq`, in the order its tensors hold them.
    ///
    /// # Errors
    /// As [`chunks`](Self::chunks).
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>> {
        Ok(self.chunks(seq)?.into_iter().flatten().collect())
    }

    /// This rank's chunks of `x` (floats, ids, masks), whose dim `dim` is the whole sequence
    /// (`[.., seq, ..] -> [.., seq / cp, ..]`; no communication; differentiable).
    ///
    /// # Errors
    /// [`TpError::DimOutOfRange`]; as [`chunks`](Self::chunks).
    pub fn split<const D: usize, K: Basic>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>> {
        if dim >= D {
            return Err(TpError::DimOutOfRange {
                op: "ContextParallel::split",
                dim,
                rank: D,
            });
        }
        let parts: Vec<Tensor<D, K>> = self
            .chunks(x.dims()[dim])?
            .into_iter()
            .map(|r| x.clone().narrow(dim, r.start, r.len()))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    /// Causal attention of this rank's queries over the whole sequence's keys, passed around the
    /// ring: `q` `[b, hq, s, hd]`, `k`, `v` `[b, hkv, s, hd]` this rank's chunks (`s = seq / cp`,
    /// in [`chunks`](Self::chunks)' order), each key / value head serving `hq / hkv` query heads;
    /// returns `[b, hq, s, hd]`. `spec` gives the scale, soft cap, window, dropout (its mask the
    /// whole sequence's: `[batch, heads, seq, seq]`) and tile; its `start` must be 0 and its
    /// padding empty. The backward passes the blocks and their gradients around again.
    ///
    /// # Errors
    /// [`TpError::Shape`] naming the shapes (other batch or head sizes, `hkv` not dividing `hq`,
    /// a length that does not split into this rank's chunks); [`TpError::Config`] for a
    /// `start` or padding; [`TpError::Comm`] when a transfer fails (every rank errs: the group
    /// is aborted, or the link times out).
    pub fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        spec: AttentionSpec,
    ) -> Result<Tensor<4>> {
        let ([b, hq, s, hd], [kb, hkv, t, khd], vd) = (q.dims(), k.dims(), v.dims());
        let (n, parts) = (self.size(), self.parts());
        if kb != b
            || khd != hd
            || t != s
            || vd != [b, hkv, t, hd]
            || hkv == 0
            || !hq.is_multiple_of(hkv)
            || s == 0
            || !s.is_multiple_of(parts)
            || spec.tile == 0
        {
            return Err(TpError::Shape {
                op: "ContextParallel::attention",
                expected: format!(
                    "q [b, hq, s, hd], k and v [b, hkv, s, hd] with hkv dividing hq and s this \
                     rank's {parts} equal chunks of the sequence (k {:?}, v {vd:?}, tile {})",
                    k.dims(),
                    spec.tile
                ),
                got: q.dims().to_vec(),
            });
        }
        if spec.start != 0 || !spec.padding.is_empty() {
            return Err(TpError::Config(format!(
                "ContextParallel::attention: start {} and padding {:?}: the ring attends over \
                 whole sequences from position 0, without padding",
                spec.start, spec.padding
            )));
        }
        let seq = s * n;
        let chunk = s / parts;
        let ring = RingSpec {
            group: self.group.clone(),
            links: self.links.clone(),
            chunks: (0..n)
                .map(|r| self.chunks_of(r, seq).iter().map(|c| c.start).collect())
                .collect(),
            chunk,
            attention: spec,
        };
        into_tensor(<Dispatch as TpBackend>::tp_ring_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            ring,
        ))
    }
}
