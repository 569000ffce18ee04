//! What every rank of a `fit` shares ([`Shared`]: the Learner, the loaders, the event
//! processor, the hand-off channels) and how a batch travels to a replica's tp peers
//! ([`Codec`], [`Handoff`]).

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::{Device, TensorData};
use burn_train::checkpoint::CheckpointingStrategy;
use burn_train::{
    Learner, LearnerModel, SupervisedTrainingEventProcessor, TrainLoader, TrainingError,
    ValidLoader,
};

use super::items::ProcessBatch;
use super::{GradSync, OptimizerFactory, ShardBuilder, TrainInput, ValidInput};

/// What a replica's leader hands its tp peers (ranks as threads).
pub(super) type Message<M> = Handoff<TrainInput<M>, ValidInput<M>>;

/// How a batch reaches a replica's tp peers: cloned (threads) or as its tensors' data over the
/// tp group (processes).
pub(super) enum Codec<T> {
    Clone(fn(&T) -> T),
    Data {
        to: fn(&T) -> Vec<TensorData>,
        from: fn(Vec<TensorData>, &Device) -> T,
    },
}

impl<T> Codec<T> {
    pub(super) fn cloned() -> Self
    where
        T: Clone,
    {
        Self::Clone(T::clone)
    }

    pub(super) fn data() -> Self
    where
        T: ProcessBatch,
    {
        Self::Data {
            to: T::to_data,
            from: T::from_data,
        }
    }
}

/// A batch handed from a replica's leader to its tp peers.
pub(super) enum Handoff<T, V> {
    Train(T),
    Valid(V),
    /// The split ended (or was interrupted): no more batches of it.
    End,
}

/// A tp peer's receiving end (none on a leader).
pub(super) type Inbox<M> = Option<Receiver<Message<M>>>;
/// A leader's senders to its tp peers (none on a peer).
pub(super) type Outbox<M> = Vec<Sender<Message<M>>>;

/// What every rank (thread) of this process shares.
pub(super) struct Shared<M: LearnerModel> {
    pub(super) tp: usize,
    pub(super) dp: usize,
    /// Ranks as processes (one per process) rather than threads.
    pub(super) processes: bool,
    pub(super) device: Device,
    /// The caller's Learner: the full model each rank shards, the schedule each rank clones.
    pub(super) learner: Learner<M>,
    pub(super) optimizer: OptimizerFactory,
    pub(super) timeout: Option<Duration>,
    pub(super) sync: GradSync,
    pub(super) shards: Option<ShardBuilder<M>>,
    pub(super) gather: bool,
    pub(super) train: Vec<TrainLoader<M>>,
    pub(super) valid: ValidLoader<M>,
    pub(super) train_items: usize,
    pub(super) valid_items: usize,
    pub(super) epochs: (usize, usize),
    pub(super) processor: Mutex<SupervisedTrainingEventProcessor<M>>,
    /// World rank 0's: it decides with it after each epoch, and `fit` gives the strategy back.
    pub(super) components: Mutex<Option<EpochControl>>,
    pub(super) interrupter: burn_train::Interrupter,
    /// Per rank thread: its receiving end (tp peers), or its senders to its peers (leaders).
    pub(super) inbox: Vec<Mutex<Inbox<M>>>,
    pub(super) outbox: Vec<Mutex<Option<Outbox<M>>>>,
    pub(super) codecs: (Codec<TrainInput<M>>, Codec<ValidInput<M>>),
    pub(super) checkpoints: Option<PathBuf>,
}

/// What world rank 0 decides with after each epoch.
pub(super) struct EpochControl {
    pub(super) checkpointing: Option<Box<dyn CheckpointingStrategy>>,
    pub(super) early_stopping: Option<Box<dyn burn_train::CloneEarlyStoppingStrategy>>,
    pub(super) event_store: Arc<burn_train::metric::store::EventStoreClient>,
}

impl<M: LearnerModel> Shared<M> {
    /// `f` on the event processor; its error stops the run (the Learner's interrupter).
    pub(super) fn process<E: Into<TrainingError>>(
        &self,
        f: impl FnOnce(&mut SupervisedTrainingEventProcessor<M>) -> std::result::Result<(), E>,
    ) {
        let mut p = self.processor.lock().unwrap_or_else(|e| e.into_inner());
        self.interrupter.fail_on_error(f(&mut p));
    }
}
