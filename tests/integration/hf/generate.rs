//! Generation: the KV cache against a full recompute and transformers, the generate example
//! (ids and text through the tokenizer), a sequence-parallel model decoding in ALL_REDUCE mode.

use super::*;

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
        g: &burn_tp::comm::ProcessGroup,
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
    fn check<M: LanguageModel>(init: Init<M>, name: &str) {
        let dir = fixture(name);
        let want = expected(&dir);
        for tp in [1usize, 2, 4] {
            let (d, prompt, n) = (dir.clone(), want.prompt.clone(), want.greedy.len());
            let out = run_local(tp, move |g| {
                let (model, _) = init(&d, TpSettings::new(), &g, &device()).unwrap();
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
                // Gemma's larger activations (norms scaling by about 3 here, embeddings by
                // sqrt(d)) carry the cached and full GEMMs' rounding further (up to 1.3e-5).
                let tol = if name.starts_with("gemma") {
                    1e-4
                } else {
                    1e-5
                };
                for (i, (cached, full)) in steps.iter().enumerate() {
                    assert_close(cached, full, tol, &format!("{tag}: step {i}"));
                }
            }
        }
    }
    for name in [
        "llama_gqa",
        "qwen2_bias",
        "llama_far",
        "llama3_scaled",
        "llama_head_dim",
        "qwen3",
        "mistral_window",
        "qwen2_layers",
        "phi3",
        "mixtral",
        "qwen2_moe",
    ] {
        check(init_llama, name);
    }
    // Gemma: sliding layers' caches keep their window, full layers' everything.
    for name in ["gemma2", "gemma3", "gemma3_capped"] {
        check(init_gemma, name);
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
/// tokens, `--logits-out` holds its last logits, `--no-cache` gives the same ids, the printed
/// line is JSON with the prompt and the new ids, and `--prompt-ids` repeated is one batch whose
/// rows are each prompt's own.
#[test]
fn the_generate_example_prints_transformers_tokens() {
    use burn_tp_examples::generate::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    // A Llama and a Gemma (its sliding layers' caches, its scaled embeddings).
    for name in ["llama_tied", "gemma3"] {
        let dir = fixture(name);
        let want = expected(&dir);
        let logits_out = std::env::temp_dir().join(format!(
            "burn-tp-generate-{name}-{}.json",
            std::process::id()
        ));
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
        assert_eq!(report.first().new_ids, want.greedy);
        let written: Vec<f64> =
            serde_json::from_str(&std::fs::read_to_string(&logits_out).unwrap()).unwrap();
        assert_close(&written, &want.last_logits, 1e-4, "--logits-out");
        let line: serde_json::Value = serde_json::from_str(&report.json(&a)).unwrap();
        assert_eq!(line["new_ids"], serde_json::json!(want.greedy));
        assert_eq!(line["prompt_ids"], serde_json::json!(want.prompt));
        assert!(line["tokens_per_s"].as_f64().unwrap() > 0.0);
        let recomputed = run(&args(&["--no-cache"])).unwrap();
        assert_eq!(recomputed.first().new_ids, want.greedy);
        // `--prompt-ids` repeated: one batch, the fixture's row as alone, a short one as alone.
        let both = run(&args(&["--prompt-ids", "7, 3"])).unwrap();
        assert_eq!(both.rows.len(), 2);
        assert_eq!(both.rows[0], report.rows[0]);
        assert_eq!(both.rows[1].prompt_ids, [7, 3]);
        let mut argv: Vec<&str> = vec!["generate", "--model", dir.to_str().unwrap()];
        argv.extend(["--tp", "2", "--prompt-ids", "7,3", "--max-new-tokens", "6"]);
        let alone = run(&Args::try_parse_from(argv).unwrap()).unwrap();
        assert_eq!(both.rows[1], alone.rows[0]);
        let e = run(&args(&["--prompt-ids", "7,x"])).unwrap_err();
        assert!(e.contains("\"7,x\"") && e.contains("\"x\""), "{e}");
        std::fs::remove_file(&logits_out).unwrap();
    }
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
    let v = expected_json(&dir);
    let ints = |k: &str| json_ints(&v, k);
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
        report.first().prompt_ids,
        ints("prompt_text_ids"),
        "the prompt's ids"
    );
    assert_eq!(
        report.first().new_ids,
        ints("text_greedy_new_ids"),
        "the new ids"
    );
    assert_eq!(
        report.first().new_text.as_deref(),
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
    // Streamed: the pieces, as they came, make the new text.
    let pieces = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = pieces.clone();
    let streamed = burn_tp_examples::generate::run_streaming(&a, move |p| {
        sink.lock().unwrap().push(p.to_string())
    })
    .unwrap();
    let pieces = pieces.lock().unwrap().clone();
    assert!(pieces.len() > 1, "{pieces:?}");
    assert_eq!(
        Some(pieces.concat()),
        streamed.first().new_text,
        "the streamed text"
    );
    // Several prompts at once (repeated --prompt, then a --prompts-file): one row each, as each
    // gives alone; the first is the single run's.
    let file = std::env::temp_dir().join(format!("burn-tp-prompts-{}.txt", std::process::id()));
    std::fs::write(&file, "a dog sees\n\nmy sister feeds the\n").unwrap();
    let several = run(&args(
        &dir,
        &[
            "--prompt",
            "the fox",
            "--prompts-file",
            file.to_str().unwrap(),
        ],
    )
    .unwrap())
    .unwrap();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(several.rows.len(), 4);
    assert_eq!(several.rows[0], report.rows[0]);
    for (i, text) in ["the fox", "a dog sees", "my sister feeds the"]
        .into_iter()
        .enumerate()
    {
        let argv = [
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--tp",
            "2",
            "--prompt",
            text,
            "--max-new-tokens",
            "6",
        ];
        let alone = run(&Args::try_parse_from(argv).unwrap()).unwrap();
        assert_eq!(several.rows[i + 1], alone.rows[0], "prompt {text:?}");
    }
    let lines: Vec<serde_json::Value> = several
        .json(&a)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(
        lines[2]["new_text"],
        several.rows[2].new_text.clone().unwrap().as_str()
    );
    assert_eq!(lines[3]["batch"], 4);
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
        let (llama, _) = init_llama(&fixture("llama_gqa"), rs, &g, &device()).unwrap();
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

/// Generation for several prompts at once: prompts of 1 to 8 tokens in one left-padded batch
/// give, row by row, what each gives alone (greedy, sampled, and with an end id that stops some
/// rows before others), the full prompt's row is transformers' greedy continuation, and the
/// padded prefill's last logits equal each prompt's own: the imported models (rotary positions,
/// sliding windows, q / k norms, grouped-query heads) at tp 1, 2 and 4 and the GPT (learned
/// positions) at tp 2.
#[test]
fn batched_generation_gives_each_prompt_what_it_gives_alone() {
    use burn_tp::attention::DecodeCache;
    use burn_tp::generate::{GenerateOptions, generate, generate_batch};
    use burn_tp::gpt::GptConfig;
    use burn_tp::model::LanguageModel;

    let _rng = rng_lock();
    /// Per option set, its name, the batch's rows and each prompt's own ids.
    type Rows = Vec<(&'static str, Vec<Vec<i64>>, Vec<Vec<i64>>)>;
    /// Each row of the batch against the prompt alone, for three option sets; and the last
    /// logits of the padded prefill against each prompt's own.
    fn check<M: LanguageModel>(
        model: &M,
        g: &burn_tp::comm::ProcessGroup,
        prompts: &[Vec<i64>],
    ) -> (Rows, [Vec<f64>; 2]) {
        let greedy = GenerateOptions {
            max_new_tokens: 6,
            ..Default::default()
        };
        let solo_first = generate(model, &prompts[0], &greedy, g, &device()).unwrap();
        let cases = [
            ("greedy", greedy),
            (
                "sampled",
                GenerateOptions {
                    temperature: 0.8,
                    top_k: Some(5),
                    seed: 3,
                    ..greedy
                },
            ),
            // The first row stops after its third token; the others go on unless they meet it.
            (
                "eos",
                GenerateOptions {
                    eos: Some(solo_first[2]),
                    ..greedy
                },
            ),
        ];
        let mut out = Vec::new();
        for (name, options) in cases {
            let batch = generate_batch(model, prompts, &options, g, &device()).unwrap();
            let alone: Vec<Vec<i64>> = prompts
                .iter()
                .map(|p| generate(model, p, &options, g, &device()).unwrap())
                .collect();
            out.push((name, batch, alone));
        }
        // The padded prefill's last position, row by row, against each prompt alone.
        let vocab = model.n_vocab();
        let last = |ids: Vec<i64>, b: usize, cache: &mut DecodeCache| -> Vec<f64> {
            let s = ids.len() / b;
            let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [s, b]), &device());
            let l = model.valid().logits_cached(ids, cache).unwrap();
            let l = gather_from_tp_region(l.narrow(0, s - 1, 1), 2, g).unwrap();
            f64s(l.narrow(2, 0, vocab))
        };
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        let padding: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
        let ids: Vec<i64> = (0..longest)
            .flat_map(|i| {
                prompts
                    .iter()
                    .zip(&padding)
                    .map(move |(p, &pad)| if i < pad { 5 } else { p[i - pad] })
            })
            .collect();
        let batched = last(ids, prompts.len(), &mut DecodeCache::with_padding(padding));
        let solo: Vec<f64> = prompts
            .iter()
            .flat_map(|p| last(p.clone(), 1, &mut DecodeCache::default()))
            .collect();
        (out, [batched, solo])
    }
    /// `tol`: of the prefill's logits, whose rotary positions are shifted by the padding (the
    /// same scores but for rounding).
    fn compare(tag: &str, (rows, [batched, solo]): (Rows, [Vec<f64>; 2]), tol: f64) {
        for (name, batch, alone) in rows {
            assert_eq!(batch, alone, "{tag}: {name}");
        }
        assert_close(
            &batched,
            &solo,
            tol,
            &format!("{tag}: the prefill's logits"),
        );
    }
    fn imported<M: LanguageModel>(init: Init<M>, name: &str) {
        let dir = fixture(name);
        let want = expected(&dir);
        let p = want.prompt.clone();
        // 8 tokens (past both windows), the fixture's 6, then 1, 3 and 5.
        let prompts = vec![
            p.clone(),
            [p.clone(), vec![3, 11]].concat(),
            vec![p[2]],
            p[..3].to_vec(),
            p[1..].to_vec(),
        ];
        for tp in [1usize, 2, 4] {
            let (d, ps) = (dir.clone(), prompts.clone());
            let out = run_local(tp, move |g| {
                let (model, _) = init(&d, TpSettings::new(), &g, &device()).unwrap();
                let results = check(&model, &g, &ps);
                let greedy = GenerateOptions {
                    max_new_tokens: 6,
                    ..Default::default()
                };
                let batch = generate_batch(&model, &ps, &greedy, &g, &device()).unwrap();
                (results, batch[0].clone())
            })
            .unwrap();
            for (r, (results, first)) in out.into_iter().enumerate() {
                let tag = format!("{name} tp {tp} rank {r}");
                assert_eq!(first, want.greedy, "{tag}: transformers' continuation");
                // Gemma's activations are larger (norms scaling by about 3 here, embeddings by
                // sqrt(d)): the rounding of the shifted rotations grows with them (measured:
                // at most 4.4e-5 for Gemma, 2.9e-6 for the Llama family).
                let tol = if name.starts_with("gemma") {
                    1e-4
                } else {
                    1e-5
                };
                compare(&tag, results, tol);
            }
        }
    }
    for name in [
        "llama_gqa",
        "llama3_scaled",
        "qwen3",
        "mistral_window",
        "qwen2_layers",
        "phi3",
        "qwen3_moe",
    ] {
        imported(init_llama, name);
    }
    for name in ["gemma2", "gemma3", "gemma3_capped"] {
        imported(init_gemma, name);
    }
    // The GPT: learned positions, each row's counted from its first token.
    device().seed(13);
    let out = run_local(2, |g| {
        let model = GptConfig::new(13, 16, 16, 4, 2)
            .init(&g, &device())
            .unwrap();
        check(&model, &g, &[vec![1, 2, 3, 4, 5], vec![7], vec![2, 9, 4]])
    })
    .unwrap();
    for (r, results) in out.into_iter().enumerate() {
        compare(&format!("gpt rank {r}"), results, 1e-5);
    }
}

/// A Gemma's text prompt through its folder's `tokenizer.json`, with and without the KV cache,
/// streamed: transformers' ids and text (the `gemma3` fixture's).
#[test]
fn a_gemma_generates_from_text_through_its_tokenizer() {
    use burn_tp_examples::generate::{Args, run, run_streaming};
    use clap::Parser;
    let _rng = rng_lock();
    let dir = fixture("gemma3");
    let v = expected_json(&dir);
    let text = v["prompt_text"].as_str().unwrap();
    let args = |extra: &[&str]| {
        let mut argv = vec!["generate", "--model", dir.to_str().unwrap(), "--tp", "2"];
        argv.extend(["--prompt", text, "--max-new-tokens", "6"]);
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    };
    for extra in [&[][..], &["--no-cache"][..]] {
        let report = run(&args(extra)).unwrap();
        let row = report.first();
        assert_eq!(
            row.prompt_ids,
            json_ints(&v, "prompt_text_ids"),
            "{extra:?}"
        );
        assert_eq!(
            row.new_ids,
            json_ints(&v, "text_greedy_new_ids"),
            "{extra:?}"
        );
        assert_eq!(row.new_text.as_deref(), v["text_greedy_new_text"].as_str());
    }
    let pieces = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = pieces.clone();
    let streamed = run_streaming(&args(&[]), move |p| {
        sink.lock().unwrap().push(p.to_string())
    });
    let pieces = pieces.lock().unwrap().concat();
    assert_eq!(Some(pieces), streamed.unwrap().first().new_text.clone());
}
