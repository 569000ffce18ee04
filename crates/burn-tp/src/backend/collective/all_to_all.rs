//! The all-to-all with per-rank row counts on backend primitives, through the host transport
//! (`burn_tp_comm`'s `all_to_all`): expert parallelism's dispatch and combine.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{Shape, TensorData};
use burn_tp_comm::{CommError, ProcessGroup, SendBuf};

use super::host::{DataRead, HostCall, HostElement, HostRead, with_host_values};
use super::pool::PooledBuf;

/// Rows of `[rows, ..]` sent to and received from each rank of the group, in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllToAllSpec {
    /// Rows this rank sends to each rank (consecutive, in rank order).
    pub send_rows: Vec<usize>,
    /// Rows this rank receives from each rank (placed in rank order).
    pub recv_rows: Vec<usize>,
}

impl AllToAllSpec {
    /// The adjoint's spec: the same exchange the other way round.
    pub fn reversed(&self) -> Self {
        Self {
            send_rows: self.recv_rows.clone(),
            recv_rows: self.send_rows.clone(),
        }
    }
}

/// `x` (`[sum(send_rows), ..]`) exchanged into `[sum(recv_rows), ..]`, through host buffers
/// (the values copied out of the backend).
pub(crate) fn host_all_to_all<B: Backend>(
    x: FloatTensor<B>,
    spec: &AllToAllSpec,
    group: &ProcessGroup,
) -> Result<FloatTensor<B>, CommError> {
    host_all_to_all_with::<B, _>(x, spec, group, |t| {
        burn::tensor::read_sync(B::float_into_data(t))
            .map(DataRead)
            .map_err(|e| CommError::Backend(format!("all_to_all: reading the tensor: {e:?}")))
    })
}

/// [`host_all_to_all`] with `read` giving the values of `x` (a backend that can reads them in
/// place); the output is written into a pooled buffer that becomes the tensor's storage, so
/// each row is copied once, from the sender's storage into the receiver's.
pub(crate) fn host_all_to_all_with<B: Backend, R: HostRead>(
    x: FloatTensor<B>,
    spec: &AllToAllSpec,
    group: &ProcessGroup,
    read: impl FnOnce(FloatTensor<B>) -> Result<R, CommError>,
) -> Result<FloatTensor<B>, CommError> {
    let (shape, dtype, device) = (x.shape(), x.dtype(), x.device());
    let row: usize = shape.iter().skip(1).product();
    if shape[0] != spec.send_rows.iter().sum::<usize>() {
        return Err(CommError::BufferSize {
            op: "all_to_all (rows of the input)",
            expected: spec.send_rows.iter().sum(),
            got: shape[0],
        });
    }
    let call = Exchange { spec, group, row };
    let out = with_host_values(dtype, shape, read(x)?, call)??;
    Ok(B::float_from_data(out, &device))
}

struct Exchange<'a> {
    spec: &'a AllToAllSpec,
    group: &'a ProcessGroup,
    row: usize,
}

impl HostCall for Exchange<'_> {
    type Output = Result<TensorData, CommError>;

    fn call<T: HostElement>(self, values: Box<dyn SendBuf<T>>, shape: Shape) -> Self::Output {
        let elements = |rows: &[usize]| rows.iter().map(|r| r * self.row).collect::<Vec<_>>();
        let (send, recv) = (
            elements(&self.spec.send_rows),
            elements(&self.spec.recv_rows),
        );
        let out = PooledBuf::<T>::new(recv.iter().sum());
        let out = self
            .group
            .all_to_all_async(values, &send, &recv, out)?
            .wait()?;
        let mut dims = shape.to_vec();
        dims[0] = self.spec.recv_rows.iter().sum();
        Ok(TensorData::from_bytes(out.into_bytes(), dims, T::dtype()))
    }
}
