//! The call descriptor: before any collective, every rank all-gathers 11 words saying what it
//! is about to do (sequence number, kind, element type, shape), so ranks that disagree get
//! [`CommError::Mismatch`] naming both calls instead of MPI's undefined behaviour.

use super::engine::Job;
use crate::{CommError, DType, OpDesc, OpKind, ReduceOp};

/// Words of a call's descriptor: seq, kind, kind's argument, dtype, rank count of the shape, six
/// dimensions (a longer shape folds its tail into the last).
pub(super) const HEADER: usize = 11;
const MAX_DIMS: usize = 6;

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Avg => 3,
    }
}

pub(super) fn encode(seq: u64, desc: &OpDesc) -> [u64; HEADER] {
    let (kind, arg) = match desc.kind {
        OpKind::AllGather => (0, 0),
        OpKind::ReduceScatter => (1, 0),
        OpKind::AllReduce(op) => (2, op_code(op)),
        OpKind::Broadcast { root } => (3, root as u64),
        OpKind::Barrier => (4, 0),
        OpKind::Split => (5, 0),
    };
    let mut h = [0u64; HEADER];
    h[0] = seq;
    h[1] = kind;
    h[2] = arg;
    h[3] = dtype_code(desc.dtype);
    h[4] = desc.shape.len() as u64;
    for (i, &d) in desc.shape.iter().enumerate() {
        let slot = 5 + i.min(MAX_DIMS - 1);
        h[slot] = if i < MAX_DIMS {
            d as u64
        } else {
            h[slot] * d as u64
        };
    }
    h
}

fn decode(h: &[u64]) -> (u64, OpDesc) {
    let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg];
    let kind = match h[1] {
        0 => OpKind::AllGather,
        1 => OpKind::ReduceScatter,
        2 => OpKind::AllReduce(op[(h[2] as usize).min(3)]),
        3 => OpKind::Broadcast {
            root: h[2] as usize,
        },
        4 => OpKind::Barrier,
        _ => OpKind::Split,
    };
    let dtype =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64][(h[3] as usize).min(4)];
    let dims = (h[4] as usize).min(MAX_DIMS);
    let shape = h[5..5 + dims].iter().map(|&d| d as usize).collect();
    (h[0], OpDesc::new(kind, dtype, shape))
}

/// The first rank whose descriptor differs from this rank's, as [`CommError::Mismatch`].
pub(super) fn mismatch(all: &[u64], job: &Job) -> Option<CommError> {
    let mine = &all[HEADER * job.rank..HEADER * (job.rank + 1)];
    let (r, theirs) = all
        .chunks_exact(HEADER)
        .enumerate()
        .find(|(_, h)| *h != mine)?;
    let (their_seq, theirs) = decode(theirs);
    if their_seq != job.seq {
        return Some(CommError::Backend(format!(
            "collective #{} mismatch: rank {} called {} as its call #{} but rank {r} called {theirs} \
             as its call #{their_seq} (the ranks issued different collectives before)",
            job.seq, job.rank, job.desc, job.seq
        )));
    }
    Some(CommError::Mismatch {
        seq: job.seq,
        rank: job.rank,
        ours: job.desc.clone(),
        other_rank: r,
        theirs,
    })
}
