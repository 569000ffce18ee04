//! The command line of `train_gpt`, its checks, and the configurations it describes.

use std::path::PathBuf;

use burn::tensor::FloatDType;
use burn_tp::gemma::GemmaConfig;
use burn_tp::gpt::GptConfig;
use burn_tp::hf::HfConfig;
use burn_tp::linear::{OverlapSchedule, TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::moe::ExpertsConfig;
use clap::{Parser, ValueEnum};

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

/// Pipeline schedule, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PpSchedule {
    /// Every micro-batch's forward, then every backward.
    Gpipe,
    /// One forward, one backward (Megatron's), after a warm-up.
    #[value(name = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B: `--virtual-stages` chunks of blocks per rank.
    Interleaved,
}

/// Model architecture, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Arch {
    /// The tiny GPT: learned positions, layer norms, GELU MLP, multi-head attention.
    Gpt,
    /// Llama-class: grouped-query attention (`--kv-heads`), RoPE, RMSNorm, SwiGLU, dropout, an
    /// untied head, the real (padded) vocabulary.
    Llama,
    /// The Llama with every MLP a mixture of experts (Mixtral's shape): `--experts` (8 by
    /// default), `--top-k` per token, split over `--ep` of the dp ranks.
    Moe,
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

/// How the attention runs, as the command line spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Attention {
    /// By blocks with an online softmax; the backward recomputes each block (FlashAttention-2).
    Fused,
    /// The `[seq, seq]` scores and probabilities materialized and kept for the backward.
    Materialized,
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
    /// Model architecture (`llama` by default with `--init-from`).
    #[arg(
        long,
        value_enum,
        default_value_t = Arch::Gpt,
        default_value_if("init_from", clap::builder::ArgPredicate::IsPresent, "llama")
    )]
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
    /// Data-parallel size (world = tp x dp x pp; gradients averaged over dp).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Expert-parallel size: each mixture-of-experts layer's experts split over this many of
    /// the dp ranks (it divides `--dp`); the experts' gradients are reduced over the ranks
    /// holding the same experts. Needs a MoE model (`--experts`, or `--init-from` a Mixtral /
    /// Qwen-MoE).
    #[arg(long, default_value_t = 1)]
    pub ep: usize,
    /// Context-parallel size: every sequence split over this many of the dp ranks (it divides
    /// `--dp`; `--seq` a multiple of `2 cp`), each holding two chunks (Megatron's load-balanced
    /// layout) and the attention passing keys and values around their ring; `dp / cp` batches
    /// per step.
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    /// Llama: every MLP a mixture of this many experts (Mixtral's shape), each as wide as
    /// `--d-ff`, `--top-k` of them per token (`--arch moe`: 8 by default).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts per token (with `--experts`).
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Weight of the routers' load-balancing loss in the training loss (with `--experts`).
    #[arg(long, default_value_t = 0.01)]
    pub aux_loss_coef: f64,
    /// Each expert takes at most this times its even share of a rank's assignments (`tokens x
    /// top-k / experts`), the first in token order; the rest are dropped and counted (a fresh
    /// MoE model or an imported one). Unset: dropless.
    #[arg(long)]
    pub capacity_factor: Option<f64>,
    /// Pipeline stages: the blocks cut into this many stages, one per rank of a pipeline group
    /// (world = tp x dp x pp; CPU ranks, threads or MPI processes, for now).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Micro-batches per step and replica (with `--pp`): each dp rank's batch cut into this
    /// many, flowing through the stages, their gradients accumulated.
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Pipeline schedule (with `--pp`).
    #[arg(long, value_enum, default_value_t = PpSchedule::OneFOneB)]
    pub pp_schedule: PpSchedule,
    /// Chunks of blocks per rank with `--pp-schedule interleaved` (the micro-batches a multiple
    /// of `--pp`, at least `--pp` x this many blocks).
    #[arg(long, default_value_t = 2)]
    pub virtual_stages: usize,
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
    /// How the attention runs: by blocks, never materializing the `[seq, seq]` scores
    /// (FlashAttention-2, the default), or materialized (scores, mask, softmax and
    /// probabilities kept for the backward: the path before the fused kernel, to compare).
    #[arg(long, value_enum, default_value_t = Attention::Fused)]
    pub attention: Attention,
    /// Keep only each block's input in the forward and recompute the block in the backward
    /// (Megatron's `--recompute-granularity full`, `burn_tp::recompute`): the least memory, at
    /// the cost of a second forward of the blocks. The gradients are averaged over dp after the
    /// backward (not with --overlap-grad-reduce or --distributed-optimizer).
    #[arg(long)]
    pub recompute_layers: bool,
    /// Average the gradients over dp while the backward runs, in buckets started as soon as
    /// their last gradient is ready (`burn_tp::dp::GradReducer`), instead of after it.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// Shard AdamW's moments over dp (ZeRO stage 1, Megatron's distributed optimizer,
    /// `burn_tp::dp::DistributedAdamW`): each bucket of gradients is reduce-scattered during the
    /// backward, each dp rank updates its 1/dp chunk, the chunks are all-gathered.
    #[arg(long)]
    pub distributed_optimizer: bool,
    /// Fully sharded data parallelism (`burn_tp::fsdp`, ZeRO-3 / PyTorch's FSDP): every
    /// parameter, its gradient and its AdamW state split over the dp ranks; each block's
    /// weights gathered just before it runs (the next one's gather in flight meanwhile), its
    /// gradients reduce-scattered by the backward. Checkpoints are written whole (they resume
    /// with or without it).
    #[arg(long)]
    pub fsdp: bool,
    /// With `--fsdp`: drop each block's gathered weights after its forward and gather them
    /// again for its backward (the block recomputed there): the least memory (ZeRO-3).
    /// Without it the gathered weights stay from the forward to the backward.
    #[arg(long)]
    pub reshard_after_forward: bool,
    /// Hybrid sharding (HSDP, implies `--fsdp`): the parameters split over `N` consecutive
    /// dp ranks (`N` divides `--dp`), replicated over the `dp / N` groups; with `--ep` (`N`
    /// and `--ep` dividing one another), the experts' rows over the ranks of a group holding
    /// them.
    #[arg(long, value_name = "N")]
    pub hsdp: Option<usize>,
    /// Clip the gradients by their global norm (the whole model's, after the dp average) to
    /// at most this (Megatron's `--clip-grad`, PyTorch's `clip_grad_norm_`).
    #[arg(long, value_name = "NORM")]
    pub clip_grad: Option<f64>,
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
    /// Model width (default 128; with `--init-from` the model's own: an error).
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Attention heads (default 4; with `--init-from` the model's own: an error).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Transformer blocks (default 2; with `--init-from` the model's own: an error).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Llama: key / value heads (default: half the heads; with `--init-from` an error).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Llama: SwiGLU hidden width (default: 8/3 d_model rounded up to a multiple of 32; with
    /// `--init-from` an error).
    #[arg(long)]
    pub d_ff: Option<usize>,
    /// Llama: dropout of the attention probabilities and residual branches; the masks are the
    /// same at every tp. Default 0.1 from scratch; with `--init-from` the model's config's
    /// (`attention_dropout`, Phi-3's `resid_pdrop`; 0 where absent), which this overrides.
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
    /// Sharded checkpoint folder to continue from (`OUT/checkpoint` of an earlier run, written
    /// at any tp x dp): the model, the optimizer state and the step count. The run continues its
    /// curve.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Also save the sharded checkpoint every this many steps (the last save is kept; one is
    /// always written at the end).
    #[arg(long, value_name = "N")]
    pub save_every: Option<usize>,
    /// Start the Llama from a Hugging Face model folder (LlamaForCausalLM, MistralForCausalLM,
    /// Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM): its architecture, sizes and dropout
    /// come from DIR's config.json (a size flag beside it is an error; `--dropout` overrides
    /// the config's dropout), its weights from DIR's safetensors. The
    /// text is tokenized by DIR's `tokenizer.json` when it has one (which must fit in the model's
    /// vocabulary; `--export-hf` copies it); otherwise its characters are token ids 0..n (in
    /// sorted order), which must fit. Implies `--arch llama`.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// At the end, also write the Llama in Hugging Face's format into DIR (config.json and
    /// model.safetensors), as the architecture of `--init-from`'s model if given. Needs `--arch
    /// llama`.
    #[arg(long, value_name = "DIR")]
    pub export_hf: Option<PathBuf>,
    /// LoRA fine-tuning: adapters of this rank on `--lora-targets`, everything else frozen (no
    /// gradient, no optimizer state); the same at every tp. A Llama-family model.
    #[arg(long, value_name = "R")]
    pub lora_rank: Option<usize>,
    /// The adapters' output is scaled by this over the rank (PEFT's `lora_alpha`; default: twice
    /// the rank).
    #[arg(long, value_name = "ALPHA")]
    pub lora_alpha: Option<f64>,
    /// The projections LoRA adapts, comma separated (PEFT's `target_modules`: `q_proj` or `q`).
    #[arg(long, value_delimiter = ',', default_value = "q,k,v,o,gate,up,down")]
    pub lora_targets: Vec<String>,
    /// Start from the PEFT LoRA adapter in DIR (`adapter_config.json`,
    /// `adapter_model.safetensors`) over `--init-from`'s model, sliced to this tp; its rank,
    /// alpha and targets are the adapter's.
    #[arg(long, value_name = "DIR")]
    pub peft_from: Option<PathBuf>,
    /// At the end, write the adapters as a PEFT folder into DIR (for `PeftModel.from_pretrained`
    /// over `--init-from`'s model).
    #[arg(long, value_name = "DIR")]
    pub export_peft: Option<PathBuf>,
    /// With `--export-hf DIR` of a LoRA run: merge the adapters into the base weights (PEFT's
    /// `merge_and_unload`) and write that model there. A LoRA run's `--export-hf` needs it.
    #[arg(long)]
    pub merge_lora: bool,
    /// QLoRA: the adapted projections' frozen base weights held in 8 bits (Burn's symmetric
    /// quantization, each rank its own shard), dequantized at each use; the adapters in f32.
    /// With `--lora-rank` or `--peft-from`, `--dtype f32`.
    #[arg(long)]
    pub qlora: bool,
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

/// The sizes a model from scratch takes when their flags are not given.
const DEFAULT_D_MODEL: usize = 128;
const DEFAULT_HEADS: usize = 4;
const DEFAULT_LAYERS: usize = 2;
/// The Llama's dropout from scratch when `--dropout` is not given.
pub(super) const DEFAULT_DROPOUT: f64 = 0.1;

impl Args {
    /// `--d-model`, or its default.
    pub fn d_model(&self) -> usize {
        self.d_model.unwrap_or(DEFAULT_D_MODEL)
    }

    /// `--heads`, or its default.
    pub fn heads(&self) -> usize {
        self.heads.unwrap_or(DEFAULT_HEADS)
    }

    /// Whether the model is the Llama (`--arch llama`, or `moe`: its MLPs mixtures of experts).
    pub fn is_llama(&self) -> bool {
        matches!(self.arch, Arch::Llama | Arch::Moe)
    }

    /// The LoRA adapters to put on (`--lora-rank`); `None`: a full fine-tune (or `--peft-from`'s).
    pub fn lora(&self) -> Option<burn_tp::lora::LoraConfig> {
        self.lora_rank.map(|r| {
            burn_tp::lora::LoraConfig::new(r, self.lora_alpha.unwrap_or(2.0 * r as f64))
                .with_targets(self.lora_targets.clone())
        })
    }

    /// With `--fsdp` or `--hsdp N`: the dp ranks each parameter is split over.
    pub fn fsdp_shard(&self) -> Option<usize> {
        match (self.fsdp, self.hsdp) {
            (_, Some(n)) => Some(n),
            (true, None) => Some(self.dp),
            (false, None) => None,
        }
    }

    /// Whether the run trains LoRA adapters (new, or a PEFT adapter's).
    pub fn is_lora(&self) -> bool {
        self.lora_rank.is_some() || self.peft_from.is_some()
    }

    /// `--experts`, or 8 with `--arch moe`; `None`: dense MLPs.
    pub fn experts(&self) -> Option<usize> {
        self.experts.or((self.arch == Arch::Moe).then_some(8))
    }

    /// `--layers`, or its default.
    pub fn layers(&self) -> usize {
        self.layers.unwrap_or(DEFAULT_LAYERS)
    }

    /// `--kv-heads`, or half the heads.
    pub(super) fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or((self.heads() / 2).max(1))
    }

    /// The size flags, as `(flag, value if given)`: the ones `--init-from` refuses.
    pub(super) fn size_flags(&self) -> [(&'static str, Option<usize>); 5] {
        [
            ("--d-model", self.d_model),
            ("--heads", self.heads),
            ("--layers", self.layers),
            ("--kv-heads", self.kv_heads),
            ("--d-ff", self.d_ff),
        ]
    }
}

/// The model configuration the arguments describe.
pub fn model_config(args: &Args, n_vocab: usize) -> GptConfig {
    GptConfig::new(
        n_vocab,
        args.seq,
        args.d_model(),
        args.heads(),
        args.layers(),
    )
    .with_settings(settings(args))
}

/// The tensor-parallel settings the arguments describe (both architectures).
pub fn settings(args: &Args) -> TpSettings {
    TpSettings::new()
        .with_mode(tp_mode(args))
        .with_async_communication(!args.no_async)
        .with_schedule(schedule(args))
        .with_fused_attention(args.attention == Attention::Fused)
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
        .unwrap_or_else(|| (8 * args.d_model() / 3).next_multiple_of(32));
    LlamaConfig::new(
        n_vocab,
        args.seq,
        args.d_model(),
        args.heads(),
        args.kv_heads(),
        args.layers(),
        d_ff,
    )
    .with_dropout(args.dropout.unwrap_or(DEFAULT_DROPOUT))
    .with_dropout_seed(args.seed)
    .with_experts(args.experts().map(|n| {
        ExpertsConfig::new(n, args.top_k, d_ff)
            .with_aux_loss_coef(args.aux_loss_coef)
            .with_capacity_factor(args.capacity_factor)
    }))
    .with_settings(settings(args))
}

/// The Llama of an imported model's configuration `hf` (`--init-from`): its sizes and dropout
/// the config's, `--dropout` (when given) replacing both of its dropout rates.
pub fn imported_llama_config(args: &Args, hf: &HfConfig) -> LlamaConfig {
    let mut config = hf.llama_config(settings(args)).with_dropout_seed(args.seed);
    if let Some(x) = &mut config.experts {
        x.capacity_factor = args.capacity_factor;
    }
    match args.dropout {
        Some(p) => config.with_dropout(p).with_attention_dropout(None),
        None => config,
    }
}

/// The Gemma of an imported Gemma's configuration `hf`, as [`imported_llama_config`].
///
/// # Errors
/// A configuration of the Llama family.
pub fn imported_gemma_config(args: &Args, hf: &HfConfig) -> Result<GemmaConfig, String> {
    let config = hf
        .gemma_config(settings(args))
        .map_err(|e| e.to_string())?
        .with_dropout_seed(args.seed);
    Ok(match args.dropout {
        Some(p) => config.with_dropout(p).with_attention_dropout(None),
        None => config,
    })
}
