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
//!         │    └─ leaders: each step's item made the whole step's over dp (DpItem: the loss
//!         │       averaged, the batch gathered); world rank 0 -> the Learner's event processor
//!         ├─ replica 0 validates (its tp ranks together), its leader reporting
//!         ├─ world rank 0, after each epoch: the checkpointing strategy's actions
//!         │    (each rank writes its shard: burn-tp's sharded checkpoint, any tp / dp resumes
//!         │    it) and early stopping, decided once and broadcast
//!         └─ the trained model gathered to tp 1 on world rank 0: LearningResult's model
//! ```
//!
//! Ranks as processes ([`TensorParallel::on_processes`]: MPI under `mpirun`, or one GPU per
//! process over NCCL) run the same code, one rank per process: each process launches its own
//! Learner, the replica leaders send each batch's tensors to their tp peers over the tp group
//! ([`ProcessBatch`]), and world rank 0's Learner reports.
//!
//! The learner handed to `launch` gives the starting weights (its model, built as without
//! tensor parallelism, sharded to each rank; or, with [`TensorParallel::with_shards`], each rank
//! builds its own shard and the Learner's model is a placeholder) and the learning-rate schedule; its optimizer is
//! replaced by one per rank from [`TensorParallel::new`]'s factory (Burn's `Learner` does not
//! hand its optimizer out), whose state is then per shard, as in burn-tp's own loop.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataloader::split::split_dataloader;
use burn::module::Module;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_tp_comm::{CommError, LocalGroup, ProcessGroup, ReduceOp};
use burn_train::checkpoint::{CheckpointingAction, CheckpointingStrategy};
use burn_train::train::WorkerFailure;
use burn_train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearnerModel,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingError, TrainingItem, TrainingStrategy, ValidLoader,
};

use crate::checkpoint::{self, CheckpointInfo};
use crate::dp::{DistributedAdamW, GradReducer, average_gradients, broadcast_parameters};
use crate::local::{RunOptions, run_ranks_with};
use crate::mesh::DeviceMesh;
use crate::reshard::Reshard;
use crate::{Result, TpError, ops};

/// A training batch of model `M`.
type TrainInput<M> = <M as TrainStep>::Input;
/// A validation batch of model `M`.
type ValidInput<M> = <M as InferenceStep>::Input;
/// A training step's output item of model `M`.
type TrainItem<M> = <M as TrainStep>::Output;

/// A checkpointing strategy, lent to world rank 0 during `fit`.
type Lent = Mutex<Option<Box<dyn CheckpointingStrategy>>>;

/// What a replica's leader hands its tp peers (ranks as threads).
type Message<M> = Handoff<TrainInput<M>, ValidInput<M>>;

/// A batch that a replica's leader can send to its tp peers in other processes (ranks as
/// processes, [`TensorParallel::on_processes`]): its tensors' data, and the batch rebuilt from
/// them on the peer's device. Megatron's `broadcast_data`, for the user's batch type.
///
/// ```ignore
/// impl ProcessBatch for MyBatch {
///     fn to_data(&self) -> Vec<TensorData> {
///         vec![self.ids.to_data(), self.targets.to_data()]
///     }
///     fn from_data(mut data: Vec<TensorData>, device: &Device) -> Self {
///         let targets = Tensor::from_data(data.pop().unwrap(), device);
///         let ids = Tensor::from_data(data.pop().unwrap(), device);
///         Self { ids, targets }
///     }
/// }
/// ```
pub trait ProcessBatch: Sized {
    /// The batch's tensors, in an order [`ProcessBatch::from_data`] reads back.
    fn to_data(&self) -> Vec<TensorData>;
    /// The batch from what [`ProcessBatch::to_data`] gave, on `device`.
    fn from_data(data: Vec<TensorData>, device: &Device) -> Self;
}

/// A training step's output item made the item of the whole step, over every replica's batch:
/// the loss averaged over dp, the predictions and targets gathered, so the Learner's metrics,
/// dashboard and logs show what they would without data parallelism. Each replica's leader
/// calls it on its item (collective over the leaders' `dp_group`: every leader calls it once
/// per step); world rank 0 reports the result. burn-train's classification, multi-label and
/// regression outputs have it; a custom output averages its loss with [`mean_over`] and
/// gathers its batch tensors with [`gather_float`] / [`gather_int`] (the replicas' batches may
/// differ in size: a split's last batch).
pub trait DpItem: Sized {
    /// This replica's item as the whole step's (itself when `dp_group` has one rank).
    ///
    /// # Errors
    /// A collective's error.
    fn dp_merge(self, dp_group: &ProcessGroup) -> Result<Self>;
}

/// `x` (detached) averaged over `group`: a replica's loss as the step's.
///
/// # Errors
/// The collective's.
pub fn mean_over(x: Tensor<1>, group: &ProcessGroup) -> Result<Tensor<1>> {
    match group.world_size() {
        1 => Ok(x),
        _ => ops::all_reduce(x.detach(), ReduceOp::Avg, group),
    }
}

/// `x` (detached) of every rank of `group`, concatenated on dim 0 in rank order: a replica's
/// predictions as the step's. The ranks' dim 0 may differ (a split's last batch); the values
/// travel as f32.
///
/// # Errors
/// The collectives', or ranks whose tensors differ past dim 0.
pub fn gather_float<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>> {
    if group.world_size() == 1 {
        return Ok(x);
    }
    let (device, dims) = (x.device(), x.dims());
    let values: Vec<f32> = x.detach().into_data().iter::<f32>().collect();
    let (all, dims) = gather_rows(values, dims, group)?;
    Ok(Tensor::from_data(TensorData::new(all, dims), &device))
}

/// [`gather_float`] for integer tensors (targets, class indices): their values as i64.
///
/// # Errors
/// As [`gather_float`].
pub fn gather_int<const D: usize>(
    x: Tensor<D, Int>,
    group: &ProcessGroup,
) -> Result<Tensor<D, Int>> {
    if group.world_size() == 1 {
        return Ok(x);
    }
    let (device, dims) = (x.device(), x.dims());
    let values: Vec<i64> = x.into_data().iter::<i64>().collect();
    let (all, dims) = gather_rows(values, dims, group)?;
    Ok(Tensor::from_data(TensorData::new(all, dims), &device))
}

/// Every rank's rows (`values`, row-major of `dims`) in rank order, and their dims: each rank's
/// row count first, then the rows padded to the most rows, the padding dropped.
fn gather_rows<E: burn_tp_comm::CommElement + Default, const D: usize>(
    mut values: Vec<E>,
    mut dims: [usize; D],
    group: &ProcessGroup,
) -> Result<(Vec<E>, [usize; D])> {
    let row: usize = dims[1..].iter().product();
    let mine = [dims[0] as i64, row as i64];
    let all = group.all_gather(mine.to_vec())?;
    if let Some(other) = all.chunks(2).find(|c| c[1] != mine[1]) {
        return Err(TpError::Config(format!(
            "DpItem: the replicas' tensors differ past dim 0 ({} values per row here, {} on \
             another)",
            row, other[1]
        )));
    }
    let rows: Vec<usize> = all.chunks(2).map(|c| c[0] as usize).collect();
    let most = rows.iter().copied().max().unwrap_or(0);
    values.resize(most * row, E::default());
    let padded = group.all_gather(values)?;
    let mut out = Vec::with_capacity(rows.iter().sum::<usize>() * row);
    for (r, &n) in rows.iter().enumerate() {
        out.extend_from_slice(&padded[r * most * row..(r * most + n) * row]);
    }
    dims[0] = rows.iter().sum();
    Ok((out, dims))
}

/// [`DpItem`] for burn-train's outputs (`loss`, `output`, `targets`; the targets gathered by
/// `$targets`).
macro_rules! dp_item {
    ($output:ty, $targets:ident) => {
        impl DpItem for $output {
            fn dp_merge(self, dp_group: &ProcessGroup) -> Result<Self> {
                Ok(Self {
                    loss: mean_over(self.loss, dp_group)?,
                    output: gather_float(self.output, dp_group)?,
                    targets: $targets(self.targets, dp_group)?,
                })
            }
        }
    };
}

dp_item!(burn_train::ClassificationOutput, gather_int);
dp_item!(burn_train::MultiLabelClassificationOutput, gather_int);
dp_item!(burn_train::RegressionOutput, gather_float);

/// How a batch reaches a replica's tp peers: cloned (threads) or as its tensors' data over the
/// tp group (processes).
enum Codec<T> {
    Clone(fn(&T) -> T),
    Data {
        to: fn(&T) -> Vec<TensorData>,
        from: fn(Vec<TensorData>, &Device) -> T,
    },
}

impl<T> Codec<T> {
    fn cloned() -> Self
    where
        T: Clone,
    {
        Self::Clone(T::clone)
    }

    fn data() -> Self
    where
        T: ProcessBatch,
    {
        Self::Data {
            to: T::to_data,
            from: T::from_data,
        }
    }
}

/// The factory of each rank's optimizer.
type OptimizerFactory = Arc<dyn Fn() -> ModuleOptimizer + Send + Sync>;

/// What builds a rank's shard of a model `M`: (its tp group, its device) -> its shard.
type ShardBuilder<M> = Arc<dyn Fn(&ProcessGroup, &Device) -> Result<M> + Send + Sync>;

/// A [`ShardBuilder`] of some model type, and that type's name.
type AnyShardBuilder = (Arc<dyn std::any::Any + Send + Sync>, &'static str);

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
/// the same one), and the training step's output item [`DpItem`] (the Learner sees one item per
/// step, over every replica's batch).
pub struct TensorParallel {
    tp: usize,
    dp: usize,
    optimizer: OptimizerFactory,
    /// The checkpoints' folder and strategy (lent to world rank 0 during `fit`).
    checkpoints: Option<(PathBuf, Lent)>,
    timeout: Option<Duration>,
    sync: GradSync,
    /// Each rank builds its shard (else it shards the Learner's model).
    shards: Option<AnyShardBuilder>,
    /// The trained model gathered to tp 1 for `LearningResult::model`.
    gather: bool,
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
            shards: None,
            gather: true,
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

    /// Each rank builds its own shard with `build(tp_group, device)` (say, `config.init(tp_group,
    /// device)`, then `hf::load(model, dir, tp_group)`), instead of sharding the Learner's
    /// model: no rank ever holds the whole model, so a model too big for one device trains. The
    /// Learner's model is then not read: give `Learner::new` a small one of the same type (a
    /// config with one small block). A replica's tp ranks must build one model's shards
    /// (burn-tp's models draw each parameter on tp rank 0 and broadcast it); replica 0's weights
    /// are then copied to the other replicas, as DDP starts. `M` must be the Learner's
    /// model type (`fit` fails naming both otherwise). With [`TensorParallel::without_gathered_model`]
    /// the trained model stays sharded.
    pub fn with_shards<M: 'static>(
        mut self,
        build: impl Fn(&ProcessGroup, &Device) -> Result<M> + Send + Sync + 'static,
    ) -> Self {
        let build: ShardBuilder<M> = Arc::new(build);
        self.shards = Some((Arc::new(build), std::any::type_name::<M>()));
        self
    }

    /// Do not gather the trained model to tp 1 at the end (for a model too big for one
    /// device): `LearningResult::model` is then the Learner's own model, untrained, and the
    /// trained weights are in the checkpoints ([`TensorParallel::with_checkpoints`]: the last
    /// epoch's is saved when the strategy says so; `KeepLastNCheckpoints` always saves).
    pub fn without_gathered_model(mut self) -> Self {
        self.gather = false;
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
        TrainItem<M>: DpItem,
    {
        TrainingStrategy::Custom(Arc::new(self))
    }

    /// The folder of epoch `epoch`'s checkpoint under `dir`.
    pub fn checkpoint_dir(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("epoch-{epoch}"))
    }
}

/// [`TensorParallel`] with this process as one rank of a world of `tp x dp` processes: MPI
/// processes under `mpirun` (`ProcessGroup::from_mpi`), or one GPU per process over NCCL
/// (`ProcessGroup::from_nccl`, `Device::cuda(local_rank)`). Made by
/// [`TensorParallel::on_processes`].
pub struct ProcessRanks {
    strategy: TensorParallel,
    world: ProcessGroup,
    device: Device,
}

impl std::fmt::Debug for ProcessRanks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} as rank {} of {} processes",
            self.strategy,
            self.world.rank(),
            self.world.world_size()
        )
    }
}

impl TensorParallel {
    /// This process as rank `world.rank()` of the `tp x dp` ranks, its shard on `device` (with
    /// autodiff): ranks as processes instead of threads, the same mesh and training code.
    ///
    /// Every process runs the same program and launches its own Learner with the same model,
    /// loaders and epochs; give each its own artifact folder (the checkpoints' folder is shared).
    /// Each replica's leader reads its split of the train loader and sends each batch's tensors
    /// to its tp peers ([`ProcessBatch`]); world rank 0's Learner reports each step's item
    /// (made the whole step's, [`DpItem`]), decides the checkpoints and early stopping. Every process's `LearningResult::model` is the trained
    /// model (each replica gathers its own to tp 1). A rank's error aborts the world (on MPI,
    /// the whole job), so no peer waits for it.
    pub fn on_processes(self, world: ProcessGroup, device: Device) -> ProcessRanks {
        ProcessRanks {
            strategy: self,
            world,
            device: device.inner().autodiff(),
        }
    }
}

impl ProcessRanks {
    /// This strategy, for `SupervisedTraining::with_training_strategy`.
    pub fn into_strategy<M>(self) -> TrainingStrategy<M>
    where
        M: LearnerModel + Reshard + Send + Sync,
        TrainInput<M>: ProcessBatch,
        ValidInput<M>: ProcessBatch,
        TrainItem<M>: DpItem,
    {
        TrainingStrategy::Custom(Arc::new(self))
    }
}

/// Where the ranks run.
enum Ranks {
    /// `tp x dp` threads of this process, on Flex.
    Threads,
    /// This process is rank `world.rank()`, on `device`.
    Process { world: ProcessGroup, device: Device },
}

/// What every rank (thread) of this process shares.
struct Shared<M: LearnerModel> {
    tp: usize,
    dp: usize,
    /// Ranks as processes (one per process) rather than threads.
    processes: bool,
    device: Device,
    /// The caller's Learner: the full model each rank shards, the schedule each rank clones.
    learner: Learner<M>,
    optimizer: OptimizerFactory,
    timeout: Option<Duration>,
    sync: GradSync,
    shards: Option<ShardBuilder<M>>,
    gather: bool,
    train: Vec<TrainLoader<M>>,
    valid: ValidLoader<M>,
    train_items: usize,
    valid_items: usize,
    epochs: (usize, usize),
    processor: Mutex<SupervisedTrainingEventProcessor<M>>,
    /// World rank 0's: it decides with it after each epoch, and `fit` gives the strategy back.
    components: Mutex<Option<EpochControl>>,
    interrupter: burn_train::Interrupter,
    /// Per rank thread: its receiving end (tp peers), or its senders to its peers (leaders).
    inbox: Vec<Mutex<Inbox<M>>>,
    outbox: Vec<Mutex<Option<Outbox<M>>>>,
    codecs: (Codec<TrainInput<M>>, Codec<ValidInput<M>>),
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
    TrainItem<M>: DpItem,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let codecs = (Codec::cloned(), Codec::cloned());
        let loaders = (dataloader_train, dataloader_valid);
        fit(
            self,
            Ranks::Threads,
            codecs,
            components,
            learner,
            loaders,
            starting_epoch,
        )
    }
}

impl<M> SupervisedLearningStrategy<M> for ProcessRanks
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainInput<M>: ProcessBatch,
    ValidInput<M>: ProcessBatch,
    TrainItem<M>: DpItem,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let ranks = Ranks::Process {
            world: self.world.clone(),
            device: self.device.clone(),
        };
        let codecs = (Codec::data(), Codec::data());
        let loaders = (dataloader_train, dataloader_valid);
        fit(
            &self.strategy,
            ranks,
            codecs,
            components,
            learner,
            loaders,
            starting_epoch,
        )
    }
}

/// `SupervisedLearningStrategy::fit` for `strategy` on `ranks`.
fn fit<M>(
    strategy: &TensorParallel,
    ranks: Ranks,
    codecs: (Codec<TrainInput<M>>, Codec<ValidInput<M>>),
    components: TrainingComponents<M>,
    learner: Learner<M>,
    (dataloader_train, dataloader_valid): (TrainLoader<M>, ValidLoader<M>),
    starting_epoch: usize,
) -> (M, SupervisedTrainingEventProcessor<M>)
where
    M: LearnerModel + Reshard + Send + Sync,
    TrainItem<M>: DpItem,
{
    let (tp, dp) = (strategy.tp, strategy.dp);
    let world_size = match &ranks {
        Ranks::Threads => None,
        Ranks::Process { world, .. } => Some(world.world_size()),
    };
    let shards = match &strategy.shards {
        Some((any, name)) => match any.downcast_ref::<ShardBuilder<M>>() {
            Some(build) => Ok(Some(build.clone())),
            None => Err(format!(
                "TensorParallel::with_shards builds {name}, but the Learner's model is {}",
                std::any::type_name::<M>()
            )),
        },
        None => Ok(None),
    };
    let problem = if tp == 0 || dp == 0 {
        Some(format!(
            "TensorParallel: tp ({tp}) and dp ({dp}) must be at least 1"
        ))
    } else if let Err(message) = &shards {
        Some(message.clone())
    } else {
        world_size.filter(|&n| n != tp * dp).map(|n| {
            format!(
                "TensorParallel::on_processes: {n} processes, but tp ({tp}) x dp ({dp}) = {}",
                tp * dp
            )
        })
    };
    if let Some(message) = problem {
        if let Ranks::Process { world, .. } = &ranks {
            world.abort(&CommError::Backend(message.clone()));
        }
        components
            .interrupter
            .fail(TrainingError::Workers(vec![WorkerFailure {
                device_id: 0,
                message,
            }]));
        return (learner.model(), components.event_processor);
    }
    let world = tp * dp;
    let device = match &ranks {
        Ranks::Threads => Device::flex().autodiff(),
        Ranks::Process { device, .. } => device.clone(),
    };
    let train_items = dataloader_train.num_items();
    let valid_items = dataloader_valid.num_items();
    let train = split_dataloader(dataloader_train, &vec![device.clone(); dp]);
    let valid = dataloader_valid.to_device(&device.clone().inner());
    let (mut inbox, mut outbox) = (Vec::new(), Vec::new());
    if matches!(ranks, Ranks::Threads) {
        for _replica in 0..dp {
            let (senders, receivers): (Vec<_>, Vec<_>) = (1..tp).map(|_| channel()).unzip();
            outbox.push(Mutex::new(Some(senders)));
            inbox.push(Mutex::new(None));
            for r in receivers {
                outbox.push(Mutex::new(None));
                inbox.push(Mutex::new(Some(r)));
            }
        }
    }
    let control = EpochControl {
        checkpointing: strategy
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
        processes: world_size.is_some(),
        device,
        learner,
        optimizer: strategy.optimizer.clone(),
        timeout: strategy.timeout,
        sync: strategy.sync.clone(),
        shards: shards.ok().flatten(),
        gather: strategy.gather,
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
        codecs,
        checkpoints: strategy.checkpoints.as_ref().map(|c| c.0.clone()),
    });
    let run = {
        let shared = shared.clone();
        match ranks {
            Ranks::Threads => match LocalGroup::new(world) {
                Ok(groups) => run_ranks_with(groups, RunOptions::default(), move |g| {
                    rank_main(&shared, g).map_err(|e| e.to_string())
                }),
                Err(e) => Err(e.to_string()),
            },
            Ranks::Process { world, .. } => {
                let rank = world.rank();
                let result = rank_main(&shared, world.clone());
                if let Err(e) = &result {
                    world.abort(&CommError::Backend(e.to_string()));
                }
                // This rank's result at its index: the failure names the world rank.
                let mut results: Vec<std::result::Result<Option<M>, String>> =
                    (0..rank).map(|_| Ok(None)).collect();
                results.push(result.map_err(|e| e.to_string()));
                Ok(results)
            }
        }
    };
    // The checkpointing strategy back, also after an error (a later fit of the same strategy
    // goes on with it).
    if let (Some((_, slot)), Some(control)) = (
        &strategy.checkpoints,
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
    let model = run.ok().and_then(|mut results| {
        results
            .iter_mut()
            .find_map(|r| r.as_mut().ok().and_then(Option::take))
    });
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

/// One rank's whole run: its shard, the epochs, the trained model gathered to tp 1 (on world
/// rank 0 with threads, on every rank with processes).
fn rank_main<M>(shared: &Shared<M>, world: ProcessGroup) -> Result<Option<M>>
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
    let mut optim = (shared.optimizer)();
    let mut schedule = shared.learner.clone();
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
        if replica == 0 {
            valid_epoch(shared, &model, &feed)?;
        }
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
            let state = optim.module_optimizer(&model)?;
            checkpoint::save(&model, Some(&state), &dir, &info, &tp_group, replica)?;
            world.barrier()?;
        }
        if stop {
            break;
        }
    }
    // The trained model at tp 1, for LearningResult: replica 0's tp ranks gather it; with
    // processes every replica gathers its own (the replicas hold the same weights), so every
    // process returns it.
    if shared.gather && (replica == 0 || shared.processes) {
        let full = model.to_full_module()?;
        return Ok((rank == 0 || shared.processes).then_some(full));
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

/// How this rank gets its replica's batches: the leader reads them and hands each to its tp
/// peers (cloned into their channels with threads, its tensors broadcast over the tp group with
/// processes).
struct Feed<'a, M: LearnerModel> {
    shared: &'a Shared<M>,
    tp_group: ProcessGroup,
    leader: bool,
    /// This rank reports its items to the Learner.
    reports: bool,
    inbox: Inbox<M>,
    outbox: Outbox<M>,
}

impl<M: LearnerModel> Feed<'_, M> {
    /// The leader's `next` batch (`None`: the split ended), handed to its tp peers; on a peer,
    /// the leader's. `wrap` / `unwrap` put a batch in a thread message and take it out.
    fn hand<T>(
        &self,
        next: Option<T>,
        codec: &Codec<T>,
        wrap: fn(T) -> Message<M>,
        unwrap: fn(Message<M>) -> Option<T>,
    ) -> Result<Option<T>> {
        match codec {
            Codec::Clone(clone) if self.leader => {
                for peer in &self.outbox {
                    let message = next.as_ref().map_or(Handoff::End, |b| wrap(clone(b)));
                    peer.send(message).map_err(|_| peer_gone())?;
                }
                Ok(next)
            }
            Codec::Clone(_) => match self.inbox.as_ref().map(Receiver::recv) {
                Some(Ok(message)) => Ok(unwrap(message)),
                Some(Err(_)) | None => Err(peer_gone()),
            },
            Codec::Data { .. } if self.tp_group.world_size() == 1 => Ok(next),
            Codec::Data { to, from } => {
                let words = match (&next, self.leader) {
                    (Some(batch), true) => Some(encode_batch(&to(batch))?),
                    _ => None,
                };
                let len = words.as_ref().map_or(-1, |w| w.len() as i64);
                let len = self.tp_group.broadcast(vec![len], 0)?[0];
                let Ok(len) = usize::try_from(len) else {
                    return Ok(None);
                };
                let words = words.unwrap_or_else(|| vec![0; len]);
                let words = self.tp_group.broadcast(words, 0)?;
                match self.leader {
                    true => Ok(next),
                    false => Ok(Some(from(decode_batch(&words)?, &self.shared.device))),
                }
            }
        }
    }
}

/// A batch's tensors as words to broadcast: a JSON header (each tensor's dtype, shape and
/// byte length), then the bytes, padded to 8.
fn encode_batch(data: &[TensorData]) -> Result<Vec<i64>> {
    let header: Vec<(DType, Vec<usize>, usize)> = data
        .iter()
        .map(|d| (d.dtype(), d.shape().to_vec(), d.as_bytes().len()))
        .collect();
    let header = serde_json::to_vec(&header)
        .map_err(|e| TpError::Config(format!("train: a batch's header: {e}")))?;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    for d in data {
        bytes.resize(bytes.len().next_multiple_of(8), 0);
        bytes.extend_from_slice(d.as_bytes());
    }
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    Ok(bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// [`encode_batch`]'s tensors back.
fn decode_batch(words: &[i64]) -> Result<Vec<TensorData>> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let bad =
        |what: &str| TpError::Config(format!("train: a broadcast batch is malformed: {what}"));
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or_else(|| bad("no header"))?;
    let header = bytes
        .get(8..8 + header_len)
        .ok_or_else(|| bad("short header"))?;
    let header: Vec<(DType, Vec<usize>, usize)> =
        serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
    let mut at = 8 + header_len;
    let mut out = Vec::with_capacity(header.len());
    for (dtype, shape, len) in header {
        at = at.next_multiple_of(8);
        let chunk = bytes.get(at..at + len).ok_or_else(|| bad("short data"))?;
        out.push(TensorData::from_bytes_vec(chunk.to_vec(), shape, dtype));
        at += len;
    }
    Ok(out)
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

/// What `slots[rank]` holds, taken (none with processes: no slots).
fn take_slot<T>(slots: &[Mutex<Option<T>>], rank: usize) -> Option<Option<T>> {
    slots
        .get(rank)
        .map(|s| s.lock().ok().and_then(|mut s| s.take()))
}

fn peer_gone() -> TpError {
    TpError::Config("train: a rank of this replica has stopped (see its error)".into())
}
