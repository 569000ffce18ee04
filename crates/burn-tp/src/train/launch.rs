//! `fit`: the rank threads or this process's rank started with what they share, and the
//! Learner's model and event processor handed back; world rank 0's decisions after an epoch.

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::split::split_dataloader;
use burn::tensor::Device;
use burn_tp_comm::{CommError, LocalGroup, ProcessGroup};
use burn_train::train::WorkerFailure;
use burn_train::{
    Learner, LearnerModel, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    TrainingError, ValidLoader,
};

use super::items::DpItem;
use super::rank::rank_main;
use super::shared::{Codec, EpochControl, Inbox, Outbox, Shared};
use super::{ShardBuilder, TensorParallel, TrainInput, TrainItem, ValidInput};
use crate::local::{RunOptions, run_ranks_with};
use crate::reshard::Reshard;

/// Where the ranks run, decided once for a `fit` (by the strategy the Learner holds:
/// [`TensorParallel`] or [`ProcessRanks`](super::ProcessRanks)); every difference between
/// ranks as threads and as processes is a method here (and the batches' [`Codec`]).
pub(super) enum Ranks {
    /// `tp x dp` threads of this process, on Flex.
    Threads,
    /// This process is rank `world.rank()`, on `device`.
    Process { world: ProcessGroup, device: Device },
}

impl Ranks {
    /// The world's processes (`None`: ranks as threads, started by [`Ranks::run`]).
    fn processes(&self) -> Option<usize> {
        match self {
            Ranks::Threads => None,
            Ranks::Process { world, .. } => Some(world.world_size()),
        }
    }

    /// Where the ranks compute (with autodiff).
    fn device(&self) -> Device {
        match self {
            Ranks::Threads => Device::flex().autodiff(),
            Ranks::Process { device, .. } => device.clone(),
        }
    }

    /// Ends every process of the world with `message` (threads end with their `fit`).
    fn abort(&self, message: &str) {
        if let Ranks::Process { world, .. } = self {
            world.abort(&CommError::Backend(message.to_string()));
        }
    }

    /// Per world rank, its channel from its replica's leader (a tp peer) or to its tp peers (a
    /// leader): ranks as threads hand batches over these; processes over the tp group (none).
    #[allow(clippy::type_complexity)]
    fn channels<M: LearnerModel>(
        &self,
        tp: usize,
        dp: usize,
    ) -> (Vec<Mutex<Inbox<M>>>, Vec<Mutex<Option<Outbox<M>>>>) {
        let (mut inbox, mut outbox) = (Vec::new(), Vec::new());
        if let Ranks::Threads = self {
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
        (inbox, outbox)
    }

    /// [`rank_main`] on this process's ranks (`world` threads, or this process), each result at
    /// its world rank (a process's peers' as `Ok(None)`: they report in their own process). A
    /// process that fails aborts the world, so no peer waits for it.
    #[allow(clippy::type_complexity)]
    fn run<M>(
        self,
        world: usize,
        shared: Arc<Shared<M>>,
    ) -> std::result::Result<Vec<std::result::Result<Option<M>, String>>, String>
    where
        M: LearnerModel + Reshard + Send + Sync,
        TrainItem<M>: DpItem,
    {
        match self {
            Ranks::Threads => match LocalGroup::new(world) {
                Ok(groups) => run_ranks_with(groups, RunOptions::default(), move |g| {
                    rank_main(&shared, g).map_err(|e| e.to_string())
                }),
                Err(e) => Err(e.to_string()),
            },
            Ranks::Process { world, .. } => {
                let rank = world.rank();
                // Draw as the rank threads do, so a process's ranks get the threads' model.
                crate::local::start_rank_stream();
                let result = rank_main(&shared, world.clone());
                if let Err(e) = &result {
                    world.abort(&CommError::Backend(e.to_string()));
                }
                let mut results: Vec<std::result::Result<Option<M>, String>> =
                    (0..rank).map(|_| Ok(None)).collect();
                results.push(result.map_err(|e| e.to_string()));
                Ok(results)
            }
        }
    }
}

/// `SupervisedLearningStrategy::fit` for `strategy` on `ranks`.
pub(super) fn fit<M>(
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
    let world_size = ranks.processes();
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
        ranks.abort(&message);
        components
            .interrupter
            .fail(TrainingError::Workers(vec![WorkerFailure {
                device_id: 0,
                message,
            }]));
        return (learner.model(), components.event_processor);
    }
    let world = tp * dp;
    let device = ranks.device();
    let train_items = dataloader_train.num_items();
    let valid_items = dataloader_valid.num_items();
    let train = split_dataloader(dataloader_train, &vec![device.clone(); dp]);
    let valid = dataloader_valid.to_device(&device.clone().inner());
    let (inbox, outbox) = ranks.channels::<M>(tp, dp);
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
    let run = ranks.run(world, shared.clone());
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
