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
//!
//! | file        | what                                                                        |
//! |-------------|-----------------------------------------------------------------------------|
//! | `mod.rs`    | [`TensorParallel`], [`ProcessRanks`]: the strategy and its builder            |
//! | `launch.rs` | `fit`: threads or processes (decided in one place, `Ranks`), what they share |
//! | `rank.rs`   | one rank's run: its shard, the training and validation epochs, checkpoints  |
//! | `shared.rs` | what every rank shares; how a batch travels (`Codec`, `Handoff`)           |
//! | `feed.rs`   | a replica's batches handed from its leader to its tp peers                  |
//! | `items.rs`  | [`DpItem`] (the Learner's one item per step over dp), [`ProcessBatch`]       |
//! | `optim.rs`  | a rank's optimizer step: the gradients reduced over dp, the update          |

mod feed;
mod items;
mod launch;
mod optim;
mod rank;
mod shared;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::Device;
use burn_tp_comm::ProcessGroup;
use burn_train::checkpoint::CheckpointingStrategy;
use burn_train::{
    InferenceStep, Learner, LearnerModel, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingStrategy,
    ValidLoader,
};

pub use items::{DpItem, ProcessBatch, gather_float, gather_int, mean_over};

use crate::Result;
use crate::reshard::Reshard;
use launch::{Ranks, fit};
use shared::Codec;

/// A training batch of model `M`.
type TrainInput<M> = <M as TrainStep>::Input;
/// A validation batch of model `M`.
type ValidInput<M> = <M as InferenceStep>::Input;
/// A training step's output item of model `M`.
type TrainItem<M> = <M as TrainStep>::Output;

/// A checkpointing strategy, lent to world rank 0 during `fit`.
type Lent = Mutex<Option<Box<dyn CheckpointingStrategy>>>;

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
    /// Averaged after the backward ([`average_gradients`](crate::dp::average_gradients)).
    AfterBackward,
    /// Averaged in buckets during the backward ([`GradReducer`](crate::dp::GradReducer)).
    Overlapped { bucket_bytes: usize },
    /// Reduce-scattered in buckets during the backward, AdamW on this rank's chunks
    /// ([`DistributedAdamW`](crate::dp::DistributedAdamW); the factory's optimizer is not used).
    Distributed {
        config: AdamWConfig,
        bucket_bytes: usize,
    },
    /// Fully sharded ([`Fsdp`](crate::fsdp::Fsdp)) over groups of `shard` dp ranks (0: all
    /// of dp), replicated over the rest: the step's whole model gathered before the user's
    /// `TrainStep`, its gradients reduce-scattered after.
    FullySharded { shard: usize },
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
    /// during the backward as soon as its last gradient is there ([`GradReducer`](crate::dp::GradReducer)): the user's
    /// `TrainStep` runs on a view of the model with the reducer's taps.
    pub fn with_overlapped_grad_reduce(mut self, bucket_bytes: usize) -> Self {
        self.sync = GradSync::Overlapped { bucket_bytes };
        self
    }

    /// Megatron's distributed optimizer: AdamW of `config` with its moments sharded over dp,
    /// the gradients reduce-scattered in buckets during the backward ([`DistributedAdamW`](crate::dp::DistributedAdamW)). It
    /// takes the schedule's base learning rate, and replaces the factory's optimizer.
    pub fn with_distributed_optimizer(mut self, config: AdamWConfig, bucket_bytes: usize) -> Self {
        self.sync = GradSync::Distributed {
            config,
            bucket_bytes,
        };
        self
    }

    /// Fully sharded data parallelism ([`crate::fsdp`]): between steps each rank holds
    /// `1 / dp` of its tp shard's parameters, gradients and optimizer state (AdamW's moments
    /// included, the bulk). The user's `TrainStep` is one closure over the whole model, so
    /// each step gathers the whole (every gather posted at once) before it and
    /// reduce-scatters its gradients after it ([`Fsdp::gather_whole`](crate::fsdp::Fsdp::gather_whole),
    /// [`Fsdp::scatter_grads`](crate::fsdp::Fsdp::scatter_grads)): the step's peak holds the
    /// whole once, not one block at a time as `train_gpt --fsdp`'s step does. Validation and
    /// the returned model gather it too; checkpoints are each rank's rows. Replaces the other
    /// gradient syncs (buckets, the distributed optimizer).
    pub fn with_fsdp(mut self) -> Self {
        self.sync = GradSync::FullySharded { shard: 0 };
        self
    }

    /// [`with_fsdp`](Self::with_fsdp) within groups of `shard` consecutive dp ranks, each group
    /// holding the whole model between them and replicated over the groups (HSDP): `shard`
    /// must divide dp (`fit` fails naming both).
    pub fn with_hsdp(mut self, shard: usize) -> Self {
        self.sync = GradSync::FullySharded { shard };
        self
    }

    /// After each epoch, `strategy` (Burn's `KeepLastNCheckpoints`, `MetricCheckpointingStrategy`,
    /// ...) decides what to save and delete: each rank writes its shard of the model and of the
    /// optimizer state into `dir/epoch-N` (burn-tp's sharded checkpoint, [`crate::checkpoint`]).
    /// `SupervisedTraining::checkpoint(N)` resumes from `dir/epoch-N`, at any tp and dp. A model
    /// with frozen parameters (a LoRA model's base) saves its trainable ones alone: the resumed
    /// run's model must hold the same frozen values (built as the first run built it).
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
