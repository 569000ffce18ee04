//! Fine-tuning an imported model with `train_gpt --init-from`, its export, its tokenizer.

use super::*;

/// A fresh scratch folder for test `name`, and in it the small text the fine-tunes train on.
pub(super) fn scratch(name: &str) -> (PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(format!("burn-tp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let data = root.join("text.txt");
    std::fs::write(&data, "hello tensor parallel world. ".repeat(40)).unwrap();
    (root, data)
}

/// `train_gpt` with `flags`, writing to `root/out`.
pub(super) fn train_gpt_args(
    flags: &[&str],
    root: &Path,
    out: &str,
) -> burn_tp_examples::train_gpt::Args {
    use clap::Parser;
    let out = root.join(out);
    let argv = ["train_gpt"].iter().chain(flags).copied();
    let argv = argv.chain(["--out", out.to_str().unwrap()]);
    burn_tp_examples::train_gpt::Args::try_parse_from(argv).unwrap()
}

/// Fine-tuning an imported model: `train_gpt --init-from DIR` (the architecture read from DIR:
/// a Llama, a Phi-3 with its fused tensors and sliding window, a Qwen3 with its q / k norms)
/// trains the Hugging Face model at tp 2, and at tp 2 x pp 2 (the loss falls from the imported
/// weights),
/// `--export-hf` writes the result as the same architecture, and that export and the run's own
/// sharded checkpoint are the same model (the same held-out loss when either starts a run). The
/// GPT, or a text with more characters than the model's vocabulary, is an error naming it.
#[test]
fn train_gpt_fine_tunes_an_imported_model_and_exports_it() {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let (root, data) = scratch("finetune");
    let args = |extra: &[&str], out: &str| {
        let mut flags = vec![
            "--quiet",
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
        flags.extend_from_slice(extra);
        train_gpt_args(&flags, &root, out)
    };
    // The tied Llama also through a pipeline of 2 stages (each stage's blocks, the export read
    // back from the whole checkpoint).
    // Gemma (tied, its head on the last stage) alone and through 2 stages of its 3 blocks.
    for (name, pp) in [
        ("llama_tied", 1),
        ("llama_tied", 2),
        ("phi3", 1),
        ("qwen3", 1),
        ("gemma2", 1),
        ("gemma3", 1),
        ("gemma3", 2),
    ] {
        let model = fixture(name);
        let name = &format!("{name}-pp{pp}");
        let export = root.join(format!("export-{name}"));
        let pp = pp.to_string();
        let tuned = run(&args(
            &[
                "--steps",
                "10",
                "--init-from",
                model.to_str().unwrap(),
                "--export-hf",
                export.to_str().unwrap(),
                "--pp",
                &pp,
                "--micro-batches",
                &pp,
            ],
            &format!("{name}-tune"),
        ))
        .unwrap();
        assert!(
            tuned.losses[9] < tuned.losses[0] - 0.5,
            "{name}: fine-tuning lowers the loss: {:?}",
            tuned.losses
        );
        assert!(export.join("config.json").exists() && export.join("model.safetensors").exists());
        let from_export = run(&args(
            &["--steps", "1", "--init-from", export.to_str().unwrap()],
            &format!("{name}-again"),
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
            &format!("{name}-resumed"),
        ))
        .unwrap();
        // The held-out loss before the first step: the same evaluation batches on both models (the
        // resumed run trains on step 10's batch, the other on step 0's).
        assert_close(
            &[from_export.held_out[0].1],
            &[from_checkpoint.held_out[0].1],
            1e-6,
            &format!("{name}: the export and the checkpoint: the held-out loss"),
        );
        assert_close(
            &[from_export.held_out[0].1],
            &[tuned.held_out.last().unwrap().1],
            1e-6,
            &format!("{name}: the export and the end of the fine-tuning run: the held-out loss"),
        );
        // Written back as the architecture it was read as.
        assert_eq!(
            HfConfig::from_dir(&export).unwrap().architecture,
            HfConfig::from_dir(&model).unwrap().architecture,
            "{name}"
        );
    }
    let model = fixture("llama_tied");
    // Errors naming the problem.
    let e = run(&Args::try_parse_from([
        "train_gpt",
        "--arch",
        "gpt",
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

/// Issue 51: `train_gpt --init-from` trains the model as its config describes it, not with the
/// from-scratch defaults. A Qwen2 whose config has no dropout trains without any: its first
/// training loss is the loss of the same batch through the evaluation path (the imported model
/// at tp 1, no dropout). `--dropout 0.2` is applied (the first loss moves) and the banner says it
/// came from the flag; a size flag beside `--init-from` is an error naming it (the Learner's
/// too); the banner names the imported model (its kv heads, width, vocabulary, dropout, dtype,
/// folder), not the command line's defaults.
#[test]
fn train_gpt_fine_tunes_with_the_imported_models_settings() {
    use burn_tp_examples::corpus::{Codec, Vocab};
    use burn_tp_examples::train_gpt::{batch, describe, run};
    let _rng = rng_lock();
    let (root, data) = scratch("settings");
    let text = std::fs::read_to_string(&data).unwrap();
    let qwen = fixture("qwen2_bias");
    let args = |model: &Path, extra: &[&str], out: &str| {
        let (data, model) = (data.to_str().unwrap(), model.to_str().unwrap());
        let mut flags = vec![
            "--quiet",
            "--tp",
            "2",
            "--batch",
            "4",
            "--seq",
            "8",
            "--steps",
            "1",
            "--sample-len",
            "0",
            "--data",
            data,
            "--init-from",
            model,
        ];
        flags.extend_from_slice(extra);
        train_gpt_args(&flags, &root, out)
    };

    // Step 0's batch through the evaluation path: the imported model at tp 1, off autodiff.
    let plain = args(&qwen, &[], "plain");
    let tokens = Codec::Chars(Vocab::new(&text))
        .encode(&text, false)
        .unwrap();
    let (ids, targets) = batch(&tokens[..tokens.len() * 9 / 10], &plain, 0);
    let (seq, rows) = (plain.seq, plain.batch);
    let dir = qwen.clone();
    let eval_loss = run_local(1, move |g| {
        let device = device().without_autodiff();
        let (model, _) = init_llama(&dir, TpSettings::new(), &g, &device).unwrap();
        let to =
            |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [seq, rows]), &device);
        let loss = model.loss(to(ids.clone()), to(targets.clone()));
        loss.into_scalar::<f32>() as f64
    })
    .unwrap()
    .remove(0);

    let tuned = run(&plain).unwrap();
    assert_close(
        &[tuned.losses[0]],
        &[eval_loss],
        1e-5,
        "no dropout in the config: the first training loss is the evaluation loss of its batch",
    );
    let banner = describe(&plain);
    for part in [
        "Qwen2ForCausalLM from ",
        qwen.to_str().unwrap(),
        "2 layers, d 32, 4 heads / 2 kv heads of 8, d_ff 48, vocabulary 53",
        "dropout 0 (its config)",
        "bfloat16 weights",
    ] {
        assert!(banner.contains(part), "{part:?} in the banner: {banner}");
    }
    // One kv head, where the command line's default would be 2.
    let gqa = describe(&args(&fixture("llama_gqa"), &[], "gqa"));
    assert!(gqa.contains("4 heads / 1 kv heads"), "{gqa}");

    // --dropout overrides the config's, and says so.
    let dropped = args(&qwen, &["--dropout", "0.2"], "dropped");
    let banner = describe(&dropped);
    assert!(
        banner.contains("dropout 0.2 (--dropout, over the config's attention 0 / residual 0)"),
        "{banner}"
    );
    let with_dropout = run(&dropped).unwrap();
    assert!(
        (with_dropout.losses[0] - eval_loss).abs() > 1e-3,
        "--dropout 0.2 is applied: {} vs the evaluation loss {eval_loss}",
        with_dropout.losses[0]
    );

    // A size flag beside --init-from is an error naming it.
    for (flag, value) in [
        ("--d-model", "64"),
        ("--heads", "8"),
        ("--layers", "3"),
        ("--kv-heads", "1"),
        ("--d-ff", "96"),
    ] {
        let e = run(&args(&qwen, &[flag, value], "sized")).unwrap_err();
        assert!(
            e.contains(&format!("{flag} {value} with --init-from")) && e.contains("config.json"),
            "{e}"
        );
    }
    use burn_tp_examples::learner_llama::{LearnerArgs, run as learner};
    use clap::Parser;
    let learner_out = root.join("learner");
    let argv = [
        "learner_llama",
        "--init-from",
        qwen.to_str().unwrap(),
        "--heads",
        "8",
        "--out",
        learner_out.to_str().unwrap(),
    ];
    let e = learner(&LearnerArgs::try_parse_from(argv).unwrap()).unwrap_err();
    assert!(e.contains("--heads 8 with --init-from"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Fine-tuning an imported model gives the same losses at every tp, step after step: Qwen3
/// (its per-head q / k norms, replicated weights whose gradients must be summed over tp, or the
/// ranks' copies drift apart), Phi-3 (the fused `qkv_proj` / `gate_up_proj` split over tp, a
/// window of 5 under 8 positions) and the windowed Mistral (a window of 4), in both modes.
#[test]
fn train_gpt_fine_tunes_imported_models_the_same_at_every_tp() {
    use burn_tp_examples::train_gpt::run;
    let _rng = rng_lock();
    let (root, data) = scratch("fine-tp");
    for name in ["qwen3", "phi3", "mistral_window"] {
        for mode in ["all-reduce", "reduce-scatter"] {
            let losses = |tp: &str| {
                let model = fixture(name);
                let (data, model) = (data.to_str().unwrap(), model.to_str().unwrap());
                let flags = [
                    "--quiet",
                    "--tp",
                    tp,
                    "--mode",
                    mode,
                    "--batch",
                    "4",
                    "--seq",
                    "8",
                    "--steps",
                    "4",
                    "--lr",
                    "2e-2",
                    "--sample-len",
                    "0",
                    "--data",
                    data,
                    "--init-from",
                    model,
                ];
                let args = train_gpt_args(&flags, &root, &format!("{name}-{mode}-{tp}"));
                run(&args).unwrap().losses
            };
            let want = losses("1");
            assert!(
                want[3] < want[0] - 0.05,
                "{name} {mode}: the loss falls: {want:?}"
            );
            for tp in ["2", "4"] {
                assert_close(
                    &losses(tp),
                    &want,
                    1e-4,
                    &format!("{name} {mode}: the losses at tp {tp} and tp 1"),
                );
            }
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// An imported mixture of experts at ep 2 is built at ep, each rank reading only its experts
/// (`hf::load_expert_parallel`; no broadcast, no whole model): Mixtral and Qwen2-MoE (its
/// shared expert and gate) at tp 2 x dp 2 x ep 2 and tp 1 x dp 4 x ep 2 give the losses of
/// the same dp without ep (each rank importing the whole model), step after step.
#[test]
fn train_gpt_imports_a_mixture_of_experts_at_ep_reading_only_its_experts() {
    use burn_tp_examples::train_gpt::run;
    let _rng = rng_lock();
    let (root, data) = scratch("fine-ep");
    for name in ["mixtral", "qwen2_moe"] {
        for (tp, dp) in [("2", "2"), ("1", "4")] {
            let losses = |ep: &str| {
                let model = fixture(name);
                let (data, model) = (data.to_str().unwrap(), model.to_str().unwrap());
                let flags = [
                    "--quiet",
                    "--tp",
                    tp,
                    "--dp",
                    dp,
                    "--ep",
                    ep,
                    "--batch",
                    "4",
                    "--seq",
                    "8",
                    "--steps",
                    "3",
                    "--lr",
                    "2e-2",
                    "--sample-len",
                    "0",
                    "--data",
                    data,
                    "--init-from",
                    model,
                ];
                let args = train_gpt_args(&flags, &root, &format!("{name}-{tp}-{dp}-{ep}"));
                run(&args).unwrap().losses
            };
            let want = losses("1");
            assert_close(
                &losses("2"),
                &want,
                1e-5,
                &format!("{name} tp {tp} x dp {dp}: ep 2 (imported at ep) and ep 1"),
            );
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}
