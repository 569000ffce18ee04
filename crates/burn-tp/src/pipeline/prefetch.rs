//! Prefetch under a pipeline: a stage's step asks for its parts (fsdp's gathered ends and
//! blocks) in an order its schedule fixes before the step starts, so the step knows each
//! request's successor and posts its gathers while the part asked for computes, across the
//! boundaries of the actions too (the next micro-batch's first block gathered while this one
//! waits for its activation: in the bubble).
//!
//! ```text
//!  the last of 2 stages (blocks 2, 3), 1F1B over 2 micro-batches, resharding after the forward
//!  actions    F0          B0 (rerun)          F1          B1 (rerun)
//!  requests   B2  B3      E*  B3*  B2*        B2  B3      E*  B3*  B2*
//!  each request's gathers posted when the one before it is handed out: B3's while B2 runs,
//!  E*'s while B3 runs, F1's B2 while B2* runs and while F1 waits for its activation
//!  (*: tracked, the backward's rerun; E: the ends, here the head)
//! ```
//!
//! Every rank of a stage's shard group runs the same actions, so they post the same gathers in
//! the same order.

use std::borrow::Cow;
use std::cell::Cell;

use burn::optim::GradientsParams;
use burn::tensor::Gradients;

use super::schedule::Action;
use crate::Result;
use crate::recompute::{Part, Parts};

/// Where a stage's virtual stages sit: the blocks of each, and which virtual stage (if any)
/// embeds (the whole model's first) and which runs the head (its last).
pub(super) struct StageShape<'s> {
    pub(super) virtual_stages: &'s [Vec<usize>],
    pub(super) first_virtual: Option<usize>,
    pub(super) last_virtual: Option<usize>,
}

impl StageShape<'_> {
    /// The parts `actions` ask for, in order, each with whether it is tracked: a forward its
    /// ends (embedding) and blocks; recomputing, its backward reruns them tracked, from the
    /// last (a tracked backward asks for nothing: its graph holds the parts).
    pub(super) fn requests(&self, actions: &[Action], recompute: bool) -> Vec<(Part, bool)> {
        let mut order = Vec::new();
        for action in actions {
            match *action {
                Action::Forward { virtual_stage, .. } => {
                    let tracked = !recompute;
                    if self.first_virtual == Some(virtual_stage) {
                        order.push((Part::Ends, tracked));
                    }
                    let blocks = &self.virtual_stages[virtual_stage];
                    order.extend(blocks.iter().map(|&l| (Part::Block(l), tracked)));
                    // The tracked forward runs the head; recomputing, the backward does.
                    if tracked && self.last_virtual == Some(virtual_stage) {
                        order.push((Part::Ends, true));
                    }
                }
                Action::Backward { virtual_stage, .. } if recompute => {
                    if self.last_virtual == Some(virtual_stage) {
                        order.push((Part::Ends, true));
                    }
                    let blocks = &self.virtual_stages[virtual_stage];
                    order.extend(blocks.iter().rev().map(|&l| (Part::Block(l), true)));
                    if self.first_virtual == Some(virtual_stage) {
                        order.push((Part::Ends, true));
                    }
                }
                Action::Backward { .. } => {}
            }
        }
        order
    }
}

/// `parts` asked for in a known `order`: handing out one posts the next one's gathers. A
/// request off the order (none is expected) ends the prefetching for the step; the values do
/// not depend on it.
pub(super) struct Planned<'p, M> {
    parts: &'p dyn Parts<M>,
    /// The models the tracked and the untracked requests run on (`valid()`'s copy).
    model: &'p M,
    inner: &'p M,
    order: Vec<(Part, bool)>,
    at: Cell<Option<usize>>,
}

impl<'p, M: Clone> Planned<'p, M> {
    /// `order`'s first part prefetched now (`parts` decides whether a prefetch posts anything).
    pub(super) fn new(
        parts: &'p dyn Parts<M>,
        (model, inner): (&'p M, &'p M),
        order: Vec<(Part, bool)>,
    ) -> Result<Self> {
        let planned = Self {
            parts,
            model,
            inner,
            order,
            at: Cell::new(Some(0)),
        };
        planned.post(0)?;
        Ok(planned)
    }

    /// Posts the gathers of request `k` of the order, if on the plan and there is one.
    fn post(&self, k: usize) -> Result<()> {
        match (self.at.get(), self.order.get(k)) {
            (Some(_), Some(&(part, tracked))) => {
                let model = if tracked { self.model } else { self.inner };
                self.parts.prefetch(model, part, tracked)
            }
            _ => Ok(()),
        }
    }
}

impl<M: Clone> Parts<M> for Planned<'_, M> {
    fn prefetch(&self, model: &M, part: Part, tracked: bool) -> Result<()> {
        self.parts.prefetch(model, part, tracked)
    }

    fn part<'m>(&self, model: &'m M, part: Part, tracked: bool) -> Result<Cow<'m, M>> {
        let got = self.parts.part(model, part, tracked)?;
        if let Some(k) = self.at.get() {
            let on_plan = self.order.get(k) == Some(&(part, tracked));
            self.at.set(on_plan.then_some(k + 1));
            self.post(k + 1)?;
        }
        Ok(got)
    }

    fn switch_to(&self, slot: usize) {
        self.parts.switch_to(slot);
    }

    fn backward_done(&self, grads: &mut Gradients) -> Result<()> {
        self.parts.backward_done(grads)
    }

    fn finish(&self, total: &mut GradientsParams) -> Result<()> {
        self.parts.finish(total)
    }
}
