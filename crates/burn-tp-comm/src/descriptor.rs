//! The call descriptor: before any collective, every MPI rank all-gathers 11 words saying what
//! it is about to do (sequence number, kind, element type, shape), so ranks that disagree get
//! [`CommError::Mismatch`] naming both calls instead of MPI's undefined behaviour.
//!
//! Transport-independent (plain words in, an error out), so it builds and is tested without
//! the `mpi` feature; the MPI engine (`mpi/engine.rs`) exchanges the words.

use crate::{CommError, DType, OpDesc, OpKind, ReduceOp};

/// Words of a call's descriptor: seq, kind, kind's argument, dtype, rank count of the shape, six
/// dimensions (a longer shape folds its tail into the last).
pub(crate) const HEADER: usize = 11;
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

pub(crate) fn encode(seq: u64, desc: &OpDesc) -> [u64; HEADER] {
    let (kind, arg) = match desc.kind {
        OpKind::AllGather => (0, 0),
        OpKind::ReduceScatter => (1, 0),
        OpKind::AllReduce(op) => (2, op_code(op)),
        OpKind::Broadcast { root } => (3, root as u64),
        OpKind::Barrier => (4, 0),
        OpKind::Split => (5, 0),
        OpKind::AllToAll => (6, 0),
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
        6 => OpKind::AllToAll,
        _ => OpKind::Split,
    };
    let dtype =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64][(h[3] as usize).min(4)];
    let dims = (h[4] as usize).min(MAX_DIMS);
    let shape = h[5..5 + dims].iter().map(|&d| d as usize).collect();
    (h[0], OpDesc::new(kind, dtype, shape))
}

/// The first rank whose descriptor in `all` (every rank's [`encode`], in rank order) differs
/// from this rank's (`rank`, about to run `desc` as its call `seq`), as
/// [`CommError::Mismatch`].
pub(crate) fn mismatch(all: &[u64], rank: usize, seq: u64, desc: &OpDesc) -> Option<CommError> {
    let mine = &all[HEADER * rank..HEADER * (rank + 1)];
    let (r, theirs) = all
        .chunks_exact(HEADER)
        .enumerate()
        .find(|(_, h)| *h != mine)?;
    let (their_seq, theirs) = decode(theirs);
    if their_seq != seq {
        return Some(CommError::Backend(format!(
            "collective #{seq} mismatch: rank {rank} called {desc} as its call #{seq} but rank \
             {r} called {theirs} as its call #{their_seq} (the ranks issued different \
             collectives before)"
        )));
    }
    Some(CommError::Mismatch {
        seq,
        rank,
        ours: desc.clone(),
        other_rank: r,
        theirs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's words for `descs` (rank order), all as call `seq`.
    fn words(seq: u64, descs: &[OpDesc]) -> Vec<u64> {
        descs.iter().flat_map(|d| encode(seq, d)).collect()
    }

    fn gather(dtype: DType, shape: &[usize]) -> OpDesc {
        OpDesc::new(OpKind::AllGather, dtype, shape.to_vec())
    }

    #[test]
    fn a_descriptor_decodes_to_its_call() {
        for desc in [
            gather(DType::BF16, &[3, 5, 7]),
            OpDesc::new(OpKind::ReduceScatter, DType::F64, vec![8]),
            OpDesc::new(OpKind::AllReduce(ReduceOp::Max), DType::F16, vec![2, 2]),
            OpDesc::new(
                OpKind::Broadcast { root: 3 },
                DType::I64,
                vec![1, 2, 3, 4, 5, 6],
            ),
            OpDesc::new(OpKind::Barrier, DType::F32, vec![]),
        ] {
            assert_eq!(decode(&encode(9, &desc)), (9, desc.clone()), "{desc}");
        }
        // A shape longer than six dims folds its tail into the last word.
        let long = encode(0, &gather(DType::F32, &[1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(long[5..11], [1, 2, 3, 4, 5, 42]);
    }

    /// Two ranks that differ in any one part of the call (kind, its argument, dtype, rank of
    /// the shape, any dim) get a `Mismatch` naming both calls and the other rank; equal calls
    /// get none.
    #[test]
    fn every_part_of_the_call_is_compared() {
        let ours = gather(DType::F32, &[4, 6]);
        assert!(mismatch(&words(5, &[ours.clone(), ours.clone()]), 0, 5, &ours).is_none());
        let others = [
            OpDesc::new(OpKind::ReduceScatter, DType::F32, vec![4, 6]),
            gather(DType::BF16, &[4, 6]),
            gather(DType::F32, &[4, 7]),
            gather(DType::F32, &[5, 6]),
            gather(DType::F32, &[4, 6, 1]),
        ];
        for theirs in others {
            let all = words(5, &[ours.clone(), ours.clone(), theirs.clone()]);
            match mismatch(&all, 1, 5, &ours) {
                Some(CommError::Mismatch {
                    seq: 5,
                    rank: 1,
                    ours: o,
                    other_rank: 2,
                    theirs: t,
                }) => assert_eq!((o, t), (ours.clone(), theirs.clone())),
                e => panic!("{theirs} against {ours}: {e:?}"),
            }
        }
        let sum = OpDesc::new(OpKind::AllReduce(ReduceOp::Sum), DType::F32, vec![3]);
        let max = OpDesc::new(OpKind::AllReduce(ReduceOp::Max), DType::F32, vec![3]);
        let e = mismatch(&words(0, &[sum.clone(), max]), 0, 0, &sum);
        assert!(
            matches!(e, Some(CommError::Mismatch { other_rank: 1, .. })),
            "{e:?}"
        );
        // A rank a call ahead: named as another sequence number.
        let mut all = words(4, &[ours.clone(), ours.clone()]);
        all[super::HEADER] = 3;
        let e = mismatch(&all, 0, 4, &ours).expect("a mismatch").to_string();
        assert!(e.contains("call #4") && e.contains("call #3"), "{e}");
    }
}
