//! A step on the shards: each part gathered just before it runs ([`Gathered`]), with
//! recompute ([`crate::recompute`]'s order of parts) when the blocks reshard after the
//! forward, or one tracked forward otherwise.

use std::borrow::Cow;
use std::cell::RefCell;

use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Int, Tensor};

use super::Fsdp;
use super::gather::{InFlight, Leaf, Waiter};
use crate::Result;
use crate::dropout::DropoutStep;
use crate::model::LanguageModel;
use crate::recompute::{Part, Parts, Sequence, loss_and_grads_with};

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

/// The asynchronous reduce-scatters: the gathered leaves of the parts since the last backward,
/// and the reduce-scatters posted after it, waited before the next backward (they travel while
/// the next part is gathered and recomputed).
#[derive(Default)]
struct Deferred {
    leaves: RefCell<Vec<Leaf>>,
    posted: RefCell<Vec<Waiter>>,
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
        let mut leaves = match (&self.deferred, tracked) {
            (Some(d), true) => Some(d.leaves.borrow_mut()),
            _ => None,
        };
        let leaves = leaves.as_deref_mut();
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

impl<M: LanguageModel> Parts<M> for Gathered<'_, M> {
    fn prefetch(&self, model: &M, part: Part, tracked: bool) -> Result<()> {
        if !self.prefetch {
            return Ok(());
        }
        let started = self.start(model, part, tracked)?;
        if let Some(((_, t), stale)) = self.next.replace(Some(((part, tracked), started))) {
            // Every rank posts the same gathers: finish the stale one so they all complete.
            self.finish(model, stale, t)?;
        }
        Ok(())
    }

    fn part<'m>(&self, model: &'m M, part: Part, tracked: bool) -> Result<Cow<'m, M>> {
        let started = match self.next.take() {
            Some((key, started)) if key == (part, tracked) => started,
            Some(((_, t), stale)) => {
                self.finish(model, stale, t)?;
                self.start(model, part, tracked)?
            }
            None => self.start(model, part, tracked)?,
        };
        Ok(Cow::Owned(self.finish(model, started, tracked)?))
    }

    fn backward_done(&self, grads: &mut Gradients) -> Result<()> {
        let Some(d) = &self.deferred else {
            return Ok(());
        };
        // Every rank posts them in the same order: its gathers'.
        let mut posted = d.posted.borrow_mut();
        for leaf in d.leaves.borrow_mut().drain(..) {
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
    /// Each part of a sharded model gathered when asked (with `prefetch`, the next one's
    /// gathers posted before the asked one is returned): what a pipeline stage's step
    /// ([`crate::pipeline::loss_and_grads_sharded`]) runs its parts with.
    pub(crate) fn parts<M: LanguageModel>(&self, prefetch: bool) -> impl Parts<M> + '_ {
        Gathered::new(self, prefetch, false)
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
        let parts = Gathered::new(self, self.prefetch, self.reshard_after_forward);
        if self.reshard_after_forward {
            return loss_and_grads_with(model, ids, targets, step, &parts);
        }
        let inner = model.valid();
        let loss = forward_loss(model, &inner, &parts, true, (ids, targets, step))?;
        let grads = GradientsParams::from_grads(loss.backward(), model);
        Ok((loss.detach(), grads))
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
