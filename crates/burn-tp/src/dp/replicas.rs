//! Replicas that start apart train a blend of different models without a word: the check
//! that the data-parallel replicas hold the same parameters, bit for bit, with one all-reduce
//! of a digest per parameter (DDP broadcasts at construction instead; burn-tp's replicas start
//! identical by construction, [`crate::init`], so it checks, and [`sync_replicas`] broadcasts
//! where asked).
//!
//! [`super::DpOptimizer`], [`super::GradReducer`], [`super::DistributedAdamW`] and
//! [`crate::fsdp::Fsdp`] run it once, at their first step (the Fsdp on the whole model it was
//! made from), so a replica that differs is refused before any update.

use burn::module::{Module, ParamId};
use burn_tp_comm::ProcessGroup;

use super::Experts;
use crate::init::ReplicaDigest;
use crate::{Result, TpError};

/// What [`sync_replicas`] does with replicas that differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReplicaPolicy {
    /// An error naming the first parameter that differs ([`TpError::ReplicasDiffer`]).
    #[default]
    Refuse,
    /// Every replica takes dp rank 0's parameters (the experts their own group's first
    /// rank's), as [`super::broadcast_parameters_with`].
    Broadcast,
}

/// Checks that every data-parallel replica holds the same parameters: the experts' (with
/// expert parallelism, which splits them over dp) over their own group, every other over
/// `dp_group`. One all-reduce of a digest per group (a parameter's bytes, shape and dtype).
/// Collective over `dp_group` (and the experts' group).
///
/// # Errors
/// [`TpError::ReplicasDiffer`] naming the first parameter that differs; a communication
/// error.
pub fn check_replicas<M: Module>(
    model: &M,
    dp_group: &ProcessGroup,
    experts: Option<&Experts>,
) -> Result<()> {
    check_digest(
        &ReplicaDigest::of(model),
        dp_group,
        experts,
        "check_replicas",
    )
}

/// [`check_replicas`] on a digest taken earlier.
fn check_digest(
    digest: &ReplicaDigest,
    dp_group: &ProcessGroup,
    experts: Option<&Experts>,
    what: &str,
) -> Result<()> {
    let is_expert = |id: ParamId| experts.is_some_and(|x| x.params.contains(&id));
    let dense = |_: usize, id: ParamId| !is_expert(id);
    let expert = |_: usize, id: ParamId| is_expert(id);
    match experts {
        Some(x) => digest.verify(&[(dp_group, &dense), (&x.group, &expert)], what),
        None => digest.verify(&[(dp_group, &dense)], what),
    }
}

/// `model` with every data-parallel replica holding the same parameters: checked as
/// [`check_replicas`]; where they differ, `policy` refuses or broadcasts dp rank 0's (the
/// experts' from their group's first rank). Collective over `dp_group` (and the experts'
/// group).
///
/// # Errors
/// With [`ReplicaPolicy::Refuse`], [`TpError::ReplicasDiffer`]; a communication error.
pub fn sync_replicas<M: Module>(
    model: M,
    dp_group: &ProcessGroup,
    experts: Option<&Experts>,
    policy: ReplicaPolicy,
) -> Result<M> {
    match (check_replicas(&model, dp_group, experts), policy) {
        (Ok(()), _) => Ok(model),
        (Err(TpError::ReplicasDiffer { .. }), ReplicaPolicy::Broadcast) => match experts {
            Some(x) => super::broadcast_parameters_with(model, dp_group, x),
            None => super::broadcast_parameters(model, dp_group),
        },
        (Err(e), _) => Err(e),
    }
}
