//! `generate`: a Hugging Face Llama-family model (`config.json` + `model.safetensors`) loaded at
//! tp ranks (threads on the CPU), then text generated with the KV cache (or by full recompute,
//! `--no-cache`, to compare). Prints one JSON line: the prompt ids, the new ids and tokens/s, and
//! the new text when the folder has a `tokenizer.json` (which `--prompt TEXT` needs).

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::generate::{GenerateOptions, generate};
use burn_tp::hf::init_llama;
use burn_tp::linear::TpSettings;
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;
use burn_tp::ops::gather_from_tp_region;
use burn_tp::precision::cast_params;
use clap::Parser;

use crate::corpus::{Codec, TOKENIZER_FILE};
use crate::train_gpt::Precision;

/// Generates text from a Hugging Face Llama-family model at any tp.
#[derive(Parser, Clone, Debug)]
#[command(
    version,
    about = "Generate text from a Hugging Face Llama-family model at any tp, with the KV cache"
)]
pub struct Args {
    /// The model folder (`config.json`, `model.safetensors` or an index of shards).
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel ranks (threads), where the heads allow.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// The prompt's token ids, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    pub prompt_ids: Vec<i64>,
    /// The prompt as text, through the model folder's `tokenizer.json` (with its special tokens,
    /// such as Llama's `<s>`, as `transformers` adds them).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 12)]
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample among the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities add up to p.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Seed of the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop after this id.
    #[arg(long)]
    pub eos: Option<i64>,
    /// Recompute the whole sequence for every new token instead of using the KV cache.
    #[arg(long)]
    pub no_cache: bool,
    /// Compute dtype (the weights are cast after loading).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Write the logits of the prompt's last position here, as a JSON array.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

/// What a run gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The prompt's ids (`--prompt-ids`, or `--prompt` tokenized).
    pub prompt_ids: Vec<i64>,
    /// The new ids.
    pub new_ids: Vec<i64>,
    /// Generated tokens per second (after loading).
    pub tokens_per_s: f64,
    /// The logits of the prompt's last position (over the real vocabulary).
    pub last_logits: Vec<f64>,
    /// The new ids as text, when the model folder has a `tokenizer.json`.
    pub new_text: Option<String>,
}

impl Report {
    /// The JSON line the program prints.
    pub fn json(&self, args: &Args) -> String {
        let mut line = serde_json::json!({
            "prompt_ids": self.prompt_ids,
            "new_ids": self.new_ids,
            "tokens_per_s": self.tokens_per_s,
            "tp": args.tp,
            "kv_cache": !args.no_cache,
        });
        if let Some(text) = &self.new_text {
            line["new_text"] = text.clone().into();
        }
        line.to_string()
    }
}

/// Loads the model at `args.tp` and generates.
///
/// # Errors
/// The model's load error; `--prompt` without a tokenizer, or a tokenizer larger than the model's
/// vocabulary; an empty prompt; a generation error; a rank that panicked.
pub fn run(args: &Args) -> Result<Report, String> {
    if args.tp == 0 {
        return Err("--tp must be at least 1".into());
    }
    let codec = Codec::from_model_dir(&args.model)?;
    let prompt_ids = match (&args.prompt, &codec) {
        (Some(text), Some(codec)) => codec.encode(text, true)?,
        (Some(_), None) => {
            return Err(format!(
                "--prompt needs the model's tokenizer, {}, which does not exist (give the ids \
                 with --prompt-ids)",
                args.model.join(TOKENIZER_FILE).display()
            ));
        }
        (None, _) => args.prompt_ids.clone(),
    };
    if prompt_ids.is_empty() {
        return Err("the prompt is empty: give at least one token".into());
    }
    let device = Device::flex().autodiff();
    let a = args.clone();
    let tokenizer_len = codec.as_ref().map(Codec::len);
    let prompt = prompt_ids.clone();
    let out = run_local(args.tp, move |g| -> Result<Report, String> {
        let (model, config) =
            init_llama(&a.model, TpSettings::new(), &g, &device).map_err(|e| e.to_string())?;
        if let Some(n) = tokenizer_len.filter(|&n| n > config.vocab_size) {
            return Err(format!(
                "{} has {n} tokens, more than the model's vocabulary of {}",
                a.model.join(TOKENIZER_FILE).display(),
                config.vocab_size
            ));
        }
        let model = cast_params(model, a.dtype.dtype());
        let n = prompt.len();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(prompt.clone(), [n, 1]), &device);
        let logits = model.logits(ids).map_err(|e| e.to_string())?;
        let last = gather_from_tp_region(logits.narrow(0, n - 1, 1), 2, &g)
            .map_err(|e| e.to_string())?
            .narrow(2, 0, model.n_vocab());
        let last_logits = last
            .into_data()
            .convert::<f64>()
            .try_to_vec::<f64>()
            .map_err(|e| format!("{e:?}"))?;
        let options = GenerateOptions {
            max_new_tokens: a.max_new_tokens,
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
            eos: a.eos,
            kv_cache: !a.no_cache,
        };
        let start = Instant::now();
        let new_ids =
            generate(&model, &prompt, &options, &g, &device).map_err(|e| e.to_string())?;
        let tokens_per_s = new_ids.len() as f64 / start.elapsed().as_secs_f64();
        Ok(Report {
            prompt_ids: prompt.clone(),
            new_ids,
            tokens_per_s,
            last_logits,
            new_text: None,
        })
    })?;
    let mut report = out.into_iter().next().expect("rank 0")?;
    if let Some(codec) = &codec {
        report.new_text = Some(codec.decode(&report.new_ids)?);
    }
    if let Some(path) = &args.logits_out {
        let text = serde_json::to_string(&report.last_logits).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(report)
}
