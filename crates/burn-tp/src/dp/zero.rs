//! [`DistributedAdamW`]: AdamW with its state sharded over the data-parallel group (ZeRO stage 1,
//! Megatron's distributed optimizer).
//!
//! ```text
//!  bucket b (flattened trainable parameters, reverse visiting order, zero-padded to dp * c)
//!  | rank 0's chunk c | rank 1's chunk c | ... | rank dp-1's chunk c |
//!
//!  backward:  gradients -> bucket's reduce-scatter (started as the bucket completes) -> my chunk
//!  step:      AdamW on my chunk only (moments for 1/dp of the parameters)
//!             -> all-gather of the updated chunks -> every rank's full parameters
//! ```

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, GradientsParams, LearningRate,
    ModuleOptimizer, Optimizer,
};
use burn::tensor::{Tensor, TensorData};
use burn_pack::Scalar;
use burn_tp_comm::{ProcessGroup, ReduceOp};

use super::GradClip;
use super::reducer::{GradReducer, ReduceGroups, first_grad};
use crate::ops::{all_gather, all_gather_async};
use crate::reshard::optimizer::IndexedState;
use crate::{Result, TpError};

/// AdamW whose moments are sharded over the data-parallel group: each dp rank owns a contiguous
/// `1/dp` chunk of every bucket of flattened parameters, gets that chunk of the averaged gradient
/// by a reduce-scatter started during the backward (the buckets of [`GradReducer`]), updates it
/// with Burn's own [`AdamW`] (elementwise, so a chunk steps exactly as the whole would), and the
/// updated chunks are all-gathered into every rank's parameters. Each rank keeps `1/dp` of the
/// moments (plus at most `dp - 1` padding elements per bucket). Under expert parallelism
/// ([`ReduceGroups::experts`]) the experts' buckets are sharded over the `dp / ep` ranks that
/// hold the same experts instead.
///
/// ```ignore
/// let mut optim = DistributedAdamW::new(&AdamWConfig::new(), &model, &dp_group, bucket_bytes);
/// let loss = optim.attach(model.clone(), true).loss(ids, targets, None)?;
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// model = optim.step(lr, model, grads)?;
/// ```
///
/// The master parameters are the module's (keep them f32 and train a bf16 copy, as
/// `precision::cast_params` does: the gradients are reduced in f32). Gradient clipping of the
/// config is not applied.
pub struct DistributedAdamW {
    reducer: GradReducer,
    adamw: AdamW,
    /// Per bucket: the state of this rank's chunk.
    state: Vec<Option<AdamWState<1>>>,
}

impl std::fmt::Debug for DistributedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DistributedAdamW({} buckets, {} state bytes on this rank)",
            self.buckets(),
            self.state_bytes()
        )
    }
}

impl DistributedAdamW {
    /// AdamW of `config` for `model`'s trainable parameters, sharded over `dp_group`, in buckets
    /// of at most `bucket_bytes`.
    pub fn new<M: Module>(
        config: &AdamWConfig,
        model: &M,
        dp_group: &ProcessGroup,
        bucket_bytes: usize,
    ) -> Self {
        Self::with_groups(
            config,
            model,
            dp_group,
            bucket_bytes,
            ReduceGroups::default(),
        )
    }

    /// [`new`](Self::new), with some gradients reduced over other groups
    /// ([`GradReducer::with_groups`]): a tied embedding's chunk, in a bucket of its own, summed
    /// over the pipeline's first and last stages after the reduce-scatter; the experts' buckets
    /// reduce-scattered over the ranks holding the same experts, whose moments they shard.
    pub fn with_groups<M: Module>(
        config: &AdamWConfig,
        model: &M,
        dp_group: &ProcessGroup,
        bucket_bytes: usize,
        groups: ReduceGroups,
    ) -> Self {
        let reducer = GradReducer::build(model, dp_group, bucket_bytes, true, groups);
        let state = (0..reducer.buckets()).map(|_| None).collect();
        Self {
            reducer,
            adamw: config.build(),
            state,
        }
    }

    /// Buckets (one reduce-scatter and one all-gather each per step).
    pub fn buckets(&self) -> usize {
        self.reducer.buckets()
    }

    /// Bytes of AdamW moments this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.state
            .iter()
            .flatten()
            .map(|s| {
                let m = &s.momentum;
                let n = m.moment_1.shape().num_elements();
                n * (m.moment_1.dtype().size() + m.moment_2.dtype().size())
            })
            .sum()
    }

    /// `model` with the gradient taps (see [`GradReducer::attach`]): run the step's forward and
    /// backward on it.
    pub fn attach<M: Module>(&self, model: M, last_micro_batch: bool) -> M {
        self.reducer.attach(model, last_micro_batch)
    }

    /// Its gradient buckets (for [`crate::pipeline::loss_and_grads_overlapped`]).
    pub fn reducer(&self) -> &GradReducer {
        &self.reducer
    }

    /// One AdamW step after the last micro-batch's backward: waits for this rank's chunks of the
    /// averaged gradients, updates them, and returns `model` with every rank's updated chunks.
    ///
    /// # Errors
    /// A communication error; a bucket never completed (see [`GradReducer::finish`]).
    pub fn step<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: GradientsParams,
    ) -> Result<M> {
        Ok(self.step_clipped(lr, model, grads, None)?.0)
    }

    /// [`step`](Self::step) with the averaged gradients clipped by their global norm first
    /// (and that norm): each rank sums the squares of its chunks' elements `clip` counts
    /// ([`GradClip::sharded`] over the world with every rank counting, from the model's tp
    /// layout and pipeline stage map alone: the chunks already split each bucket over dp, and
    /// the experts' over the ranks holding them, so every element is in one rank's chunk).
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn step_clipped<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: GradientsParams,
        clip: Option<&GradClip>,
    ) -> Result<(M, Option<f64>)> {
        self.reducer.check_started()?;
        self.reducer
            .check_replicas_once(&model, "DistributedAdamW")?;
        let Some(like) = first_grad(&model, &grads) else {
            return Ok((model, None));
        };
        let mut grad_chunks = self.reducer.resolve(like)?;
        // Chunk r of a bucket of its own covers the same elements on every stage that shares
        // the parameter.
        if let Some((_, bucket, group)) = self.reducer.summed() {
            let chunk = grad_chunks[bucket].clone();
            grad_chunks[bucket] = crate::ops::all_reduce(chunk, ReduceOp::Sum, group)?;
        }
        let norm = match clip {
            Some(clip) => {
                let (norm, scale) = clip.norm_of(self.chunks_sum_sq(&model, &grad_chunks, clip))?;
                if let Some(scale) = scale {
                    for g in &mut grad_chunks {
                        *g = g.clone().mul_scalar(scale);
                    }
                }
                Some(norm)
            }
            None => None,
        };
        let flat = self.flat_params(&model);
        let _scope =
            burn_tp_comm::profile::scope("dp parameter all-gather (distributed optimizer)");
        let mut gathers = Vec::with_capacity(flat.len());
        for (b, (params, grad)) in flat.into_iter().zip(grad_chunks).enumerate() {
            let group = self.reducer.group_of(b);
            let (r, n) = (group.rank(), group.world_size());
            let c = self.reducer.padded()[b] / n;
            let mine = params.narrow(0, r * c, c);
            let grad = grad.cast(mine.dtype());
            let (updated, state) = self.adamw.step(lr, mine, grad, self.state[b].take());
            self.state[b] = state;
            gathers.push(all_gather_async(updated, 0, group)?);
        }
        let full = gathers
            .into_iter()
            .map(|g| g.wait())
            .collect::<Result<Vec<_>>>()?;
        Ok((self.with_flat(model, full), norm))
    }

    /// The sum of squares of the elements of this rank's gradient chunks `chunks` that `clip`
    /// counts (each parameter's counted ranges, at its offset in its bucket, cut to the chunk).
    fn chunks_sum_sq<M: Module>(&self, model: &M, chunks: &[Tensor<1>], clip: &GradClip) -> f64 {
        struct Shapes(Vec<(ParamId, Vec<usize>)>);
        impl ModuleVisitor for Shapes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push((param.id, param.val().dims().to_vec()));
            }
        }
        let mut shapes = Shapes(Vec::new());
        model.visit(&mut shapes);
        let layout = self.reducer.layout();
        let mut parts = Vec::new();
        for (b, slots) in layout.buckets.iter().enumerate() {
            let group = self.reducer.group_of(b);
            let c = self.reducer.padded()[b] / group.world_size();
            let (lo, hi) = (group.rank() * c, (group.rank() + 1) * c);
            for &slot in slots {
                let (id, dims) = &shapes.0[slot];
                let at = layout.offset[slot];
                for r in clip.counted_flat(*id, dims) {
                    let (s, e) = ((at + r.start).max(lo), (at + r.end).min(hi));
                    if s < e {
                        let part = chunks[b].clone().narrow(0, s - lo, e - s);
                        parts.push(
                            part.cast(burn::tensor::FloatDType::F32)
                                .powi_scalar(2)
                                .sum(),
                        );
                    }
                }
            }
        }
        match parts.is_empty() {
            true => 0.0,
            false => Tensor::cat(parts, 0).sum().into_scalar::<f64>(),
        }
    }

    /// Per bucket: the flattened values of its parameters (inner tensors), zero-padded.
    fn flat_params<M: Module>(&self, model: &M) -> Vec<Tensor<1>> {
        struct Values(Vec<Option<Tensor<1>>>);
        impl ModuleVisitor for Values {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val().inner();
                self.0.push(Some(t.flatten(0, D - 1)));
            }
        }
        let mut values = Values(Vec::new());
        model.visit(&mut values);
        let mut values = values.0;
        self.reducer
            .layout()
            .buckets
            .iter()
            .enumerate()
            .map(|(b, slots)| {
                let mut parts: Vec<Tensor<1>> = slots
                    .iter()
                    .map(|&s| values[s].take().expect("each slot in one bucket"))
                    .collect();
                let n: usize = parts.iter().map(|p| p.shape().num_elements()).sum();
                let pad = self.reducer.padded()[b] - n;
                if pad > 0 {
                    let first = &parts[0];
                    parts.push(Tensor::zeros([pad], (&first.device(), first.dtype())));
                }
                Tensor::cat(parts, 0)
            })
            .collect()
    }

    /// `model` with the values of `flat` (per bucket, flattened, padded) as its parameters.
    fn with_flat<M: Module>(&self, model: M, flat: Vec<Tensor<1>>) -> M {
        struct Replace<'a> {
            numel: &'a [usize],
            offset: &'a [usize],
            bucket_of: &'a [Option<usize>],
            flat: Vec<Tensor<1>>,
            slot: usize,
        }
        impl ModuleMapper for Replace<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let slot = self.slot;
                self.slot += 1;
                let Some(b) = self.bucket_of[slot] else {
                    return param;
                };
                let values = self.flat[b]
                    .clone()
                    .narrow(0, self.offset[slot], self.numel[slot]);
                param.map(|t| {
                    let values: Tensor<D> = values.reshape(t.shape());
                    Tensor::from_inner(values).require_grad()
                })
            }
        }
        let layout = self.reducer.layout();
        model.map(&mut Replace {
            numel: layout.numel,
            offset: layout.offset,
            bucket_of: layout.bucket_of,
            flat,
            slot: 0,
        })
    }

    /// The state as a Burn AdamW over the whole model (each rank's chunks gathered over dp), to
    /// save with [`crate::checkpoint::save`]. Collective over the dp group.
    ///
    /// # Errors
    /// A communication error; an encoding error.
    pub fn to_module_optimizer<M: Module>(
        &self,
        config: &AdamWConfig,
        model: &M,
    ) -> Result<ModuleOptimizer> {
        let optim = config.init();
        let Some(time) = self.state.iter().flatten().map(|s| s.momentum.time).next() else {
            return Ok(optim);
        };
        let layout = self.reducer.layout();
        let (numel, offset, buckets) = (layout.numel, layout.offset, layout.buckets);
        let shapes = shapes(model);
        let mut state = IndexedState::default();
        for (b, slots) in buckets.iter().enumerate() {
            let Some(s) = &self.state[b] else { continue };
            let group = self.reducer.group_of(b);
            let m1 = all_gather(s.momentum.moment_1.clone(), 0, group)?;
            let m2 = all_gather(s.momentum.moment_2.clone(), 0, group)?;
            for &slot in slots {
                let (o, n) = (offset[slot], numel[slot]);
                let shape = shapes[slot].clone();
                for (field, m) in [("momentum.moment_1", &m1), ("momentum.moment_2", &m2)] {
                    let (bytes, _, dtype) = m.clone().narrow(0, o, n).into_data().into_parts();
                    let data = TensorData::from_bytes(bytes, shape.clone(), dtype);
                    state.tensors.insert((slot, field.to_string()), data);
                }
                state.scalars.insert(
                    format!("{slot}.__rank"),
                    Scalar::UInt(shapes[slot].len() as u64),
                );
                state
                    .scalars
                    .insert(format!("{slot}.momentum.time"), Scalar::UInt(time as u64));
            }
        }
        Ok(optim.load_record(state.record(model)?))
    }

    /// Takes this rank's chunks of a Burn AdamW's state over the whole model (loaded, say, by
    /// [`crate::checkpoint::load_optimizer`], saved at any dp).
    ///
    /// # Errors
    /// An encoding error; a parameter whose moments are missing while others have them.
    pub fn shard_module_optimizer<M: Module>(
        &mut self,
        optim: &ModuleOptimizer,
        model: &M,
    ) -> Result<()> {
        let state = IndexedState::of(optim, model)?;
        let layout = self.reducer.layout();
        let (numel, buckets) = (layout.numel, layout.buckets);
        let device = first_device(model);
        for (b, slots) in buckets.iter().enumerate() {
            let mut m1 = Vec::new();
            let mut m2 = Vec::new();
            let mut time = None;
            for &slot in slots {
                let get = |field: &str| state.tensors.get(&(slot, field.to_string()));
                match (get("momentum.moment_1"), get("momentum.moment_2")) {
                    (Some(a), Some(b)) => {
                        m1.push(flat_of(a.clone(), numel[slot], &device));
                        m2.push(flat_of(b.clone(), numel[slot], &device));
                    }
                    _ if m1.is_empty() && slot == slots[0] => break,
                    _ => {
                        return Err(TpError::Config(format!(
                            "optimizer state: parameter {slot} has no AdamW moments while \
                             others of its bucket do"
                        )));
                    }
                }
                if let Some(Scalar::UInt(t)) =
                    state.scalars.get(&format!("{slot}.momentum.time")).copied()
                {
                    time = Some(t as usize);
                }
            }
            if m1.is_empty() {
                self.state[b] = None;
                continue;
            }
            let group = self.reducer.group_of(b);
            let (r, dp) = (group.rank(), group.world_size());
            let c = self.reducer.padded()[b] / dp;
            let chunk = |parts: Vec<Tensor<1>>| {
                let n: usize = parts.iter().map(|p| p.shape().num_elements()).sum();
                let mut parts = parts;
                let pad = c * dp - n;
                if pad > 0 {
                    let first = &parts[0];
                    parts.push(Tensor::zeros([pad], (&first.device(), first.dtype())));
                }
                Tensor::cat(parts, 0).narrow(0, r * c, c)
            };
            let mut momentum = AdaptiveMomentumState::new(time.unwrap_or(0), chunk(m1), chunk(m2));
            momentum.max_moment_2 = None;
            self.state[b] = Some(AdamWState { momentum });
        }
        Ok(())
    }
}

/// Each parameter's shape, in visiting order.
fn shapes<M: Module>(model: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().shape().to_vec());
        }
    }
    let mut s = Shapes(Vec::new());
    model.visit(&mut s);
    s.0
}

/// The device of the model's first parameter, without autodiff (the moments' device).
fn first_device<M: Module>(model: &M) -> burn::tensor::Device {
    struct First(Option<burn::tensor::Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().inner().device());
            }
        }
    }
    let mut f = First(None);
    model.visit(&mut f);
    f.0.expect("a model with parameters")
}

fn flat_of(data: TensorData, n: usize, device: &burn::tensor::Device) -> Tensor<1> {
    let (bytes, _, dtype) = data.into_parts();
    let data = TensorData::from_bytes(bytes, vec![n], dtype);
    Tensor::from_data(data, (device, dtype))
}
