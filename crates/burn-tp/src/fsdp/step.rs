//! A step on the shards: each part gathered just before it runs ([`Gathered`]), with
//! recompute ([`crate::recompute`]'s order of parts) when the blocks reshard after the
//! forward, or one tracked forward otherwise.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Int, Tensor};

use super::Fsdp;
use super::gather::{InFlight, Leaf, Waiter};
use crate::Result;
use crate::dropout::DropoutStep;
use crate::model::LanguageModel;
use crate::recompute::{Part, Parts, Sequence, loss_and_grads_with, merge, seeded_backward};

/// The profile's labels of a part's gathers: posted ahead, while the part before it ran; or
/// when the part was asked for (no prefetch, or another part prefetched: a wasted gather).
pub const PREFETCHED: &str = "fsdp gather (prefetched)";
/// See [`PREFETCHED`].
pub const ON_DEMAND: &str = "fsdp gather (on demand)";

/// What is in flight for a part: the model minus its blocks (the ends), or one block.
enum Started<M: LanguageModel> {
    Ends(M, Vec<M::Block>, InFlight),
    Block(usize, M::Block, InFlight),
}

/// A prefetched part: which (and whether tracked), and its gathers in flight.
type Prefetched<M> = ((Part, bool), Started<M>);

/// The parts of a sharded model, each gathered when asked, the next one's gathers posted
/// before the asked one is returned (so they run while it computes).
struct Gathered<'f, M: LanguageModel> {
    fsdp: &'f Fsdp,
    next: RefCell<Option<Prefetched<M>>>,
    prefetch: bool,
    /// The tracked parts' gathers untracked, their wholes leaves whose gradients
    /// [`Parts::backward_done`] reduce-scatters asynchronously (the recomputed step, whose
    /// parts each have a backward of their own); otherwise the gathers' own backward does.
    deferred: Option<Deferred>,
}

/// The asynchronous reduce-scatters: the gathered leaves of the parts since the last backward
/// (per slot: a pipeline runs several forwards before their backwards), and the reduce-scatters
/// posted after it, waited before the next backward (they travel while the next part is
/// gathered and recomputed).
#[derive(Default)]
struct Deferred {
    slot: Cell<usize>,
    leaves: RefCell<HashMap<usize, Vec<Leaf>>>,
    posted: RefCell<Vec<Waiter>>,
}

impl Deferred {
    /// The current slot's leaves, taken.
    fn take(&self) -> Vec<Leaf> {
        self.leaves
            .borrow_mut()
            .remove(&self.slot.get())
            .unwrap_or_default()
    }
}

impl<'f, M: LanguageModel> Gathered<'f, M> {
    fn new(fsdp: &'f Fsdp, prefetch: bool, deferred: bool) -> Self {
        Self {
            fsdp,
            next: RefCell::new(None),
            prefetch,
            deferred: deferred.then(Deferred::default),
        }
    }
}

impl<M: LanguageModel> Gathered<'_, M> {
    fn start(&self, model: &M, part: Part, tracked: bool) -> Result<Started<M>> {
        let detach = tracked && self.deferred.is_some();
        Ok(match part {
            Part::Ends => {
                // The blocks set aside (kept as shards): the ends alone are gathered.
                let mut ends = model.clone();
                let blocks = std::mem::take(ends.blocks_mut().0);
                let flight = self.fsdp.start(&ends, detach)?;
                Started::Ends(ends, blocks, flight)
            }
            Part::Block(i) => {
                let block = crate::model::block_at(model, i)?.clone();
                let flight = self.fsdp.start(&block, detach)?;
                Started::Block(i, block, flight)
            }
        })
    }

    fn finish(&self, model: &M, started: Started<M>, tracked: bool) -> Result<M> {
        let mut all = match (&self.deferred, tracked) {
            (Some(d), true) => Some((d.leaves.borrow_mut(), d.slot.get())),
            _ => None,
        };
        let leaves = all
            .as_mut()
            .map(|(all, slot)| all.entry(*slot).or_default());
        Ok(match started {
            Started::Ends(ends, blocks, flight) => {
                let mut ends = self.fsdp.finish(ends, flight, leaves)?;
                *ends.blocks_mut().0 = blocks;
                ends
            }
            Started::Block(i, block, flight) => {
                let block = self.fsdp.finish(block, flight, leaves)?;
                let at = model
                    .block_ids()
                    .iter()
                    .position(|&j| j == i)
                    .expect("a block the model holds: started from it");
                let mut m = model.clone();
                m.blocks_mut().0[at] = block;
                m
            }
        })
    }
}

impl<M: LanguageModel> Gathered<'_, M> {
    /// The leaves of the parts gathered since the last call (kept: each part's own, for the
    /// part-by-part backward).
    fn take_leaves(&self) -> Vec<Leaf> {
        self.deferred
            .as_ref()
            .map(Deferred::take)
            .unwrap_or_default()
    }
}

impl<M: LanguageModel> Parts<M> for Gathered<'_, M> {
    fn prefetch(&self, model: &M, part: Part, tracked: bool) -> Result<()> {
        if !self.prefetch {
            return Ok(());
        }
        let started = {
            let _scope = burn_tp_comm::profile::scope(PREFETCHED);
            self.start(model, part, tracked)?
        };
        if let Some(((_, t), stale)) = self.next.replace(Some(((part, tracked), started))) {
            // Every rank posts the same gathers: finish the stale one so they all complete.
            self.finish(model, stale, t)?;
        }
        Ok(())
    }

    fn part<'m>(&self, model: &'m M, part: Part, tracked: bool) -> Result<Cow<'m, M>> {
        let on_demand = || {
            let _scope = burn_tp_comm::profile::scope(ON_DEMAND);
            self.start(model, part, tracked)
        };
        let started = match self.next.take() {
            Some((key, started)) if key == (part, tracked) => started,
            Some(((_, t), stale)) => {
                self.finish(model, stale, t)?;
                on_demand()?
            }
            None => on_demand()?,
        };
        Ok(Cow::Owned(self.finish(model, started, tracked)?))
    }

    fn switch_to(&self, slot: usize) {
        if let Some(d) = &self.deferred {
            d.slot.set(slot);
        }
    }

    fn backward_done(&self, grads: &mut Gradients) -> Result<()> {
        let Some(d) = &self.deferred else {
            return Ok(());
        };
        // Every rank posts them in the same order: its gathers'.
        let mut posted = d.posted.borrow_mut();
        for leaf in d.take() {
            posted.extend(leaf(grads)?);
        }
        Ok(())
    }

    fn finish(&self, total: &mut GradientsParams) -> Result<()> {
        let Some(d) = &self.deferred else {
            return Ok(());
        };
        d.posted.take().into_iter().try_for_each(|w| w(total))
    }
}

impl Fsdp {
    /// Each part of a sharded model gathered when asked, a prefetch posting a part's gathers
    /// ahead (unless [`with_prefetch(false)`](Self::with_prefetch)): what a pipeline stage's
    /// step ([`crate::pipeline::loss_and_grads_sharded`]) runs its parts with. `deferred`:
    /// the tracked parts' wholes are leaves, reduce-scattered by
    /// [`Parts::backward_done`] in the gathers' order (a mixture of experts: the gathers' own
    /// backward runs in autodiff's order, which differs between ranks where an expert got no
    /// token); otherwise each gather's backward reduce-scatters as soon as its gradient is
    /// complete.
    pub(crate) fn parts<M: LanguageModel>(&self, deferred: bool) -> impl Parts<M> + '_ {
        Gathered::new(self, self.prefetch, deferred)
    }

    /// The loss of `model` (this rank's shards) on `ids`, `targets` (`[seq, batch]`, off
    /// autodiff), untracked (evaluation): each part gathered just before it runs and dropped
    /// after, the next one's gathers in flight meanwhile; the ends held throughout. Collective
    /// over the shard group.
    ///
    /// # Errors
    /// As [`LanguageModel::loss`]; a communication error.
    pub fn loss<M: LanguageModel>(
        &self,
        model: &M,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> Result<Tensor<1>> {
        let inner = model.valid();
        let parts = Gathered::new(self, self.prefetch, false);
        forward_loss(&inner, &inner, &parts, false, (ids, targets, step))
    }

    /// The loss of `model` (this rank's shards, [`shard`](Self::shard)) on `ids`, `targets`
    /// (`[seq, batch]`) and its shards' gradients, summed over the shard group
    /// ([`finish_grads`](Self::finish_grads) averages them): each part gathered just before it
    /// runs, the next one's gathers posted while it computes. With
    /// [`reshard_after_forward`](Self::reshard_after_forward) the blocks run untracked and are
    /// gathered and recomputed for their backward ([`crate::recompute`]); otherwise one
    /// tracked forward keeps the gathered weights to the backward. The same values as the
    /// whole model's `loss` then `backward`. Collective over the shard group.
    ///
    /// # Errors
    /// As [`LanguageModel::loss`]; a communication error.
    pub fn loss_and_grads<M: LanguageModel>(
        &self,
        model: &M,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        step: Option<DropoutStep>,
    ) -> Result<(Tensor<1>, GradientsParams)> {
        let parts = Gathered::new(self, self.prefetch, true);
        if self.reshard_after_forward {
            return loss_and_grads_with(model, ids, targets, step, &parts);
        }
        if model.router_loss_experts() == 0 {
            return kept(model, &parts, (ids, targets, step));
        }
        // A MoE model's routers' loss joins every block: one backward over the whole forward,
        // then each gathered whole's reduce-scatter in the gathers' order. (Not the gathers'
        // own backward: autodiff runs it in an order that follows the graph, and an expert no
        // token reached on one rank sits elsewhere in that rank's graph, so the ranks would
        // pair one expert's reduce-scatter with another's.)
        let inner = model.valid();
        let loss = forward_loss(model, &inner, &parts, true, (ids, targets, step))?;
        let mut grads = loss.backward();
        parts.backward_done(&mut grads)?;
        let mut total = GradientsParams::new();
        merge(&mut total, grads, model);
        Parts::finish(&parts, &mut total)?;
        Ok((loss.detach(), total))
    }
}

/// The loss of one forward of `model` (tracked; else of `inner`, its `valid()` copy) by parts,
/// each from `parts` (the next one's gathers in flight while one runs), the ends held
/// throughout; with the routers' loss of a MoE model.
fn forward_loss<M: LanguageModel>(
    model: &M,
    inner: &M,
    parts: &Gathered<'_, M>,
    tracked: bool,
    (ids, targets, step): (Tensor<2, Int>, Tensor<2, Int>, Option<DropoutStep>),
) -> Result<Tensor<1>> {
    let held = model.held_layers();
    let mut order = vec![(Part::Ends, tracked)];
    order.extend(held.iter().map(|&i| (Part::Block(i), tracked)));
    let mut seq = Sequence::new(model, inner, parts, order)?;
    let ends = seq.next_part()?;
    let (loss, routers) = crate::moe::record(|| -> Result<Tensor<1>> {
        let mut x = ends.embed(ids)?;
        for &i in &held {
            x = seq.next_part()?.layer(i, x, step)?;
        }
        ends.head_loss(x, targets)
    });
    let loss = loss?;
    Ok(match model.router_loss(&routers) {
        Some(aux) => loss.clone() + aux.cast(loss.dtype()),
        None => loss,
    })
}

/// Keeping the gathered weights (no reshard), a dense model: one tracked forward cut at the
/// parts (each block's input a leaf, each part's gathered weights leaves of their own), then
/// the backward part by part in reverse: each part's reduce-scatters posted after its backward
/// and waited after the next part's, so they travel while it computes.
///
/// ```text
///  forward   gE gB0 gB1 ...         (each part's gathers posted while the one before runs)
///            embed B0  B1 ... head  (the graphs and the gathered weights kept)
///  backward  head | B(L-1)      | B(L-2)      | ... | embed      |
///            rs E | rs B(L-1) ->| rs B(L-2) ->| ... | rs E     ->| wait
///                   wait rs E     wait rs B(L-1)
/// ```
fn kept<M: LanguageModel>(
    model: &M,
    parts: &Gathered<'_, M>,
    (ids, targets, step): (Tensor<2, Int>, Tensor<2, Int>, Option<DropoutStep>),
) -> Result<(Tensor<1>, GradientsParams)> {
    let held = model.held_layers();
    let mut order = vec![(Part::Ends, true)];
    order.extend(held.iter().map(|&i| (Part::Block(i), true)));
    let inner = model.valid();
    let mut seq = Sequence::new(model, &inner, parts, order)?;
    let ends = seq.next_part()?.into_owned();
    let ends_leaves = parts.take_leaves();
    let embedded = ends.embed(ids)?;
    let mut x = embedded.clone();
    let mut blocks = Vec::with_capacity(held.len());
    for &i in &held {
        let block = seq.next_part()?;
        let input = x.detach().require_grad();
        let y = block.layer(i, input.clone(), step)?;
        blocks.push((input, y.clone(), parts.take_leaves()));
        x = y;
    }
    let h = x.detach().require_grad();
    let loss = ends.head_loss(h.clone(), targets)?;

    let mut total = GradientsParams::new();
    let mut in_flight: Vec<Waiter> = Vec::new();
    // After a part's backward: the previous part's reduce-scatters (in flight during it)
    // waited, this part's posted (every rank in its gathers' order).
    let mut done = |mut grads: Gradients, leaves: &[Leaf], total: &mut GradientsParams| {
        for wait in in_flight.drain(..) {
            wait(total)?;
        }
        for leaf in leaves {
            in_flight.extend(leaf(&mut grads)?);
        }
        merge(total, grads, model);
        Result::Ok(())
    };
    let mut grads = loss.backward();
    let mut dy = h.grad_remove(&mut grads).expect("the head reads its input");
    done(grads, &ends_leaves, &mut total)?;
    for (input, y, leaves) in blocks.into_iter().rev() {
        let mut grads = seeded_backward(y, Tensor::from_inner(dy));
        dy = input
            .grad_remove(&mut grads)
            .expect("a block reads its input");
        done(grads, &leaves, &mut total)?;
    }
    let grads = seeded_backward(embedded, Tensor::from_inner(dy));
    done(grads, &ends_leaves, &mut total)?;
    for wait in in_flight {
        wait(&mut total)?;
    }
    Ok((loss.detach(), total))
}
