//! The communicator trait every transport implements: [`ProcessGroup`] on host buffers (ranks as
//! threads) and, with feature `nccl`, [`NcclGroup`](crate::nccl::NcclGroup) on CUDA device buffers.
//!
//! Code written against [`Communicator`] runs on either. Buffers move into the call and come
//! back from the wait, so a transport keeps its input alive (and unaliased) while it is in flight.

use std::time::Duration;

use crate::{CommElement, ProcessGroup, ReduceOp, Result, Work};

/// A collective in flight: wait for it, or ask whether it is done.
pub trait CommWork {
    /// What the wait returns (the output buffer).
    type Output;
    /// Waits with the communicator's timeout and returns the output.
    ///
    /// # Errors
    /// A transport error, a mismatch across ranks, a peer that left, or a timeout.
    fn wait(self) -> Result<Self::Output>;
    /// Waits at most `timeout`.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    fn wait_timeout(self, timeout: Duration) -> Result<Self::Output>;
    /// Whether [`wait`](Self::wait) would return without blocking.
    fn is_completed(&self) -> bool;
}

/// Collectives over buffers of `T`, one rank's side. Every rank issues the same calls in the same
/// order (as with NCCL and MPI).
pub trait Communicator<T: CommElement>: Send + Sync {
    /// The transport's buffer: `Vec<T>` on the host, a `CudaSlice<T>` on a GPU.
    type Buffer;
    /// The handle of a call in flight.
    type Work: CommWork<Output = Self::Buffer>;

    /// This rank's index in `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Starts an all-gather: rank-order concatenation (`[len] -> [world_size * len]`).
    ///
    /// # Errors
    /// Checks before any communication (buffer sizes), or a transport error.
    fn all_gather_async(&self, input: Self::Buffer) -> Result<Self::Work>;
    /// Starts a reduce-scatter (sum): rank `r` receives the sum of every rank's chunk `r`
    /// (`[len] -> [len / world_size]`).
    ///
    /// # Errors
    /// [`CommError::NotDivisible`](crate::CommError::NotDivisible) before any communication, or a
    /// transport error.
    fn reduce_scatter_async(&self, input: Self::Buffer) -> Result<Self::Work>;
    /// Starts an all-reduce: the element-wise `op` of every rank's buffer, to every rank.
    ///
    /// # Errors
    /// A transport error.
    fn all_reduce_async(&self, input: Self::Buffer, op: ReduceOp) -> Result<Self::Work>;
    /// Starts a broadcast of `root`'s buffer (every rank passes one of the same length).
    ///
    /// # Errors
    /// [`CommError::InvalidRoot`](crate::CommError::InvalidRoot), or a transport error.
    fn broadcast_async(&self, input: Self::Buffer, root: usize) -> Result<Self::Work>;
    /// Blocks until every rank has arrived.
    ///
    /// # Errors
    /// A transport error or a timeout.
    fn barrier(&self) -> Result<()>;

    /// Blocking [`all_gather_async`](Self::all_gather_async).
    ///
    /// # Errors
    /// As the async form and [`CommWork::wait`].
    fn all_gather(&self, input: Self::Buffer) -> Result<Self::Buffer> {
        self.all_gather_async(input)?.wait()
    }
    /// Blocking [`reduce_scatter_async`](Self::reduce_scatter_async).
    ///
    /// # Errors
    /// As the async form and [`CommWork::wait`].
    fn reduce_scatter(&self, input: Self::Buffer) -> Result<Self::Buffer> {
        self.reduce_scatter_async(input)?.wait()
    }
    /// Blocking [`all_reduce_async`](Self::all_reduce_async).
    ///
    /// # Errors
    /// As the async form and [`CommWork::wait`].
    fn all_reduce(&self, input: Self::Buffer, op: ReduceOp) -> Result<Self::Buffer> {
        self.all_reduce_async(input, op)?.wait()
    }
    /// Blocking [`broadcast_async`](Self::broadcast_async).
    ///
    /// # Errors
    /// As the async form and [`CommWork::wait`].
    fn broadcast(&self, input: Self::Buffer, root: usize) -> Result<Self::Buffer> {
        self.broadcast_async(input, root)?.wait()
    }
}

impl<T> CommWork for Work<T> {
    type Output = T;
    fn wait(self) -> Result<T> {
        Work::wait(self)
    }
    fn wait_timeout(self, timeout: Duration) -> Result<T> {
        Work::wait_timeout(self, timeout)
    }
    fn is_completed(&self) -> bool {
        Work::is_completed(self)
    }
}

impl<T: CommElement> Communicator<T> for ProcessGroup {
    type Buffer = Vec<T>;
    type Work = Work<Vec<T>>;

    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }
    fn world_size(&self) -> usize {
        ProcessGroup::world_size(self)
    }
    fn all_gather_async(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        Ok(ProcessGroup::all_gather_async(self, input))
    }
    fn reduce_scatter_async(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        ProcessGroup::reduce_scatter_async(self, input)
    }
    fn all_reduce_async(&self, input: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        Ok(ProcessGroup::all_reduce_async(self, input, op))
    }
    fn broadcast_async(&self, input: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        ProcessGroup::broadcast_async(self, input, root)
    }
    fn barrier(&self) -> Result<()> {
        ProcessGroup::barrier(self)
    }
}
