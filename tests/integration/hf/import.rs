//! The import: transformers' logits and greedy tokens at every tp, configs read as transformers
//! wrote them, unsupported ones refused naming the field.

use super::*;

#[test]
fn hugging_face_models_give_the_logits_and_tokens_of_transformers_at_every_tp() {
    let _rng = rng_lock();
    for name in [
        "llama_gqa",
        "llama_tied",
        "qwen2_bias",
        "mistral",
        "llama_far",
        "llama_text",
        "llama3_scaled",
        "llama_head_dim",
        "qwen3",
        "mistral_window",
        "qwen2_layers",
        "phi3",
        "gemma2",
        "gemma3",
        "gemma3_capped",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
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
    // Every field away from its default, each read from its own field.
    let c = HfConfig::from_dir(&fixture("llama_far")).unwrap();
    assert_eq!(
        (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings),
        (1e-2, 2500.0, 40)
    );
    assert!(c.tie_word_embeddings && c.qkv_bias && c.out_bias);
    assert_eq!((c.vocab_size, c.num_key_value_heads), (67, 2));
    let l = c.llama_config(burn_tp::linear::TpSettings::new());
    assert_eq!((l.norm_eps, l.rope_theta, l.max_seq), (1e-2, 2500.0, 40));
    assert!(l.tie_embeddings && l.qkv_bias && l.out_bias);
    assert_eq!(l.rope_scaling, None);
    // Llama 3's rotary scaling, as transformers 5 writes it (`rope_parameters`) and as earlier
    // versions did (`rope_theta` beside `rope_scaling`, its kind under `type`).
    let scaled = burn_tp::attention::Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32,
    };
    let c = HfConfig::from_dir(&fixture("llama3_scaled")).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (100.0, Some(scaled)));
    let l = c.llama_config(burn_tp::linear::TpSettings::new());
    assert_eq!(
        (l.rope_theta, l.rope_scaling, l.max_seq),
        (100.0, Some(scaled), 256)
    );
    let mut old: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama3_scaled").join("config.json")).unwrap(),
    )
    .unwrap();
    let params = old["rope_parameters"].take();
    old["rope_theta"] = params["rope_theta"].clone();
    old["rope_scaling"] = serde_json::json!({
        "type": "llama3",
        "factor": params["factor"],
        "low_freq_factor": params["low_freq_factor"],
        "high_freq_factor": params["high_freq_factor"],
        "original_max_position_embeddings": params["original_max_position_embeddings"],
    });
    let dir = std::env::temp_dir().join(format!("burn-tp-hf-llama3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), old.to_string()).unwrap();
    let c = HfConfig::from_dir(&dir).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (100.0, Some(scaled)));
    std::fs::remove_dir_all(&dir).ok();
    // An explicit head size: kept where it is not hidden_size / num_attention_heads.
    let c = HfConfig::from_dir(&fixture("llama_head_dim")).unwrap();
    assert_eq!(
        (c.head_dim, c.head_size(), c.hidden_size),
        (Some(16), 16, 32)
    );
    assert_eq!(
        c.llama_config(burn_tp::linear::TpSettings::new()).head_dim,
        Some(16)
    );
    let c = HfConfig::from_dir(&fixture("llama3_scaled")).unwrap();
    assert_eq!((c.head_dim, c.head_size()), (None, 8));
    // Qwen3's per-head norms, Mistral's and Phi-3's windows.
    let c = HfConfig::from_dir(&fixture("qwen3")).unwrap();
    assert_eq!(c.architecture, HfArchitecture::Qwen3);
    assert!(c.qk_norm && !c.qkv_bias && c.sliding_window.is_none());
    assert_eq!(c.head_dim, Some(16));
    let c = HfConfig::from_dir(&fixture("mistral_window")).unwrap();
    assert_eq!((c.sliding_window, c.qk_norm), (Some(4), false));
    let l = c.llama_config(burn_tp::linear::TpSettings::new());
    assert_eq!(l.sliding_window, Some(4));
    let c = HfConfig::from_dir(&fixture("phi3")).unwrap();
    assert_eq!(
        (c.architecture, c.sliding_window),
        (HfArchitecture::Phi3, Some(5))
    );
    // A window as long as the context is none.
    assert_eq!(
        HfConfig::from_dir(&fixture("mistral"))
            .unwrap()
            .sliding_window,
        None
    );
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
    let cases: [(&str, serde_json::Value, &str); 6] = [
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
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "llama3", "rope_theta": 10000.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
            "factor",
        ),
        (
            "partial_rotary_factor",
            serde_json::json!(0.5),
            "partial_rotary_factor",
        ),
        ("mlp_bias", serde_json::json!(true), "mlp_bias"),
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
    // A sliding window on some layers only (Qwen2's `max_window_layers`, transformers 5's
    // `layer_types`): read as each layer's type; on every layer, as the one window.
    use burn_tp::attention::LayerType::{Full, Sliding};
    let mut config = base.clone();
    config["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    config["use_sliding_window"] = serde_json::json!(true);
    config["sliding_window"] = serde_json::json!(8);
    config["max_window_layers"] = serde_json::json!(1);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let c = HfConfig::from_dir(&dir).unwrap();
    assert_eq!(
        (c.sliding_window, c.layer_types.clone()),
        (Some(8), vec![Full, Sliding])
    );
    let l = c.llama_config(TpSettings::new());
    assert_eq!(
        (l.sliding_window, l.layer_types),
        (Some(8), vec![Full, Sliding])
    );
    config["layer_types"] = serde_json::json!(["sliding_attention", "sliding_attention"]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let c = HfConfig::from_dir(&dir).unwrap();
    assert_eq!((c.sliding_window, c.layer_types), (Some(8), vec![]));
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
            init_llama(&d, TpSettings::new(), &g, &device()).map(|_| ())
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

/// Gemma 3's config as transformers 5 writes it, and as earlier versions did
/// (`sliding_window_pattern`, `rope_theta` beside `rope_local_base_freq`); what burn-tp's Gemma
/// does not do yet refused naming the field.
#[test]
fn gemma_configs_read_as_transformers_wrote_them() {
    use burn_tp::gemma::LayerType::{Full, Sliding};

    let c = HfConfig::from_dir(&fixture("gemma3")).unwrap();
    assert_eq!(c.architecture, HfArchitecture::Gemma3);
    assert_eq!(c.layer_types, [Sliding, Full, Sliding]);
    assert_eq!(
        (c.rope_theta, c.rope_local_theta, c.sliding_window),
        (500.0, Some(50.0), Some(4))
    );
    assert_eq!(
        (
            c.query_pre_attn_scalar,
            c.final_logit_softcapping,
            c.head_size()
        ),
        (Some(24.0), None, 16)
    );
    assert!(c.qk_norm && c.tie_word_embeddings && !c.qkv_bias);
    let g = c.gemma_config(TpSettings::new()).unwrap();
    assert_eq!((g.head_dim, g.query_pre_attn_scalar), (16, Some(24.0)));
    assert_eq!((g.rope_theta, g.rope_local_theta), (500.0, 50.0));
    assert_eq!(
        (g.layer_types.clone(), g.sliding_window),
        (vec![Sliding, Full, Sliding], Some(4))
    );
    let c = HfConfig::from_dir(&fixture("gemma3_capped")).unwrap();
    assert_eq!(c.final_logit_softcapping, Some(8.0));
    assert!(!c.tie_word_embeddings);
    // Gemma 2: both caps, one rotary base, no q / k norms.
    let c = HfConfig::from_dir(&fixture("gemma2")).unwrap();
    assert_eq!(c.architecture, HfArchitecture::Gemma2);
    assert_eq!(
        (c.attn_logit_softcapping, c.final_logit_softcapping),
        (Some(2.0), Some(8.0))
    );
    assert_eq!((c.rope_theta, c.rope_local_theta), (50.0, Some(50.0)));
    assert!(!c.qk_norm && c.tie_word_embeddings);
    let g = c.gemma_config(TpSettings::new()).unwrap();
    assert_eq!((g.attn_logit_softcap, g.qk_norm), (Some(2.0), false));
    assert!(
        HfConfig::from_dir(&fixture("llama_gqa"))
            .unwrap()
            .gemma_config(TpSettings::new())
            .is_err()
    );

    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("gemma3").join("config.json")).unwrap(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("burn-tp-hf-gemma-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let read = |config: &serde_json::Value| {
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        HfConfig::from_dir(&dir)
    };
    // The older form: every third layer full, the bases as two fields; defaults without them.
    let mut old = base.clone();
    for field in ["layer_types", "rope_parameters", "tie_word_embeddings"] {
        old.as_object_mut().unwrap().remove(field);
    }
    old["sliding_window_pattern"] = serde_json::json!(3);
    old["rope_theta"] = serde_json::json!(700.0);
    old["rope_local_base_freq"] = serde_json::json!(70.0);
    let c = read(&old).unwrap();
    assert_eq!(c.layer_types, [Sliding, Sliding, Full]);
    assert_eq!((c.rope_theta, c.rope_local_theta), (700.0, Some(70.0)));
    assert!(c.tie_word_embeddings, "Gemma ties by default");
    for field in [
        "sliding_window_pattern",
        "rope_theta",
        "rope_local_base_freq",
    ] {
        old.as_object_mut().unwrap().remove(field);
    }
    let c = read(&old).unwrap();
    assert_eq!(c.layer_types, [Sliding, Sliding, Sliding]);
    assert_eq!(
        (c.rope_theta, c.rope_local_theta),
        (1_000_000.0, Some(10_000.0))
    );
    // Gemma 2's caps default to transformers' 30 and 50 where a config leaves them out, none
    // where it says null; its layers alternate.
    let mut gemma2: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("gemma2").join("config.json")).unwrap(),
    )
    .unwrap();
    for field in [
        "layer_types",
        "attn_logit_softcapping",
        "final_logit_softcapping",
    ] {
        gemma2.as_object_mut().unwrap().remove(field);
    }
    let c = read(&gemma2).unwrap();
    assert_eq!(c.layer_types, [Sliding, Full, Sliding]);
    assert_eq!(
        (c.attn_logit_softcapping, c.final_logit_softcapping),
        (Some(50.0), Some(30.0))
    );
    gemma2["attn_logit_softcapping"] = serde_json::Value::Null;
    assert_eq!(read(&gemma2).unwrap().attn_logit_softcapping, None);
    // Refused, naming the field.
    let cases: [(&str, serde_json::Value, &str); 6] = [
        (
            "attn_logit_softcapping",
            serde_json::json!(-1.0),
            "attn_logit_softcapping",
        ),
        (
            "layer_types",
            serde_json::json!(["sliding_attention", "chunked_attention", "full_attention"]),
            "chunked_attention",
        ),
        (
            "hidden_activation",
            serde_json::json!("gelu"),
            "hidden_activation",
        ),
        (
            "rope_parameters",
            serde_json::json!({"full_attention": {"rope_type": "linear", "factor": 8.0,
                "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default"}}),
            "rope_parameters.full_attention",
        ),
        (
            "layer_types",
            serde_json::json!(["sliding_attention", "full_attention"]),
            "layer_types",
        ),
        (
            "use_bidirectional_attention",
            serde_json::json!(true),
            "use_bidirectional_attention",
        ),
    ];
    for (field, value, named) in cases {
        let mut config = base.clone();
        config[field] = value;
        match read(&config) {
            Err(TpError::Checkpoint { what, .. }) => {
                assert!(what.contains(named), "{field}: {what}")
            }
            other => panic!("{field}: expected an error, got {other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // A Gemma through the Llama importer: an error pointing to init_gemma.
    let d = fixture("gemma3");
    let out = run_local(1, move |g| {
        init_llama(&d, TpSettings::new(), &g, &device())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(out[0].contains("init_gemma"), "{}", out[0]);
}

/// Gemma at tp 2 in REDUCE_SCATTER mode (its four norms on sequence shards), and with the CPU
/// attention kernel on tiles of 2 (the online rescale across tiles, with Gemma's scale and the
/// window cutting tiles), gives transformers' logits; so does the materialized attention.
#[test]
fn gemma_gives_transformers_logits_in_every_mode_and_kernel() {
    use burn_tp::linear::TpMode;

    let _rng = rng_lock();
    for name in ["gemma2", "gemma3", "gemma3_capped"] {
        let dir = fixture(name);
        let want = expected(&dir);
        let settings = [
            (
                "reduce-scatter",
                TpSettings::new().with_mode(TpMode::ReduceScatter),
            ),
            ("tiles of 2", TpSettings::new().with_attention_tile(2)),
            (
                "reduce-scatter, tiles of 2",
                TpSettings::new()
                    .with_mode(TpMode::ReduceScatter)
                    .with_attention_tile(2),
            ),
            (
                "materialized",
                TpSettings::new().with_fused_attention(false),
            ),
        ];
        for (how, s) in settings {
            let (logits, _) = run_with(init_gemma, dir.clone(), 2, s, want.prompt.clone(), 0);
            assert_close(
                &logits,
                &want.last_logits,
                1e-4,
                &format!("{name} at tp 2, {how}"),
            );
        }
    }
}

#[test]
fn moe_configs_read_as_transformers_wrote_them() {
    use burn_tp::moe::ExpertsConfig;
    let experts = |name: &str| {
        let c = HfConfig::from_dir(&fixture(name)).unwrap();
        (c.architecture, c.experts.unwrap())
    };
    // Mixtral: every layer sparse, its experts as wide as `intermediate_size`, always
    // renormalized; no aux loss without `output_router_logits`.
    assert_eq!(
        experts("mixtral"),
        (HfArchitecture::Mixtral, ExpertsConfig::new(4, 2, 48))
    );
    let (arch, x) = experts("qwen3_moe");
    assert_eq!(arch, HfArchitecture::Qwen3Moe);
    assert_eq!(
        x,
        ExpertsConfig::new(4, 2, 24).with_mlp_only_layers(vec![0])
    );
    assert!(!x.is_sparse(0) && x.is_sparse(1));
    let (arch, x) = experts("qwen2_moe");
    assert_eq!(arch, HfArchitecture::Qwen2Moe);
    assert_eq!(
        x,
        ExpertsConfig::new(4, 2, 24)
            .with_norm_topk_prob(false)
            .with_shared_expert(Some(40))
    );
    // Errors naming the field and the values.
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen2_moe").join("config.json")).unwrap(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("burn-tp-hf-moe-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (field, value, says) in [
        (
            "num_experts_per_tok",
            serde_json::json!(5),
            "`num_experts_per_tok` = 5",
        ),
        ("num_experts", serde_json::Value::Null, "`num_experts`"),
        ("output_router_logits", serde_json::json!(true), ""),
        (
            "router_jitter_noise",
            serde_json::json!(0.01),
            "`router_jitter_noise` = 0.01",
        ),
    ] {
        let mut v = base.clone();
        v[field] = value;
        std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
        match HfConfig::from_dir(&dir) {
            Err(e) => assert!(
                !says.is_empty() && e.to_string().contains(says),
                "{field}: {e}"
            ),
            // With `output_router_logits` the config's coefficient weighs the aux loss.
            Ok(c) => assert_eq!(c.experts.unwrap().aux_loss_coef, 0.001, "{field}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A MoE model imported at tp x ep (`init_llama_expert_parallel`): each rank builds and reads
/// only its `n / ep` experts, which are bit for bit the whole import's experts of its ep rank,
/// and every rank's prompt logits are transformers'.
#[test]
fn moe_models_import_at_every_tp_x_ep_reading_only_their_experts() {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn_tp::hf::init_llama_expert_parallel;
    fn bits<M: Module>(m: &M) -> Vec<Vec<u32>> {
        struct Bits(Vec<Vec<u32>>);
        impl ModuleVisitor for Bits {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0.push(
                    f64s(p.val())
                        .iter()
                        .map(|&x| (x as f32).to_bits())
                        .collect(),
                );
            }
        }
        let mut b = Bits(Vec::new());
        m.visit(&mut b);
        b.0
    }
    let _rng = rng_lock();
    for name in ["mixtral", "qwen3_moe", "qwen2_moe"] {
        let dir = fixture(name);
        let want = expected(&dir);
        for (tp, ep) in [(1usize, 2usize), (2, 2), (1, 4)] {
            let tag = format!("{name} at tp {tp} x ep {ep}");
            let (dir, prompt) = (dir.clone(), want.prompt.clone());
            let out = run_local(tp * ep, move |world| {
                let r = world.rank();
                let tp_group = world.split(r / tp, r).unwrap();
                let ep_group = world.split(ep + r % tp, r).unwrap();
                let settings = TpSettings::new();
                let (model, config) =
                    init_llama_expert_parallel(&dir, settings, &tp_group, &ep_group, &device())
                        .unwrap();
                let (whole, _) = init_llama(&dir, settings, &tp_group, &device()).unwrap();
                let mine = whole.expert_parallel(&ep_group).unwrap();
                let s = prompt.len();
                let ids = TensorData::new(prompt.clone(), [s, 1]);
                let logits = model
                    .logits(Tensor::<2, Int>::from_data(ids, &device()))
                    .unwrap();
                let logits = gather_from_tp_region(logits, 2, &tp_group).unwrap();
                let vocab = config.vocab_size;
                let last = f64s(
                    logits
                        .narrow(0, s - 1, 1)
                        .narrow(2, 0, vocab)
                        .reshape([vocab]),
                );
                (last, bits(&model) == bits(&mine), bits(&model).len())
            })
            .unwrap();
            for (rank, (last, same, params)) in out.into_iter().enumerate() {
                assert!(same, "{tag}: rank {rank}'s {params} parameters");
                assert_close(
                    &last,
                    &want.last_logits,
                    1e-4,
                    &format!("{tag}: rank {rank}"),
                );
            }
        }
    }
}
