//! Full activation recompute (Megatron's `--recompute-granularity full`): the forward keeps only
//! each block's input, and the backward recomputes each block, tracked, just before its own
//! backward. For the longest sequences, where even the activations Megatron keeps per layer
//! ([`crate::backend`]'s fused ops) do not fit.
//!
//! ```text
//!  forward (untracked)   ids ─ embed ─> x0 ─ block 0 ─> x1 ─ ... ─> xL
//!                                       kept           kept        kept
//!  backward              head_loss(xL) ─ backward ─> dxL
//!                        block L-1(x(L-1)) tracked, backward with dxL ─> dx(L-1)
//!                        ...
//!                        embed(ids) tracked, backward with dx0
//! ```
//!
//! Each part's backward is seeded with the gradient of its output (`sum(y * dy)`: the
//! gradient of `y` is `dy`), and the parameter gradients of the parts are summed (a tied
//! embedding gets the head's and the embedding's). The dropout masks are the same in the
//! recomputation: they are functions of their counters ([`crate::dropout`]). Every rank runs
//! the same parts in the same order, so the collectives of each part's backward meet.

use std::borrow::Cow;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Int, Tensor};

use crate::Result as TpResult;
use crate::dropout::DropoutStep;
use crate::model::LanguageModel;
use crate::moe::RouterStats;

/// The loss of `model` on `ids`, `targets` (`[seq, batch]`) and its parameters' gradients, with
/// every block recomputed in the backward: the forward keeps one `[s(/tp), batch, d_model]`
/// tensor per block. The same values as `model.loss(..)` then `backward()` (the same ops,
/// cut at the blocks), at the cost of one more forward of the blocks.
///
/// # Errors
/// As [`LanguageModel::loss`].
pub fn loss_and_grads<M: LanguageModel>(
    model: &M,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    step: Option<DropoutStep>,
) -> TpResult<(Tensor<1>, GradientsParams)> {
    loss_and_grads_with(model, ids, targets, step, &Whole)
}

/// A part of a model a recomputation runs on its own: the ends (the embedding, the final norm
/// and the head) or one block (the whole model's index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Ends,
    Block(usize),
}

/// Where each part's parameters come from: the model itself ([`Whole`]), or gathered just
/// before the part runs ([`crate::fsdp`]). `tracked`: the part runs on the autodiff model
/// (else on its `valid()` copy). Every rank asks for the same parts in the same order.
pub(crate) trait Parts<M: Clone> {
    /// Starts whatever `part` needs, while the part before it runs.
    fn prefetch(&self, model: &M, part: Part, tracked: bool) -> TpResult<()>;
    /// The model to run `part` with.
    fn part<'m>(&self, model: &'m M, part: Part, tracked: bool) -> TpResult<Cow<'m, M>>;

    /// The parts asked for from now on run in the forward or the backward of `slot` (a
    /// pipeline's (virtual stage, micro-batch)): what the source keeps of them for their
    /// backward ([`backward_done`](Self::backward_done)) is that slot's, so several forwards
    /// may run before their backwards. One slot (0) unless called.
    fn switch_to(&self, slot: usize) {
        let _ = slot;
    }

    /// A part's backward is done, `grads` its gradients: the source takes its own (fsdp's
    /// gathered leaves' of the current slot, whose reduce-scatters it posts).
    fn backward_done(&self, grads: &mut Gradients) -> TpResult<()> {
        let _ = grads;
        Ok(())
    }

    /// Whatever the source has in flight, added to `total`: before the next backward (so it
    /// ran during the part's recompute), and after the last.
    fn finish(&self, total: &mut GradientsParams) -> TpResult<()> {
        let _ = total;
        Ok(())
    }
}

/// Every part runs on the model as it is.
pub(crate) struct Whole;

impl<M: Clone> Parts<M> for Whole {
    fn prefetch(&self, _: &M, _: Part, _: bool) -> TpResult<()> {
        Ok(())
    }
    fn part<'m>(&self, model: &'m M, _: Part, _: bool) -> TpResult<Cow<'m, M>> {
        Ok(Cow::Borrowed(model))
    }
}

/// The parts of a step in the order they run, each prefetched while the one before runs.
pub(crate) struct Sequence<'m, 'p, M, P> {
    model: &'m M,
    inner: &'m M,
    parts: &'p P,
    order: Vec<(Part, bool)>,
    at: usize,
}

impl<'m, 'p, M: Clone, P: Parts<M>> Sequence<'m, 'p, M, P> {
    /// `order` of `model` (tracked) and `inner` (its `valid()` copy, untracked); the first
    /// part prefetched now.
    pub(crate) fn new(
        model: &'m M,
        inner: &'m M,
        parts: &'p P,
        order: Vec<(Part, bool)>,
    ) -> TpResult<Self> {
        let seq = Self {
            model,
            inner,
            parts,
            order,
            at: 0,
        };
        if let Some(&(part, tracked)) = seq.order.first() {
            parts.prefetch(seq.pick(tracked), part, tracked)?;
        }
        Ok(seq)
    }

    fn pick(&self, tracked: bool) -> &'m M {
        if tracked { self.model } else { self.inner }
    }

    /// [`Parts::backward_done`] of the source.
    pub(crate) fn backward_done(&self, grads: &mut Gradients) -> TpResult<()> {
        self.parts.backward_done(grads)
    }

    /// [`Parts::finish`] of the source.
    pub(crate) fn finish(&self, total: &mut GradientsParams) -> TpResult<()> {
        self.parts.finish(total)
    }

    /// The next part's model, the one after it prefetched.
    ///
    /// # Panics
    /// Past the end of the order.
    pub(crate) fn next_part(&mut self) -> TpResult<Cow<'m, M>> {
        let (part, tracked) = self.order[self.at];
        let m = self.parts.part(self.pick(tracked), part, tracked)?;
        self.at += 1;
        if let Some(&(next, tracked)) = self.order.get(self.at) {
            self.parts.prefetch(self.pick(tracked), next, tracked)?;
        }
        Ok(m)
    }
}

/// [`loss_and_grads`] with each part's parameters from `parts`.
pub(crate) fn loss_and_grads_with<M: LanguageModel, P: Parts<M>>(
    model: &M,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    step: Option<DropoutStep>,
    parts: &P,
) -> TpResult<(Tensor<1>, GradientsParams)> {
    let held = model.held_layers();
    // Untracked: the ends, the blocks; tracked: the ends (the head), the blocks backwards,
    // the ends (the embedding).
    let mut order = vec![(Part::Ends, false)];
    order.extend(held.iter().map(|&i| (Part::Block(i), false)));
    order.push((Part::Ends, true));
    order.extend(held.iter().rev().map(|&i| (Part::Block(i), true)));
    order.push((Part::Ends, true));
    let inner = model.valid();
    let mut parts = Sequence::new(model, &inner, parts, order)?;
    // The forward, untracked: only the blocks' inputs stay, and each MoE block's router
    // statistics (constants here), which the routers' loss of the whole forward needs.
    let mut inputs = Vec::with_capacity(model.num_layers() + 1);
    let mut routers: Vec<Vec<RouterStats>> = Vec::with_capacity(model.num_layers());
    let mut x = parts.next_part()?.embed(ids.clone().inner())?;
    for &i in &held {
        let block = parts.next_part()?;
        let (next, stats) = crate::moe::record(|| block.layer(i, x.clone(), step));
        inputs.push(x);
        routers.push(stats.into_iter().map(RouterStats::from_inner).collect());
        x = next?;
    }

    let mut total = GradientsParams::new();
    let leaf = |x: Tensor<3>| Tensor::from_inner(x).require_grad();
    let h = leaf(x);
    let mut loss = parts.next_part()?.head_loss(h.clone(), targets)?;
    let mut grads = loss.backward();
    let all: Vec<RouterStats> = routers.iter().flatten().cloned().collect();
    if let Some(aux) = model.router_loss(&all) {
        loss = loss.clone() + aux.cast(loss.dtype());
    }
    let mut dy = take_grad(&h, &mut grads);
    parts.backward_done(&mut grads)?;
    merge(&mut total, grads, model);
    for (k, &i) in held.iter().enumerate().rev() {
        let block = parts.next_part()?;
        let x = leaf(inputs.pop().expect("one input per block"));
        let (y, stats) = crate::moe::record(|| block.layer(i, x.clone(), step));
        let y = y?;
        // The routers' loss with this block's statistics tracked and every other block's
        // held: its gradient is exactly this block's part of the whole loss's (transformers'
        // load-balancing loss is linear in each layer's probabilities, the counts fixed).
        let seeded = (y.clone() * Tensor::from_inner(dy).cast(y.dtype())).sum();
        let seeded = match stats.is_empty() {
            true => seeded,
            false => {
                let mut parts = routers.clone();
                parts[k] = stats;
                let parts: Vec<RouterStats> = parts.into_iter().flatten().collect();
                match model.router_loss(&parts) {
                    Some(aux) => seeded.clone() + aux.cast(seeded.dtype()),
                    None => seeded,
                }
            }
        };
        drop(block);
        parts.finish(&mut total)?;
        let mut grads = seeded.backward();
        dy = take_grad(&x, &mut grads);
        parts.backward_done(&mut grads)?;
        merge(&mut total, grads, model);
    }
    let embedded = parts.next_part()?.embed(ids)?;
    parts.finish(&mut total)?;
    let mut grads = seeded_backward(embedded, Tensor::from_inner(dy));
    parts.backward_done(&mut grads)?;
    merge(&mut total, grads, model);
    parts.finish(&mut total)?;
    Ok((loss.detach(), total))
}

/// The backward of `y` with upstream gradient `dy` (cast to `y`'s dtype): `sum(y * dy)`'s.
pub(crate) fn seeded_backward(y: Tensor<3>, dy: Tensor<3>) -> Gradients {
    let dy = dy.cast(y.dtype());
    (y * dy).sum().backward()
}

fn take_grad(x: &Tensor<3>, grads: &mut Gradients) -> Tensor<3> {
    x.grad_remove(grads)
        .expect("a block's input takes part in its output")
}

/// Adds the gradients of `model`'s parameters in `grads` to `total`.
pub(crate) fn merge<M: Module>(total: &mut GradientsParams, grads: Gradients, model: &M) {
    struct Add<'a> {
        total: &'a mut GradientsParams,
        part: GradientsParams,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.part.remove::<D>(param.id) {
                let g = match self.total.remove::<D>(param.id) {
                    Some(sum) => sum + g,
                    None => g,
                };
                self.total.register(param.id, g);
            }
        }
    }
    let part = GradientsParams::from_grads(grads, model);
    model.visit(&mut Add { total, part });
}
