//! Hugging Face models (the Llama family, Gemma 3) imported at tp 1, 2 and 4 against what
//! `transformers` itself
//! computes with them (the fixtures of `tests/fixtures/hf`, made by `make_fixtures.py`, run by
//! hand): the logits of the last prompt position and the greedy continuation.
//!
//! | file           | what                                                      |
//! |----------------|-----------------------------------------------------------|
//! | `import.rs`    | logits and tokens at every tp, configs, refusals          |
//! | `export.rs`    | import -> export -> import, bit exact                     |
//! | `generate.rs`  | the KV cache, the generate example, decoding views        |
//! | `fine_tune.rs` | `train_gpt --init-from`, export, tokenizer                |
//! | `lora.rs`      | `train_gpt --lora-rank`, `--qlora`: checkpoint, exports   |

mod export;
mod fine_tune;
mod generate;
mod import;
mod lora;

use crate::common::{assert_close, device, f64s, rng_lock};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::TpError;
use burn_tp::hf::{HfArchitecture, HfConfig, init_gemma, init_llama};
use burn_tp::linear::TpSettings;
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;
use burn_tp::ops::gather_from_tp_region;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf")
        .join(name)
}

struct Expected {
    prompt: Vec<i64>,
    last_logits: Vec<f64>,
    greedy: Vec<i64>,
}

/// A fixture's `expected.json`.
fn expected_json(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The integer list `k` of an `expected.json`.
fn json_ints(v: &serde_json::Value, k: &str) -> Vec<i64> {
    v[k].as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn expected(dir: &Path) -> Expected {
    let v = expected_json(dir);
    let ints = |k: &str| json_ints(&v, k);
    Expected {
        prompt: ints("prompt_ids"),
        last_logits: v["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        greedy: ints("greedy_new_ids"),
    }
}

/// An importer: [`init_llama`] or [`init_gemma`].
type Init<M> = fn(
    &Path,
    TpSettings,
    &burn_tp::comm::ProcessGroup,
    &burn::tensor::Device,
) -> burn_tp::Result<(M, HfConfig)>;

/// Whether the fixture in `dir` is a Gemma (imported by [`init_gemma`]).
fn is_gemma(dir: &Path) -> bool {
    HfConfig::from_dir(dir).unwrap().architecture.is_gemma()
}

/// `(last-position logits over the real vocabulary, greedy continuation)` of the model in `dir`
/// at `tp`, on rank 0 (every rank computes the same).
fn run(dir: PathBuf, tp: usize, prompt: Vec<i64>, new: usize) -> (Vec<f64>, Vec<i64>) {
    if is_gemma(&dir) {
        run_with(init_gemma, dir, tp, TpSettings::new(), prompt, new)
    } else {
        run_with(init_llama, dir, tp, TpSettings::new(), prompt, new)
    }
}

/// [`run`] with importer `init` and `settings` (`new` = 0: the prompt's logits alone).
fn run_with<M: LanguageModel>(
    init: Init<M>,
    dir: PathBuf,
    tp: usize,
    settings: TpSettings,
    prompt: Vec<i64>,
    new: usize,
) -> (Vec<f64>, Vec<i64>) {
    let out = run_local(tp, move |g| {
        let (model, config) = init(&dir, settings, &g, &device()).unwrap();
        let vocab = config.vocab_size;
        let last_logits = |ids: &[i64]| -> Vec<f64> {
            let s = ids.len();
            let t = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [s, 1]), &device());
            let logits = model.logits(t).unwrap(); // [s, 1, V_p / tp]
            let logits = gather_from_tp_region(logits, 2, &g).unwrap();
            f64s(
                logits
                    .narrow(0, s - 1, 1)
                    .narrow(2, 0, vocab)
                    .reshape([vocab]),
            )
        };
        let first = last_logits(&prompt);
        let mut ids = prompt.clone();
        for _ in 0..new {
            let l = last_logits(&ids);
            let next = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap();
            ids.push(next as i64);
        }
        (first, ids[prompt.len()..].to_vec())
    })
    .unwrap();
    out.into_iter().next().unwrap()
}
