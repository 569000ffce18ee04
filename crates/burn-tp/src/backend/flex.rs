//! `TpBackend` for Flex, Burn's CPU backend: the trait's defaults (the host transport and the
//! overlapped linears of [`crate::backend::matmul::overlap`]), with the inputs of a collective read in place from
//! the tensor's storage instead of copied out of it. Every rank is a thread on the one Flex device.

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::DType;
use burn_flex::FlexTensor;
use burn_tp_comm::{CommError, ProcessGroup, SendBuf};

use super::{
    AllToAllSpec, AttentionSpec, Collective, CollectiveOutput, PendingCollective, TpBackend,
};
use crate::backend::attention::{flash, flash_cpu};
use crate::backend::collective::all_to_all::host_all_to_all_with;
use crate::backend::collective::host::{DataRead, HostElement, HostRead, host_start_with};

impl TpBackend for Flex {
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingCollective<Self> {
        host_start_with::<Self, _>(x, op, group, |moved| Ok(FlexRead(moved)))
    }

    fn tp_all_to_all(
        x: FloatTensor<Self>,
        spec: AllToAllSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        host_all_to_all_with::<Self, _>(x, &spec, &group, |t| Ok(FlexRead(t))).into()
    }

    /// The CPU kernel (`flash_cpu/`: f32 tiles between GEMM calls) for f32 and half inputs; the
    /// tensor-op tiles for f64.
    fn tp_attention_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cpu_kernel(&q) {
            true => flash_cpu::forward(q, k, v, &spec),
            false => flash::forward::<Self>(q, k, v, &spec),
        }
    }

    fn tp_attention_kernel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        match cpu_kernel(&q) {
            true => flash_cpu::backward(q, k, v, out, lse, d_out, &spec),
            false => flash::backward::<Self>(q, k, v, out, lse, d_out, &spec),
        }
    }
}

/// Whether the CPU kernel runs `q`'s attention: f32 and half (computed in f32), not f64.
fn cpu_kernel(q: &FlexTensor) -> bool {
    matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// A Flex tensor's values: its storage itself when it is laid out as the flat buffer (contiguous,
/// from the start), else a contiguous copy.
struct FlexRead(FlexTensor);

/// A view of a Flex tensor's storage; holding the tensor keeps the storage alive and, being a
/// second owner, makes Flex copy before any in-place write to it.
struct FlexView<T> {
    tensor: FlexTensor,
    len: usize,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: HostElement> SendBuf<T> for FlexView<T> {
    fn as_slice(&self) -> &[T] {
        &self.tensor.storage::<T>()[..self.len]
    }
}

impl HostRead for FlexRead {
    fn values<T: HostElement>(self) -> Result<Box<dyn SendBuf<T>>, CommError> {
        let t = self.0;
        let len = t.layout().num_elements();
        if t.is_contiguous() && t.layout().start_offset() == 0 && t.dtype() == T::dtype() {
            return Ok(Box::new(FlexView {
                tensor: t,
                len,
                _t: std::marker::PhantomData,
            }));
        }
        DataRead(t.into_data()).values::<T>()
    }
}
