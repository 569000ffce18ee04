//! The gradient tap: how data parallelism reduces gradients while the backward still runs.
//!
//! Burn has no gradient hooks, so the hook is an op. [`crate::dp::GradReducer::attach`] puts
//! [`TpBackend::tp_grad_tap`](super::TpBackend::tp_grad_tap) (identity forward) between each
//! trainable parameter and its uses. Its backward node runs once per backward with the
//! parameter's whole gradient (autodiff sums every use first, tied embeddings included) and
//! hands it to [`TapShared::deliver`]: the gradient is added to the parameter's accumulator
//! (f32 for half-precision gradients, as Megatron's `main_grad`), and on the last micro-batch,
//! once every parameter of a bucket has delivered, the bucket's accumulators are flattened,
//! concatenated and their average over the data-parallel group started
//! ([`TpBackend::tp_start`](super::TpBackend::tp_start)). The backward goes on; after it,
//! [`TpBackend::tp_grad_bucket`](super::TpBackend::tp_grad_bucket) waits for each bucket.
//!
//! Buckets hold parameters in reverse visiting order (DDP's order: the last layers' gradients
//! come first), so the first buckets start while the first layers still differentiate. Every
//! data-parallel rank runs the same graph, so buckets start in the same order on every rank.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape};
use burn_tp_comm::{CommError, ProcessGroup, ReduceOp};

use super::{Collective, PendingCollective, TpBackend};

/// One parameter's tap: the reducer's shared state and the parameter's slot (its index in the
/// module's visiting order). Public because [`TpBackend`](super::TpBackend)'s signatures name it.
#[derive(Clone)]
pub struct GradTap {
    pub(crate) shared: Arc<TapShared>,
    pub(crate) slot: usize,
}

impl fmt::Debug for GradTap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GradTap(slot {})", self.slot)
    }
}

/// What the taps of one [`crate::dp::GradReducer`] share.
pub(crate) struct TapShared {
    /// The data-parallel group (weak: graph nodes must not keep a panicking rank in it).
    pub(crate) group: ProcessGroup,
    /// Expert parallelism: the ranks holding the same experts (weak), which the buckets of
    /// experts' gradients reduce over instead.
    pub(crate) expert_group: Option<ProcessGroup>,
    /// Per bucket: whether it holds experts' gradients (and none else).
    pub(crate) expert: Vec<bool>,
    /// Per slot: its bucket, `None` for a frozen parameter (no tap).
    pub(crate) bucket_of: Vec<Option<usize>>,
    /// Per bucket: its slots, in the order they are concatenated.
    pub(crate) buckets: Vec<Vec<usize>>,
    /// Per bucket with `scatter`: its elements, zero-padded to a multiple of its group's size.
    pub(crate) padded: Vec<usize>,
    /// Reduce-scatter each bucket (the distributed optimizer: rank `r` keeps chunk `r` of the
    /// average) instead of all-reducing it.
    pub(crate) scatter: bool,
    pub(crate) state: Mutex<TapState>,
}

/// The mutable part: accumulators, countdowns, started buckets.
#[derive(Default)]
pub(crate) struct TapState {
    /// Per slot: the accumulated gradient (a `FloatTensor<B>` of the backend that delivered).
    pub(crate) acc: Vec<Option<Box<dyn Any + Send>>>,
    /// Per bucket: slots still to deliver in this backward (counted on the last micro-batch).
    pub(crate) remaining: Vec<usize>,
    /// Whether this backward is the last micro-batch of the step (buckets start).
    pub(crate) last: bool,
    /// Per bucket: the started average (a `PendingCollective<B>`).
    pub(crate) started: Vec<Option<Box<dyn Any + Send>>>,
    /// The first failure inside a backward, returned by the reducer's `finish`.
    pub(crate) error: Option<CommError>,
}

impl TapShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, TapState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Called by the tap's backward node with slot `slot`'s gradient of this backward.
    pub(crate) fn deliver<B: TpBackend>(&self, slot: usize, grad: FloatTensor<B>) {
        // Half-precision gradients accumulate and average in f32.
        let grad = match grad.dtype() {
            DType::F16 | DType::BF16 => B::float_cast(grad, FloatDType::F32),
            _ => grad,
        };
        let Some(bucket) = self.bucket_of.get(slot).copied().flatten() else {
            return;
        };
        let mut st = self.lock();
        let acc = match st.acc[slot].take() {
            Some(prev) => match prev.downcast::<FloatTensor<B>>() {
                Ok(prev) => B::float_add(*prev, grad),
                Err(_) => grad,
            },
            None => grad,
        };
        st.acc[slot] = Some(Box::new(acc));
        if !st.last {
            return;
        }
        st.remaining[bucket] = st.remaining[bucket].saturating_sub(1);
        if st.remaining[bucket] == 0 {
            self.start::<B>(&mut st, bucket);
        }
    }

    /// Starts bucket `bucket`'s average: its accumulators, flattened, concatenated.
    fn start<B: TpBackend>(&self, st: &mut TapState, bucket: usize) {
        let mut flat = Vec::with_capacity(self.buckets[bucket].len());
        for &slot in &self.buckets[bucket] {
            match st.acc[slot]
                .take()
                .and_then(|a| a.downcast::<FloatTensor<B>>().ok())
            {
                Some(g) => {
                    let n = g.shape().num_elements();
                    flat.push(B::float_reshape(*g, Shape::from(vec![n])));
                }
                None => {
                    st.error.get_or_insert(CommError::Backend(format!(
                        "overlapped gradient reduction: parameter slot {slot} has no gradient"
                    )));
                    return;
                }
            }
        }
        let n: usize = flat.iter().map(|g| g.shape().num_elements()).sum();
        if self.scatter && self.padded[bucket] > n {
            let first = &flat[0];
            let (device, dtype) = (first.device(), first.dtype().into());
            flat.push(B::float_zeros(
                Shape::from(vec![self.padded[bucket] - n]),
                &device,
                dtype,
            ));
        }
        let flat = if flat.len() == 1 {
            flat.pop().expect("one gradient")
        } else {
            B::float_cat(flat, 0)
        };
        let _scope = burn_tp_comm::profile::scope("dp gradient bucket (overlapped)");
        let dp = self.group.world_size() as f64;
        let group = match (self.expert[bucket], &self.expert_group) {
            (true, Some(experts)) => experts,
            _ => &self.group,
        };
        // An expert's gradient already sums its ep ranks' tokens: the dp average is the sum
        // over the ranks holding the same expert, over dp. Either average is a sum of
        // pre-scaled values when scattering (exact for a power-of-two dp).
        let (flat, op) = match (self.scatter, self.expert[bucket]) {
            (false, false) => (flat, Collective::AllReduce(ReduceOp::Avg)),
            (false, true) => (
                B::float_mul_scalar(flat, (1.0 / dp).into()),
                Collective::AllReduce(ReduceOp::Sum),
            ),
            (true, _) => (
                B::float_mul_scalar(flat, (1.0 / dp).into()),
                Collective::ReduceScatter { dim: 0 },
            ),
        };
        let pending = B::tp_start(flat, op, group.clone());
        st.started[bucket] = Some(Box::new(pending));
    }

    /// The started average of bucket `bucket` (once), as the backend `B` that started it.
    pub(crate) fn take<B: TpBackend>(
        &self,
        bucket: usize,
    ) -> Result<PendingCollective<B>, CommError> {
        let mut st = self.lock();
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        let started = st.started.get_mut(bucket).and_then(Option::take);
        match started.map(|p| p.downcast::<PendingCollective<B>>()) {
            Some(Ok(p)) => Ok(*p),
            Some(Err(_)) => Err(CommError::Backend(format!(
                "overlapped gradient reduction: bucket {bucket} was started by another backend"
            ))),
            None => Err(CommError::Backend(format!(
                "overlapped gradient reduction: bucket {bucket} was never started"
            ))),
        }
    }
}
