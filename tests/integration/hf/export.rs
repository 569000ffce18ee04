//! The export: import -> export -> import bit exact at any tp.

use super::*;

/// Import -> export -> import is bit exact: a fixture imported at tp 2, written back in HF's
/// format, imported again at tp 1 and 4, gives the same full parameters bit for bit (and so the
/// same logits as transformers).
#[test]
fn import_export_import_is_bit_exact() {
    use burn::module::{Module, ModuleVisitor, Param};

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
    fn round_trip<M: LanguageModel>(init: Init<M>, name: &str) {
        let src = fixture(name);
        let out =
            std::env::temp_dir().join(format!("burn-tp-hf-export-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let (s, o) = (src.clone(), out.clone());
        let first = run_local(2, move |g| {
            let (model, config) = init(&s, TpSettings::new(), &g, &device()).unwrap();
            burn_tp::hf::save(&model, &config, &o, &g).unwrap();
            bits(&model.to_full_module().unwrap())
        })
        .unwrap()
        .remove(0);
        for tp in [1usize, 4] {
            let o = out.clone();
            let again = run_local(tp, move |g| {
                let (model, _) = init(&o, TpSettings::new(), &g, &device()).unwrap();
                bits(&model.to_full_module().unwrap())
            })
            .unwrap()
            .remove(0);
            assert!(
                again == first,
                "{name}: re-imported at tp {tp}, the parameters differ"
            );
        }
        // The field types transformers' strict configs check (Gemma's scalar is an integer).
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let original: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        for field in [
            "query_pre_attn_scalar",
            "sliding_window",
            "head_dim",
            "vocab_size",
        ] {
            if original[field].is_null() {
                continue;
            }
            assert_eq!(
                json[field].is_u64(),
                original[field].is_u64(),
                "{name}: {field} is {} in the export, {} in the original",
                json[field],
                original[field]
            );
        }
        // The special ids written back as they were.
        for field in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            assert_eq!(json[field], original[field], "{name}: {field}");
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
    for name in [
        "llama_gqa",
        "llama_tied",
        "qwen2_bias",
        "llama_far",
        "llama3_scaled",
        "llama_head_dim",
        "qwen3",
        "mistral_window",
        "qwen2_layers",
        "phi3",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
    ] {
        round_trip(init_llama, name);
    }
    for name in ["gemma2", "gemma3", "gemma3_capped"] {
        round_trip(init_gemma, name);
    }
}
