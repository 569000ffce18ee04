//! Element types the collectives move and reduce.

use std::fmt::Debug;

use half::{bf16, f16};

/// The element type of a buffer, checked across ranks so a mismatch is an error, not garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`
    F32,
    /// `f64`
    F64,
    /// IEEE half, [`half::f16`]
    F16,
    /// brain float, [`half::bf16`]
    BF16,
    /// `i64` (token ids, split colours)
    I64,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// How [`all_reduce`](crate::ProcessGroup::all_reduce) combines the ranks' buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ReduceOp {
    /// Element-wise sum, accumulated in rank order (bit-identical on every rank, run to run).
    #[default]
    Sum,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Sum in rank order, then divided by the world size.
    Avg,
}

/// A plain value the collectives can copy and reduce.
///
/// Reductions are done in the element's own precision, one rank at a time in rank order, so every
/// rank computes exactly the same bits.
pub trait CommElement: Copy + Send + Sync + Debug + 'static {
    /// The tag checked across ranks.
    const DTYPE: DType;
    /// `self + other`.
    fn add(self, other: Self) -> Self;
    /// The larger of the two.
    fn max(self, other: Self) -> Self;
    /// The smaller of the two.
    fn min(self, other: Self) -> Self;
    /// `self / n`, used by [`ReduceOp::Avg`].
    fn div_count(self, n: usize) -> Self;

    /// Folds `other` into `acc` with `op` (for `Avg`, the sum; the division comes last).
    fn combine(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
        debug_assert_eq!(acc.len(), other.len());
        match op {
            ReduceOp::Sum | ReduceOp::Avg => {
                acc.iter_mut().zip(other).for_each(|(a, b)| *a = a.add(*b))
            }
            ReduceOp::Max => acc.iter_mut().zip(other).for_each(|(a, b)| *a = a.max(*b)),
            ReduceOp::Min => acc.iter_mut().zip(other).for_each(|(a, b)| *a = a.min(*b)),
        }
    }

    /// Completes `op` over `ranks` ranks once every rank is folded in: [`ReduceOp::Avg`]'s
    /// division (the other ops are complete). The one place every host transport (threads and
    /// MPI) takes the average, so the thread tests check MPI's arithmetic too.
    fn finish(op: ReduceOp, acc: &mut [Self], ranks: usize) {
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|v| *v = v.div_count(ranks));
        }
    }
}

macro_rules! float_element {
    ($ty:ty, $tag:ident, $from_usize:expr) => {
        impl CommElement for $ty {
            const DTYPE: DType = DType::$tag;
            fn add(self, other: Self) -> Self {
                self + other
            }
            fn max(self, other: Self) -> Self {
                if other > self { other } else { self }
            }
            fn min(self, other: Self) -> Self {
                if other < self { other } else { self }
            }
            fn div_count(self, n: usize) -> Self {
                self / $from_usize(n)
            }
        }
    };
}

float_element!(f32, F32, |n: usize| n as f32);
float_element!(f64, F64, |n: usize| n as f64);
float_element!(f16, F16, |n: usize| f16::from_f32(n as f32));
float_element!(bf16, BF16, |n: usize| bf16::from_f32(n as f32));

impl CommElement for i64 {
    const DTYPE: DType = DType::I64;
    fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
    fn max(self, other: Self) -> Self {
        Ord::max(self, other)
    }
    fn min(self, other: Self) -> Self {
        Ord::min(self, other)
    }
    fn div_count(self, n: usize) -> Self {
        self / n as i64
    }
}
