//! Tensor parallelism as a training strategy of Burn's Learner (feature `train`): a Burn user
//! keeps `SupervisedTraining`, its metrics, dashboard, metric logs, checkpointing strategies and
//! early stopping, and trains at tp x dp.
//!
//! ```text
//!  SupervisedTraining::launch(learner)            (the caller's thread: the event processor)
//!    └─ TensorParallel::fit
//!         ├─ rank threads, tp x dp (tp ranks adjacent: DeviceMesh)
//!         │    each: its shard of learner's model (Reshard::shard_module), its optimizer,
//!         │    a clone of the learner's learning-rate schedule
//!         │    replica r's tp rank 0 (its leader) reads replica r's part of the train loader
//!         │    (split as Burn's DDP splits it) and hands each batch to its tp peers; every rank
//!         │    runs the user's TrainStep on its shard, gradients averaged over dp, the step
//!         │    └─ leaders: each step's item -> the Learner's event processor (as Burn's DDP:
//!         │       every replica reports, so an epoch's loss is the mean over dp)
//!         ├─ replica 0 validates (its tp ranks together), its leader reporting
//!         ├─ world rank 0, after each epoch: the checkpointing strategy's actions
//!         │    (each rank writes its shard: burn-tp's sharded checkpoint, any tp / dp resumes
//!         │    it) and early stopping, decided once and broadcast
//!         └─ the trained model gathered to tp 1 on world rank 0: LearningResult's model
//! ```
//!
//! The learner handed to `launch` gives the starting weights (its model, built as without
//! tensor parallelism, sharded to each rank) and the learning-rate schedule; its optimizer is
//! replaced by one per rank from [`TensorParallel::new`]'s factory (Burn's `Learner` does not
//! hand its optimizer out), whose state is then per shard, as in burn-tp's own loop.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataloader::split::split_dataloader;
use burn::module::Module;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::Device;
use burn_tp_comm::{LocalGroup, ProcessGroup, ReduceOp};
use burn_train::checkpoint::{CheckpointingAction, CheckpointingStrategy};
use burn_train::train::WorkerFailure;
use burn_train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearnerModel,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingError, TrainingItem, TrainingStrategy, ValidLoader,
};

use crate::checkpoint::{self, CheckpointInfo};
use crate::dp::{DistributedAdamW, GradReducer, average_gradients};
use crate::local::{RunOptions, run_ranks_with};
use crate::mesh::DeviceMesh;
use crate::reshard::Reshard;
use crate::{Result, TpError};

/// A training batch of model `M`.
type TrainInput<M> = <M as TrainStep>::Input;
/// A validation batch of model `M`.
type ValidInput<M> = <M as InferenceStep>::Input;

/// A checkpointing strategy, lent to world rank 0 during `fit`.
type Lent = Mutex<Option<Box<dyn CheckpointingStrategy>>>;

/// What a replica's leader hands its tp peers.
type Message<M> = Handoff<TrainInput<M>, ValidInput<M>>;

/// The factory of each rank's optimizer.
type OptimizerFactory = Arc<dyn Fn() -> ModuleOptimizer + Send + Sync>;

/// Tensor (and data) parallel training through Burn's `SupervisedTraining`: a
/// `SupervisedLearningStrategy` running `tp x dp` rank threads (see the module's diagram).
///
/// ```ignore
/// let strategy = TensorParallel::new(2, 1, || AdamWConfig::new().init())
///     .with_checkpoints(dir.join("tp-checkpoints"), KeepLastNCheckpoints::new(2));
/// let result = SupervisedTraining::new(dir, train_loader, valid_loader)
///     .metrics((LossMetric::new(),))
///     .with_training_strategy(strategy.into_strategy())
///     .num_epochs(3)
///     .launch(Learner::new(model, AdamWConfig::new().init(), 1e-3));
/// ```
///
/// The model type is the user's: it implements `TrainStep` and `InferenceStep` as without
/// tensor parallelism (its layers being burn-tp's, built on a tp group) and [`Reshard`] (how its
/// full weights split over tp). A training batch must be `Clone` (a replica's tp ranks each take
/// the same one).
pub struct TensorParallel {
    tp: usize,
    dp: usize,
    optimizer: OptimizerFactory,
    /// The checkpoints' folder and strategy (lent to world rank 0 during `fit`).
    checkpoints: Option<(PathBuf, Lent)>,
    timeout: Option<Duration>,
    sync: GradSync,
}

/// How the gradients meet over dp.
#[derive(Clone, Debug)]
enum GradSync {
    /// Averaged after the backward ([`average_gradients`]).
    AfterBackward,
    /// Averaged in buckets during the backward ([`GradReducer`]).
    Overlapped { bucket_bytes: usize },
    /// Reduce-scattered in buckets during the backward, AdamW on this rank's chunks
    /// ([`DistributedAdamW`]; the factory's optimizer is not used).
    Distributed {
        config: AdamWConfig,
        bucket_bytes: usize,
    },
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TensorParallel(tp {}, dp {}, checkpoints {:?})",
            self.tp,
            self.dp,
            self.checkpoints.as_ref().map(|c| &c.0)
        )
    }
}

/// A batch handed from a replica's leader to its tp peers.
enum Handoff<T, V> {
    Train(T),
    Valid(V),
    /// The split ended (or was interrupted): no more batches of it.
    End,
}

impl TensorParallel {
    /// `tp x dp` ranks (threads of this process), each with an optimizer from `optimizer`.
    pub fn new(
        tp: usize,
        dp: usize,
        optimizer: impl Fn() -> ModuleOptimizer + Send + Sync + 'static,
    ) -> Self {
        Self {
            tp,
            dp,
            optimizer: Arc::new(optimizer),
            checkpoints: None,
            timeout: None,
            sync: GradSync::AfterBackward,
        }
    }

    /// The dp average of the gradients in buckets of at most `bucket_bytes`, each started
    /// during the backward as soon as its last gradient is there ([`GradReducer`]): the user's
    /// `TrainStep` runs on a view of the model with the reducer's taps.
    pub fn with_overlapped_grad_reduce(mut self, bucket_bytes: usize) -> Self {
        self.sync = GradSync::Overlapped { bucket_bytes };
        self
    }

    /// Megatron's distributed optimizer: AdamW of `config` with its moments sharded over dp,
    /// the gradients reduce-scattered in buckets during the backward ([`DistributedAdamW`]). It
    /// takes the schedule's base learning rate, and replaces the factory's optimizer.
    pub fn with_distributed_optimizer(mut self, config: AdamWConfig, bucket_bytes: usize) -> Self {
        self.sync = GradSync::Distributed {
            config,
            bucket_bytes,
        };
        self
    }

    /// After each epoch, `strategy` (Burn's `KeepLastNCheckpoints`, `MetricCheckpointingStrategy`,
    /// ...) decides what to save and delete: each rank writes its shard of the model and of the
    /// optimizer state into `dir/epoch-N` (burn-tp's sharded checkpoint, [`crate::checkpoint`]).
    /// `SupervisedTraining::checkpoint(N)` resumes from `dir/epoch-N`, at any tp and dp.
    pub fn with_checkpoints(
        mut self,
        dir: impl Into<PathBuf>,
        strategy: impl CheckpointingStrategy + 'static,
    ) -> Self {
        self.checkpoints = Some((dir.into(), Mutex::new(Some(Box::new(strategy)))));
        self
    }

    /// How long a collective may wait for the other ranks before it fails (the group's default
    /// otherwise).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// This strategy, for `SupervisedTraining::with_training_strategy`.
    pub fn into_strategy<M>(self) -> TrainingStrategy<M>
    where
        M: LearnerModel + Reshard + Send + Sync,
        TrainInput<M>: Clone,
        ValidInput<M>: Clone,
    {
        TrainingStrategy::Custom(Arc::new(self))
    }

    /// The folder of epoch `epoch`'s checkpoint under `dir`.
    pub fn checkpoint_dir(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("epoch-{epoch}"))
    }
}

/// What every rank thread shares.
struct Shared<M: LearnerModel> {
    tp: usize,
    dp: usize,
    /// The caller's Learner: the full model each rank shards, the schedule each rank clones.
    learner: Learner<M>,
    optimizer: OptimizerFactory,
    timeout: Option<Duration>,
    sync: GradSync,
    train: Vec<TrainLoader<M>>,
    valid: ValidLoader<M>,
    train_items: usize,
    valid_items: usize,
    epochs: (usize, usize),
    processor: Mutex<SupervisedTrainingEventProcessor<M>>,
    components: Mutex<Option<EpochControl>>,
    interrupter: burn_train::Interrupter,
    /// Per world rank: its receiving end (tp peers), or its senders to its peers (leaders).
    inbox: Vec<Mutex<Inbox<M>>>,
    outbox: Vec<Mutex<Option<Outbox<M>>>>,
    checkpoints: Option<PathBuf>,
}

/// What world rank 0 decides with after each epoch.
struct EpochControl {
    checkpointing: Option<Box<dyn CheckpointingStrategy>>,
    early_stopping: Option<Box<dyn burn_train::CloneEarlyStoppingStrategy>>,
    event_store: Arc<burn_train::metric::store::EventStoreClient>,
}

impl<M> SupervisedLearningStrategy<M> for TensorParallel
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainInput<M>: Clone,
    ValidInput<M>: Clone,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let (tp, dp) = (self.tp, self.dp);
        if tp == 0 || dp == 0 {
            components
                .interrupter
                .fail(TrainingError::Workers(vec![WorkerFailure {
                    device_id: 0,
                    message: format!("TensorParallel: tp ({tp}) and dp ({dp}) must be at least 1"),
                }]));
            return (learner.model(), components.event_processor);
        }
        let world = tp * dp;
        let device = Device::flex().autodiff();
        let train_items = dataloader_train.num_items();
        let valid_items = dataloader_valid.num_items();
        let train = split_dataloader(dataloader_train, &vec![device.clone(); dp]);
        let valid = dataloader_valid.to_device(&device.clone().inner());
        let mut inbox = Vec::with_capacity(world);
        let mut outbox = Vec::with_capacity(world);
        for _replica in 0..dp {
            let (senders, receivers): (Vec<_>, Vec<_>) = (1..tp).map(|_| channel()).unzip();
            outbox.push(Mutex::new(Some(senders)));
            inbox.push(Mutex::new(None));
            for r in receivers {
                outbox.push(Mutex::new(None));
                inbox.push(Mutex::new(Some(r)));
            }
        }
        let control = EpochControl {
            checkpointing: self
                .checkpoints
                .as_ref()
                .and_then(|(_, s)| s.lock().ok()?.take()),
            early_stopping: components.early_stopping,
            event_store: components.event_store.clone(),
        };
        let interrupter = components.interrupter.clone();
        let shared = Arc::new(Shared {
            tp,
            dp,
            learner,
            optimizer: self.optimizer.clone(),
            timeout: self.timeout,
            sync: self.sync.clone(),
            train,
            valid,
            train_items,
            valid_items,
            epochs: (starting_epoch, components.num_epochs),
            processor: Mutex::new(components.event_processor),
            components: Mutex::new(Some(control)),
            interrupter: interrupter.clone(),
            inbox,
            outbox,
            checkpoints: self.checkpoints.as_ref().map(|c| c.0.clone()),
        });
        let run = {
            let shared = shared.clone();
            match LocalGroup::new(world) {
                Ok(groups) => run_ranks_with(groups, RunOptions::default(), move |g| {
                    rank_main(&shared, g).map_err(|e| e.to_string())
                }),
                Err(e) => Err(e.to_string()),
            }
        };
        // The checkpointing strategy back (a later fit of the same strategy goes on with it).
        if let (Some((_, slot)), Some(control)) = (
            &self.checkpoints,
            shared.components.lock().ok().and_then(|mut c| c.take()),
        ) && let Ok(mut slot) = slot.lock()
        {
            *slot = control.checkpointing;
        }
        let failures: Vec<WorkerFailure> = match &run {
            Ok(results) => results
                .iter()
                .enumerate()
                .filter_map(|(rank, r)| {
                    r.as_ref().err().map(|message| WorkerFailure {
                        device_id: rank,
                        message: message.clone(),
                    })
                })
                .collect(),
            Err(message) => vec![WorkerFailure {
                device_id: 0,
                message: message.clone(),
            }],
        };
        let model = run
            .ok()
            .and_then(|mut results| results.get_mut(0).and_then(|r| r.as_mut().ok()?.take()));
        if !failures.is_empty() {
            interrupter.fail(TrainingError::Workers(failures));
        }
        let shared = match Arc::try_unwrap(shared) {
            Ok(shared) => shared,
            Err(_) => unreachable!("every rank thread has ended"),
        };
        let model = model.unwrap_or_else(|| shared.learner.model());
        let processor = shared
            .processor
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        (model, processor)
    }
}

/// One rank's whole run: its shard, the epochs, the trained model gathered on world rank 0.
fn rank_main<M>(shared: &Shared<M>, world: ProcessGroup) -> Result<Option<M>>
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainInput<M>: Clone,
    ValidInput<M>: Clone,
{
    if let Some(t) = shared.timeout {
        world.set_timeout(t);
    }
    let rank = world.rank();
    let mesh = DeviceMesh::new(world.clone(), shared.tp)?;
    let (tp_group, dp_group) = (mesh.tp_group().clone(), mesh.dp_group().clone());
    let replica = mesh.dp_rank();
    let leader = tp_group.rank() == 0;
    let inbox = shared.inbox[rank].lock().ok().and_then(|mut s| s.take());
    let outbox = shared.outbox[rank]
        .lock()
        .ok()
        .and_then(|mut s| s.take())
        .unwrap_or_default();
    // The Learner's model is the full one: each rank takes its shard of it.
    let mut model = M::shard_module(&shared.learner.model(), &tp_group)?;
    let mut optim = (shared.optimizer)();
    let mut schedule = shared.learner.clone();
    let control = if rank == 0 {
        shared.components.lock().ok().and_then(|mut c| c.take())
    } else {
        None
    };
    let (first_epoch, last_epoch) = shared.epochs;
    let mut step: u64 = 0;
    if first_epoch > 1
        && let Some(dir) = &shared.checkpoints
    {
        let dir = TensorParallel::checkpoint_dir(dir, first_epoch - 1);
        let (loaded, info) = checkpoint::load(model, &dir, None::<&()>, &tp_group)?;
        model = loaded;
        optim = checkpoint::load_optimizer(optim, &model, &dir, &tp_group)?;
        step = info.step;
        // The schedule where it was (a scheduler's state is its step count).
        for _ in 0..step {
            schedule.lr_step();
        }
    }
    let mut optim = RankOptim::new(&shared.sync, optim, &model, &dp_group)?;
    let mut control = control;
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
            (&dp_group, replica, leader),
            (&inbox, &outbox),
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
        if replica == 0 {
            valid_epoch(shared, &model, leader, (&inbox, &outbox))?;
        }
        world.barrier()?;
        // World rank 0 decides (checkpoint, stop) from the flushed metrics; every rank follows.
        let decision = match &mut control {
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
        let decision = world.broadcast(decision.to_vec(), 0)?;
        let (save, stop) = (decision[0] > 0.5, decision[1] > 0.5);
        if save && let Some(dir) = &shared.checkpoints {
            let dir = TensorParallel::checkpoint_dir(dir, epoch);
            let info = CheckpointInfo::new(step, shared.tp, shared.dp, &());
            let state = optim.module_optimizer(&model)?;
            checkpoint::save(&model, Some(&state), &dir, &info, &tp_group, replica)?;
            world.barrier()?;
        }
        if stop {
            break;
        }
    }
    // Give the checkpointing strategy back for the caller to keep.
    if let Some(control) = control
        && let Ok(mut slot) = shared.components.lock()
    {
        *slot = Some(control);
    }
    // The trained model at tp 1 (replica 0's tp ranks gather it), for LearningResult.
    if replica == 0 {
        let full = model.to_full_module()?;
        return Ok((rank == 0).then_some(full));
    }
    Ok(None)
}

impl<M: LearnerModel> Shared<M> {
    /// `f` on the event processor; its error stops the run (the Learner's interrupter).
    fn process<E: Into<TrainingError>>(
        &self,
        f: impl FnOnce(&mut SupervisedTrainingEventProcessor<M>) -> std::result::Result<(), E>,
    ) {
        let mut p = self.processor.lock().unwrap_or_else(|e| e.into_inner());
        self.interrupter.fail_on_error(f(&mut p));
    }
}

/// World rank 0's decision after epoch `epoch`: `[save, stop]` (1 or 0). Deletions are done
/// here (the files are shared).
fn decide(
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

/// A tp peer's receiving end (none on a leader).
type Inbox<M> = Option<Receiver<Message<M>>>;
/// A leader's senders to its tp peers (none on a peer).
type Outbox<M> = Vec<Sender<Message<M>>>;

/// One training epoch on this rank: its replica's batches (its leader reads them and hands them
/// to the tp peers), each the user's `TrainStep`, the gradients averaged over dp, the step. The
/// leaders report each step's item. Every replica runs as many steps as the shortest split.
/// Returns the steps run.
fn train_epoch<M>(
    shared: &Shared<M>,
    model: &mut M,
    optim: &mut RankOptim,
    schedule: &mut Learner<M>,
    (dp_group, replica, leader): (&ProcessGroup, usize, bool),
    (inbox, outbox): (&Inbox<M>, &Outbox<M>),
) -> Result<u64>
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainInput<M>: Clone,
{
    let dp = shared.dp;
    let mut iterator = leader.then(|| shared.train[replica].iter());
    let mut steps = 0u64;
    loop {
        let item = match iterator.as_mut() {
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
                let next = next.filter(|_| all[0] > 0.5);
                for peer in outbox {
                    let message = match &next {
                        Some(item) => Handoff::Train(item.clone()),
                        None => Handoff::End,
                    };
                    peer.send(message).map_err(|_| peer_gone())?;
                }
                next.map(|item| (item, Some(it.progress())))
            }
            None => match inbox.as_ref().map(Receiver::recv) {
                Some(Ok(Handoff::Train(item))) => Some((item, None)),
                Some(Ok(_)) => None,
                Some(Err(_)) | None => return Err(peer_gone()),
            },
        };
        let Some((item, progress)) = item else {
            break;
        };
        steps += 1;
        schedule.lr_step();
        let lr = schedule.lr_current();
        let out = optim.step(model, item, lr.clone(), dp_group)?;
        if let Some(mut progress) = progress {
            // As Burn's DDP counts: every replica's items.
            progress.items_processed *= dp;
            progress.items_total *= dp;
            let item = TrainingItem::new(out, progress, Some(steps as usize * dp), Some(lr));
            shared.process(|p| p.process_train(LearnerEvent::ProcessedItem(item)));
        }
    }
    Ok(steps)
}

/// Replica 0's validation: its leader reads the valid loader and hands each batch to the tp
/// peers; every rank runs the user's `InferenceStep` on its shard; the leader reports.
fn valid_epoch<M>(
    shared: &Shared<M>,
    model: &M,
    leader: bool,
    (inbox, outbox): (&Inbox<M>, &Outbox<M>),
) -> Result<()>
where
    M: LearnerModel + Reshard + Send + Sync,
    ValidInput<M>: Clone,
{
    let model = model.valid();
    let mut iterator = leader.then(|| shared.valid.iter());
    let mut iteration = 0;
    loop {
        let item = match iterator.as_mut() {
            Some(it) => {
                let next = match it.next() {
                    Some(Ok(item)) => Some(item),
                    Some(Err(e)) => {
                        return Err(TpError::Config(format!("the valid loader failed: {e}")));
                    }
                    None => None,
                };
                for peer in outbox {
                    let message = match &next {
                        Some(item) => Handoff::Valid(item.clone()),
                        None => Handoff::End,
                    };
                    peer.send(message).map_err(|_| peer_gone())?;
                }
                next.map(|item| (item, Some(it.progress())))
            }
            None => match inbox.as_ref().map(Receiver::recv) {
                Some(Ok(Handoff::Valid(item))) => Some((item, None)),
                Some(Ok(_)) => None,
                Some(Err(_)) | None => return Err(peer_gone()),
            },
        };
        let Some((item, progress)) = item else {
            break;
        };
        iteration += 1;
        let out = InferenceStep::step(&model, item);
        if let Some(progress) = progress {
            let item = TrainingItem::new(out, progress, Some(iteration), None);
            shared.process(|p| p.process_valid(LearnerEvent::ProcessedItem(item)));
        }
    }
    Ok(())
}

/// A rank's optimizer: the factory's, with the dp average after the backward or in buckets
/// during it; or the distributed optimizer.
struct RankOptim {
    optim: ModuleOptimizer,
    reducer: Option<GradReducer>,
    zero: Option<(DistributedAdamW, AdamWConfig)>,
}

impl RankOptim {
    /// `optim` (loaded, on resume) for `model` on `dp_group`, as `sync` asks.
    fn new<M: Module>(
        sync: &GradSync,
        optim: ModuleOptimizer,
        model: &M,
        dp_group: &ProcessGroup,
    ) -> Result<Self> {
        Ok(match sync {
            GradSync::AfterBackward => Self {
                optim,
                reducer: None,
                zero: None,
            },
            GradSync::Overlapped { bucket_bytes } => Self {
                optim,
                reducer: Some(GradReducer::new(model, dp_group, *bucket_bytes)),
                zero: None,
            },
            GradSync::Distributed {
                config,
                bucket_bytes,
            } => {
                let mut zero = DistributedAdamW::new(config, model, dp_group, *bucket_bytes);
                // This rank's chunks of a resumed state (saved at any dp).
                zero.shard_module_optimizer(&optim, model)?;
                Self {
                    optim,
                    reducer: None,
                    zero: Some((zero, config.clone())),
                }
            }
        })
    }

    /// One training step of `model` on `item`: the user's `TrainStep`, the gradients reduced
    /// over dp, the update. Returns the step's output item.
    fn step<M: LearnerModel>(
        &mut self,
        model: &mut M,
        item: TrainInput<M>,
        lr: burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate,
        dp_group: &ProcessGroup,
    ) -> Result<<M as TrainStep>::Output> {
        if let Some((zero, _)) = &mut self.zero {
            let view = zero.attach(model.clone(), true);
            let out = TrainStep::step(&view, item);
            *model = zero.step(lr.base(), model.clone(), out.grads)?;
            return Ok(out.item);
        }
        let out = match &self.reducer {
            Some(reducer) => {
                let view = reducer.attach(model.clone(), true);
                let mut out = TrainStep::step(&view, item);
                reducer.finish(&*model, &mut out.grads)?;
                out
            }
            None => {
                let mut out = TrainStep::step(&*model, item);
                average_gradients(&*model, &mut out.grads, dp_group)?;
                out
            }
        };
        *model = model.clone().optimize(&mut self.optim, lr, out.grads);
        Ok(out.item)
    }

    /// The state as a Burn optimizer over this rank's shard, to save (the distributed
    /// optimizer's chunks gathered over dp first: collective over dp).
    fn module_optimizer<M: Module>(&mut self, model: &M) -> Result<ModuleOptimizer> {
        if let Some((zero, config)) = &self.zero {
            self.optim = zero.to_module_optimizer(config, model)?;
        }
        Ok(self.optim.clone())
    }
}

fn peer_gone() -> TpError {
    TpError::Config("train: a rank of this replica has stopped (see its error)".into())
}
