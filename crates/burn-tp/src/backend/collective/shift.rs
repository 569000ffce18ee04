//! A ring shift through the host: this rank's tensor to rank `r + 1`, rank `r - 1`'s to this
//! one, posted at once and waited for later (what ring attention passes around the
//! context-parallel group while it computes: the key / value blocks, their gradients).
//!
//! Values travel in the tensor's own dtype (f32, f64, bf16, f16) over `burn-tp-comm`'s
//! [`RingLinks`] (two-rank links, so a ring's transfers fail and time out as the collectives
//! do).

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, Shape, TensorData};
use burn_tp_comm::{CommError, Neighbour, RingLinks, Transfer};
use half::{bf16, f16};

use crate::backend::collective::host::HostElement;

/// Both transfers of a shift in flight, and the shape of what arrives.
pub(crate) struct Pair<T> {
    send: Transfer<T>,
    recv: Transfer<T>,
    shape: Shape,
}

impl<T: HostElement> Pair<T> {
    fn post(data: TensorData, links: &RingLinks) -> Result<Self, CommError> {
        let (shape, dtype) = (data.shape().clone(), data.dtype());
        let values = data
            .try_into_vec::<T>()
            .map_err(|e| CommError::Backend(format!("ring shift: a {dtype:?} tensor: {e:?}")))?;
        let len = values.len();
        let (send, recv) = links.send_recv((Neighbour::Next, values), (Neighbour::Prev, len))?;
        Ok(Self { send, recv, shape })
    }

    fn finish(self) -> Result<TensorData, CommError> {
        let values = self.recv.wait()?;
        self.send.wait()?;
        Ok(TensorData::new(values, self.shape))
    }
}

/// The transfers of a shift in flight, by element type.
pub(crate) enum Shift {
    F32(Pair<f32>),
    F64(Pair<f64>),
    Bf16(Pair<bf16>),
    F16(Pair<f16>),
}

/// Posts `x` to the next rank of `links` and the receive of the previous rank's tensor of the
/// same shape and dtype.
///
/// # Errors
/// Reading the tensor; a dtype the transports do not carry; posting either transfer (a ring of
/// one rank).
pub(crate) fn start<B: Backend>(x: FloatTensor<B>, links: &RingLinks) -> Result<Shift, CommError> {
    let dtype = x.dtype();
    let data = burn::tensor::read_sync(B::float_into_data(x))
        .map_err(|e| CommError::Backend(format!("ring shift: reading the tensor: {e:?}")))?;
    Ok(match dtype {
        DType::F32 => Shift::F32(Pair::post(data, links)?),
        DType::F64 => Shift::F64(Pair::post(data, links)?),
        DType::BF16 => Shift::Bf16(Pair::post(data, links)?),
        DType::F16 => Shift::F16(Pair::post(data, links)?),
        other => {
            return Err(CommError::Backend(format!(
                "ring shift: a {other:?} tensor (f32, f64, bf16 or f16)"
            )));
        }
    })
}

impl Shift {
    /// Waits for both transfers and returns the previous rank's tensor on `device`.
    ///
    /// # Errors
    /// As [`Transfer::wait`]: a peer's failure or the timeout.
    pub(crate) fn finish<B: Backend>(
        self,
        device: &B::Device,
    ) -> Result<FloatTensor<B>, CommError> {
        let data = match self {
            Shift::F32(p) => p.finish()?,
            Shift::F64(p) => p.finish()?,
            Shift::Bf16(p) => p.finish()?,
            Shift::F16(p) => p.finish()?,
        };
        Ok(B::float_from_data(data, device))
    }
}
