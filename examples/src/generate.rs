//! `generate`: a Hugging Face model of the Llama or Gemma family (`config.json` + `model.safetensors`) loaded at
//! tp ranks (threads on the CPU), then text generated with the KV cache (or by full recompute,
//! `--no-cache`, to compare), for one prompt or several at once (one batch, left-padded). Prints
//! one JSON line per prompt: the prompt ids, the new ids and tokens/s, and the new text when the
//! folder has a `tokenizer.json` (which `--prompt TEXT` needs); a single text prompt's new text
//! is also streamed to stdout as it comes, before its line.

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::comm::ProcessGroup;
use burn_tp::generate::{GenerateOptions, generate_batch_with};
use burn_tp::hf::{HfConfig, init_gemma, init_llama};
use burn_tp::linear::TpSettings;
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;
use burn_tp::ops::gather_from_tp_region;
use burn_tp::precision::cast_params;
use clap::Parser;

use crate::corpus::{Codec, TOKENIZER_FILE};
use crate::train_gpt::Precision;

/// Generates text from a Hugging Face model (Llama or Gemma family) at any tp.
#[derive(Parser, Clone, Debug)]
#[command(
    version,
    about = "Generate text from a Hugging Face model (Llama or Gemma family) at any tp, with the KV cache"
)]
pub struct Args {
    /// The model folder (`config.json`, `model.safetensors` or an index of shards).
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel ranks (threads), where the heads allow.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// A prompt's token ids, comma separated. Repeat it for several prompts, generated at once
    /// (one batch).
    #[arg(
        long,
        value_name = "IDS",
        required_unless_present_any = ["prompt", "prompts_file"],
        conflicts_with_all = ["prompt", "prompts_file"]
    )]
    pub prompt_ids: Vec<String>,
    /// A prompt as text, through the model folder's `tokenizer.json` (with its special tokens,
    /// such as Llama's `<s>`, as `transformers` adds them). Repeat it for several prompts,
    /// generated at once (one batch).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// Text prompts, one per line (empty lines skipped), after any `--prompt`.
    #[arg(long, value_name = "FILE")]
    pub prompts_file: Option<PathBuf>,
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
    /// Write the logits of the (first) prompt's last position here, as a JSON array.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
}

/// What one prompt gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The prompt's ids (`--prompt-ids`, or a `--prompt` tokenized).
    pub prompt_ids: Vec<i64>,
    /// The new ids.
    pub new_ids: Vec<i64>,
    /// The new ids as text, when the model folder has a `tokenizer.json`.
    pub new_text: Option<String>,
}

/// What a run gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Per prompt, in order.
    pub rows: Vec<Generated>,
    /// Generated tokens per second, every prompt's together (after loading).
    pub tokens_per_s: f64,
    /// The logits of the first prompt's last position (over the real vocabulary).
    pub last_logits: Vec<f64>,
}

impl Report {
    /// The first (or only) prompt's result.
    pub fn first(&self) -> &Generated {
        &self.rows[0]
    }

    /// The lines the program prints: one JSON object per prompt.
    pub fn json(&self, args: &Args) -> String {
        let lines: Vec<String> = self
            .rows
            .iter()
            .map(|row| {
                let mut line = serde_json::json!({
                    "prompt_ids": row.prompt_ids,
                    "new_ids": row.new_ids,
                    "tokens_per_s": self.tokens_per_s,
                    "batch": self.rows.len(),
                    "tp": args.tp,
                    "kv_cache": !args.no_cache,
                });
                if let Some(text) = &row.new_text {
                    line["new_text"] = text.clone().into();
                }
                line.to_string()
            })
            .collect();
        lines.join("\n")
    }
}

/// Rank 0's new ids per prompt, tokens per second, and the first prompt's last logits.
type RankOut = (Vec<Vec<i64>>, f64, Vec<f64>);

/// Loads the model at `args.tp` and generates.
///
/// # Errors
/// As [`run_streaming`].
pub fn run(args: &Args) -> Result<Report, String> {
    run_streaming(args, |_| {})
}

/// Loads the model at `args.tp` and generates; for a single prompt with a tokenizer, calls
/// `on_text` with each new piece of its text as soon as its token is picked.
///
/// # Errors
/// The model's load error; `--prompt` without a tokenizer, or a tokenizer larger than the model's
/// vocabulary; an empty prompt or prompts file; a generation error; a rank that panicked.
pub fn run_streaming(
    args: &Args,
    on_text: impl FnMut(&str) + Send + 'static,
) -> Result<Report, String> {
    if args.tp == 0 {
        return Err("--tp must be at least 1".into());
    }
    let codec = Codec::from_model_dir(&args.model)?;
    let mut texts = args.prompt.clone();
    if let Some(path) = &args.prompts_file {
        let file = std::fs::read_to_string(path)
            .map_err(|e| format!("reading --prompts-file {}: {e}", path.display()))?;
        let lines: Vec<String> = file
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        if lines.is_empty() {
            return Err(format!(
                "--prompts-file {}: no prompt in it",
                path.display()
            ));
        }
        texts.extend(lines);
    }
    let prompts: Vec<Vec<i64>> = match (texts.is_empty(), &codec) {
        (true, _) => args
            .prompt_ids
            .iter()
            .map(|ids| {
                ids.split(',')
                    .filter(|t| !t.trim().is_empty())
                    .map(|t| {
                        t.trim()
                            .parse::<i64>()
                            .map_err(|e| format!("--prompt-ids {ids:?}: {t:?}: {e}"))
                    })
                    .collect::<Result<Vec<i64>, String>>()
            })
            .collect::<Result<_, _>>()?,
        (false, Some(codec)) => texts
            .iter()
            .map(|t| codec.encode(t, true))
            .collect::<Result<_, _>>()?,
        (false, None) => {
            return Err(format!(
                "--prompt needs the model's tokenizer, {}, which does not exist (give the ids \
                 with --prompt-ids)",
                args.model.join(TOKENIZER_FILE).display()
            ));
        }
    };
    if let Some(r) = prompts.iter().position(Vec::is_empty) {
        return Err(format!("prompt {r} is empty: give at least one token each"));
    }
    let device = Device::flex().autodiff();
    let a = args.clone();
    let tokenizer_len = codec.as_ref().map(Codec::len);
    // One prompt's text streams from rank 0, each piece as its token is picked.
    let stream = (prompts.len() == 1)
        .then(|| codec.clone())
        .flatten()
        .map(|c| {
            let on_text: Box<dyn FnMut(&str) + Send> = Box::new(on_text);
            std::sync::Arc::new(std::sync::Mutex::new((c, on_text, Vec::new(), 0usize)))
        });
    let batch = prompts.clone();
    let out = run_local(args.tp, move |g| -> Result<RankOut, String> {
        let model = a.model.clone();
        let fits = |config: &HfConfig| match tokenizer_len.filter(|&n| n > config.vocab_size) {
            Some(n) => Err(format!(
                "{} has {n} tokens, more than the model's vocabulary of {}",
                model.join(TOKENIZER_FILE).display(),
                config.vocab_size
            )),
            None => Ok(()),
        };
        let stream = stream.as_ref().filter(|_| g.rank() == 0);
        let hf = HfConfig::from_dir(&model).map_err(|e| e.to_string())?;
        let e = |e: burn_tp::TpError| e.to_string();
        if hf.architecture.is_gemma() {
            let (m, config) = init_gemma(&model, TpSettings::new(), &g, &device).map_err(e)?;
            fits(&config)?;
            on_rank(m, &a, &g, &device, &batch, stream)
        } else {
            let (m, config) = init_llama(&model, TpSettings::new(), &g, &device).map_err(e)?;
            fits(&config)?;
            on_rank(m, &a, &g, &device, &batch, stream)
        }
    })?;
    let (new_ids, tokens_per_s, last_logits) = out.into_iter().next().expect("rank 0")?;
    let rows = prompts
        .into_iter()
        .zip(new_ids)
        .map(|(prompt_ids, new_ids)| {
            let new_text = codec.as_ref().map(|c| c.decode(&new_ids)).transpose()?;
            Ok(Generated {
                prompt_ids,
                new_ids,
                new_text,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    if let Some(path) = &args.logits_out {
        let text = serde_json::to_string(&last_logits).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(Report {
        rows,
        tokens_per_s,
        last_logits,
    })
}

/// A single prompt's streamed text: the tokenizer, where its pieces go, the ids so far and the
/// bytes shown.
type Stream =
    std::sync::Arc<std::sync::Mutex<(Codec, Box<dyn FnMut(&str) + Send>, Vec<i64>, usize)>>;

/// One rank's work on its shards of `model` (a Llama or a Gemma): the first prompt's last
/// logits, then the batch generated (streamed from rank 0 through `stream`).
fn on_rank<M: LanguageModel>(
    model: M,
    a: &Args,
    g: &ProcessGroup,
    device: &Device,
    batch: &[Vec<i64>],
    stream: Option<&Stream>,
) -> Result<RankOut, String> {
    let model = cast_params(model, a.dtype.dtype());
    let first = &batch[0];
    let n = first.len();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(first.clone(), [n, 1]), device);
    let logits = model.logits(ids).map_err(|e| e.to_string())?;
    let last = gather_from_tp_region(logits.narrow(0, n - 1, 1), 2, g)
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
    let mut on_token = |_: usize, id: i64| {
        if let Some(stream) = stream {
            let mut s = stream.lock().unwrap_or_else(|e| e.into_inner());
            let (codec, on_text, ids, shown) = &mut *s;
            ids.push(id);
            // The whole text so far, less what was shown: a piece that only decodes with
            // the next token (a split character) waits for it.
            if let Ok(text) = codec.decode(ids)
                && text.len() > *shown
                && text.is_char_boundary(*shown)
            {
                on_text(&text[*shown..]);
                *shown = text.len();
            }
        }
    };
    let start = Instant::now();
    let rows = generate_batch_with(&model, batch, &options, g, device, &mut on_token)
        .map_err(|e| e.to_string())?;
    let tokens: usize = rows.iter().map(Vec::len).sum();
    let tokens_per_s = tokens as f64 / start.elapsed().as_secs_f64();
    Ok((rows, tokens_per_s, last_logits))
}
