//! `TpBackend` for Flex, Burn's CPU backend: the trait's defaults (the host transport and the
//! overlapped linears of [`crate::backend::matmul::overlap`]), with the inputs of a collective read in place from
//! the tensor's storage instead of copied out of it. Every rank is a thread on the one Flex device.

use burn::backend::{Flex, tensor::FloatTensor};
use burn_flex::FlexTensor;
use burn_tp_comm::{CommError, ProcessGroup, SendBuf};

use super::{Collective, PendingCollective, TpBackend};
use crate::backend::collective::host::{DataRead, HostElement, HostRead, host_start_with};

impl TpBackend for Flex {
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingCollective<Self> {
        host_start_with::<Self, _>(x, op, group, |moved| Ok(FlexRead(moved)))
    }
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
