//! Host buffers through NCCL: a [`ProcessGroup`](crate::ProcessGroup) over NCCL moves host
//! values (weights at init, ids, barriers, the experts' all-to-all) by staging them through the
//! GPU: copy in, the collective, copy out, blocking. Tensors on the GPU never come here.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{NcclGroup, RawDeviceBuffer, RawOp, nccl_err};
use crate::{CommElement, Result};

impl NcclGroup {
    /// `input` copied to the GPU and a zeroed output of `out_bytes`, each at least one byte
    /// (an empty buffer still needs an allocation to point at).
    fn staged<T: CommElement>(
        &self,
        input: &[T],
        out_bytes: usize,
    ) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
        let cuda = |e| nccl_err("host staging", 0, self.rank, e);
        // Safety: CommElement types are plain numbers (no padding, any bit pattern valid).
        let bytes = unsafe {
            std::slice::from_raw_parts(input.as_ptr().cast::<u8>(), std::mem::size_of_val(input))
        };
        let bytes = if bytes.is_empty() { &[0u8][..] } else { bytes };
        let dev_in = self.compute.clone_htod(bytes).map_err(cuda)?;
        let dev_out = self
            .compute
            .alloc_zeros::<u8>(out_bytes.max(1))
            .map_err(cuda)?;
        Ok((dev_in, dev_out))
    }

    /// `op` of a host buffer, staged through the GPU (copy in, collective, copy out), blocking:
    /// what a [`ProcessGroup`](crate::ProcessGroup) over NCCL does with host buffers (weights
    /// at init, ids, barriers). Tensors on the GPU never come here.
    ///
    /// # Errors
    /// As [`post_into`](Self::post_into), a CUDA copy error, or a timeout.
    pub(crate) fn host_collective<T: CommElement>(&self, op: RawOp, input: &[T]) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let out_len = match op {
            RawOp::AllGather => input.len() * self.world_size,
            RawOp::ReduceScatter => input.len() / self.world_size.max(1),
            RawOp::AllReduce(_) | RawOp::Broadcast { .. } => input.len(),
        };
        self.check_len(op, "host collective", input.len(), out_len)?;
        let cuda = |e| nccl_err("host staging", 0, self.rank, e);
        let (dev_in, mut dev_out) = self.staged(input, out_len * size)?;
        let (pin, _r) = dev_in.device_ptr(&self.compute);
        let (pout, _w) = dev_out.device_ptr_mut(&self.compute);
        // Safety: both are live allocations of the sizes given, held until the host wait below.
        let work = unsafe { self.post_raw(op, T::DTYPE, (pin, input.len()), (pout, out_len)) }?;
        drop((_r, _w));
        work.wait_host()?;
        let out_bytes = self.compute.clone_dtoh(&dev_out).map_err(cuda)?;
        Ok(values_of::<T>(&out_bytes, out_len))
    }

    /// The all-to-all of a host buffer with per-peer counts (elements; checked across ranks
    /// by the caller), staged through the GPU: one NCCL group of an `ncclSend` and an
    /// `ncclRecv` per peer (PyTorch's `all_to_all_single` does the same), bytes moved as they
    /// are, blocking (at most the group's timeout).
    ///
    /// # Errors
    /// A CUDA copy error, an NCCL error naming the rank, or a timeout.
    pub(crate) fn host_all_to_all<T: CommElement>(
        &self,
        input: &[T],
        send: &[usize],
        recv: &[usize],
    ) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        let (rank, stream) = (self.rank, self.comm_stream.clone());
        let cuda = |e| nccl_err("all_to_all staging", 0, rank, e);
        let out_len: usize = recv.iter().sum();
        let (dev_in, mut dev_out) = self.staged(input, out_len * size)?;
        let (pin, _r) = dev_in.device_ptr(&self.compute);
        let (pout, _w) = dev_out.device_ptr_mut(&self.compute);
        let (send_at, recv_at) = (
            crate::buffer::displacements(send),
            crate::buffer::displacements(recv),
        );
        let work = self.issue("all_to_all", |c, seq| {
            let fail = |e| nccl_err("all_to_all", seq, rank, e);
            cudarc::nccl::result::group_start().map_err(fail)?;
            let mut posted = Ok(());
            for p in 0..self.world_size {
                let peer = p as i32;
                // Safety: ranges inside the two live allocations above, held until the wait.
                let (out_buf, mut in_buf) = unsafe {
                    (
                        RawDeviceBuffer::<u8>::new(
                            pin + (send_at[p] * size) as u64,
                            send[p] * size,
                            stream.clone(),
                        ),
                        RawDeviceBuffer::<u8>::new(
                            pout + (recv_at[p] * size) as u64,
                            recv[p] * size,
                            stream.clone(),
                        ),
                    )
                };
                if send[p] > 0 && posted.is_ok() {
                    posted = c.send(&out_buf, peer).map_err(fail);
                }
                if recv[p] > 0 && posted.is_ok() {
                    posted = c.recv(&mut in_buf, peer).map(|_| ()).map_err(fail);
                }
            }
            // The group is closed even after a failed post, so NCCL is left consistent.
            cudarc::nccl::result::group_end().map_err(fail)?;
            posted
        })?;
        drop((_r, _w));
        work.wait_host()?;
        let out_bytes = self.compute.clone_dtoh(&dev_out).map_err(cuda)?;
        Ok(values_of::<T>(&out_bytes, out_len))
    }
}

/// The first `len` values of `T` in `bytes` (a host copy of a staged output).
fn values_of<T: CommElement>(bytes: &[u8], len: usize) -> Vec<T> {
    let mut out = Vec::<T>::with_capacity(len);
    // Safety: `bytes` holds at least `len` values of T written by NCCL (or zeros), and
    // CommElement types are plain numbers (any bit pattern valid).
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            out.as_mut_ptr().cast::<u8>(),
            len * std::mem::size_of::<T>(),
        );
        out.set_len(len);
    }
    out
}
