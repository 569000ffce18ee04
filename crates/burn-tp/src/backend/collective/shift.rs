//! A ring shift through the host: this rank's tensor to rank `r + 1`, rank `r - 1`'s to this
//! one, posted at once and waited for later (what ring attention passes around the
//! context-parallel group while it computes: the key / value blocks, their gradients).
//!
//! Values travel as f32, or f64 for an f64 tensor (a half tensor widened, exactly, and cast
//! back on arrival), over `burn-tp-comm`'s [`RingLinks`] (two-rank links, so a ring's
//! transfers fail and time out as the collectives do).

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, Shape, TensorData};
use burn_tp_comm::{CommError, Neighbour, RingLinks, Transfer};

/// The receive of a shift in flight (its send kept alive until then).
pub(crate) enum Shift {
    F32(Transfer<f32>, Transfer<f32>, Shape, DType),
    F64(Transfer<f64>, Transfer<f64>, Shape, DType),
}

/// Posts `x` to the next rank of `links` and the receive of the previous rank's tensor of the
/// same shape and dtype.
///
/// # Errors
/// Reading the tensor; posting either transfer (a ring of one rank).
pub(crate) fn start<B: Backend>(x: FloatTensor<B>, links: &RingLinks) -> Result<Shift, CommError> {
    let (shape, dtype) = (x.shape(), x.dtype());
    let data = burn::tensor::read_sync(B::float_into_data(x))
        .map_err(|e| CommError::Backend(format!("ring shift: reading the tensor: {e:?}")))?;
    let len = shape.num_elements();
    let read = |e| CommError::Backend(format!("ring shift: a {dtype:?} tensor: {e:?}"));
    Ok(match dtype {
        DType::F64 => {
            let values = data.convert::<f64>().try_into_vec::<f64>().map_err(read)?;
            let (send, recv) =
                links.send_recv((Neighbour::Next, values), (Neighbour::Prev, len))?;
            Shift::F64(send, recv, shape, dtype)
        }
        _ => {
            let values = data.convert::<f32>().try_into_vec::<f32>().map_err(read)?;
            let (send, recv) =
                links.send_recv((Neighbour::Next, values), (Neighbour::Prev, len))?;
            Shift::F32(send, recv, shape, dtype)
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
        let (data, dtype) = match self {
            Shift::F32(send, recv, shape, dtype) => {
                let values = recv.wait()?;
                send.wait()?;
                (TensorData::new(values, shape), dtype)
            }
            Shift::F64(send, recv, shape, dtype) => {
                let values = recv.wait()?;
                send.wait()?;
                (TensorData::new(values, shape), dtype)
            }
        };
        let x = B::float_from_data(data, device);
        Ok(if x.dtype() == dtype {
            x
        } else {
            B::float_cast(x, dtype.into())
        })
    }
}
