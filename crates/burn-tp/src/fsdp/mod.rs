//! Fully sharded data parallelism (ZeRO-3, PyTorch's FSDP2, Megatron-FSDP): every parameter's
//! tp shard is split again over the data-parallel ranks, so between steps a rank holds
//! `1 / dp` of its parameters, their gradients and the optimizer's state. Each part of the
//! model (the ends: embedding, final norm, head; each block) is all-gathered just before it
//! runs, the next part's gather posted while this one computes; the gather's backward is the
//! reduce-scatter, so each parameter's gradient leaves the backward already summed over the
//! ranks and cut to this rank's shard.
//!
//! ```text
//!  shards      rank r holds rows [r c, (r+1) c) of every parameter's dim 0 (c = ceil(rows / dp),
//!              the last rank's padded with zeros that stay zero)
//!
//!  forward     gather E | gather B0 | gather B1 |  ...         gather = all-gather on dim 0
//!                       | embed     | block 0   | block 1 ...  each gather posted while the
//!                                                              part before it computes
//!  reshard_after_forward = true (ZeRO-3): a block's gathered weights are dropped after its
//!  forward (the block runs untracked, its input kept) and gathered again for its backward:
//!  backward    gather B(L-1) | gather B(L-2) | ...
//!              head, backward| recompute B(L-1), backward  ->  reduce-scatter dW(L-1) -> my shard
//!  reshard_after_forward = false (ZeRO-2 style): the gathered weights stay from the forward
//!  to their backward; no regather, no recompute; the backward runs part by part, each part's
//!  reduce-scatters in flight while the next part's backward runs.
//!
//!  step        grads /= dp (HSDP: all-reduce over the replicas first); AdamW on the shards
//! ```
//!
//! Sharding is per parameter on dim 0 (FSDP2's choice, not FSDP1's flat buffer per block): a
//! shard keeps its parameter's rank and id, so Burn's optimizers, [`crate::precision`] and
//! [`crate::reshard::move_optimizer_state`] work on the sharded model unchanged, and the
//! backward of each parameter's gather is a reduce-scatter of that parameter alone (a flat
//! buffer's backward would add every parameter's gradient into a whole-block zero tensor).
//! HSDP: the shard group is a subset of dp ([`crate::mesh::DeviceMesh::fsdp_groups`]), the
//! shards replicated over the rest.

mod gather;
mod step;
mod whole;

pub use step::{ON_DEMAND, PREFETCHED};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_tp_comm::{ProcessGroup, ReduceOp};

use crate::checkpoint::{HeldRows, Sharding, StageMap};
use crate::init::owned;
use crate::ops::{all_gather, all_reduce};
use crate::reshard::Reshard;
use crate::{Result, TpError};

/// How a model's parameters are sharded over the data-parallel ranks, and how a step gathers
/// them. Made from the whole (tp-sharded) model with [`new`](Self::new), the same on every
/// rank; [`shard`](Self::shard) then cuts each rank's shards, [`loss_and_grads`](Self::loss_and_grads)
/// runs a step on them.
#[derive(Clone, Debug)]
pub struct Fsdp {
    shard: ProcessGroup,
    replicas: Option<ProcessGroup>,
    /// Each sharded parameter's dim 0 before padding.
    rows: Arc<HashMap<ParamId, usize>>,
    reshard_after_forward: bool,
    compute: Option<FloatDType>,
    prefetch: bool,
    /// Expert parallelism: the experts' parameters, split over the ranks holding the same
    /// experts instead of the shard group.
    experts: Option<Arc<ExpertGroups>>,
    /// The digest of the whole model it was made from, checked against the other replicas'
    /// at the first step ([`crate::dp::check_replicas`]), then dropped.
    digest: Arc<std::sync::Mutex<Option<crate::init::ReplicaDigest>>>,
}

/// The experts' parameters and the groups they are split and replicated over.
#[derive(Debug)]
struct ExpertGroups {
    ids: HashSet<ParamId>,
    group: ProcessGroup,
    replicas: Option<ProcessGroup>,
}

impl Fsdp {
    /// The sharding of `model` (the whole model, each parameter its tp shard) over `shard`
    /// (the data-parallel group, or its shard group with HSDP): every float parameter with an
    /// element, but quantized ones (a QLoRA base stays whole). Reshards after the forward.
    pub fn new<M: Module>(model: &M, shard: &ProcessGroup) -> Self {
        struct Rows(HashMap<ParamId, usize>);
        impl ModuleVisitor for Rows {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                if D > 0 && t.shape().num_elements() > 0 && !matches!(t.dtype(), DType::QFloat(_)) {
                    self.0.insert(param.id, t.dims()[0]);
                }
            }
        }
        let mut rows = Rows(HashMap::new());
        model.visit(&mut rows);
        Self {
            shard: shard.clone(),
            replicas: None,
            rows: Arc::new(rows.0),
            reshard_after_forward: true,
            compute: None,
            prefetch: true,
            experts: None,
            digest: Arc::new(std::sync::Mutex::new(Some(crate::init::ReplicaDigest::of(
                model,
            )))),
        }
    }

    /// Expert parallelism: the experts' parameters `params` (this rank's experts, the model
    /// cut by [`crate::moe`]'s `expert_parallel`; [`crate::dp::Experts`]' fields) split over
    /// `group` (of the ranks holding the same experts: all `dp / ep` of them, or with HSDP
    /// those of one shard group, [`crate::mesh::DeviceMesh::fsdp_expert_groups`]), the rest
    /// over the shard group. Their gradients leave the backward summed over that group (and
    /// then over [`with_expert_replicas`](Self::with_expert_replicas)'), which with the
    /// all-to-all's backward covers every dp rank's tokens, as plain expert parallelism's
    /// average does.
    pub fn with_experts(
        mut self,
        params: impl IntoIterator<Item = ParamId>,
        group: &ProcessGroup,
    ) -> Self {
        let replicas = self.experts.as_ref().and_then(|x| x.replicas.clone());
        self.experts = Some(Arc::new(ExpertGroups {
            ids: params.into_iter().collect(),
            group: group.clone(),
            replicas,
        }));
        self
    }

    /// HSDP with expert parallelism: the experts' shards ([`with_experts`](Self::with_experts),
    /// called first) replicated over `replicas` (the ranks holding the same rows of the same
    /// experts), whose gradients are summed over them too. A group of one: none.
    ///
    /// # Panics
    /// Before [`with_experts`](Self::with_experts).
    pub fn with_expert_replicas(mut self, replicas: &ProcessGroup) -> Self {
        let x = self
            .experts
            .as_ref()
            .expect("Fsdp::with_expert_replicas after with_experts");
        self.experts = Some(Arc::new(ExpertGroups {
            ids: x.ids.clone(),
            group: x.group.clone(),
            replicas: (replicas.world_size() > 1).then(|| replicas.clone()),
        }));
        self
    }

    /// The ranks parameter `id` is split over: the shard group, or the experts' group.
    fn group_of(&self, id: ParamId) -> &ProcessGroup {
        match &self.experts {
            Some(x) if x.ids.contains(&id) => &x.group,
            _ => &self.shard,
        }
    }

    /// The ranks holding the same shard of parameter `id` (HSDP), if any.
    fn replicas_of(&self, id: ParamId) -> Option<&ProcessGroup> {
        match &self.experts {
            Some(x) if x.ids.contains(&id) => x.replicas.as_ref(),
            _ => self.replicas.as_ref(),
        }
    }

    /// HSDP: the shards replicated over `replicas` (the ranks holding the same shard), whose
    /// gradients are averaged over them too.
    pub fn with_replicas(mut self, replicas: &ProcessGroup) -> Self {
        self.replicas = (replicas.world_size() > 1).then(|| replicas.clone());
        self
    }

    /// Whether a block's gathered weights are dropped after its forward and gathered again
    /// for its backward (the block then recomputed, as [`crate::recompute`]: ZeRO-3, the
    /// least memory), or kept from the forward to the backward (`false`: ZeRO-2 style, no
    /// second gather or forward).
    pub fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    /// The gathered parameters cast to `dtype` (bf16 compute over f32 shards); the gathers
    /// and the gradients' reduce-scatters stay in the shards' dtype.
    pub fn with_compute_dtype(mut self, dtype: FloatDType) -> Self {
        self.compute = Some(dtype);
        self
    }

    /// Whether the next part's gathers are posted while a part computes (the default), or
    /// only when the part is asked for (to measure what the prefetch hides).
    pub fn with_prefetch(mut self, prefetch: bool) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Whether a block's weights are gathered again for its backward.
    pub fn reshard_after_forward(&self) -> bool {
        self.reshard_after_forward
    }

    /// The ranks a parameter is split over.
    pub fn shard_group(&self) -> &ProcessGroup {
        &self.shard
    }

    /// The data-parallel ranks the gradients average over: the shard group's size times the
    /// replicas'.
    pub fn dp_size(&self) -> usize {
        self.shard.world_size() * self.replicas.as_ref().map_or(1, ProcessGroup::world_size)
    }

    /// This rank's shards of `model` (the whole model [`new`](Self::new) was made from, or a
    /// model of the same shapes: an optimizer state's fields): rows `[r c, (r + 1) c)` of each
    /// sharded parameter's dim 0, `c = ceil(rows / n)`, zero past the end. Local: no
    /// communication.
    pub fn shard<M: Module>(&self, model: M) -> M {
        struct Cut<'a>(&'a Fsdp);
        impl ModuleMapper for Cut<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(&rows) = self.0.rows.get(&param.id) else {
                    return param;
                };
                let group = self.0.group_of(param.id);
                let (r, n) = (group.rank(), group.world_size());
                let c = rows.div_ceil(n);
                param.map(|t| {
                    let requires_grad = t.is_require_grad();
                    let t = t.detach();
                    let (start, end) = ((r * c).min(rows), ((r + 1) * c).min(rows));
                    let mut shard = t.clone().narrow(0, start, end - start);
                    if end - start < c {
                        let mut dims = t.dims();
                        dims[0] = c - (end - start);
                        let pad = Tensor::<D>::zeros(dims, (&t.device(), t.dtype()));
                        shard = Tensor::cat(vec![shard, pad], 0);
                    }
                    let shard = owned(shard);
                    if requires_grad {
                        shard.require_grad()
                    } else {
                        shard
                    }
                })
            }
        }
        model.map(&mut Cut(self))
    }

    /// The whole model of the shards `model` holds (every sharded parameter gathered, fresh
    /// leaves with the same ids and requires-grad): to save, evaluate or export. Collective
    /// over the shard group.
    ///
    /// # Errors
    /// A communication error.
    pub fn unshard<M: Module>(&self, model: M) -> Result<M> {
        self.unshard_on(model, true)
    }

    /// [`unshard`](Self::unshard) where `keep`: every rank of the shard group takes part, one
    /// parameter at a time, and only those with `keep` hold the whole (the writer of a
    /// checkpoint); the others get `model` back, having held one parameter's whole at a time.
    /// Collective over the shard group.
    ///
    /// # Errors
    /// A communication error.
    pub fn unshard_on<M: Module>(&self, model: M, keep: bool) -> Result<M> {
        struct Whole<'a> {
            fsdp: &'a Fsdp,
            keep: bool,
            error: Option<TpError>,
        }
        impl ModuleMapper for Whole<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let Some(&rows) = self.fsdp.rows.get(&param.id) else {
                    return param;
                };
                if self.error.is_some() {
                    return param;
                }
                let group = self.fsdp.group_of(param.id);
                let mut error = None;
                let param = param.map(|t| {
                    let requires_grad = t.is_require_grad();
                    match all_gather(t.clone().detach(), 0, group) {
                        Ok(_) if !self.keep => t,
                        Ok(whole) => {
                            let whole = owned(whole.narrow(0, 0, rows));
                            if requires_grad {
                                whole.require_grad()
                            } else {
                                whole
                            }
                        }
                        Err(e) => {
                            error = Some(e);
                            t
                        }
                    }
                });
                self.error = error;
                param
            }
        }
        let mut whole = Whole {
            fsdp: self,
            keep,
            error: None,
        };
        let model = model.map(&mut whole);
        whole.error.map_or(Ok(model), Err)
    }

    /// The data-parallel average of the shards' gradients in `grads`, which the backward left
    /// summed over the shard group: summed over the replicas (HSDP), then divided by
    /// [`dp_size`](Self::dp_size). A parameter that is not sharded is summed over both
    /// groups first. Collective over the replicas.
    ///
    /// # Errors
    /// A communication error.
    pub fn finish_grads<M: Module>(&self, model: &M, grads: &mut GradientsParams) -> Result<()> {
        struct Average<'a> {
            fsdp: &'a Fsdp,
            grads: &'a mut GradientsParams,
            error: Option<TpError>,
        }
        impl ModuleVisitor for Average<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.error.is_some() {
                    return;
                }
                let Some(mut g) = self.grads.remove::<D>(param.id) else {
                    return;
                };
                let fsdp = self.fsdp;
                let mut sum = |g: Tensor<D>, group: &ProcessGroup| {
                    all_reduce(g.clone(), ReduceOp::Sum, group).unwrap_or_else(|e| {
                        self.error.get_or_insert(e);
                        g
                    })
                };
                if !fsdp.rows.contains_key(&param.id) {
                    g = sum(g, fsdp.group_of(param.id));
                }
                if let Some(replicas) = fsdp.replicas_of(param.id) {
                    g = sum(g, replicas);
                }
                let g = g.div_scalar(fsdp.dp_size() as f64);
                self.grads.register(param.id, g);
            }
        }
        if self.dp_size() == 1 {
            return Ok(());
        }
        self.check_replicas_once()?;
        let _scope = burn_tp_comm::profile::scope("fsdp gradient (replicas)");
        let mut average = Average {
            fsdp: self,
            grads,
            error: None,
        };
        model.visit(&mut average);
        average.error.map_or(Ok(()), Err)
    }

    /// At the first step only: the whole model [`new`](Self::new) was made from the same on
    /// every rank of the shard group and the replicas (the experts' over theirs). Collective.
    fn check_replicas_once(&self) -> Result<()> {
        let digest = self.digest.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(digest) = digest else {
            return Ok(());
        };
        let is_expert = |id: ParamId| self.experts.as_ref().is_some_and(|x| x.ids.contains(&id));
        let dense = |_: usize, id: ParamId| !is_expert(id);
        let expert = |_: usize, id: ParamId| is_expert(id);
        let mut checks: Vec<(&ProcessGroup, crate::init::Picks<'_>)> = vec![(&self.shard, &dense)];
        if let Some(r) = &self.replicas {
            checks.push((r, &dense));
        }
        if let Some(x) = &self.experts {
            checks.push((&x.group, &expert));
            if let Some(r) = &x.replicas {
                checks.push((r, &expert));
            }
        }
        digest.verify(&checks, "Fsdp")
    }

    /// The rows of parameter `id`'s tp shard this rank's shard holds (its `shard_rows` rows
    /// from `r c`, the padding past the end cut off); all of them if it is not sharded.
    pub fn held_rows(&self, id: ParamId, shard_rows: usize) -> std::ops::Range<usize> {
        match self.rows.get(&id) {
            Some(&rows) => {
                let start = (self.group_of(id).rank() * shard_rows).min(rows);
                start..(start + shard_rows).min(rows)
            }
            None => 0..shard_rows,
        }
    }

    /// Where this rank's shards lie in the whole model, for a checkpoint each rank writes its
    /// own rows of ([`save_sharded`](crate::checkpoint::save_sharded), read back at any layout
    /// by [`load_sharded`](crate::checkpoint::load_sharded)): `whole`'s tp layout at `tp_rank`
    /// (`whole`: the model this sharding was made from, or one of its shapes), its parameters
    /// the whole model's `map` (with experts, [`StageMap::expert_parallel`] of this rank's),
    /// and the rows of each this rank holds. A parameter that is not sharded is written by the
    /// first rank of its group alone; with HSDP, only the first replica of a shard writes it
    /// (the ranks that write anything: `sharding.map.writes` has one).
    pub fn sharding<M: Module + Reshard>(
        &self,
        whole: &M,
        tp_rank: usize,
        map: StageMap,
    ) -> Sharding {
        let mut sharding = Sharding::of(whole, tp_rank, map);
        for (k, id) in crate::model::param_ids(whole).into_iter().enumerate() {
            match self.rows.get(&id) {
                Some(&rows) => {
                    let group = self.group_of(id);
                    let (r, n) = (group.rank(), group.world_size());
                    let c = rows.div_ceil(n);
                    let held = (r * c).min(rows)..((r + 1) * c).min(rows);
                    sharding.rows[k] = Some(HeldRows { held, extent: c });
                    // An ep rank's map ([`StageMap::expert_parallel`]) leaves the parameters
                    // replicated over ep to rank 0; split over the shard group, each rank
                    // writes its rows.
                    if self.experts.is_some() {
                        sharding.map.writes[k] = true;
                    }
                }
                // Whole on every rank of its group: its first rank writes it.
                None if self.group_of(id).rank() > 0 => {
                    for piece in &mut sharding.layouts[k].pieces {
                        piece.writes = false;
                    }
                }
                None => {}
            }
            if self.replicas_of(id).is_some_and(|r| r.rank() > 0) {
                sharding.map.writes[k] = false;
            }
        }
        sharding
    }

    /// The bytes of `model`'s float parameters (a rank's shards between steps: the whole
    /// model's bytes / the shard group's size, but the padding).
    pub fn param_bytes<M: Module>(model: &M) -> usize {
        struct Bytes(usize);
        impl ModuleVisitor for Bytes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let t = param.val();
                self.0 += t.shape().num_elements() * t.dtype().size();
            }
        }
        let mut bytes = Bytes(0);
        model.visit(&mut bytes);
        bytes.0
    }
}
