//! What one rank passes to one collective: its kind, element type and shape. Ranks must agree
//! on all of it; a disagreement fails the call on every rank.

use std::fmt;

use crate::{DType, ReduceOp};

/// The kind of a collective call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Rank-order concatenation.
    AllGather,
    /// Sum, chunk `r` to rank `r`.
    ReduceScatter,
    /// Reduction to every rank.
    AllReduce(ReduceOp),
    /// Root's buffer to every rank.
    Broadcast {
        /// The sending rank.
        root: usize,
    },
    /// Synchronisation only.
    Barrier,
    /// `ProcessGroup::split` exchanging colours and keys.
    Split,
    /// Per-peer slices to each peer (counts of the caller's, checked across ranks first).
    AllToAll,
}

/// What one rank passed to one collective; ranks must agree on all of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// The collective.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Logical shape of this rank's input (`[len]` for plain buffers).
    pub shape: Vec<usize>,
}

impl OpDesc {
    pub(crate) fn new(kind: OpKind, dtype: DType, shape: Vec<usize>) -> Self {
        Self { kind, dtype, shape }
    }

    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes this rank receives in the call, for the link model (ring algorithms).
    pub(crate) fn recv_bytes(&self, rank: usize, world: usize) -> usize {
        let bytes = self.len() * self.dtype.size();
        match self.kind {
            OpKind::AllGather | OpKind::Split => bytes * (world - 1),
            OpKind::ReduceScatter => bytes / world * (world - 1),
            OpKind::AllReduce(_) => 2 * bytes / world * (world - 1),
            OpKind::Broadcast { root } if root != rank => bytes,
            OpKind::Broadcast { .. } | OpKind::Barrier => 0,
            // Counts differ per rank and are not in the descriptor: the call says its own
            // (`Work::with_recv_bytes`).
            OpKind::AllToAll => 0,
        }
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            OpKind::AllGather => "all_gather".to_string(),
            OpKind::ReduceScatter => "reduce_scatter".to_string(),
            OpKind::AllReduce(op) => format!("all_reduce({op:?})"),
            OpKind::Broadcast { root } => format!("broadcast(root={root})"),
            OpKind::Barrier => "barrier".to_string(),
            OpKind::Split => "split".to_string(),
            OpKind::AllToAll => "all_to_all".to_string(),
        };
        write!(f, "{kind} of {:?} {:?}", self.dtype, self.shape)
    }
}

/// The members of `rank`'s new group in a split, from every rank's `[color, key]` (gathered in
/// rank order): the parent ranks of `color`, ordered by `(key, rank)`, and `rank`'s position
/// among them.
pub(crate) fn split_members(all: &[i64], color: usize, rank: usize) -> (Vec<usize>, usize) {
    let mut members: Vec<(i64, usize)> = (0..all.len() / 2)
        .filter(|&r| all[2 * r] == color as i64)
        .map(|r| (all[2 * r + 1], r))
        .collect();
    members.sort_unstable();
    let new_rank = members
        .iter()
        .position(|&(_, r)| r == rank)
        .expect("this rank is a member of its colour");
    (members.into_iter().map(|(_, r)| r).collect(), new_rank)
}
