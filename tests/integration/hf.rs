//! Hugging Face Llama-family models imported at tp 1, 2 and 4 against what `transformers` itself
//! computes with them (the fixtures of `tests/fixtures/hf`, made by `make_fixtures.py`, run by
//! hand): the logits of the last prompt position and the greedy continuation.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::TpError;
use burn_tp::hf::{HfArchitecture, HfConfig, load_llama};
use burn_tp::linear::TpSettings;
use burn_tp::local::run_local;
use burn_tp::ops::gather_from_tp_region;

use crate::common::{assert_close, device, f64s, rng_lock};

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

fn expected(dir: &Path) -> Expected {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ints = |k: &str| -> Vec<i64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
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

/// `(last-position logits over the real vocabulary, greedy continuation)` of the model in `dir`
/// at `tp`, on rank 0 (every rank computes the same).
fn run(dir: PathBuf, tp: usize, prompt: Vec<i64>, new: usize) -> (Vec<f64>, Vec<i64>) {
    let out = run_local(tp, move |g| {
        let (model, config) = load_llama(&dir, TpSettings::new(), &g, &device()).unwrap();
        let vocab = config.vocab_size;
        let last_logits = |ids: &[i64]| -> Vec<f64> {
            let s = ids.len();
            let t = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [s, 1]), &device());
            let logits = model.try_forward(t, None).unwrap(); // [s, 1, V_p / tp]
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

#[test]
fn hugging_face_models_give_the_logits_and_tokens_of_transformers_at_every_tp() {
    let _rng = rng_lock();
    for name in [
        "llama_gqa",
        "llama_tied",
        "qwen2_bias",
        "mistral",
        "llama_text",
    ] {
        let dir = fixture(name);
        let want = expected(&dir);
        for tp in [1usize, 2, 4] {
            let (logits, greedy) = run(dir.clone(), tp, want.prompt.clone(), want.greedy.len());
            let tag = format!("{name} at tp {tp}");
            assert_close(
                &logits,
                &want.last_logits,
                1e-4,
                &format!("{tag}: last logits"),
            );
            assert_eq!(greedy, want.greedy, "{tag}: greedy tokens");
        }
    }
}

#[test]
fn the_configs_read_as_transformers_wrote_them() {
    let c = HfConfig::from_dir(&fixture("qwen2_bias")).unwrap();
    assert_eq!(c.architecture, HfArchitecture::Qwen2);
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads
        ),
        (53, 32, 4, 2)
    );
    assert!(c.qkv_bias && !c.out_bias && !c.tie_word_embeddings);
    let c = HfConfig::from_dir(&fixture("llama_tied")).unwrap();
    assert_eq!(
        (c.rope_theta, c.tie_word_embeddings, c.qkv_bias),
        (500000.0, true, false)
    );
    let c = HfConfig::from_dir(&fixture("llama_gqa")).unwrap();
    assert_eq!((c.num_key_value_heads, c.rms_norm_eps), (1, 1e-6));
}

/// What the import does not support is an error naming the file and the field, before any
/// weight is read.
#[test]
fn unsupported_configs_are_errors_naming_the_field() {
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama_gqa").join("config.json")).unwrap(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("burn-tp-hf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, serde_json::Value, &str); 5] = [
        (
            "architectures",
            serde_json::json!(["GPT2LMHeadModel"]),
            "GPT2LMHeadModel",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            "rope_parameters",
        ),
        ("sliding_window", serde_json::json!(8), "sliding_window"),
        ("head_dim", serde_json::json!(16), "head_dim"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
    ];
    for (field, value, named) in cases {
        let mut config = base.clone();
        config[field] = value;
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        match HfConfig::from_dir(&dir) {
            Err(TpError::Checkpoint { path, what }) => {
                assert!(path.ends_with("config.json"), "{field}: {path}");
                assert!(what.contains(named), "{field}: {what}");
            }
            other => panic!("{field}: expected an error, got {other:?}"),
        }
    }
    // Weights of another model: the first tensor of another shape is named (llama_tied has
    // two key / value heads where this config has one), and a tensor missing (it has no
    // lm_head: its embeddings are tied) too.
    std::fs::write(dir.join("config.json"), base.to_string()).unwrap();
    std::fs::copy(
        fixture("llama_tied").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let load = |dir: &PathBuf| {
        let d = dir.clone();
        let out = run_local(1, move |g| {
            load_llama(&d, TpSettings::new(), &g, &device()).map(|_| ())
        })
        .unwrap();
        match out.into_iter().next().unwrap() {
            Err(TpError::Checkpoint { path, what }) => format!("{path}: {what}"),
            other => panic!("expected an error, got {other:?}"),
        }
    };
    let e = load(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("embed_tokens") && e.contains("[64, 32]"),
        "{e}"
    );
    let mut config = base.clone();
    config["vocab_size"] = serde_json::json!(64);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = load(&dir);
    assert!(
        e.contains("k_proj") && e.contains("[16, 32]") && e.contains("[8, 32]"),
        "{e}"
    );
    config["num_key_value_heads"] = serde_json::json!(2);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = load(&dir);
    assert!(e.contains("lm_head.weight is missing"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Generation with the KV cache: greedy tokens equal transformers' (computed by full
/// recompute) at tp 1, 2 and 4, and at every step the cached logits equal a full recompute of
/// the whole sequence, for the imported Llamas and for the GPT.
#[test]
fn kv_cache_decoding_equals_full_recompute_and_transformers() {
    use burn_tp::attention::DecodeCache;
    use burn_tp::generate::{GenerateOptions, generate};
    use burn_tp::gpt::GptConfig;
    use burn_tp::model::LanguageModel;

    let _rng = rng_lock();
    // Cached logits of each new position vs the last position of a full recompute.
    fn step_by_step<M: LanguageModel>(
        model: &M,
        g: &burn_tp::ProcessGroup,
        prompt: &[i64],
        steps: usize,
    ) -> Vec<(Vec<f64>, Vec<f64>)> {
        let vocab = model.n_vocab();
        let ids = |v: &[i64]| {
            Tensor::<2, Int>::from_data(TensorData::new(v.to_vec(), [v.len(), 1]), &device())
        };
        let last = |logits: Tensor<3>| {
            let s = logits.dims()[0];
            let l = gather_from_tp_region(logits.narrow(0, s - 1, 1), 2, g).unwrap();
            f64s(l.narrow(2, 0, vocab).reshape([vocab]))
        };
        let mut cache = DecodeCache::default();
        let mut seq = prompt.to_vec();
        let mut fed = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..steps {
            let cached = last(model.logits_cached(ids(&fed), &mut cache).unwrap());
            let full = last(model.logits(ids(&seq)).unwrap());
            let next = (0..cached.len())
                .max_by(|&a, &b| cached[a].total_cmp(&cached[b]))
                .unwrap() as i64;
            out.push((cached, full));
            seq.push(next);
            fed = vec![next];
        }
        out
    }
    for name in ["llama_gqa", "qwen2_bias"] {
        let dir = fixture(name);
        let want = expected(&dir);
        for tp in [1usize, 2, 4] {
            let (d, prompt, n) = (dir.clone(), want.prompt.clone(), want.greedy.len());
            let out = run_local(tp, move |g| {
                let (model, _) = load_llama(&d, TpSettings::new(), &g, &device()).unwrap();
                let options = GenerateOptions {
                    max_new_tokens: n,
                    ..Default::default()
                };
                let tokens = generate(&model, &prompt, &options, &g, &device()).unwrap();
                (tokens, step_by_step(&model, &g, &prompt, 4))
            })
            .unwrap();
            for (r, (tokens, steps)) in out.into_iter().enumerate() {
                let tag = format!("{name} tp {tp} rank {r}");
                assert_eq!(tokens, want.greedy, "{tag}: generated tokens");
                for (i, (cached, full)) in steps.iter().enumerate() {
                    assert_close(cached, full, 1e-5, &format!("{tag}: step {i}"));
                }
            }
        }
    }
    // The GPT (learned positions, biases, multi-head) at tp 2.
    device().seed(9);
    let out = run_local(2, |g| {
        let model = GptConfig::new(13, 16, 16, 4, 2)
            .init(&g, &device())
            .unwrap();
        step_by_step(&model, &g, &[1, 2, 3], 5)
    })
    .unwrap();
    for (i, (cached, full)) in out[0].iter().enumerate() {
        assert_close(cached, full, 1e-5, &format!("gpt step {i}"));
    }
    // In REDUCE_SCATTER mode a new token cannot be split over the sequence: a clear error.
    let out = run_local(2, |g| {
        let model = GptConfig::new(13, 16, 16, 4, 2)
            .with_settings(TpSettings::new().with_mode(burn_tp::linear::TpMode::ReduceScatter))
            .init(&g, &device())
            .unwrap();
        generate(&model, &[1, 2], &GenerateOptions::default(), &g, &device())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(out[0].contains("ALL_REDUCE"), "{}", out[0]);
}

/// The `generate` example as a user runs it: at tp 2 the new ids are transformers' greedy
/// tokens, `--logits-out` holds its last logits, `--no-cache` gives the same ids, and the
/// printed line is JSON with the prompt and the new ids.
#[test]
fn the_generate_example_prints_transformers_tokens() {
    use burn_tp_examples::generate::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let dir = fixture("llama_tied");
    let want = expected(&dir);
    let logits_out =
        std::env::temp_dir().join(format!("burn-tp-generate-{}.json", std::process::id()));
    let prompt = want
        .prompt
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let args = |extra: &[&str]| {
        let mut argv = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--tp",
            "2",
            "--prompt-ids",
            &prompt,
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
        ];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    };
    let a = args(&["--logits-out", logits_out.to_str().unwrap()]);
    let report = run(&a).unwrap();
    assert_eq!(report.new_ids, want.greedy);
    let written: Vec<f64> =
        serde_json::from_str(&std::fs::read_to_string(&logits_out).unwrap()).unwrap();
    assert_close(&written, &want.last_logits, 1e-4, "--logits-out");
    let line: serde_json::Value = serde_json::from_str(&report.json(&a)).unwrap();
    assert_eq!(line["new_ids"], serde_json::json!(want.greedy));
    assert_eq!(line["prompt_ids"], serde_json::json!(want.prompt));
    assert!(line["tokens_per_s"].as_f64().unwrap() > 0.0);
    let recomputed = run(&args(&["--no-cache"])).unwrap();
    assert_eq!(recomputed.new_ids, want.greedy);
    std::fs::remove_file(&logits_out).unwrap();
}

/// `generate --prompt TEXT` through the folder's `tokenizer.json`: the prompt's ids are the ones
/// the `tokenizers` library gave in Python (with Llama's `<s>`), the new ids are transformers'
/// greedy tokens for them and the new text is their decoding; `--dtype bf16` keeps the logits
/// near. `--prompt` without a tokenizer, or beside `--prompt-ids`, is an error.
#[test]
fn the_generate_example_takes_a_text_prompt_through_the_tokenizer() {
    use burn_tp_examples::generate::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let dir = fixture("llama_text");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ints = |k: &str| -> Vec<i64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    let text = v["prompt_text"].as_str().unwrap();
    let args = |model: &Path, extra: &[&str]| {
        let mut argv = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--tp",
            "2",
            "--prompt",
            text,
            "--max-new-tokens",
            "6",
        ];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv)
    };
    let a = args(&dir, &[]).unwrap();
    let report = run(&a).unwrap();
    assert_eq!(
        report.prompt_ids,
        ints("prompt_text_ids"),
        "the prompt's ids"
    );
    assert_eq!(report.new_ids, ints("text_greedy_new_ids"), "the new ids");
    assert_eq!(
        report.new_text.as_deref(),
        v["text_greedy_new_text"].as_str(),
        "the new text"
    );
    let line: serde_json::Value = serde_json::from_str(&report.json(&a)).unwrap();
    assert_eq!(
        line["prompt_ids"],
        serde_json::json!(ints("prompt_text_ids"))
    );
    assert_eq!(line["new_text"], v["text_greedy_new_text"]);
    // bf16: the same prompt's last logits within bf16's rounding of the f32 ones.
    let bf16 = run(&args(&dir, &["--dtype", "bf16"]).unwrap()).unwrap();
    let scale = report
        .last_logits
        .iter()
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = bf16
        .last_logits
        .iter()
        .zip(&report.last_logits)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst > 0.0 && worst < 0.05 * scale,
        "bf16 logits {worst} from f32 (scale {scale})"
    );
    // Errors.
    let e = run(&args(&fixture("llama_tied"), &[]).unwrap()).unwrap_err();
    assert!(
        e.contains("--prompt") && e.contains("llama_tied/tokenizer.json"),
        "{e}"
    );
    let e = args(&dir, &["--prompt-ids", "1,2"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--prompt-ids") && e.contains("--prompt"), "{e}");
}

/// Import -> export -> import is bit exact: a fixture imported at tp 2, written back in HF's
/// format, imported again at tp 1 and 4, gives the same full parameters bit for bit (and so the
/// same logits as transformers).
#[test]
fn import_export_import_is_bit_exact() {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn_tp::hf::save_llama;
    use burn_tp::reshard::Reshard;

    fn bits<M: Module>(m: &M) -> Vec<Vec<u32>> {
        struct Collect(Vec<Vec<u32>>);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                let v: Vec<f32> = p.val().into_data().convert::<f32>().try_to_vec().unwrap();
                self.0.push(v.iter().map(|x| x.to_bits()).collect());
            }
        }
        let mut c = Collect(Vec::new());
        m.visit(&mut c);
        c.0
    }
    let _rng = rng_lock();
    for name in ["llama_gqa", "llama_tied", "qwen2_bias"] {
        let src = fixture(name);
        let out =
            std::env::temp_dir().join(format!("burn-tp-hf-export-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let (s, o) = (src.clone(), out.clone());
        let first = run_local(2, move |g| {
            let (model, config) = load_llama(&s, TpSettings::new(), &g, &device()).unwrap();
            save_llama(&model, &config, &o, &g).unwrap();
            bits(&model.to_full_module().unwrap())
        })
        .unwrap()
        .remove(0);
        for tp in [1usize, 4] {
            let o = out.clone();
            let again = run_local(tp, move |g| {
                let (model, _) = load_llama(&o, TpSettings::new(), &g, &device()).unwrap();
                bits(&model.to_full_module().unwrap())
            })
            .unwrap()
            .remove(0);
            assert!(
                again == first,
                "{name}: re-imported at tp {tp}, the parameters differ"
            );
        }
        let want = expected(&src);
        let (logits, greedy) = run(out.clone(), 2, want.prompt.clone(), want.greedy.len());
        assert_close(
            &logits,
            &want.last_logits,
            1e-4,
            &format!("{name} exported: logits"),
        );
        assert_eq!(greedy, want.greedy, "{name} exported: greedy");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Fine-tuning an imported model: `train_gpt --arch llama --init-from DIR` trains the Hugging
/// Face model at tp 2 (the loss falls from the imported weights), `--export-hf` writes the
/// result, and that export and the run's own sharded checkpoint are the same model (the same
/// held-out loss when either starts a run). The GPT, or a text with more characters than the
/// model's vocabulary, is an error naming it.
#[test]
fn train_gpt_fine_tunes_an_imported_model_and_exports_it() {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let root = std::env::temp_dir().join(format!("burn-tp-finetune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let data = root.join("text.txt");
    std::fs::write(&data, "hello tensor parallel world. ".repeat(40)).unwrap();
    let model = fixture("llama_tied");
    let args = |extra: &[&str], out: &str| {
        let mut argv = vec![
            "train_gpt",
            "--quiet",
            "--arch",
            "llama",
            "--tp",
            "2",
            "--batch",
            "4",
            "--seq",
            "8",
            "--lr",
            "1e-2",
            "--dropout",
            "0",
            "--sample-len",
            "8",
            "--eval-every",
            "5",
            "--data",
            data.to_str().unwrap(),
        ];
        argv.extend_from_slice(extra);
        let out = root.join(out);
        let mut argv: Vec<String> = argv.into_iter().map(String::from).collect();
        argv.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
        Args::try_parse_from(argv).unwrap()
    };
    let export = root.join("export");
    let tuned = run(&args(
        &[
            "--steps",
            "10",
            "--init-from",
            model.to_str().unwrap(),
            "--export-hf",
            export.to_str().unwrap(),
        ],
        "tune",
    ))
    .unwrap();
    assert!(
        tuned.losses[9] < tuned.losses[0] - 0.5,
        "fine-tuning lowers the loss: {:?}",
        tuned.losses
    );
    assert!(export.join("config.json").exists() && export.join("model.safetensors").exists());
    let from_export = run(&args(
        &["--steps", "1", "--init-from", export.to_str().unwrap()],
        "again",
    ))
    .unwrap();
    let from_checkpoint = run(&args(
        &[
            "--steps",
            "1",
            "--resume",
            tuned.checkpoint.to_str().unwrap(),
            "--init-from",
            model.to_str().unwrap(),
        ],
        "resumed",
    ))
    .unwrap();
    // The held-out loss before the first step: the same evaluation batches on both models (the
    // resumed run trains on step 10's batch, the other on step 0's).
    assert_close(
        &[from_export.held_out[0].1],
        &[from_checkpoint.held_out[0].1],
        1e-6,
        "the export and the checkpoint: the held-out loss",
    );
    assert_close(
        &[from_export.held_out[0].1],
        &[tuned.held_out.last().unwrap().1],
        1e-6,
        "the export and the end of the fine-tuning run: the held-out loss",
    );
    // Errors naming the problem.
    let e = run(&Args::try_parse_from([
        "train_gpt",
        "--init-from",
        model.to_str().unwrap(),
        "--out",
        root.join("gpt").to_str().unwrap(),
    ])
    .unwrap())
    .unwrap_err();
    assert!(e.contains("--arch llama"), "{e}");
    let wide: String = (0..70u8).map(|i| char::from(b'0' + i)).collect();
    std::fs::write(&data, wide.repeat(20)).unwrap();
    let e = run(&args(
        &["--steps", "1", "--init-from", model.to_str().unwrap()],
        "wide",
    ))
    .unwrap_err();
    assert!(
        e.contains("70 distinct characters") && e.contains("64"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// `train_gpt --init-from DIR` with a `tokenizer.json` in DIR trains on the tokenizer's ids (the
/// built-in corpus, which it was made for, in fewer tokens than characters), its sample is the
/// tokenizer's text, and `--export-hf` copies the tokenizer. A tokenizer larger than the model's
/// vocabulary is an error naming both.
#[test]
fn train_gpt_fine_tunes_through_the_model_tokenizer() {
    use burn_tp_examples::corpus;
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let root = std::env::temp_dir().join(format!("burn-tp-tokenizer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let model = fixture("llama_text");
    let export = root.join("export");
    let args = |init: &Path, extra: &[&str]| {
        let mut argv = vec![
            "train_gpt",
            "--quiet",
            "--arch",
            "llama",
            "--tp",
            "2",
            "--batch",
            "4",
            "--seq",
            "16",
            "--lr",
            "1e-2",
            "--dropout",
            "0",
            "--sample-len",
            "12",
            "--eval-every",
            "10",
            "--init-from",
            init.to_str().unwrap(),
        ];
        argv.extend_from_slice(extra);
        let mut argv: Vec<String> = argv.into_iter().map(String::from).collect();
        argv.extend(["--out".into(), root.join("out").to_str().unwrap().into()]);
        Args::try_parse_from(argv).unwrap()
    };
    let tuned = run(&args(
        &model,
        &["--steps", "10", "--export-hf", export.to_str().unwrap()],
    ))
    .unwrap();
    let text = corpus::builtin(200_000);
    let tokenizer = corpus::Codec::from_model_dir(&model).unwrap().unwrap();
    let ids = tokenizer.encode(&text, false).unwrap();
    assert_eq!(tuned.text_tokens, ids.len(), "the text's tokens");
    assert!(
        ids.len() < text.chars().count() / 2,
        "the BPE merges: {} tokens for {} characters",
        ids.len(),
        text.chars().count()
    );
    assert!(
        tuned.losses[9] < tuned.losses[0] - 0.5,
        "fine-tuning lowers the loss: {:?}",
        tuned.losses
    );
    // The sample is text of the corpus's alphabet (the tokenizer's pieces, `▁` back to spaces).
    assert!(!tuned.sample.is_empty());
    assert!(
        tuned.sample.chars().all(|c| text.contains(c)),
        "{:?}",
        tuned.sample
    );
    assert_eq!(
        std::fs::read(export.join("tokenizer.json")).unwrap(),
        std::fs::read(model.join("tokenizer.json")).unwrap(),
        "the export's tokenizer"
    );
    // The 96-token tokenizer beside a 64-token model.
    let small = root.join("small");
    std::fs::create_dir_all(&small).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama_tied").join(f), small.join(f)).unwrap();
    }
    std::fs::copy(model.join("tokenizer.json"), small.join("tokenizer.json")).unwrap();
    let e = run(&args(&small, &["--steps", "1"])).unwrap_err();
    assert!(
        e.contains("tokenizer.json has 96 tokens") && e.contains("vocabulary of 64"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// `with_mode`: a sequence-parallel model viewed in ALL_REDUCE mode (its weights shared) gives
/// the same logits, so it can generate with the KV cache.
#[test]
fn a_sequence_parallel_model_viewed_in_all_reduce_mode_gives_the_same_logits() {
    use burn_tp::gpt::GptConfig;
    use burn_tp::linear::TpMode;
    use burn_tp::model::LanguageModel;
    let _rng = rng_lock();
    device().seed(12);
    let out = run_local(2, |g| {
        let rs = TpSettings::new().with_mode(TpMode::ReduceScatter);
        let gpt = GptConfig::new(13, 8, 16, 4, 2)
            .with_settings(rs)
            .init(&g, &device())
            .unwrap();
        let (llama, _) = load_llama(&fixture("llama_gqa"), rs, &g, &device()).unwrap();
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(vec![1i64, 2, 3, 4, 5, 6, 7, 8], [8, 1]),
            &device(),
        );
        let both = |a: Tensor<3>, b: Tensor<3>| {
            (
                f64s(gather_from_tp_region(a, 2, &g).unwrap()),
                f64s(gather_from_tp_region(b, 2, &g).unwrap()),
            )
        };
        let g1 = both(
            gpt.logits(ids.clone()).unwrap(),
            gpt.clone()
                .with_mode(TpMode::AllReduce)
                .logits(ids.clone())
                .unwrap(),
        );
        let l1 = both(
            llama.logits(ids.clone()).unwrap(),
            llama
                .clone()
                .with_mode(TpMode::AllReduce)
                .logits(ids)
                .unwrap(),
        );
        (g1, l1)
    })
    .unwrap();
    for (r, ((g_rs, g_ar), (l_rs, l_ar))) in out.into_iter().enumerate() {
        assert_close(&g_ar, &g_rs, 1e-5, &format!("gpt rank {r}"));
        assert_close(&l_ar, &l_rs, 1e-5, &format!("llama rank {r}"));
    }
}
