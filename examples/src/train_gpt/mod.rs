//! Trains the tiny GPT of `burn_tp::gpt` (or, with `--arch llama`, the Llama-class model of
//! `burn_tp::llama`) at tp x dp ranks (threads on the CPU), with Burn's AdamW.
//!
//! Every rank runs the same loop on its shard; rank 0 reports. The checkpoint written at the end
//! (and every `--save-every` steps) is sharded (`burn_tp::checkpoint`): each rank writes only its
//! own slices of the model and of the AdamW state into `OUT/checkpoint/`, and a run resumes from
//! it at any tp x dp into the curve it left. `--export-hf DIR` also writes the Llama in Hugging
//! Face's format.
//!
//! | file        | what                                                                   |
//! |-------------|------------------------------------------------------------------------|
//! | `mod.rs`    | [`run`]: the data, the model's configuration, the files rank 0 writes  |
//! | `args.rs`   | [`Args`]: the command line, its checks, the configurations it describes |
//! | `banner.rs` | [`describe`], [`overlap_path`]: what the run says of itself              |
//! | `launch.rs` | the ranks as threads, MPI processes or CUDA processes                   |
//! | `train.rs`  | one rank's training: start or resume, the steps, the checkpoint         |
//! | `optimizer.rs` | its optimizer: AdamW after the dp average, buckets, ZeRO, the experts' groups |
//! | `pipelined.rs` | its pipeline pieces: micro-batches, the held-out loss through the stages |
//! | `trainable.rs` | [`Trainable`]: a model's Hugging Face form, its LoRA adapters       |

mod args;
mod banner;
pub(crate) mod check;
mod launch;
mod optimizer;
mod pipelined;
mod train;
mod trainable;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn_tp::comm::profile::Profile;
use burn_tp::gemma::Gemma;
use burn_tp::gpt::Gpt;
use burn_tp::hf::HfConfig;
use burn_tp::llama::Llama;

pub use crate::eval::batch;
pub use args::*;
pub use banner::{describe, overlap_path};
use check::check;
pub use trainable::Trainable;

use crate::corpus::{self, Codec};
use crate::eval::Data;
use launch::launch;
#[cfg(all(feature = "cuda", feature = "train"))]
pub(crate) use launch::nccl_world;
use train::RankOut;

/// Seconds this rank spent on checkpoints (rank 0's are reported).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CheckpointTimes {
    /// Reading the checkpoint of `--resume` (model and optimizer state).
    pub load_s: f64,
    /// The last sharded save.
    pub save_s: f64,
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
    /// Tokens processed per second, over the whole run (building, evaluation and checkpoints
    /// included).
    pub tokens_per_s: f64,
    /// Tokens per second of the optimizer steps alone, after the first (a warm-up), as a
    /// benchmark peer measures them; the first step's when there is only one.
    pub step_tokens_per_s: f64,
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
    /// A MoE model's tokens routed to each expert over the run (all MoE layers and dp ranks;
    /// also `OUT/experts.csv`); empty for a dense model.
    pub expert_tokens: Vec<u64>,
    /// The assignments the experts' capacity dropped over the run (`--capacity-factor`; 0
    /// dropless), all MoE layers and dp ranks, as `expert_tokens` counts them.
    pub expert_dropped: u64,
    /// With `--pp`: per stage, the seconds it waited for an activation or a gradient and the
    /// seconds of its pipelined steps (rank 0's pipeline; also in `OUT/pipeline.csv`).
    pub stage_idle: Vec<(f64, f64)>,
}

/// Runs the training; the same arguments give the same losses at every tp.
///
/// # Errors
/// Bad arguments, unreadable data, or a failure on any rank, as text.
pub fn run(args: &Args) -> Result<Report, String> {
    check(args)?;
    // The imported model's own tokenizer when its folder has one; characters otherwise.
    let (codec, tokens) = corpus::load_tokens(args.data.as_deref(), args.init_from.as_deref())?;
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
        Arch::Llama | Arch::Moe => match &args.init_from {
            Some(dir) => {
                let hf = HfConfig::from_dir(dir).map_err(|e| e.to_string())?;
                corpus::check_fits(&codec, dir, hf.vocab_size)?;
                if hf.architecture.is_gemma() {
                    let config = imported_gemma_config(args, &hf)?;
                    launch::<Gemma>(args, config, &data, &checkpoint)?
                } else {
                    launch::<Llama>(args, imported_llama_config(args, &hf), &data, &checkpoint)?
                }
            }
            None => launch::<Llama>(args, llama_config(args, codec.len()), &data, &checkpoint)?,
        },
    };
    let RankOut {
        stopped,
        timings,
        first_step,
        losses,
        held_out,
        sample,
        profile,
        step_s,
        stage_idle,
        expert_tokens,
        expert_dropped,
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
        if !stage_idle.is_empty() {
            let path = args.out.join("pipeline.csv");
            let mut csv = String::from("stage,idle_s,step_s,idle_fraction\n");
            for (s, (idle, step)) in stage_idle.iter().enumerate() {
                csv += &format!("{s},{idle:.6},{step:.6},{:.4}\n", idle / step.max(1e-12));
            }
            std::fs::write(&path, csv).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        if !expert_tokens.is_empty() {
            // The load balance: each expert's share of the routed tokens (1 / experts each when
            // even), summed over the MoE layers.
            let path = args.out.join("experts.csv");
            let total = expert_tokens.iter().sum::<u64>().max(1) as f64;
            let mut csv = String::from("expert,tokens,share\n");
            for (e, t) in expert_tokens.iter().enumerate() {
                csv += &format!("{e},{t},{:.4}\n", *t as f64 / total);
            }
            std::fs::write(&path, csv).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
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
    let warm = if step_s.len() > 1 {
        &step_s[1..]
    } else {
        &step_s[..]
    };
    let step_tokens_per_s =
        (warm.len() * args.batch * args.seq) as f64 / warm.iter().sum::<f64>().max(1e-9);
    Ok(Report {
        first_step,
        losses,
        held_out,
        sample,
        unigram_entropy,
        text_tokens: tokens.len(),
        tokens_per_s,
        step_tokens_per_s,
        checkpoint,
        profile,
        overlap: overlap_path(args),
        checkpoint_times: timings,
        rank,
        stage_idle,
        expert_tokens,
        expert_dropped,
    })
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
