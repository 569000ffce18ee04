//! Activations and their gradients between stages: sent as f32 (a half-precision model's
//! widened), received in the model's dtype, every wait for one timed (the stage's idle time:
//! the bubble and the transfers not hidden), every send kept until the step's end.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_tp_comm::Transfer;

use super::Pipeline;
use crate::{Result, TpError};

/// The neighbour a tensor comes from or goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    /// The previous stage (activations come from it, gradients go to it).
    Prev,
    /// The next stage.
    Next,
}

/// One step's transfers of one stage, of activations of one shape, each followed by `extra`
/// values (the routers' statistics so far, [`super::routers`]).
pub(super) struct Transfers<'a> {
    pipe: &'a Pipeline,
    shape: [usize; 3],
    extra: usize,
    dtype: DType,
    idle: Duration,
    sends: Vec<Transfer<f32>>,
}

impl<'a> Transfers<'a> {
    /// Transfers of `shape` (`[s(/tp), batch, d_model]`) activations, received as `dtype`.
    pub(super) fn new(pipe: &'a Pipeline, shape: [usize; 3], dtype: DType) -> Self {
        Self::with_extra(pipe, shape, dtype, 0)
    }

    /// [`new`](Self::new), each tensor followed by `extra` values.
    pub(super) fn with_extra(
        pipe: &'a Pipeline,
        shape: [usize; 3],
        dtype: DType,
        extra: usize,
    ) -> Self {
        Self {
            pipe,
            shape,
            extra,
            dtype,
            idle: Duration::ZERO,
            sends: Vec::new(),
        }
    }

    /// The tensor `from` sends next, on `device` in the model's dtype; the wait counted idle.
    pub(super) fn recv(&mut self, from: Side, device: &Device) -> Result<Tensor<3>> {
        self.recv_with(from, device).map(|(x, _)| x)
    }

    /// [`recv`](Self::recv), and the `extra` values that follow the tensor.
    pub(super) fn recv_with(
        &mut self,
        from: Side,
        device: &Device,
    ) -> Result<(Tensor<3>, Vec<f32>)> {
        let len = self.shape.iter().product::<usize>() + self.extra;
        let links = &self.pipe.links;
        let waiting = Instant::now();
        let values = in_profile(|| {
            Ok(match from {
                Side::Prev => links.recv_prev::<f32>(len)?.wait()?,
                Side::Next => links.recv_next::<f32>(len)?.wait()?,
            })
        })?;
        self.idle += waiting.elapsed();
        let mut values = values;
        let extra = values.split_off(len - self.extra);
        let x =
            Tensor::<3>::from_data(TensorData::new(values, self.shape), device).cast(self.dtype);
        Ok((x, extra))
    }

    /// Posts `x` (its values; no graph travels) to `to`; waited for by [`finish`](Self::finish).
    pub(super) fn send(&mut self, to: Side, x: Tensor<3>) -> Result<()> {
        self.send_with(to, x, &vec![0.0; self.extra])
    }

    /// [`send`](Self::send), `extra` (the `extra` values) after the tensor.
    pub(super) fn send_with(&mut self, to: Side, x: Tensor<3>, extra: &[f32]) -> Result<()> {
        debug_assert_eq!(extra.len(), self.extra, "a message's extra values");
        let mut values = to_vec(x)?;
        values.extend_from_slice(extra);
        let links = &self.pipe.links;
        let send = in_profile(|| {
            Ok(match to {
                Side::Next => links.send_next(values)?,
                Side::Prev => links.send_prev(values)?,
            })
        })?;
        self.sends.push(send);
        Ok(())
    }

    /// Waits for every send; returns the time spent waiting in the whole step.
    pub(super) fn finish(mut self) -> Result<Duration> {
        let waiting = Instant::now();
        for send in std::mem::take(&mut self.sends) {
            in_profile(|| Ok(send.wait()?))?;
        }
        Ok(self.idle + waiting.elapsed())
    }
}

/// `f`'s transfers counted under their own label in the communication profile (per stage:
/// what each sent, received and waited), not under the layers'.
fn in_profile<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _scope = burn_tp_comm::profile::scope("pipeline transfers");
    f()
}

/// An activation's values, as they travel.
fn to_vec(t: Tensor<3>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| TpError::Config(format!("pipeline: reading an activation: {e:?}")))
}
