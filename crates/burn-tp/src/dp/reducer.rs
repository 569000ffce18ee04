//! [`GradReducer`]: the data-parallel gradient reduction overlapped with the backward.

use std::fmt;
use std::sync::Arc;

use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::ops::all_reduce;

use crate::backend::TpBackend;
use crate::backend::grad_tap::{GradTap, TapShared, TapState};
use crate::{Result, TpError};

/// The groups some gradients of a [`GradReducer`] (or [`super::DistributedAdamW`]) reduce over
/// besides the data-parallel group.
#[derive(Clone, Debug, Default)]
pub struct ReduceGroups {
    /// A parameter whose gradient is also summed over another group after its dp average, in
    /// a bucket of its own (as in Megatron, so its chunks line up on both stages under the
    /// distributed optimizer): a tied embedding over a pipeline's first and last stages
    /// ([`crate::pipeline::Pipeline::tied_embedding`]).
    pub summed: Option<(ParamId, ProcessGroup)>,
    /// Expert parallelism: the experts' gradients summed over their own group and divided by
    /// dp (as [`super::average_gradients_with`]), in buckets of their own.
    pub experts: Option<super::Experts>,
}

/// Data-parallel gradient averaging overlapped with the backward, in buckets (PyTorch DDP's and
/// Megatron's `overlap_grad_reduce`): each bucket's average over the data-parallel group starts
/// the moment its last gradient is produced, while the backward goes on with earlier layers.
///
/// Burn has no gradient hooks: [`attach`](Self::attach) puts a tap op between each trainable
/// parameter and its uses (`backend/grad_tap.rs` documents the mechanism); [`finish`](Self::finish)
/// waits for the buckets and puts the averages in place of the gradients. Parameters are bucketed
/// in reverse visiting order, at most `bucket_bytes` each (a larger parameter has its own).
///
/// ```ignore
/// let reducer = GradReducer::new(&model, &dp_group, GradReducer::DEFAULT_BUCKET_BYTES);
/// let view = reducer.attach(model.clone(), true); // the last (here the only) micro-batch
/// let loss = view.loss(ids, targets, None)?;
/// let mut grads = GradientsParams::from_grads(loss.backward(), &model);
/// reducer.finish(&model, &mut grads)?; // the dp averages, as average_gradients gives
/// ```
///
/// Limits: every trainable parameter must get a gradient in each step's last backward (a
/// parameter unused in the forward is an error at `finish`, naming how many, as DDP without
/// `find_unused_parameters`); frozen parameters (not requiring grad at [`new`](Self::new)) are
/// left out; gradients accumulate over micro-batches inside the reducer (in f32 for
/// half-precision gradients, Megatron's `main_grad`) and only the last micro-batch's backward
/// communicates. One view per backward: a parameter tapped twice in one graph counts twice.
pub struct GradReducer {
    shared: Arc<TapShared>,
    group: ProcessGroup,
    /// Expert parallelism: the ranks holding the same experts.
    experts: Option<ProcessGroup>,
    /// A parameter whose gradient is also summed over another group (its slot, in a bucket of
    /// its own): a tied embedding over a pipeline's first and last stages.
    summed: Option<(usize, ProcessGroup)>,
    /// Per slot: its elements, and its offset in its bucket.
    numel: Vec<usize>,
    offset: Vec<usize>,
    /// Whether the replicas were found to agree ([`Self::check_replicas_once`]).
    replicas_checked: Arc<std::sync::atomic::AtomicBool>,
}

impl fmt::Debug for GradReducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GradReducer({} parameters in {} buckets over dp {})",
            self.shared.bucket_of.iter().flatten().count(),
            self.shared.buckets.len(),
            self.group.world_size()
        )
    }
}

impl GradReducer {
    /// The default bucket size: 4 MiB.
    pub const DEFAULT_BUCKET_BYTES: usize = 4 << 20;

    /// A reducer for `model`'s trainable parameters over `dp_group`, in buckets of at most
    /// `bucket_bytes`.
    pub fn new<M: Module>(model: &M, dp_group: &ProcessGroup, bucket_bytes: usize) -> Self {
        Self::build(
            model,
            dp_group,
            bucket_bytes,
            false,
            ReduceGroups::default(),
        )
    }

    /// [`new`](Self::new), with some gradients reduced over other groups as well or instead
    /// ([`ReduceGroups`]: a tied embedding over a pipeline's first and last stages, the
    /// experts under expert parallelism).
    pub fn with_groups<M: Module>(
        model: &M,
        dp_group: &ProcessGroup,
        bucket_bytes: usize,
        groups: ReduceGroups,
    ) -> Self {
        Self::build(model, dp_group, bucket_bytes, false, groups)
    }

    /// With `scatter`, each bucket is reduce-scattered (zero-padded to a multiple of its
    /// group's size): rank `r` of the group gets chunk `r` of the average
    /// ([`super::DistributedAdamW`]).
    pub(crate) fn build<M: Module>(
        model: &M,
        dp_group: &ProcessGroup,
        bucket_bytes: usize,
        scatter: bool,
        groups: ReduceGroups,
    ) -> Self {
        struct Sizes(Vec<(usize, usize, bool, ParamId)>);
        impl ModuleVisitor for Sizes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                let n = t.shape().num_elements();
                self.0
                    .push((n, n * t.dtype().size(), t.is_require_grad(), param.id));
            }
        }
        let mut sizes = Sizes(Vec::new());
        model.visit(&mut sizes);
        let sizes = sizes.0;
        let summed = groups.summed.and_then(|(id, group)| {
            let slot = sizes.iter().position(|s| s.3 == id && s.2)?;
            Some((slot, group))
        });
        let alone = summed.as_ref().map(|s| s.0);
        let is_expert = |slot: usize| {
            groups
                .experts
                .as_ref()
                .is_some_and(|x| x.params.contains(&sizes[slot].3))
        };
        let mut bucket_of = vec![None; sizes.len()];
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut expert = Vec::new();
        // Per kind (dense, expert): the bucket being filled and its bytes. Experts' gradients
        // reduce over another group, so they fill buckets of their own.
        let mut open: [Option<(usize, usize)>; 2] = [None, None];
        // Reverse visiting order: the backward produces the last layers' gradients first.
        for slot in (0..sizes.len()).rev().filter(|&s| sizes[s].2) {
            let bytes = sizes[slot].1;
            let kind = usize::from(is_expert(slot));
            let own = alone == Some(slot);
            let bucket = match open[kind] {
                Some((b, filled)) if !own && filled + bytes <= bucket_bytes => b,
                _ => {
                    buckets.push(Vec::new());
                    expert.push(kind == 1);
                    buckets.len() - 1
                }
            };
            buckets[bucket].push(slot);
            bucket_of[slot] = Some(bucket);
            let filled = open[kind].filter(|o| o.0 == bucket).map_or(0, |o| o.1) + bytes;
            // A parameter summed over another group keeps its bucket to itself.
            open[kind] = (!own).then_some((bucket, filled));
        }
        let mut offset = vec![0; sizes.len()];
        for bucket in &buckets {
            let mut at = 0;
            for &slot in bucket {
                offset[slot] = at;
                at += sizes[slot].0;
            }
        }
        let experts = groups.experts.map(|x| x.group);
        let size = |b: usize| match (expert[b], &experts) {
            (true, Some(g)) => g.world_size().max(1),
            _ => dp_group.world_size().max(1),
        };
        let padded = buckets
            .iter()
            .enumerate()
            .map(|(b, slots)| {
                let n: usize = slots.iter().map(|&s| sizes[s].0).sum();
                n.div_ceil(size(b)) * size(b)
            })
            .collect();
        let n_buckets = buckets.len();
        let state = TapState {
            acc: (0..sizes.len()).map(|_| None).collect(),
            remaining: vec![0; n_buckets],
            started: (0..n_buckets).map(|_| None).collect(),
            ..TapState::default()
        };
        Self {
            shared: Arc::new(TapShared {
                group: dp_group.weak(),
                expert_group: experts.as_ref().map(ProcessGroup::weak),
                expert,
                bucket_of,
                buckets,
                padded,
                scatter,
                state: std::sync::Mutex::new(state),
            }),
            group: dp_group.clone(),
            experts,
            summed,
            numel: sizes.iter().map(|s| s.0).collect(),
            offset,
            replicas_checked: Arc::default(),
        }
    }

    /// The group bucket `bucket` reduces over: the experts' group for a bucket of experts'
    /// gradients, the data-parallel group otherwise.
    pub(crate) fn group_of(&self, bucket: usize) -> &ProcessGroup {
        match (self.shared.expert[bucket], &self.experts) {
            (true, Some(g)) => g,
            _ => &self.group,
        }
    }

    /// At the first step only: every trainable parameter the same on every replica (the
    /// experts' over their group; [`super::check_replicas`]). Collective over dp (and the
    /// experts' group).
    pub(crate) fn check_replicas_once<M: Module>(&self, model: &M, what: &str) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.replicas_checked.load(Ordering::Relaxed) {
            return Ok(());
        }
        let bucket = |slot: usize| self.shared.bucket_of.get(slot).copied().flatten();
        let dense = |slot: usize, _| bucket(slot).is_some_and(|b| !self.shared.expert[b]);
        let expert = |slot: usize, _| bucket(slot).is_some_and(|b| self.shared.expert[b]);
        let digest = crate::init::ReplicaDigest::of(model);
        match &self.experts {
            Some(x) => digest.verify(&[(&self.group, &dense), (x, &expert)], what)?,
            None => digest.verify(&[(&self.group, &dense)], what)?,
        }
        self.replicas_checked.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether experts' gradients reduce over their own group ([`ReduceGroups::experts`]).
    pub fn has_experts(&self) -> bool {
        self.experts.is_some()
    }

    /// Whether the coming backward completes its parameters' gradients for the step (each
    /// bucket starts once all its parameters have delivered in such a backward): a pipeline's
    /// schedule tells it before each backward.
    pub(crate) fn set_last_micro_batch(&self, last: bool) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.last = last;
    }

    /// The parameter summed over another group after its dp average, and its bucket.
    pub(crate) fn summed(&self) -> Option<(usize, usize, &ProcessGroup)> {
        let (slot, group) = self.summed.as_ref()?;
        let bucket = self.shared.bucket_of[*slot]?;
        Some((*slot, bucket, group))
    }

    /// Buckets (each one all-reduce per step).
    pub fn buckets(&self) -> usize {
        self.shared.buckets.len()
    }

    /// `model` with a tap on each trainable parameter: run this step's forward and backward on
    /// it. `last_micro_batch`: this backward's gradients complete the step's (the buckets start);
    /// earlier micro-batches only accumulate.
    pub fn attach<M: Module>(&self, model: M, last_micro_batch: bool) -> M {
        self.begin(last_micro_batch);
        self.view(model)
    }

    /// Every bucket waits for all its parameters again; `last`: the coming backward completes
    /// the step's gradients.
    pub(crate) fn begin(&self, last: bool) {
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.last = last;
        for (b, slots) in self.shared.buckets.iter().enumerate() {
            st.remaining[b] = slots.len();
        }
    }

    /// `model` with a tap on each trainable parameter, the step's state left as it is: one
    /// view per forward whose backward delivers.
    pub(crate) fn view<M: Module>(&self, model: M) -> M {
        struct Tapper<'a> {
            shared: &'a Arc<TapShared>,
            slot: usize,
        }
        impl ModuleMapper for Tapper<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let slot = self.slot;
                self.slot += 1;
                if self.shared.bucket_of.get(slot).copied().flatten().is_none() {
                    return param;
                }
                let tap = GradTap {
                    shared: self.shared.clone(),
                    slot,
                };
                param.map(|t| {
                    Tensor::from_dispatch(<Dispatch as TpBackend>::tp_grad_tap(
                        t.into_dispatch(),
                        tap,
                    ))
                })
            }
        }
        model.map(&mut Tapper {
            shared: &self.shared,
            slot: 0,
        })
    }

    /// Waits for every bucket and puts the data-parallel average of each parameter's
    /// (accumulated) gradient into `grads`, in place of this rank's. Call after the last
    /// micro-batch's backward, with the model the view was attached to.
    ///
    /// # Errors
    /// A communication error; a trainable parameter without a gradient this step (the group is
    /// aborted, so every rank fails rather than waits).
    pub fn finish<M: Module>(&self, model: &M, grads: &mut GradientsParams) -> Result<()> {
        self.check_started()?;
        self.check_replicas_once(model, "GradReducer")?;
        let Some(like) = first_grad(model, grads) else {
            return Ok(());
        };
        let mut flat = self.resolve(like)?;
        if let Some((_, bucket, group)) = self.summed() {
            flat[bucket] = all_reduce(flat[bucket].clone(), ReduceOp::Sum, group)?;
        }
        struct Finisher<'a> {
            reducer: &'a GradReducer,
            grads: &'a mut GradientsParams,
            slot: usize,
            flat: Vec<Tensor<1>>,
        }
        impl ModuleVisitor for Finisher<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let slot = self.slot;
                self.slot += 1;
                let r = self.reducer;
                let Some(bucket) = r.shared.bucket_of.get(slot).copied().flatten() else {
                    return;
                };
                // Every bucketed parameter gets its average, whether `grads` had it or not
                // (gradients read off a tapped view have none: its parameters are not leaves).
                self.grads.remove::<D>(param.id);
                let avg: Tensor<D> = self.flat[bucket]
                    .clone()
                    .narrow(0, r.offset[slot], r.numel[slot])
                    .reshape(param.val().shape());
                self.grads.register(param.id, avg);
            }
        }
        model.visit(&mut Finisher {
            reducer: self,
            grads,
            slot: 0,
            flat,
        });
        Ok(())
    }

    /// `Ok` when every bucket was started in this step's last backward; otherwise the error,
    /// after aborting the group (so every rank fails rather than waits) and dropping the
    /// step's accumulators.
    pub(crate) fn check_started(&self) -> Result<()> {
        let missing = {
            let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.started.iter().filter(|s| s.is_none()).count()
        };
        if missing > 0 {
            let e = burn_tp_comm::CommError::Backend(format!(
                "overlapped gradient reduction: {missing} of {} buckets never completed: a \
                 trainable parameter got no gradient this step (unused in the forward, or the \
                 view not attached with last_micro_batch = true)",
                self.buckets()
            ));
            self.group.abort(&e);
            // The accumulators of this failed step go.
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.acc.iter_mut().for_each(|a| *a = None);
            st.started.iter_mut().for_each(|s| *s = None);
            return Err(e.into());
        }
        Ok(())
    }

    /// Waits for every bucket, in order: the flat average (or, scattering, this rank's chunk of
    /// it). `like`: any gradient of the backward, which routes the call to its backend.
    pub(crate) fn resolve(&self, like: Tensor<1>) -> Result<Vec<Tensor<1>>> {
        (0..self.buckets())
            .map(|bucket| {
                let tap = GradTap {
                    shared: self.shared.clone(),
                    slot: 0,
                };
                let like = like.clone().into_dispatch();
                <Dispatch as TpBackend>::tp_grad_bucket(like, tap, bucket)
                    .into_result()
                    .map(Tensor::from_dispatch)
                    .map_err(TpError::from)
            })
            .collect()
    }

    /// Where each parameter lies in the buckets.
    pub(crate) fn layout(&self) -> BucketLayout<'_> {
        BucketLayout {
            numel: &self.numel,
            offset: &self.offset,
            buckets: &self.shared.buckets,
            bucket_of: &self.shared.bucket_of,
        }
    }

    /// Per bucket: its padded length (a multiple of the dp size when scattering).
    pub(crate) fn padded(&self) -> &[usize] {
        &self.shared.padded
    }
}

/// Any gradient in `grads` of a parameter of `model`, flattened, or else any of its trainable
/// parameters' values (inner): it routes the bucket resolves to their backend. `None` for a
/// model without trainable parameters.
pub(crate) fn first_grad<M: Module>(model: &M, grads: &GradientsParams) -> Option<Tensor<1>> {
    struct First<'a>(&'a GradientsParams, Option<Tensor<1>>, Option<Tensor<1>>);
    impl ModuleVisitor for First<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.1.is_none()
                && let Some(g) = self.0.get::<D>(param.id)
            {
                self.1 = Some(g.flatten(0, D - 1));
            }
            let t = param.val();
            if self.2.is_none() && t.is_require_grad() {
                self.2 = Some(t.inner().flatten(0, D - 1));
            }
        }
    }
    let mut first = First(grads, None, None);
    model.visit(&mut first);
    first.1.or(first.2)
}

/// Where each parameter (slot, in visiting order) lies in the buckets.
pub(crate) struct BucketLayout<'a> {
    /// Per slot: its elements.
    pub(crate) numel: &'a [usize],
    /// Per slot: its offset in its bucket.
    pub(crate) offset: &'a [usize],
    /// Per bucket: its slots, in order.
    pub(crate) buckets: &'a [Vec<usize>],
    /// Per slot: its bucket (`None`: frozen).
    pub(crate) bucket_of: &'a [Option<usize>],
}
