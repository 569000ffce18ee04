//! One rank's run: its shard (built or sharded), the epochs (training, validation, world rank
//! 0's decisions), its checkpoints, the trained model gathered.

use std::path::Path;

use burn_tp_comm::{ProcessGroup, ReduceOp};
use burn_train::EventProcessorTraining;
use burn_train::checkpoint::CheckpointingAction;
use burn_train::{InferenceStep, Learner, LearnerEvent, LearnerModel, TrainingItem};

use super::feed::{Feed, take_slot};
use super::items::DpItem;
use super::optim::RankOptim;
use super::shared::{EpochControl, Handoff, Shared};
use super::{GradSync, TensorParallel, TrainItem};
use crate::checkpoint::{self, CheckpointInfo, Sharding, StageMap};
use crate::dp::broadcast_parameters;
use crate::fsdp::Fsdp;
use crate::mesh::DeviceMesh;
use crate::reshard::Reshard;
use crate::{Result, TpError};

/// One rank's whole run: its shard, the epochs, the trained model gathered to tp 1 (on world
/// rank 0 with threads, on every rank with processes).
pub(super) fn rank_main<M>(shared: &Shared<M>, world: ProcessGroup) -> Result<Option<M>>
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainItem<M>: DpItem,
{
    if let Some(t) = shared.timeout {
        world.set_timeout(t);
    }
    let rank = world.rank();
    let mesh = DeviceMesh::new(world.clone(), shared.tp)?;
    let (tp_group, dp_group) = (mesh.tp_group().clone(), mesh.dp_group().clone());
    let replica = mesh.dp_rank();
    let leader = tp_group.rank() == 0;
    let feed = Feed {
        shared,
        tp_group: tp_group.clone(),
        leader,
        // World rank 0 reports (with processes, the only Learner showing anything).
        reports: rank == 0,
        inbox: take_slot(&shared.inbox, rank).flatten(),
        outbox: take_slot(&shared.outbox, rank)
            .flatten()
            .unwrap_or_default(),
    };
    // The Learner's model is the full one: each rank takes its shard of it.
    let mut model = match &shared.shards {
        // Replica 0 builds first, alone on the device's RNG (rank threads share Flex's one):
        // its draws are those of the model built whole from the same seed. The others build
        // after it and take its weights, as DDP starts.
        Some(build) => {
            let first = (replica == 0)
                .then(|| build(&tp_group, &shared.device))
                .transpose()?;
            world.barrier()?;
            let model = match first {
                Some(model) => model,
                None => build(&tp_group, &shared.device)?,
            };
            broadcast_parameters(model, &dp_group)?
        }
        None => M::shard_module(&shared.learner.model(), &tp_group)?,
    };
    // Fully sharded: each rank keeps its rows of every parameter.
    let sharded = match shared.sync {
        GradSync::FullySharded { shard } => {
            let (group, replicas) = mesh.fsdp_groups(if shard == 0 { shared.dp } else { shard })?;
            let fsdp = Fsdp::new(&model, &group).with_replicas(&replicas);
            let map = StageMap::whole(model.layout(tp_group.rank()).len());
            let sharding = fsdp.sharding(&model, tp_group.rank(), map);
            model = fsdp.shard(model);
            Some((fsdp, sharding))
        }
        _ => None,
    };
    // Where each rank's tensors lie in the checkpoints: its tp shards, or its rows of them.
    let sharding = match &sharded {
        Some((_, sharding)) => sharding.clone(),
        None => {
            let map = StageMap::whole(model.layout(tp_group.rank()).len());
            Sharding::of(&model, tp_group.rank(), map)
        }
    };
    let mut optim = (shared.optimizer)();
    let mut schedule = shared.learner.clone();
    let (first_epoch, last_epoch) = shared.epochs;
    let mut step: u64 = 0;
    if first_epoch > 1
        && let Some(dir) = &shared.checkpoints
    {
        let dir = TensorParallel::checkpoint_dir(dir, first_epoch - 1);
        let (loaded, info) = checkpoint::load_sharded(model, &dir, None::<&()>, &sharding)?;
        model = loaded;
        optim = checkpoint::load_optimizer_sharded(optim, &model, &dir, &sharding)?;
        step = info.step;
        // The schedule where it was (a scheduler's state is its step count).
        for _ in 0..step {
            schedule.lr_step();
        }
    }
    let fsdp = sharded.as_ref().map(|(f, _)| f);
    let mut optim = RankOptim::new(&shared.sync, optim, &model, &dp_group, fsdp)?;
    for epoch in first_epoch..=last_epoch {
        if rank == 0 {
            shared.process(|p| {
                p.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: shared.train_items,
                })
            });
        }
        let steps = train_epoch(
            shared,
            &mut model,
            &mut optim,
            &mut schedule,
            (&dp_group, replica),
            &feed,
        )?;
        step += steps;
        world.barrier()?;
        if rank == 0 {
            shared.process(|p| p.process_train(LearnerEvent::EndSplit(epoch)));
            shared.process(|p| {
                p.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: shared.valid_items,
                })
            });
        }
        // Fully sharded: the first shard group gathers the whole for replica 0.
        let whole = match fsdp {
            Some(f) if replica < f.shard_group().world_size() => {
                Some(f.unshard_on(model.clone(), replica == 0)?)
            }
            _ => None,
        };
        if replica == 0 {
            valid_epoch(shared, whole.as_ref().unwrap_or(&model), &feed)?;
        }
        drop(whole);
        world.barrier()?;
        // World rank 0 decides (checkpoint, stop) from the flushed metrics; every rank follows.
        // (The strategy stays in `shared`: `fit` gives it back whether or not this rank fails.)
        let mut control = match rank {
            0 => Some(shared.components.lock().unwrap_or_else(|e| e.into_inner())),
            _ => None,
        };
        let decision = match control.as_deref_mut().and_then(Option::as_mut) {
            Some(control) => {
                shared.process(|p| p.process_valid(LearnerEvent::EndSplit(epoch)));
                shared.process(|p| p.process_train(LearnerEvent::EndEpoch(epoch)));
                shared.process(|p| p.flush());
                decide(
                    control,
                    epoch,
                    shared.checkpoints.as_deref(),
                    &shared.interrupter,
                )
            }
            None => [0.0, 0.0],
        };
        drop(control);
        let decision = world.broadcast(decision.to_vec(), 0)?;
        let (save, stop) = (decision[0] > 0.5, decision[1] > 0.5);
        if save && let Some(dir) = &shared.checkpoints {
            let dir = TensorParallel::checkpoint_dir(dir, epoch);
            let info = CheckpointInfo::new(step, shared.tp, shared.dp, &());
            // A model with frozen parameters (LoRA's base) saves what it trains, alone: a resume
            // builds the same frozen values first, as the run did.
            let info = match crate::reshard::trainable(&model).contains(&false) {
                true => info.with_frozen_base("the model the Learner was given"),
                false => info,
            };
            let state = optim.module_optimizer(&model)?;
            match fsdp {
                // Each rank of the first shard group writes its rows.
                Some(f) => {
                    let writes = replica < f.shard_group().world_size();
                    let (state, dir) = (Some(&state), &dir);
                    checkpoint::save_sharded(&model, state, dir, &info, &sharding, &world, writes)?
                }
                None => checkpoint::save(&model, Some(&state), &dir, &info, &tp_group, replica)?,
            }
            world.barrier()?;
        }
        if stop {
            break;
        }
    }
    // The trained model at tp 1, for LearningResult: replica 0's tp ranks gather it; with
    // processes every replica gathers its own (the replicas hold the same weights), so every
    // process returns it.
    let keep = replica == 0 || shared.processes;
    if let (true, Some(f)) = (shared.gather, fsdp) {
        model = f.unshard_on(model, keep)?;
    }
    if shared.gather && keep {
        let full = model.to_full_module()?;
        return Ok((rank == 0 || shared.processes).then_some(full));
    }
    Ok(None)
}

/// One training epoch on this rank: its replica's batches (its leader reads them and hands them
/// to the tp peers), each the user's `TrainStep`, the gradients averaged over dp, the step. The
/// leaders report each step's item. Every replica runs as many steps as the shortest split.
/// Returns the steps run.
fn train_epoch<M>(
    shared: &Shared<M>,
    model: &mut M,
    optim: &mut RankOptim,
    schedule: &mut Learner<M>,
    (dp_group, replica): (&ProcessGroup, usize),
    feed: &Feed<'_, M>,
) -> Result<u64>
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainItem<M>: DpItem,
{
    let dp = shared.dp;
    let mut iterator = feed.leader.then(|| shared.train[replica].iter());
    let mut steps = 0u64;
    loop {
        let next = match iterator.as_mut() {
            // The leaders agree (over their dp group) whether every replica has a batch, and
            // the run has not been stopped.
            Some(it) => {
                let next = if shared.interrupter.should_stop() {
                    None
                } else {
                    it.next()
                };
                let next = match next {
                    Some(Ok(item)) => Some(item),
                    Some(Err(e)) => {
                        return Err(TpError::Config(format!("the train loader failed: {e}")));
                    }
                    None => None,
                };
                let all = dp_group
                    .all_reduce(vec![f32::from(u8::from(next.is_some()))], ReduceOp::Min)?;
                next.filter(|_| all[0] > 0.5)
            }
            None => None,
        };
        let unwrap = |m| match m {
            Handoff::Train(item) => Some(item),
            _ => None,
        };
        let Some(item) = feed.hand(next, &shared.codecs.0, Handoff::Train, unwrap)? else {
            break;
        };
        let progress = iterator.as_ref().map(|it| it.progress());
        steps += 1;
        schedule.lr_step();
        let lr = schedule.lr_current();
        let out = optim.step(model, item, lr.clone(), dp_group)?;
        // The leaders make their items the step's (over the leaders' dp group); world rank 0
        // reports it, counting every replica's batch.
        let out = match feed.leader {
            true => Some(out.dp_merge(dp_group)?),
            false => None,
        };
        if let (Some(out), Some(mut progress)) = (out, progress.filter(|_| feed.reports)) {
            progress.items_processed *= dp;
            progress.items_total *= dp;
            let item = TrainingItem::new(out, progress, Some(steps as usize), Some(lr));
            shared.process(|p| p.process_train(LearnerEvent::ProcessedItem(item)));
        }
    }
    Ok(steps)
}

/// Replica 0's validation: its leader reads the valid loader and hands each batch to the tp
/// peers; every rank runs the user's `InferenceStep` on its shard; the leader reports.
fn valid_epoch<M>(shared: &Shared<M>, model: &M, feed: &Feed<'_, M>) -> Result<()>
where
    M: LearnerModel + Reshard + Send + Sync,
{
    let model = model.valid();
    let mut iterator = feed.leader.then(|| shared.valid.iter());
    let mut iteration = 0;
    loop {
        let next = match iterator.as_mut().and_then(Iterator::next) {
            Some(Ok(item)) => Some(item),
            Some(Err(e)) => {
                return Err(TpError::Config(format!("the valid loader failed: {e}")));
            }
            None => None,
        };
        let unwrap = |m| match m {
            Handoff::Valid(item) => Some(item),
            _ => None,
        };
        let Some(item) = feed.hand(next, &shared.codecs.1, Handoff::Valid, unwrap)? else {
            break;
        };
        let progress = iterator.as_ref().map(|it| it.progress());
        iteration += 1;
        let out = InferenceStep::step(&model, item);
        if let Some(progress) = progress.filter(|_| feed.reports) {
            let item = TrainingItem::new(out, progress, Some(iteration), None);
            shared.process(|p| p.process_valid(LearnerEvent::ProcessedItem(item)));
        }
    }
    Ok(())
}

/// World rank 0's decision after epoch `epoch`: `[save, stop]` (1 or 0). Deletions are done
/// here (the files are shared).
pub(super) fn decide(
    control: &mut EpochControl,
    epoch: usize,
    dir: Option<&Path>,
    interrupter: &burn_train::Interrupter,
) -> [f32; 2] {
    let mut save = false;
    if let (Some(strategy), Some(dir)) = (&mut control.checkpointing, dir) {
        for action in strategy.checkpointing(epoch, &control.event_store) {
            match action {
                CheckpointingAction::Save => save = true,
                CheckpointingAction::Delete(e) => {
                    let _ = std::fs::remove_dir_all(TensorParallel::checkpoint_dir(dir, e));
                }
            }
        }
    }
    let stop = interrupter.should_stop()
        || control
            .early_stopping
            .as_mut()
            .is_some_and(|s| s.should_stop(epoch, &control.event_store));
    [f32::from(u8::from(save)), f32::from(u8::from(stop))]
}
