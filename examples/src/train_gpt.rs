//! Trains the tiny GPT of `burn_tp::gpt` at tp x dp ranks (threads on the CPU), with Burn's AdamW.
//!
//! Every rank runs the same loop on its shard; rank 0 reports. The checkpoint written at the end
//! is the full, unsharded model (a Burn record), so it resumes at any tp.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::dp::{average_gradients, broadcast_parameters};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::TpMode;
use burn_tp::local::run_ranks;
use burn_tp::ops::all_reduce;
use burn_tp::reshard::Reshard;
use burn_tp::{LocalGroup, ProcessGroup, ReduceOp};
use clap::{Parser, ValueEnum};

use crate::corpus::{self, Vocab};

/// Activation layout, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Replicated activations; all-reduce after each row-parallel layer.
    AllReduce,
    /// Sequence parallel: activations sharded on the sequence.
    ReduceScatter,
}

/// Where the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// Ranks are threads of this process on the CPU (Flex), with the in-process group.
    Cpu,
    /// One process per GPU, started by `burn-tp-launch` (or torchrun-style env), over NCCL.
    /// Needs the `cuda` feature.
    Cuda,
}

/// Command line of `train_gpt`.
#[derive(Parser, Clone, Debug)]
#[command(about = "Train a tiny character-level GPT with tensor parallelism (ranks are threads)")]
pub struct Args {
    /// Tensor-parallel size (with `--device cuda`: the launch's WORLD_SIZE).
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
    /// Where the ranks run.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Data-parallel size (world = tp x dp; gradients averaged over dp).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Activation layout.
    #[arg(long, value_enum, default_value_t = Mode::AllReduce)]
    pub mode: Mode,
    /// Use the plain composed collectives instead of the overlapped ops.
    #[arg(long)]
    pub no_async: bool,
    /// Optimizer steps.
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    /// Sequences per step (over all dp ranks).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Seed of the weights and of the batches.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// UTF-8 text to train on (character level); the built-in corpus if absent.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Output folder: loss.csv, loss.png, checkpoint.bpk.
    #[arg(long, default_value = "out")]
    pub out: PathBuf,
    /// Full checkpoint to start from (written by any tp).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct Report {
    /// Loss of every step (mean over the dp ranks).
    pub losses: Vec<f64>,
    /// Unigram entropy of the training text, in nats.
    pub unigram_entropy: f64,
    /// Tokens processed per second.
    pub tokens_per_s: f64,
    /// Where the full checkpoint was written.
    pub checkpoint: PathBuf,
}

/// The model configuration the arguments describe.
pub fn model_config(args: &Args, n_vocab: usize) -> GptConfig {
    GptConfig::new(n_vocab, args.seq, args.d_model, args.heads, args.layers)
        .with_mode(match args.mode {
            Mode::AllReduce => TpMode::AllReduce,
            Mode::ReduceScatter => TpMode::ReduceScatter,
        })
        .with_async_communication(!args.no_async)
}

/// Batch `step` of the run: `[seq, batch]` ids and next-token targets, the same on every rank.
fn batch(tokens: &[i64], args: &Args, step: usize) -> (Vec<i64>, Vec<i64>) {
    let span = tokens.len() - args.seq - 1;
    let mut ids = vec![0; args.seq * args.batch];
    let mut targets = ids.clone();
    for b in 0..args.batch {
        // SplitMix64 of (seed, step, b): any rank computes any batch without shared state.
        let mut z = args.seed ^ ((step as u64) << 20) ^ b as u64;
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let start = ((z ^ (z >> 31)) % span as u64) as usize;
        for s in 0..args.seq {
            ids[s * args.batch + b] = tokens[start + s];
            targets[s * args.batch + b] = tokens[start + s + 1];
        }
    }
    (ids, targets)
}

/// This dp rank's columns of a `[seq, batch]` batch.
fn dp_slice(v: &[i64], args: &Args, dp_rank: usize, device: &Device) -> Tensor<2, Int> {
    let t =
        Tensor::<2, Int>::from_data(TensorData::new(v.to_vec(), [args.seq, args.batch]), device);
    let per = args.batch / args.dp;
    t.slice([0..args.seq, dp_rank * per..(dp_rank + 1) * per])
}

fn check(args: &Args) -> Result<(), String> {
    if args.tp == 0 || args.dp == 0 {
        return Err(format!(
            "--tp and --dp must be at least 1 (got tp {} dp {})",
            args.tp, args.dp
        ));
    }
    if !args.batch.is_multiple_of(args.dp) {
        return Err(format!(
            "--batch {} is not divisible by --dp {}",
            args.batch, args.dp
        ));
    }
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    Ok(())
}

/// Runs the training; the same arguments give the same losses at every tp.
///
/// # Errors
/// Bad arguments, unreadable data, or a failure on any rank, as text.
pub fn run(args: &Args) -> Result<Report, String> {
    check(args)?;
    let text = match &args.data {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?
        }
        None => corpus::builtin(200_000),
    };
    let vocab = Vocab::new(&text);
    let tokens = vocab.encode(&text);
    if tokens.len() < args.seq + 2 {
        return Err(format!(
            "the data has {} characters; --seq {} needs at least {}",
            tokens.len(),
            args.seq,
            args.seq + 2
        ));
    }
    let unigram_entropy = corpus::unigram_entropy(&tokens, vocab.len());
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    let checkpoint = args.out.join("checkpoint.bpk");
    let config = model_config(args, vocab.padded_len());

    let start = Instant::now();
    let (rank, losses) = match args.device {
        DeviceKind::Cpu => {
            let device = Device::flex().autodiff();
            // One device RNG for every rank thread: seed it once, before they start.
            device.seed(args.seed);
            let world = args.tp * args.dp;
            let groups = LocalGroup::new(world).map_err(|e| e.to_string())?;
            let (args2, tokens, config2, ckpt) = (
                args.clone(),
                tokens.clone(),
                config.clone(),
                checkpoint.clone(),
            );
            let results = run_ranks(groups, move |world_group| {
                train_rank(&args2, &config2, &tokens, world_group, &device, &ckpt)
                    .map_err(|e| e.to_string())
            })?;
            let losses = results.into_iter().next().expect("rank 0");
            (0, losses.map_err(|e| format!("rank 0: {e}"))?)
        }
        DeviceKind::Cuda => cuda_rank(args, &config, &tokens, &checkpoint)?,
    };
    let elapsed = start.elapsed().as_secs_f64();
    // Rank 0 (of the threads, or of a multi-process launch) writes the files.
    if rank == 0 {
        write_csv(&args.out.join("loss.csv"), &losses)?;
        crate::plot::loss_png(&args.out.join("loss.png"), &losses, unigram_entropy)?;
    }
    let tokens_per_s = (args.steps * args.batch * args.seq) as f64 / elapsed;
    Ok(Report {
        losses,
        unigram_entropy,
        tokens_per_s,
        checkpoint,
    })
}

/// This process's rank of a `--device cuda` launch: one GPU (`LOCAL_RANK`), NCCL over the
/// launch's store. Returns (rank, losses).
#[cfg(feature = "cuda")]
fn cuda_rank(
    args: &Args,
    config: &GptConfig,
    tokens: &[i64],
    checkpoint: &Path,
) -> Result<(usize, Vec<f64>), String> {
    use burn_tp::comm::nccl::NcclGroup;
    use burn_tp::comm::store::LaunchEnv;
    let env = LaunchEnv::from_env().map_err(|e| {
        format!("--device cuda runs one process per GPU: start it with burn-tp-launch ({e})")
    })?;
    if env.world_size != args.tp || args.dp != 1 {
        return Err(format!(
            "--device cuda: the launch has WORLD_SIZE {} but --tp {} --dp {}; on GPUs world = tp \
             and dp = 1 (NCCL groups cannot be split yet)",
            env.world_size, args.tp, args.dp
        ));
    }
    let timeout = burn_tp::comm::DEFAULT_TIMEOUT;
    let (_server, store) = env.rendezvous(timeout).map_err(|e| e.to_string())?;
    let nccl = NcclGroup::new(&env, &store, timeout).map_err(|e| e.to_string())?;
    let world = ProcessGroup::from_nccl(nccl);
    let device = Device::cuda(env.local_rank).autodiff();
    device.seed(args.seed);
    let losses = train_rank(args, config, tokens, world, &device, checkpoint)
        .map_err(|e| format!("rank {}: {e}", env.rank))?;
    Ok((env.rank, losses))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rank(_: &Args, _: &GptConfig, _: &[i64], _: &Path) -> Result<(usize, Vec<f64>), String> {
    Err(
        "--device cuda needs the `cuda` feature: cargo run --release --example train_gpt \
         --features cuda (see README: burn's CUDA backend cannot be linked on machines without \
         network access)"
            .into(),
    )
}

fn train_rank(
    args: &Args,
    config: &GptConfig,
    tokens: &[i64],
    world: ProcessGroup,
    device: &Device,
    checkpoint: &Path,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let rank = world.rank();
    let (tp_rank, dp_rank) = (rank % args.tp, rank / args.tp);
    // Without data parallelism the world is the tp group (no split: NCCL groups cannot).
    let (tp_group, dp_group) = if args.dp == 1 {
        (world.clone(), LocalGroup::new(1)?.remove(0))
    } else {
        (world.split(dp_rank, rank)?, world.split(tp_rank, rank)?)
    };
    let device = device.clone();

    // dp replica 0 draws the weights first (only its tp rank 0 uses the RNG); the others wait,
    // then take replica 0's weights by broadcast.
    if dp_rank != 0 {
        world.barrier()?;
    }
    let model = match &args.resume {
        Some(path) => {
            let solo = LocalGroup::new(1)?.remove(0);
            let full: Gpt = config
                .init(&solo, &device)?
                .try_load_file(path)
                .map_err(|e| format!("loading {}: {e:?}", path.display()))?;
            Gpt::shard_module(&full, &tp_group)?
        }
        None => config.init(&tp_group, &device)?,
    };
    if dp_rank == 0 {
        world.barrier()?;
    }
    let mut model = broadcast_parameters(model, &dp_group)?;
    let mut optim = AdamWConfig::new().init();
    let progress = (rank == 0 && !args.quiet).then(|| {
        let bar = indicatif::ProgressBar::new(args.steps as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                .expect("a valid template"),
        );
        bar
    });
    let start = Instant::now();
    let mut losses = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let (ids, targets) = batch(tokens, args, step);
        let ids = dp_slice(&ids, args, dp_rank, &device);
        let targets = dp_slice(&targets, args, dp_rank, &device);
        let loss = model.try_loss(ids, targets)?;
        let mean = all_reduce(loss.clone().detach(), ReduceOp::Avg, &dp_group)?;
        let value = mean.into_scalar::<f32>() as f64;
        losses.push(value);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        average_gradients(&model, &mut grads, &dp_group)?;
        model = optim.step(args.lr, model, grads);
        if let Some(bar) = &progress {
            let tokens_per_s =
                ((step + 1) * args.batch * args.seq) as f64 / start.elapsed().as_secs_f64();
            bar.set_message(format!("loss {value:.4}  {tokens_per_s:.0} tok/s"));
            bar.inc(1);
        }
    }
    if let Some(bar) = progress {
        bar.finish();
    }
    // The full model on every rank of each tp group; world rank 0 writes it.
    let full = model.to_full_module()?;
    if rank == 0 {
        full.save_file(checkpoint)
            .map_err(|e| format!("saving {}: {e:?}", checkpoint.display()))?;
    }
    world.barrier()?;
    Ok(losses)
}

fn write_csv(path: &Path, losses: &[f64]) -> Result<(), String> {
    let mut csv = String::from("step,loss\n");
    for (i, l) in losses.iter().enumerate() {
        csv.push_str(&format!("{i},{l}\n"));
    }
    std::fs::write(path, csv).map_err(|e| format!("writing {}: {e}", path.display()))
}
