//! Reductions of 16-bit floats: MPI has no bf16 / f16 types, so they travel as `uint16_t` and
//! are reduced by user operations that do the arithmetic in the element's own type (as the
//! thread transport does), never as integers.

use std::ffi::{c_int, c_void};

use half::{bf16, f16};
use mpi::ffi;

use crate::{DType, ReduceOp};

pub(super) struct UserOps {
    /// `[f16, bf16] x [sum, max, min]`.
    half: [[ffi::MPI_Op; 3]; 2],
}

/// `inout = inout op input` over `*len` elements of `T`, with the element's own arithmetic
/// ([`CommElement::combine`](crate::CommElement::combine), as the thread transport reduces).
/// `OP` is the index of [`REDUCTIONS`] (a `ReduceOp` cannot be a const parameter).
unsafe extern "C" fn half_op<T: crate::CommElement, const OP: usize>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _: *mut ffi::MPI_Datatype,
) {
    // Safety: MPI passes two buffers of `*len` elements of the type the op was registered for
    // (uint16_t words holding `T`s, which have the same layout).
    unsafe {
        let n = *len as usize;
        let other = std::slice::from_raw_parts(input as *const T, n);
        let acc = std::slice::from_raw_parts_mut(inout as *mut T, n);
        T::combine(REDUCTIONS[OP], acc, other);
    }
}

/// The reductions MPI does for us, by index (the average is a sum, divided afterwards).
const REDUCTIONS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

impl UserOps {
    pub(super) fn new() -> Self {
        let make = |f: UserFn| {
            let mut op = unsafe { ffi::RSMPI_SUM };
            // Safety: registers a commutative function with MPI's signature.
            unsafe { ffi::MPI_Op_create(Some(f), 1, &mut op) };
            op
        };
        Self {
            half: [
                [
                    make(half_op::<f16, 0>),
                    make(half_op::<f16, 1>),
                    make(half_op::<f16, 2>),
                ],
                [
                    make(half_op::<bf16, 0>),
                    make(half_op::<bf16, 1>),
                    make(half_op::<bf16, 2>),
                ],
            ],
        }
    }

    /// The MPI operation of `op` on `dtype` (the average is a sum, divided afterwards).
    pub(super) fn get(&self, dtype: DType, op: ReduceOp) -> ffi::MPI_Op {
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        };
        match dtype {
            DType::F16 => self.half[0][i],
            DType::BF16 => self.half[1][i],
            // Safety: reads of constants rsmpi's C shim exports.
            _ => unsafe { [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][i] },
        }
    }
}

impl Drop for UserOps {
    fn drop(&mut self) {
        for op in self.half.iter_mut().flatten() {
            // Safety: ops made by `MPI_Op_create`, freed once, before MPI_Finalize.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}
