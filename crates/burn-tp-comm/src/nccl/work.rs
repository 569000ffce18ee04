//! The handles of NCCL calls: [`DeviceWork`] (a call in flight: this transport's
//! [`crate::Work`]), [`RawOp`] (a call on raw device
//! pointers) and [`RawDeviceBuffer`] (a buffer another allocator owns).

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::{CommError, ReduceOp, Result};

/// A collective in flight on the communication stream, holding its output (and keeping its
/// input alive) until waited on.
#[must_use = "a collective is ordered before later compute only once waited on"]
pub struct DeviceWork<O = ()> {
    pub(super) done: CudaEvent,
    pub(super) compute: Arc<CudaStream>,
    pub(super) what: String,
    pub(super) timeout: Duration,
    pub(super) output: O,
    // The input buffer: freed only after the collective read it.
    pub(super) _input: Option<Box<dyn std::any::Any + Send>>,
}

impl<O> DeviceWork<O> {
    /// Orders the compute stream after the collective (the host does not block) and returns
    /// the output.
    ///
    /// # Errors
    /// A CUDA error.
    pub fn wait(self) -> Result<O> {
        self.compute
            .wait(&self.done)
            .map_err(|e| CommError::Backend(format!("{}: {e:?}", self.what)))?;
        Ok(self.output)
    }

    /// Whether the collective has finished on the device (`false` on a CUDA error too: use
    /// [`poll`](Self::poll) to tell the two apart).
    pub fn is_completed(&self) -> bool {
        matches!(self.poll(), Ok(true))
    }

    /// `Ok(true)` once the collective has finished on the device, `Ok(false)` while it runs,
    /// and the error at once on any other CUDA status (a sticky fault, say): a fault must not
    /// read as "still pending" until the timeout.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the call and the CUDA status.
    pub fn poll(&self) -> Result<bool> {
        // Safety: a live event of this context.
        let status = unsafe { cudarc::driver::result::event::query(self.done.cu_event()) };
        event_status(&self.what, status)
    }

    /// Blocks the host until the collective finished, at most the group's timeout.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the call on timeout or a CUDA error.
    pub fn wait_host(self) -> Result<O> {
        let timeout = self.timeout;
        self.wait_host_timeout(timeout)
    }

    /// Blocks the host until the collective finished, at most `timeout`.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the call on timeout or a CUDA error.
    pub fn wait_host_timeout(self, timeout: Duration) -> Result<O> {
        let deadline = Instant::now() + timeout;
        while !self.poll()? {
            if Instant::now() >= deadline {
                return Err(CommError::Backend(format!(
                    "{} timed out after {timeout:?} (a peer never joined, or failed)",
                    self.what
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.wait()
    }

    pub(super) fn with_buffers<P>(
        self,
        output: P,
        input: Box<dyn std::any::Any + Send>,
    ) -> DeviceWork<P> {
        DeviceWork {
            done: self.done,
            compute: self.compute,
            what: self.what,
            timeout: self.timeout,
            output,
            _input: Some(input),
        }
    }
}

/// What an event query means: done, still running (`CUDA_ERROR_NOT_READY`), or an error.
pub(crate) fn event_status(
    what: &str,
    status: std::result::Result<(), cudarc::driver::DriverError>,
) -> Result<bool> {
    use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY;
    match status {
        Ok(()) => Ok(true),
        Err(e) if e.0 == CUDA_ERROR_NOT_READY => Ok(false),
        // The status code by name: `DriverError`'s Debug asks libcuda for a description,
        // which panics where libcuda cannot be loaded.
        Err(e) => Err(CommError::Backend(format!("{what}: CUDA error {:?}", e.0))),
    }
}

/// A device buffer another allocator owns (burn's cubecl tensors), as cudarc's NCCL calls take
/// it: a pointer and a length, no ownership, no stream tracking (the caller orders streams).
pub struct RawDeviceBuffer<T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> RawDeviceBuffer<T> {
    /// Wraps `len` elements at `ptr`.
    ///
    /// # Safety
    /// `ptr` is a device allocation of this group's GPU holding at least `len` elements of `T`,
    /// live (and not written by anyone else) until the collective using it has completed.
    pub unsafe fn new(ptr: CUdeviceptr, len: usize, stream: Arc<CudaStream>) -> Self {
        Self {
            ptr,
            len,
            stream,
            _elem: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for RawDeviceBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for RawDeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for RawDeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// A collective on raw device pointers, for [`NcclGroup::post_raw`](super::NcclGroup::post_raw).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawOp {
    /// `count` elements in, `count * world_size` out.
    AllGather,
    /// `count` elements in, `count / world_size` out (summed).
    ReduceScatter,
    /// `count` in, `count` out.
    AllReduce(ReduceOp),
    /// `count` in, `count` out (the root's).
    Broadcast {
        /// The sending rank.
        root: usize,
    },
}

#[cfg(test)]
mod tests {
    use cudarc::driver::DriverError;
    use cudarc::driver::sys::cudaError_enum;

    use super::event_status;

    #[test]
    fn an_event_query_tells_not_ready_from_a_fault() {
        assert!(event_status("x", Ok(())).unwrap());
        let pending = Err(DriverError(cudaError_enum::CUDA_ERROR_NOT_READY));
        assert!(!event_status("x", pending).unwrap());
        let fault = Err(DriverError(cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS));
        let e = event_status("NCCL all_gather #3 on rank 1", fault).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("NCCL all_gather #3 on rank 1") && msg.contains("ILLEGAL_ADDRESS"),
            "{msg}"
        );
    }
}
