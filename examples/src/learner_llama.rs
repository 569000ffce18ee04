//! `learner_llama`: the Llama trained through Burn's `SupervisedTraining` at tp 2 (feature
//! `train`): the Learner's metrics (loss, perplexity, learning rate, tokens/s), its terminal
//! dashboard when a terminal is there (the plain renderer otherwise, or with `--plain`), its
//! metric logs, an evaluation split, checkpoints kept by Burn's `KeepLastNCheckpoints` (burn-tp's
//! sharded ones, resumable at any tp / dp with `--resume EPOCH`). Ranks are threads, or with
//! `--transport mpi` one process each under `mpirun -n TPxDP` (feature `mpi`).

use std::path::{Path, PathBuf};

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_tp::comm::{LocalGroup, ProcessGroup};
use burn_tp::hf::HfConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::train::TensorParallel;
use burn_train::checkpoint::KeepLastNCheckpoints;
use burn_train::metric::{LearningRateMetric, LossMetric};
use burn_train::renderer::CliMetricsRenderer;
use burn_train::{Learner, SupervisedTraining};
use clap::Parser;

use crate::corpus;
use crate::learner::{LmBatcher, LmLearner, PerplexityMetric, TokensPerSecond, Windows};
pub use crate::train_gpt::{DeviceKind, Transport};

/// `learner_llama`'s command line.
#[derive(Parser, Debug, Clone)]
#[command(about = "Train a Llama through Burn's Learner (SupervisedTraining) at tp x dp")]
pub struct LearnerArgs {
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
    /// Data-parallel size (world = tp x dp).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Fully sharded data parallelism: each rank holds its rows of every parameter, of its
    /// gradient and of AdamW's moments between steps (`TensorParallel::with_fsdp`).
    #[arg(long)]
    pub fsdp: bool,
    /// How the ranks run: threads of this process, or one process each under `mpirun -n
    /// (tp x dp)` (feature `mpi`). With MPI, world rank 0's Learner writes to `--out` (and
    /// shows its replica's items), rank N's to `OUT/rank-N`; the checkpoints are shared.
    #[arg(long, value_enum, default_value_t = Transport::Threads)]
    pub transport: Transport,
    /// Where the ranks compute: the CPU, or one GPU per process started by `burn-tp-launch`
    /// over NCCL (feature `cuda`; rank N's Learner writes to `OUT/rank-N` as with MPI).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// The seed of the model's initial weights (every process draws the same).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Epochs over the training text.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Sequences per batch and replica.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Model width (default 128; with `--init-from` the model's own: an error).
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Attention heads (default 4; with `--init-from` an error).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key / value heads (default 2; with `--init-from` an error).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Blocks (default 2; with `--init-from` an error).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Dropout of the attention probabilities and residual branches: default 0 from scratch;
    /// with `--init-from` the model's config's, which this overrides.
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Learning rate (AdamW).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// A text file to train on (default: the built-in corpus); its last tenth validates.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Start from this Hugging Face Llama-family folder (its config, with its sizes and dropout,
    /// its weights and tokenizer).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// LoRA fine-tuning: adapters of this rank on `--lora-targets`, everything else frozen
    /// (`burn_tp::lora::apply_lora`).
    #[arg(long, value_name = "R")]
    pub lora_rank: Option<usize>,
    /// The adapters' output is scaled by this over the rank (default: twice the rank).
    #[arg(long, value_name = "ALPHA")]
    pub lora_alpha: Option<f64>,
    /// The projections LoRA adapts, comma separated (`q_proj` or `q`, ...).
    #[arg(long, value_delimiter = ',', default_value = "q,k,v,o,gate,up,down")]
    pub lora_targets: Vec<String>,
    /// At most this many training sequences per epoch (a short run).
    #[arg(long)]
    pub max_sequences: Option<usize>,
    /// Checkpoints to keep (Burn's `KeepLastNCheckpoints`), in `OUT/checkpoints/epoch-N`.
    #[arg(long, default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Resume after this epoch (its checkpoint in `OUT/checkpoints`, written at any tp / dp).
    #[arg(long)]
    pub resume: Option<usize>,
    /// The plain renderer even in a terminal.
    #[arg(long)]
    pub plain: bool,
    /// Output folder: the Learner's logs and metrics, the checkpoints.
    #[arg(long, default_value = "out/learner")]
    pub out: PathBuf,
}

/// What a run reports: each epoch's mean training and validation loss (from the Learner's
/// metric logs; empty on MPI ranks other than 0, whose Learners show nothing).
#[derive(Debug)]
pub struct LearnerReport {
    /// This process's world rank (0 with threads).
    pub rank: usize,
    /// Per epoch run: the mean training loss.
    pub train_loss: Vec<f64>,
    /// Per epoch run: the mean validation loss.
    pub valid_loss: Vec<f64>,
    /// Training sequences per epoch.
    pub sequences: usize,
}

/// Runs `learner_llama` with `args`.
///
/// # Errors
/// Bad arguments, data or model folders, or the training's error, as text.
pub fn run(args: &LearnerArgs) -> Result<LearnerReport, String> {
    if args.tp == 0 || args.dp == 0 || args.epochs == 0 || args.batch == 0 {
        return Err(format!(
            "--tp, --dp, --epochs and --batch must be at least 1 (got {}, {}, {}, {})",
            args.tp, args.dp, args.epochs, args.batch
        ));
    }
    let (codec, tokens) = corpus::load_tokens(args.data.as_deref(), args.init_from.as_deref())?;
    let split = tokens.len() * 9 / 10;
    let mut train = tokens[..split].to_vec();
    if let Some(n) = args.max_sequences {
        train.truncate(n * args.seq + 1);
    }
    let train = Windows::new(train, args.seq, args.seq);
    let valid = Windows::new(tokens[split..].to_vec(), args.seq, args.seq);
    let sequences = burn::data::dataset::Dataset::len(&train);
    if sequences < args.batch * args.dp || burn::data::dataset::Dataset::len(&valid) == 0 {
        return Err(format!(
            "{} training sequences of --seq {} for --batch {} x --dp {}: more data, or a \
             shorter --seq",
            sequences, args.seq, args.batch, args.dp
        ));
    }
    let settings = TpSettings::new().with_mode(TpMode::ReduceScatter);
    let sizes = [
        ("--d-model", args.d_model),
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--layers", args.layers),
    ];
    crate::train_gpt::check::refuse_sizes(args.init_from.as_deref(), &sizes)?;
    if let Some(p) = args.dropout.filter(|p| !(0.0..1.0).contains(p)) {
        return Err(format!("--dropout must be in [0, 1) (got {p})"));
    }
    let (config, init_from) = match &args.init_from {
        Some(dir) => {
            let hf = HfConfig::from_dir(dir).map_err(|e| e.to_string())?;
            if hf.architecture.is_gemma() {
                return Err(format!(
                    "--init-from {}: a {} (a Gemma); learner_llama trains the Llama family \
                     (train_gpt --init-from trains a Gemma)",
                    dir.display(),
                    hf.architecture.names().0
                ));
            }
            corpus::check_fits(&codec, dir, hf.vocab_size)?;
            let config = hf.llama_config(settings);
            let config = match args.dropout {
                Some(p) => config.with_dropout(p).with_attention_dropout(None),
                None => config,
            };
            (config, Some(dir.as_path()))
        }
        None => {
            let d_model = args.d_model.unwrap_or(128);
            let config = LlamaConfig::new(
                codec.len(),
                args.seq,
                d_model,
                args.heads.unwrap_or(4),
                args.kv_heads.unwrap_or(2),
                args.layers.unwrap_or(2),
                (8 * d_model / 3).next_multiple_of(32),
            )
            .with_dropout(args.dropout.unwrap_or(0.0))
            .with_settings(settings);
            (config, None)
        }
    };
    // Each rank builds its own shard (no rank holds the whole model); the Learner's model is
    // only a tiny placeholder of the same type.
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    let solo = LocalGroup::new(1).map_err(|e| e.to_string())?.remove(0);
    let placeholder = LlamaConfig::new(2, 2, 8, 1, 1, 1, 8)
        .init(&solo, &device)
        .map_err(|e| e.to_string())?;
    device.seed(args.seed);
    // The layers draw from the seed's own stream (every rank thread, or this process's rank).
    burn_tp::local::set_init_seed(args.seed);
    let init_from = init_from.map(Path::to_path_buf);
    let lora = args.lora_rank.map(|r| {
        burn_tp::lora::LoraConfig::new(r, args.lora_alpha.unwrap_or(2.0 * r as f64))
            .with_targets(args.lora_targets.clone())
    });
    if let Some(c) = &lora {
        c.short_targets()
            .map_err(|e| format!("--lora-rank / --lora-targets: {e}"))?;
    }
    let build = move |tp_group: &ProcessGroup, device: &Device| {
        let model = config.init(tp_group, device)?;
        let model = match &init_from {
            Some(dir) => burn_tp::hf::load(model, dir, tp_group)?,
            None => model,
        };
        let model = match &lora {
            Some(c) => burn_tp::lora::apply_lora(model, c)?,
            None => model,
        };
        Ok(LmLearner::new(model))
    };
    let checkpoints = args.out.join("checkpoints");
    let tensor_parallel = TensorParallel::new(args.tp, args.dp, || AdamWConfig::new().init())
        .with_shards(build)
        .with_checkpoints(
            &checkpoints,
            KeepLastNCheckpoints::new(args.keep_checkpoints),
        );
    let tensor_parallel = match args.fsdp {
        true => tensor_parallel.with_fsdp(),
        false => tensor_parallel,
    };
    // With MPI or NCCL, this process is one rank (what its world needs lives until the
    // training ends).
    let (world, rank_device, _keep) = match (args.device, args.transport) {
        (DeviceKind::Cpu, Transport::Threads) => (None, device.clone(), None),
        (DeviceKind::Cpu, Transport::Mpi) => {
            let (world, runtime) = mpi_world(args)?;
            let keep: Box<dyn std::any::Any> = Box::new(runtime);
            (Some(world), device.clone(), Some(keep))
        }
        (DeviceKind::Cuda, Transport::Threads) => {
            let (world, device, keep) = nccl_world(args)?;
            (Some(world), device, Some(keep))
        }
        (DeviceKind::Cuda, Transport::Mpi) => {
            return Err(
                "--transport mpi runs CPU ranks; --device cuda ranks talk over NCCL".into(),
            );
        }
    };
    let (strategy, rank) = match world {
        None => (tensor_parallel.into_strategy(), 0),
        Some(world) => {
            let rank = world.rank();
            let strategy = tensor_parallel.on_processes(world, rank_device);
            (strategy.into_strategy(), rank)
        }
    };
    let out = match rank {
        0 => args.out.clone(),
        rank => args.out.join(format!("rank-{rank}")),
    };
    let loader = |windows: Windows| {
        DataLoaderBuilder::new(LmBatcher)
            .batch_size(args.batch)
            .build(windows)
    };
    let mut training = SupervisedTraining::new(&out, loader(train), loader(valid))
        .metrics((
            LossMetric::new(),
            PerplexityMetric::default(),
            TokensPerSecond::default(),
            LearningRateMetric::new(),
        ))
        .with_training_strategy(strategy)
        .num_epochs(args.epochs)
        .summary();
    if args.plain {
        training = training.renderer(Box::new(CliMetricsRenderer::new()));
    }
    if let Some(epoch) = args.resume {
        training = training.checkpoint(epoch);
    }
    let result = training.launch(Learner::new(
        LmLearner::new(placeholder),
        AdamWConfig::new().init(),
        args.lr,
    ));
    if let Some(e) = result.error {
        return Err(e.to_string());
    }
    if rank != 0 {
        return Ok(LearnerReport {
            rank,
            train_loss: Vec::new(),
            valid_loss: Vec::new(),
            sequences,
        });
    }
    let first = args.resume.map_or(1, |e| e + 1);
    let mean = |split: &str, epoch: usize| epoch_mean(&args.out, split, epoch, "Loss");
    let epochs: Vec<usize> = (first..=args.epochs)
        .take_while(|&e| args.out.join("train").join(format!("epoch-{e}")).exists())
        .collect();
    Ok(LearnerReport {
        rank,
        train_loss: epochs
            .iter()
            .map(|&e| mean("train", e))
            .collect::<Result<_, _>>()?,
        valid_loss: epochs
            .iter()
            .map(|&e| mean("valid", e))
            .collect::<Result<_, _>>()?,
        sequences,
    })
}

/// The MPI world of this process (under `mpirun`), and its runtime, checked to hold
/// `--tp x --dp` processes.
#[cfg(feature = "mpi")]
fn mpi_world(
    args: &LearnerArgs,
) -> Result<(burn_tp::comm::ProcessGroup, burn_tp::comm::mpi::MpiRuntime), String> {
    let runtime = burn_tp::comm::mpi::MpiRuntime::init().map_err(|e| e.to_string())?;
    if runtime.world_size() != args.tp * args.dp {
        return Err(format!(
            "--transport mpi: mpirun started {} processes but --tp {} x --dp {} = {}",
            runtime.world_size(),
            args.tp,
            args.dp,
            args.tp * args.dp
        ));
    }
    Ok((burn_tp::comm::ProcessGroup::from_mpi(&runtime), runtime))
}

/// This process's GPU and its NCCL world, under `burn-tp-launch` (one process per GPU), checked
/// to hold `--tp x --dp` processes; and what must live while it trains (the launch's store).
#[cfg(feature = "cuda")]
fn nccl_world(
    args: &LearnerArgs,
) -> Result<(burn_tp::comm::ProcessGroup, Device, Box<dyn std::any::Any>), String> {
    let timeout = burn_tp::comm::LocalGroupOptions::default().timeout;
    let (world, local_rank, keep) = crate::train_gpt::nccl_world((args.tp, args.dp), timeout)?;
    let device = Device::cuda(local_rank);
    device.seed(args.seed);
    Ok((world, device, keep))
}

#[cfg(not(feature = "cuda"))]
fn nccl_world(
    _: &LearnerArgs,
) -> Result<(burn_tp::comm::ProcessGroup, Device, Box<dyn std::any::Any>), String> {
    Err(
        "--device cuda needs the `cuda` feature: cargo build --release -p burn-tp-examples \
         --features train,cuda --example learner_llama, then burn-tp-launch (see docs/guide/mpi-gpu.md)"
            .into(),
    )
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_: &LearnerArgs) -> Result<(burn_tp::comm::ProcessGroup, ()), String> {
    Err(
        "--transport mpi needs the `mpi` feature and a system MPI: cargo build --release \
         -p burn-tp-examples --features train,mpi --example learner_llama, then mpirun -n TPxDP \
         (see docs/guide/mpi-gpu.md)"
            .into(),
    )
}

/// The mean of metric `name` over epoch `epoch`'s items of `split`, from the Learner's log.
fn epoch_mean(out: &Path, split: &str, epoch: usize, name: &str) -> Result<f64, String> {
    let path = out
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join(format!("{name}.log"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.ends_with(",final"))
        .filter_map(|l| l.split(',').next()?.parse().ok())
        .collect();
    if values.is_empty() {
        return Err(format!("{}: no values", path.display()));
    }
    Ok(values.iter().sum::<f64>() / values.len() as f64)
}
