//! The communicator trait every transport implements: [`ProcessGroup`] on host buffers (ranks as
//! threads) and, with feature `nccl`, [`NcclGroup`](crate::nccl::NcclGroup) on CUDA device buffers.
//!
//! It is the transport extension point: code written against [`Communicator`] runs on every
//! transport (the conformance tests run one check on both; a new transport passes them by
//! implementing it). burn-tp's layers do not use it: they go through the backend extension,
//! which holds a [`ProcessGroup`]. Buffers move into the call and come back from the wait, so a
//! transport keeps its input alive (and unaliased) while it is in flight; the transport
//! allocates the output. A [`ProcessGroup`]'s own async collectives take the caller's output
//! buffer instead.

use std::time::Duration;

use crate::{CommElement, ProcessGroup, ReduceOp, Result, Work};

/// Collectives over buffers of `T`, one rank's side. Every rank issues the same calls in the same
/// order (as with NCCL and MPI).
pub trait Communicator<T: CommElement>: Send + Sync {
    /// The transport's buffer: `Vec<T>` on the host, a `CudaSlice<T>` on a GPU.
    type Buffer;
    /// The handle of a call in flight: [`crate::Work`] on the host, `nccl::DeviceWork` (feature
    /// `nccl`) on a GPU. Waited on with [`wait`](Self::wait).
    type Work;

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
    /// Waits for `work`, at most `timeout` (`None`: the communicator's), and returns its output.
    ///
    /// # Errors
    /// A transport error, a mismatch across ranks, a peer that left, or a timeout.
    fn wait(&self, work: Self::Work, timeout: Option<Duration>) -> Result<Self::Buffer>;
    /// Whether waiting for `work` would return without blocking.
    fn is_completed(&self, work: &Self::Work) -> bool;

    /// Blocking [`all_gather_async`](Self::all_gather_async).
    ///
    /// # Errors
    /// As the async form and [`wait`](Self::wait).
    fn all_gather(&self, input: Self::Buffer) -> Result<Self::Buffer> {
        self.wait(self.all_gather_async(input)?, None)
    }
    /// Blocking [`reduce_scatter_async`](Self::reduce_scatter_async).
    ///
    /// # Errors
    /// As the async form and [`wait`](Self::wait).
    fn reduce_scatter(&self, input: Self::Buffer) -> Result<Self::Buffer> {
        self.wait(self.reduce_scatter_async(input)?, None)
    }
    /// Blocking [`all_reduce_async`](Self::all_reduce_async).
    ///
    /// # Errors
    /// As the async form and [`wait`](Self::wait).
    fn all_reduce(&self, input: Self::Buffer, op: ReduceOp) -> Result<Self::Buffer> {
        self.wait(self.all_reduce_async(input, op)?, None)
    }
    /// Blocking [`broadcast_async`](Self::broadcast_async).
    ///
    /// # Errors
    /// As the async form and [`wait`](Self::wait).
    fn broadcast(&self, input: Self::Buffer, root: usize) -> Result<Self::Buffer> {
        self.wait(self.broadcast_async(input, root)?, None)
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
        Ok(self.all_gather_owned(input))
    }
    fn reduce_scatter_async(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        self.reduce_scatter_owned(input)
    }
    fn all_reduce_async(&self, input: Vec<T>, op: ReduceOp) -> Result<Work<Vec<T>>> {
        self.all_reduce_owned(input, op)
    }
    fn broadcast_async(&self, input: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        self.broadcast_owned(input, root)
    }
    fn barrier(&self) -> Result<()> {
        ProcessGroup::barrier(self)
    }
    fn wait(&self, work: Work<Vec<T>>, timeout: Option<Duration>) -> Result<Vec<T>> {
        match timeout {
            Some(t) => work.wait_timeout(t),
            None => work.wait(),
        }
    }
    fn is_completed(&self, work: &Work<Vec<T>>) -> bool {
        work.is_completed()
    }
}
