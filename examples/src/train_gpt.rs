//! Trains the tiny GPT of `burn_tp::gpt` (or, with `--arch llama`, the Llama-class model of
//! `burn_tp::llama`) at tp x dp ranks (threads on the CPU), with Burn's AdamW.
//!
//! Every rank runs the same loop on its shard; rank 0 reports. The checkpoint written at the end
//! (and every `--save-every` steps) is sharded (`burn_tp::checkpoint`): each rank writes only its
//! own slices of the model and of the AdamW state into `OUT/checkpoint/`, and a run resumes from
//! it at any tp x dp into the curve it left. `--export-full FILE` also writes the full, unsharded
//! model (a Burn record) with its optimizer state (`FILE.optim.bpk`) and step count
//! (`FILE.steps`), which `--resume FILE` reads too.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, FloatDType};
use burn_tp::checkpoint::{CheckpointInfo, load_sharded, load_sharded_optimizer, save_sharded};
use burn_tp::comm::Profile;
use burn_tp::dp::{DistributedAdamW, GradReducer, average_gradients, broadcast_parameters};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::hf::HfConfig;
use burn_tp::linear::{OverlapSchedule, TpMode, TpSettings};
use burn_tp::llama::{DropoutStep, Llama, LlamaConfig};
use burn_tp::local::run_ranks;
use burn_tp::mesh::DeviceMesh;
use burn_tp::ops::all_reduce;
use burn_tp::precision::{cast_grads, cast_params};
use burn_tp::reshard::FullOptimizerState;
use burn_tp::transformer::ReplicatedGrads;
use burn_tp::{LocalGroup, LocalGroupOptions, ProcessGroup, ReduceOp};
use clap::{Parser, ValueEnum};

use crate::corpus::{self, Codec, TOKENIZER_FILE, Vocab};
use crate::eval::{Data, batch, dp_slice, generate, held_out_loss};
use burn_tp::model::LanguageModel;

/// Activation layout, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Replicated activations; all-reduce after each row-parallel layer.
    AllReduce,
    /// Sequence parallel: activations sharded on the sequence.
    ReduceScatter,
}

/// Overlap schedule of the parallel linears, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Schedule {
    /// Own shard during the communication, the rest after it (nanotron).
    Split,
    /// Each peer's shard consumed as it arrives.
    Ring,
}

/// Model architecture, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Arch {
    /// The tiny GPT: learned positions, layer norms, GELU MLP, multi-head attention.
    Gpt,
    /// Llama-class: grouped-query attention (`--kv-heads`), RoPE, RMSNorm, SwiGLU, dropout, an
    /// untied head, the real (padded) vocabulary.
    Llama,
}

/// Compute dtype, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// f32 throughout.
    F32,
    /// bf16 forward and backward (weights, activations, gradients, collectives) on f32 master
    /// weights: the gradients are cast to f32 for the dp average and the AdamW step (Megatron's
    /// mixed precision). The cross-entropy computes in f32.
    Bf16,
}

impl Precision {
    /// The dtype of the forward and backward.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
        }
    }
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

/// How CPU ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// Ranks are threads of this process (`--tp x --dp` of them).
    Threads,
    /// One rank per process under `mpirun -n (tp x dp)`, over MPI. Needs the `mpi` feature.
    Mpi,
}

/// Command line of `train_gpt`.
#[derive(Parser, Clone, Debug)]
#[command(about = "Train a tiny character-level GPT with tensor parallelism (ranks are threads)")]
pub struct Args {
    /// Model architecture.
    #[arg(long, value_enum, default_value_t = Arch::Gpt)]
    pub arch: Arch,
    /// Tensor-parallel size (with `--device cuda`: the launch's WORLD_SIZE).
    #[arg(long, default_value_t = 2)]
    pub tp: usize,
    /// Where the ranks run.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// How CPU ranks talk (`--device cpu`).
    #[arg(long, value_enum, default_value_t = Transport::Threads)]
    pub transport: Transport,
    /// Data-parallel size (world = tp x dp; gradients averaged over dp).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Activation layout (reduce-scatter: sequence parallel, the overlapped row-linear backward).
    #[arg(long, value_enum, default_value_t = Mode::ReduceScatter)]
    pub mode: Mode,
    /// Overlap schedule of the async parallel linears.
    #[arg(long, value_enum, default_value_t = Schedule::Ring)]
    pub schedule: Schedule,
    /// Compute dtype (the master weights and the optimizer stay f32).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Use the plain composed collectives instead of the overlapped ops.
    #[arg(long)]
    pub no_async: bool,
    /// Average the gradients over dp while the backward runs, in buckets started as soon as
    /// their last gradient is ready (`burn_tp::dp::GradReducer`), instead of after it.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Shard AdamW's moments over dp (ZeRO stage 1, Megatron's distributed optimizer,
    /// `burn_tp::dp::DistributedAdamW`): each bucket of gradients is reduce-scattered during the
    /// backward, each dp rank updates its 1/dp chunk, the chunks are all-gathered.
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// Bucket size of `--overlap-grad-reduce` and `--distributed-optimizer`, in MiB.
    #[arg(long, default_value_t = 4.0, value_name = "MIB")]
    pub bucket_mb: f64,
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
    /// Llama: key / value heads (default: half the heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Llama: SwiGLU hidden width (default: 8/3 d_model rounded up to a multiple of 32).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// Llama: dropout of the attention probabilities and residual branches (default 0.1); the
    /// masks are the same at every tp.
    #[arg(long)]
    pub dropout: Option<f64>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Seed of the weights and of the batches.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// UTF-8 text to train on (character level); the built-in corpus if absent.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Output folder: loss.csv, loss.png, sample.txt, the sharded checkpoint `checkpoint/`.
    #[arg(long, default_value = "out")]
    pub out: PathBuf,
    /// Checkpoint to continue from, written at any tp x dp: a sharded checkpoint folder
    /// (`OUT/checkpoint`), or a full export (`--export-full FILE`, with `FILE.optim.bpk` and
    /// `FILE.steps` beside it). The run continues its curve.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Also save the sharded checkpoint every this many steps (the last save is kept; one is
    /// always written at the end).
    #[arg(long, value_name = "N")]
    pub save_every: Option<usize>,
    /// At the end, also write the full, unsharded model to FILE (a Burn record) with its
    /// optimizer state (`FILE.optim.bpk`) and step count (`FILE.steps`): for small models and
    /// inspection; every rank then holds the whole model for a moment.
    #[arg(long, value_name = "FILE")]
    pub export_full: Option<PathBuf>,
    /// Start the Llama from a Hugging Face model folder (LlamaForCausalLM, MistralForCausalLM,
    /// Qwen2ForCausalLM): its sizes come from DIR's config.json (the size flags are not used),
    /// its weights from DIR's safetensors. The text is tokenized by DIR's `tokenizer.json` when it
    /// has one (which must fit in the model's vocabulary; `--export-hf` copies it); otherwise its
    /// characters are token ids 0..n (in sorted order), which must fit. Needs `--arch llama`.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// At the end, also write the Llama in Hugging Face's format into DIR (config.json and
    /// model.safetensors). Needs `--arch llama`.
    #[arg(long, value_name = "DIR")]
    pub export_hf: Option<PathBuf>,
    /// Held-out loss every this many steps (and before the first, and after the last), on the
    /// last tenth of the text, which is never trained on.
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    /// Tokens (characters, without a tokenizer) the trained model writes at the end (printed, and
    /// out/sample.txt); 0: none.
    #[arg(long, default_value_t = 300)]
    pub sample_len: usize,
    /// Sampling temperature of that text (0: greedy); the draws are seeded by `--seed`.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Profile the communication: a table per layer and op at the end (bytes, time in flight,
    /// time waited, fraction hidden), and out/comm.csv.
    #[arg(long)]
    pub profile: bool,
    /// Go on when the loss is not finite (by default the run stops with an error naming the step).
    #[arg(long)]
    pub keep_going: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Seconds a collective (or, with `--device cuda`, NCCL's start-up) may wait for the other
    /// ranks before every rank fails with an error; default `BURN_TP_TIMEOUT_S`, else 300.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<f64>,
    /// CPU ranks talk over a simulated link of this latency (and `--link-gb-s`): collectives
    /// then progress in the background and the async layers run their overlap schedule block
    /// by block, as over NCCL. Without it, ranks as threads move the data on the waiting thread
    /// and the schedules take one block (nothing to hide).
    #[arg(long, value_name = "US")]
    pub link_latency_us: Option<f64>,
    /// Bandwidth of the simulated link (`--link-latency-us`), in GB/s.
    #[arg(long, default_value_t = 100.0, value_name = "GBPS")]
    pub link_gb_s: f64,
}

/// Seconds this rank spent on checkpoints (rank 0's are reported).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CheckpointTimes {
    /// Reading the checkpoint of `--resume` (model and optimizer state).
    pub load_s: f64,
    /// The last sharded save.
    pub save_s: f64,
    /// The full export (`--export-full`), if any.
    pub export_s: f64,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct Report {
    /// Steps done before this run (from `--resume`); step `first_step + i` gave `losses[i]`.
    pub first_step: usize,
    /// Loss of every step (mean over the dp ranks).
    pub losses: Vec<f64>,
    /// `(steps done, loss)` on the held-out text.
    pub held_out: Vec<(usize, f64)>,
    /// Text the trained model wrote (`--sample-len` tokens).
    pub sample: String,
    /// Unigram entropy of the training text, in nats.
    pub unigram_entropy: f64,
    /// Tokens in the whole text (training and held out): its characters, or the tokenizer's ids
    /// with `--init-from` a folder that has one.
    pub text_tokens: usize,
    /// Tokens processed per second.
    pub tokens_per_s: f64,
    /// The sharded checkpoint folder written (`OUT/checkpoint`).
    pub checkpoint: PathBuf,
    /// Rank 0's communication profile (`--profile`).
    pub profile: Option<Profile>,
    /// Which path the async layers took ([`overlap_path`]).
    pub overlap: String,
    /// Time spent on checkpoints.
    pub checkpoint_times: CheckpointTimes,
    /// This process's rank (0 when the ranks are threads): only rank 0 writes the files.
    pub rank: usize,
}

/// The model configuration the arguments describe.
pub fn model_config(args: &Args, n_vocab: usize) -> GptConfig {
    GptConfig::new(n_vocab, args.seq, args.d_model, args.heads, args.layers)
        .with_settings(settings(args))
}

/// The tensor-parallel settings the arguments describe (both architectures).
pub fn settings(args: &Args) -> TpSettings {
    TpSettings::new()
        .with_mode(tp_mode(args))
        .with_async_communication(!args.no_async)
        .with_schedule(schedule(args))
}

fn tp_mode(args: &Args) -> TpMode {
    match args.mode {
        Mode::AllReduce => TpMode::AllReduce,
        Mode::ReduceScatter => TpMode::ReduceScatter,
    }
}

fn schedule(args: &Args) -> OverlapSchedule {
    match args.schedule {
        Schedule::Split => OverlapSchedule::Split,
        Schedule::Ring => OverlapSchedule::Ring,
    }
}

/// The Llama configuration the arguments describe, for the real vocabulary `n_vocab` (the model
/// pads it itself).
pub fn llama_config(args: &Args, n_vocab: usize) -> LlamaConfig {
    let d_ff = args
        .d_ff
        .unwrap_or_else(|| (8 * args.d_model / 3).next_multiple_of(32));
    LlamaConfig::new(
        n_vocab,
        args.seq,
        args.d_model,
        args.heads,
        args.kv_heads.unwrap_or((args.heads / 2).max(1)),
        args.layers,
        d_ff,
    )
    .with_dropout(args.dropout.unwrap_or(0.1))
    .with_dropout_seed(args.seed)
    .with_settings(settings(args))
}

/// A one-line description of the run, for the plot's title.
pub fn describe(args: &Args) -> String {
    let arch = match args.arch {
        Arch::Gpt => "tiny GPT".to_string(),
        Arch::Llama => format!(
            "Llama (kv heads {}, dropout {})",
            args.kv_heads.unwrap_or((args.heads / 2).max(1)),
            args.dropout.unwrap_or(0.1)
        ),
    };
    format!(
        "{arch}: tp={} dp={} {:?} {}schedule {:?}, {:?}, {} steps",
        args.tp,
        args.dp,
        args.mode,
        if args.no_async { "sync, " } else { "async, " },
        args.schedule,
        args.dtype.dtype(),
        args.steps
    )
}

/// Which path the parallel layers take in this run: whether their overlap schedules run block
/// by block (NCCL, or a simulated link) or take one block (ranks as threads without a link).
pub fn overlap_path(args: &Args) -> String {
    let schedule = format!("{:?}", args.schedule).to_lowercase();
    if args.no_async {
        "sync layers (--no-async): each collective completes before the compute that uses it".into()
    } else if args.tp == 1 {
        "tp 1: the layers communicate nothing".into()
    } else if args.device == DeviceKind::Cuda {
        format!("NCCL: the {schedule} schedule overlaps communication with compute on the GPU")
    } else if args.transport == Transport::Mpi {
        format!(
            "MPI: the {schedule} schedule overlaps communication with compute where each rank \
             has a spare core (else the async layers take one block; BURN_TP_MPI_OVERLAP=1|0 \
             decides)"
        )
    } else if let Some(us) = args.link_latency_us {
        format!(
            "simulated link ({us} us, {} GB/s): the {schedule} schedule overlaps communication \
             with compute, block by block",
            args.link_gb_s
        )
    } else {
        "ranks as threads without a link: the async layers take one block (the data moves on \
         the waiting thread, nothing to hide; --link-latency-us runs the schedules)"
            .into()
    }
}

fn check(args: &Args) -> Result<(), String> {
    if let Some(us) = args.link_latency_us {
        if !(us.is_finite() && us >= 0.0 && args.link_gb_s.is_finite() && args.link_gb_s > 0.0) {
            return Err(format!(
                "--link-latency-us must be >= 0 and --link-gb-s > 0 (got {us}, {})",
                args.link_gb_s
            ));
        }
        if args.device == DeviceKind::Cuda {
            return Err(
                "--link-latency-us simulates a link between CPU ranks; with --device \
                        cuda the ranks talk over NCCL"
                    .into(),
            );
        }
    }
    if args.transport == Transport::Mpi && args.device == DeviceKind::Cuda {
        return Err("--transport mpi runs CPU ranks; --device cuda ranks talk over NCCL".into());
    }
    if args.transport == Transport::Mpi && args.link_latency_us.is_some() {
        return Err(
            "--link-latency-us simulates a link between ranks as threads; with --transport mpi \
             the ranks talk over MPI"
                .into(),
        );
    }
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
    if !(args.bucket_mb.is_finite() && args.bucket_mb > 0.0) {
        return Err(format!(
            "--bucket-mb must be a positive number (got {})",
            args.bucket_mb
        ));
    }
    if args.save_every == Some(0) {
        return Err("--save-every must be at least 1".into());
    }
    if args.arch != Arch::Llama && (args.init_from.is_some() || args.export_hf.is_some()) {
        return Err(
            "--init-from and --export-hf read and write Hugging Face Llama-family \
                    models: use --arch llama"
                .into(),
        );
    }
    if args.seq == 0 || args.batch == 0 || args.eval_every == 0 {
        return Err(format!(
            "--seq, --batch and --eval-every must be at least 1 (got {}, {}, {})",
            args.seq, args.batch, args.eval_every
        ));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr must be a positive number (got {})", args.lr));
    }
    if let Some(p) = args.dropout {
        if args.arch == Arch::Gpt && p != 0.0 {
            return Err(format!(
                "--dropout {p}: the GPT has no dropout (use --arch llama)"
            ));
        }
        if !(0.0..1.0).contains(&p) {
            return Err(format!("--dropout must be in [0, 1) (got {p})"));
        }
    }
    if args.arch == Arch::Gpt && (args.kv_heads.is_some() || args.d_ff.is_some()) {
        return Err("--kv-heads and --d-ff are Llama options (use --arch llama)".into());
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(format!(
            "--temperature must be a number >= 0 (got {})",
            args.temperature
        ));
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
    // The imported model's own tokenizer when its folder has one; characters otherwise.
    let hf_codec = match &args.init_from {
        Some(dir) => Codec::from_model_dir(dir)?,
        None => None,
    };
    let codec = hf_codec.unwrap_or_else(|| Codec::Chars(Vocab::new(&text)));
    let tokens = codec.encode(&text, false)?;
    let unit = match &codec {
        Codec::Chars(_) => "characters",
        Codec::Hf(_) => "tokens",
    };
    // The last tenth is held out: never trained on, only evaluated.
    let split = tokens.len() * 9 / 10;
    if tokens.len() - split < args.seq + 2 {
        return Err(format!(
            "the data has {} {unit}; --seq {} needs at least {} (a tenth is held out)",
            tokens.len(),
            args.seq,
            10 * (args.seq + 2)
        ));
    }
    let data = Data {
        train: tokens[..split].to_vec(),
        held_out: tokens[split..].to_vec(),
        vocab: codec.len(),
    };
    let unigram_entropy = corpus::unigram_entropy(&tokens, codec.len());
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
    let checkpoint = args.out.join("checkpoint");
    let start = Instant::now();
    let (rank, out) = match args.arch {
        Arch::Gpt => launch::<Gpt>(
            args,
            model_config(args, codec.padded_len()),
            &data,
            &checkpoint,
        )?,
        Arch::Llama => {
            let config = match &args.init_from {
                Some(dir) => {
                    let hf = HfConfig::from_dir(dir).map_err(|e| e.to_string())?;
                    if codec.len() > hf.vocab_size {
                        let what = match &codec {
                            Codec::Chars(_) => {
                                format!("the text has {} distinct characters", codec.len())
                            }
                            Codec::Hf(_) => format!(
                                "{} has {} tokens",
                                dir.join(TOKENIZER_FILE).display(),
                                codec.len()
                            ),
                        };
                        return Err(format!(
                            "--init-from {}: {what}, more than the model's vocabulary of {}",
                            dir.display(),
                            hf.vocab_size
                        ));
                    }
                    hf.llama_config(settings(args))
                        .with_dropout(args.dropout.unwrap_or(0.1))
                        .with_dropout_seed(args.seed)
                }
                None => llama_config(args, codec.len()),
            };
            launch::<Llama>(args, config, &data, &checkpoint)?
        }
    };
    let RankOut {
        stopped,
        timings,
        first_step,
        losses,
        held_out,
        sample,
        profile,
    } = out;
    let sample = codec.decode(&sample)?;
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(why) = stopped {
        if rank == 0 {
            write_csv(&args.out.join("loss.csv"), first_step, &losses, &held_out)?;
        }
        return Err(why);
    }
    // Rank 0 (of the threads, or of a multi-process launch) writes the files.
    if rank == 0 {
        write_csv(&args.out.join("loss.csv"), first_step, &losses, &held_out)?;
        let curves = crate::plot::LossCurves {
            title: &describe(args),
            first_step,
            train: &losses,
            held_out: &held_out,
            reference: unigram_entropy,
        };
        crate::plot::loss_png(&args.out.join("loss.png"), &curves)?;
        if let Some(profile) = &profile {
            let path = args.out.join("comm.csv");
            std::fs::write(&path, profile.to_csv())
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        let path = args.out.join("sample.txt");
        std::fs::write(&path, &sample).map_err(|e| format!("writing {}: {e}", path.display()))?;
        if let (Some(from), Some(to)) = (&args.init_from, &args.export_hf) {
            corpus::copy_tokenizer_files(from, to)?;
        }
    }
    let tokens_per_s = (args.steps * args.batch * args.seq) as f64 / elapsed;
    Ok(Report {
        first_step,
        losses,
        held_out,
        sample,
        unigram_entropy,
        text_tokens: tokens.len(),
        tokens_per_s,
        checkpoint,
        profile,
        overlap: overlap_path(args),
        checkpoint_times: timings,
        rank,
    })
}

/// Runs every rank of the run (threads on the CPU, or this process's GPU) with model `M`;
/// returns (this process's rank, what it brought back).
fn launch<M: LanguageModel>(
    args: &Args,
    config: M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    match args.device {
        DeviceKind::Cpu if args.transport == Transport::Mpi => {
            mpi_rank::<M>(args, &config, data, checkpoint)
        }
        DeviceKind::Cpu => {
            let device = Device::flex().autodiff();
            // One device RNG for every rank thread: seed it once, before they start.
            device.seed(args.seed);
            let world = args.tp * args.dp;
            let options = LocalGroupOptions {
                profile: args.profile,
                timeout: group_timeout(args),
                link: args
                    .link_latency_us
                    .map(|us| burn_tp::LinkModel::new(args.link_gb_s, us)),
                ..Default::default()
            };
            let groups = LocalGroup::with_options(world, options).map_err(|e| e.to_string())?;
            let (args2, data2, ckpt) = (args.clone(), data.clone(), checkpoint.to_path_buf());
            // A training program: keep the step's freed buffers mapped (README; off with
            // BURN_TP_KEEP_FREED_MEMORY=0).
            burn_tp::local::keep_freed_memory_unless_disabled();
            let results = run_ranks(groups, move |world_group| {
                train_rank::<M>(&args2, &config, &data2, world_group, &device, &ckpt)
                    .map_err(|e| e.to_string())
            })?;
            let out = results.into_iter().next().expect("rank 0");
            Ok((0, out.map_err(|e| format!("rank 0: {e}"))?))
        }
        DeviceKind::Cuda => cuda_rank::<M>(args, &config, data, checkpoint),
    }
}

/// `--timeout`, else the default of every group (`BURN_TP_TIMEOUT_S`, else 300 s).
fn group_timeout(args: &Args) -> std::time::Duration {
    args.timeout
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(std::time::Duration::from_secs_f64)
        .unwrap_or_else(|| LocalGroupOptions::default().timeout)
}

/// This process's rank of a `--device cuda` launch: one GPU (`LOCAL_RANK`), NCCL over the
/// launch's store. Returns (rank, losses).
#[cfg(feature = "cuda")]
fn cuda_rank<M: LanguageModel>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    use burn_tp::comm::nccl::NcclGroup;
    use burn_tp::comm::store::LaunchEnv;
    let env = LaunchEnv::from_env().map_err(|e| {
        format!("--device cuda runs one process per GPU: start it with burn-tp-launch ({e})")
    })?;
    if env.world_size != args.tp * args.dp {
        return Err(format!(
            "--device cuda: the launch has WORLD_SIZE {} but --tp {} x --dp {} = {}",
            env.world_size,
            args.tp,
            args.dp,
            args.tp * args.dp
        ));
    }
    // burn's kernels need NVRTC, no newer than the driver: say so now, not from deep in cubecl.
    let probe = burn_tp::comm::nccl::probe().map_err(|e| e.to_string())?;
    if let Some(problem) = probe.kernel_problem() {
        return Err(format!("--device cuda: {problem}"));
    }
    let timeout = group_timeout(args);
    let (_server, store) = env.rendezvous(timeout).map_err(|e| e.to_string())?;
    let nccl = NcclGroup::new(&env, &store, timeout).map_err(|e| e.to_string())?;
    let world = ProcessGroup::from_nccl(nccl);
    let device = Device::cuda(env.local_rank).autodiff();
    device.seed(args.seed);
    let out = train_rank::<M>(args, config, data, world, &device, checkpoint)
        .map_err(|e| format!("rank {}: {e}", env.rank))?;
    Ok((env.rank, out))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rank<M: LanguageModel>(
    _: &Args,
    _: &M::Config,
    _: &Data,
    _: &Path,
) -> Result<(usize, RankOut), String> {
    Err(
        "--device cuda needs the `cuda` feature: cargo run --release --example train_gpt \
         --features cuda (see README: burn's CUDA backend cannot be linked on machines without \
         network access)"
            .into(),
    )
}

/// This process's rank of a `--transport mpi` run under `mpirun` (one rank per process, the
/// world from MPI). Returns (rank, what it brought back). A rank that fails ends the job
/// (`MPI_Abort`): its peers may be waiting for it in a collective.
#[cfg(feature = "mpi")]
fn mpi_rank<M: LanguageModel>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    use burn_tp::comm::mpi::MpiRuntime;
    let runtime = MpiRuntime::init().map_err(|e| e.to_string())?;
    let rank = runtime.rank();
    if runtime.world_size() != args.tp * args.dp {
        eprintln!(
            "train_gpt: --transport mpi: mpirun started {} processes but --tp {} x --dp {} = {}",
            runtime.world_size(),
            args.tp,
            args.dp,
            args.tp * args.dp
        );
        runtime.abort(1);
    }
    let world = ProcessGroup::from_mpi(&runtime);
    world.set_timeout(group_timeout(args));
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    match train_rank::<M>(args, config, data, world, &device, checkpoint) {
        Ok(out) => Ok((rank, out)),
        Err(e) => {
            eprintln!("train_gpt: rank {rank}: {e}");
            runtime.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_rank<M: LanguageModel>(
    _: &Args,
    _: &M::Config,
    _: &Data,
    _: &Path,
) -> Result<(usize, RankOut), String> {
    Err(
        "--transport mpi needs the `mpi` feature and a system MPI: cargo build --release \
         --example train_gpt --features mpi, then mpirun -n TPxDP (see README)"
            .into(),
    )
}

/// What a rank brings back.
struct RankOut {
    /// Why training stopped early (a non-finite loss).
    stopped: Option<String>,
    profile: Option<Profile>,
    timings: CheckpointTimes,
    first_step: usize,
    losses: Vec<f64>,
    held_out: Vec<(usize, f64)>,
    sample: Vec<i64>,
}

fn train_rank<M: LanguageModel>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    world: ProcessGroup,
    device: &Device,
    checkpoint: &Path,
) -> Result<RankOut, Box<dyn std::error::Error>> {
    let rank = world.rank();
    // The tp x dp grid, its groups made once (tp ranks adjacent).
    let mesh = DeviceMesh::new(world.clone(), args.tp)?;
    let dp_rank = mesh.dp_rank();
    let (tp_group, dp_group) = (mesh.tp_group().clone(), mesh.dp_group().clone());
    let device = device.clone();

    // dp replica 0 draws the weights first (only its tp rank 0 uses the RNG); the others wait,
    // then take replica 0's weights by broadcast.
    if dp_rank != 0 {
        world.barrier()?;
    }
    // A sharded checkpoint is read slice by slice into this rank's shards; a full export is
    // loaded whole and sharded.
    let mut timings = CheckpointTimes::default();
    let load_start = Instant::now();
    let sharded = args.resume.as_deref().filter(|p| p.is_dir());
    let (model, resumed, sharded_step) = match (&args.resume, sharded) {
        (Some(_), Some(dir)) => {
            let fresh = M::init(config, &tp_group, &device)?;
            let (model, info) = load_sharded(fresh, dir, Some(config), &tp_group)?;
            (model, None, Some(info.step as usize))
        }
        (Some(path), None) => {
            let solo = LocalGroup::new(1)?.remove(0);
            let full: M = M::init(config, &solo, &device)?
                .try_load_file(path)
                .map_err(|e| format!("loading {}: {e:?}", path.display()))?;
            let model = M::shard_module(&full, &tp_group)?;
            (model, Some(full), None)
        }
        (None, _) => {
            let model = M::init(config, &tp_group, &device)?;
            // A Hugging Face model's weights in place of the drawn ones (each rank its slices).
            let model = match &args.init_from {
                Some(dir) => model.load_hf(dir, &tp_group)?,
                None => model,
            };
            (model, None, None)
        }
    };
    if dp_rank == 0 {
        world.barrier()?;
    }
    let mut model = broadcast_parameters(model, &dp_group)?;
    let mut optim = AdamWConfig::new().init();
    // A resumed run continues where the checkpoint left off: the optimizer state (resharded to
    // this tp) and the step count, so the batches and the AdamW bias correction go on.
    let first_step = match (&args.resume, resumed, sharded_step) {
        (Some(dir), _, Some(step)) => {
            optim = load_sharded_optimizer(optim, &model, dir, &tp_group)?;
            step
        }
        (Some(path), Some(full), None) => {
            let state = FullOptimizerState::load(&optimizer_path(path))?;
            optim = optim.load_record(state.shard(&full, &model, &tp_group)?);
            read_steps(path)?
        }
        _ => 0,
    };
    if args.resume.is_some() {
        timings.load_s = load_start.elapsed().as_secs_f64();
    }
    // This rank's slices of the model and the AdamW state after `steps` steps, into the sharded
    // checkpoint (data-parallel replica 0 writes; every rank waits for it).
    let save =
        |model: &M, optim: &burn::optim::ModuleOptimizer, steps: usize| -> burn_tp::Result<()> {
            let info = CheckpointInfo::new(steps as u64, args.tp, args.dp, config);
            save_sharded(model, Some(optim), checkpoint, &info, &tp_group, dp_rank)?;
            world.barrier()?;
            Ok(())
        };
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
    // The model the forward and backward run: the master weights, or a bf16 copy of them.
    let dtype = args.dtype.dtype();
    let compute = |model: &M| cast_params(model.clone(), dtype);
    let mut held_out = vec![(
        first_step,
        held_out_loss(&compute(&model), args, data, dp_rank, &dp_group, &device)?,
    )];
    let mut stopped = None;
    let bucket_bytes = (args.bucket_mb * (1 << 20) as f64) as usize;
    let mut zero = match args.distributed_optimizer {
        true => {
            let mut zero =
                DistributedAdamW::new(&AdamWConfig::new(), &model, &dp_group, bucket_bytes);
            // This rank's chunks of a resumed state (saved at any dp).
            zero.load_module_optimizer(&optim, &model)?;
            Some(zero)
        }
        false => None,
    };
    // One coalesced tp all-reduce per step for the replicated parameters (sequence parallel);
    // the distributed optimizer reduces its gradients inside the backward, so it keeps the
    // per-use all-reduces.
    let replicated = zero.is_none().then(|| ReplicatedGrads::new(&tp_group));
    let reducer = (args.overlap_grad_reduce && zero.is_none())
        .then(|| GradReducer::new(&model, &dp_group, bucket_bytes));
    // The state the checkpoints write: the distributed optimizer's chunks gathered over dp.
    let synced = |zero: &Option<DistributedAdamW>,
                  model: &M,
                  optim: burn::optim::ModuleOptimizer|
     -> burn_tp::Result<burn::optim::ModuleOptimizer> {
        match zero {
            Some(z) => z.to_module_optimizer(&AdamWConfig::new(), model),
            None => Ok(optim),
        }
    };
    for step in first_step..first_step + args.steps {
        let (ids, targets) = batch(&data.train, args, step);
        let ids = dp_slice(&ids, args, dp_rank, &device);
        let targets = dp_slice(&targets, args, dp_rank, &device);
        let working = compute(&model);
        let per = args.batch / args.dp;
        let dropout = DropoutStep::new(step as u64).with_batch(dp_rank * per, args.batch);
        let forward = || match (&zero, &reducer) {
            // The tapped view: each bucket's reduction starts during the backward.
            (Some(z), _) => z
                .attach(working.clone(), true)
                .loss(ids, targets, Some(dropout)),
            (None, Some(r)) => r
                .attach(working.clone(), true)
                .loss(ids, targets, Some(dropout)),
            (None, None) => working.loss(ids, targets, Some(dropout)),
        };
        let loss = match &replicated {
            // The replicated parameters' tp sums deferred to one coalesced all-reduce.
            Some(r) => r.scope(forward)?,
            None => forward()?,
        };
        let mean = all_reduce(loss.clone().detach(), ReduceOp::Avg, &dp_group)?;
        let value = mean.into_scalar::<f32>() as f64;
        losses.push(value);
        // Every rank sees the same (dp-averaged) value, so all stop at the same step.
        if !value.is_finite() && !args.keep_going {
            stopped = Some(format!(
                "the loss is {value} at step {step}: training stopped (--keep-going to go on); \
                 loss.csv has the steps up to there"
            ));
            break;
        }
        // The copy's parameters have the master's ids: its gradients, in f32, step the master.
        let mut grads = GradientsParams::from_grads(loss.backward(), &working);
        if let Some(z) = &mut zero {
            // This rank's chunks of the f32 average, stepped, gathered.
            cast_grads(&working, &mut grads, FloatDType::F32);
            model = z.step(args.lr, model, grads)?;
        } else {
            // Averaged in f32 (half-precision gradients accumulate in f32 in the reducer); the
            // tp sum of the replicated parameters' gradients and the dp average commute.
            if let Some(r) = &reducer {
                r.finish(&working, &mut grads)?;
            }
            cast_grads(&working, &mut grads, FloatDType::F32);
            if let Some(r) = &replicated {
                r.finish(&working, &mut grads)?;
            }
            if reducer.is_none() {
                average_gradients(&model, &mut grads, &dp_group)?;
            }
            model = optim.step(args.lr, model, grads);
        }
        if (step + 1) % args.eval_every == 0 || step + 1 == first_step + args.steps {
            let loss = held_out_loss(&compute(&model), args, data, dp_rank, &dp_group, &device)?;
            held_out.push((step + 1, loss));
        }
        let last = step + 1 == first_step + args.steps;
        if !last
            && args
                .save_every
                .is_some_and(|n| (step + 1 - first_step) % n == 0)
        {
            optim = synced(&zero, &model, optim)?;
            save(&model, &optim, step + 1)?;
        }
        if let Some(bar) = &progress {
            let tokens_per_s = ((step + 1 - first_step) * args.batch * args.seq) as f64
                / start.elapsed().as_secs_f64();
            bar.set_message(format!("loss {value:.4}  {tokens_per_s:.0} tok/s"));
            bar.inc(1);
        }
    }
    if let Some(bar) = progress {
        bar.finish();
    }
    if stopped.is_some() {
        // No checkpoint or sample of a diverged model: only the curve up to there.
        return Ok(RankOut {
            timings,
            profile: world.profile(),
            first_step,
            losses,
            held_out,
            sample: Vec::new(),
            stopped,
        });
    }
    if let Some(dir) = &args.export_hf {
        if dp_rank == 0 {
            model.save_hf(config, dir, &tp_group)?;
        }
        world.barrier()?;
    }
    let save_start = Instant::now();
    optim = synced(&zero, &model, optim)?;
    save(&model, &optim, first_step + args.steps)?;
    timings.save_s = save_start.elapsed().as_secs_f64();
    if let Some(file) = &args.export_full {
        let export_start = Instant::now();
        // The full model and optimizer state on every rank of each tp group; world rank 0
        // writes them, with the number of steps done.
        let full = model.to_full_module()?;
        let optim_state = FullOptimizerState::gather(&optim, &model)?;
        if rank == 0 {
            full.save_file(file)
                .map_err(|e| format!("saving {}: {e:?}", file.display()))?;
            optim_state.save(&optimizer_path(file))?;
            let steps = steps_path(file);
            std::fs::write(&steps, (first_step + args.steps).to_string())
                .map_err(|e| format!("writing {}: {e}", steps.display()))?;
        }
        world.barrier()?;
        timings.export_s = export_start.elapsed().as_secs_f64();
    }
    // The profile covers training only (not the sample below).
    let profile = world.profile();
    let sample = generate(&compute(&model), args, data, &tp_group, &device)?;
    Ok(RankOut {
        stopped: None,
        timings,
        profile,
        first_step,
        losses,
        held_out,
        sample,
    })
}

/// The optimizer state beside a checkpoint: `checkpoint.optim.bpk`.
pub fn optimizer_path(checkpoint: &Path) -> PathBuf {
    checkpoint.with_extension("optim.bpk")
}

/// The number of steps a checkpoint has done, beside it: `checkpoint.steps`.
pub fn steps_path(checkpoint: &Path) -> PathBuf {
    checkpoint.with_extension("steps")
}

fn read_steps(checkpoint: &Path) -> Result<usize, String> {
    let path = steps_path(checkpoint);
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.trim()
        .parse()
        .map_err(|e| format!("{}: not a step count ({e})", path.display()))
}

/// `step,loss,held_out_loss`: the loss of step `i` (0-based) is the one before its update; the
/// held-out loss on row `i` is after `i` updates (empty between evaluations).
fn write_csv(
    path: &Path,
    first_step: usize,
    losses: &[f64],
    held_out: &[(usize, f64)],
) -> Result<(), String> {
    let mut csv = String::from("step,loss,held_out_loss\n");
    for i in first_step..=first_step + losses.len() {
        let train = losses
            .get(i - first_step)
            .map_or(String::new(), |l| l.to_string());
        let held = held_out
            .iter()
            .find(|(s, _)| *s == i)
            .map_or(String::new(), |(_, l)| l.to_string());
        csv.push_str(&format!("{i},{train},{held}\n"));
    }
    std::fs::write(path, csv).map_err(|e| format!("writing {}: {e}", path.display()))
}
