//! LoRA and QLoRA fine-tunes of imported models through `train_gpt`: the same losses at every
//! tp, the adapters-only checkpoint, the PEFT and merged exports.

use super::fine_tune::{scratch, train_gpt_args};
use super::*;

/// LoRA through `train_gpt --init-from DIR --lora-rank 4`: tp 2 in both modes gives the tp 1
/// run's losses (dp 2); the loss falls with only the adapters training; `--export-peft` writes
/// an adapter that `load_peft` reads over the base and `--export-hf` the merged model, which
/// give the same logits, other than the base's; `--peft-from` that adapter starts where the
/// run ended (its held-out loss); LoRA on the GPT is an error naming it.
#[test]
fn train_gpt_fine_tunes_with_lora_and_exports_the_adapter_and_the_merged_model() {
    use burn_tp::hf::load_peft;
    use burn_tp_examples::train_gpt::run;
    let _rng = rng_lock();
    let (root, data) = scratch("lora");
    let base = fixture("llama_tied");
    // `adapter`: `--lora-rank 4`, or the flags that bring one.
    let args_with = |adapter: &[&str], extra: &[&str], out: &str| {
        let mut flags = vec![
            "--quiet",
            "--init-from",
            base.to_str().unwrap(),
            "--batch",
            "4",
            "--seq",
            "8",
            "--dp",
            "2",
            "--lr",
            "1e-2",
            "--dropout",
            "0",
            "--sample-len",
            "8",
            "--eval-every",
            "6",
            "--data",
            data.to_str().unwrap(),
        ];
        flags.extend_from_slice(adapter);
        flags.extend_from_slice(extra);
        train_gpt_args(&flags, &root, out)
    };
    let args =
        |extra: &[&str], out: &str| args_with(&["--lora-rank", "4", "--steps", "6"], extra, out);
    let want = run(&args(&["--tp", "1"], "tp1")).unwrap();
    assert!(
        want.losses.last().unwrap() < want.losses.first().unwrap(),
        "{:?}",
        want.losses
    );
    let (peft, merged) = (root.join("peft"), root.join("merged"));
    let mut last_held_out = f64::NAN;
    for (tp, mode) in [("2", "all-reduce"), ("2", "reduce-scatter")] {
        let mut extra = vec!["--tp", tp, "--mode", mode];
        if mode == "reduce-scatter" {
            extra.extend([
                "--export-peft",
                peft.to_str().unwrap(),
                "--export-hf",
                merged.to_str().unwrap(),
                "--merge-lora",
            ]);
        }
        let got = run(&args(&extra, mode)).unwrap();
        assert_close(&got.losses, &want.losses, 1e-5, &format!("tp {tp} {mode}"));
        last_held_out = got.held_out.last().unwrap().1;
    }
    // The adapter over the base and the merged model: the same logits, not the base's.
    let prompt = vec![1i64, 5, 9, 13, 2, 7];
    let (base2, peft2, merged2) = (base.clone(), peft.clone(), merged.clone());
    let logits = run_local(1, move |g| {
        let last = |model: &burn_tp::llama::Llama, vocab: usize| {
            let s = prompt.len();
            let ids = TensorData::new(prompt.clone(), [s, 1]);
            let logits = model
                .logits(Tensor::<2, Int>::from_data(ids, &device()))
                .unwrap();
            f64s(
                logits
                    .narrow(0, s - 1, 1)
                    .narrow(2, 0, vocab)
                    .reshape([vocab]),
            )
        };
        let (model, hf) = init_llama(&base2, TpSettings::new(), &g, &device()).unwrap();
        let plain = last(&model, hf.vocab_size);
        let adapted = last(&load_peft(model, &peft2, &hf).unwrap(), hf.vocab_size);
        let (merged, hf) = init_llama(&merged2, TpSettings::new(), &g, &device()).unwrap();
        (plain, adapted, last(&merged, hf.vocab_size))
    })
    .unwrap()
    .remove(0);
    let (plain, adapted, merged_logits) = logits;
    assert_close(&merged_logits, &adapted, 1e-4, "merged vs base + adapter");
    assert!(
        plain
            .iter()
            .zip(&adapted)
            .any(|(a, b)| (a - b).abs() > 1e-3),
        "the adapter changed nothing"
    );
    // A LoRA run's checkpoint (the adapters and their AdamW state, the frozen base) resumes at
    // tp 1 and through 2 pipeline stages where the uninterrupted run goes on.
    let whole = run(&args_with(
        &["--lora-rank", "4", "--steps", "6"],
        &["--tp", "2"],
        "whole",
    ))
    .unwrap()
    .losses;
    let first = run(&args_with(
        &["--lora-rank", "4", "--steps", "3"],
        &["--tp", "2"],
        "first",
    ))
    .unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    // The checkpoint holds the adapters (2 blocks x 7 projections x A, B) and their moments
    // alone, and names its base.
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(first.checkpoint.join(burn_tp::checkpoint::INDEX)).unwrap(),
    )
    .unwrap();
    let tensors = index["tensors"].as_object().unwrap();
    let params = tensors.keys().filter(|k| !k.contains('.')).count();
    assert_eq!(
        (params, tensors.len()),
        (2 * 7 * 2, 3 * 2 * 7 * 2),
        "stored"
    );
    let frozen_base = index["info"]["frozen_base"].as_str().unwrap();
    assert!(frozen_base.contains("llama_tied"), "{frozen_base}");
    // Over another base (the same model in another folder): an error naming both.
    let moved = root.join("moved-base");
    std::fs::create_dir_all(&moved).unwrap();
    for e in std::fs::read_dir(&base).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, moved.join(p.file_name().unwrap())).unwrap();
    }
    let mut over_moved = args_with(
        &["--lora-rank", "4", "--steps", "1", "--resume", &ckpt],
        &[],
        "moved",
    );
    over_moved.init_from = Some(moved.clone());
    let e = run(&over_moved).unwrap_err().to_string();
    assert!(e.contains("llama_tied") && e.contains("moved-base"), "{e}");
    // Each exports its adapters; the pipelined run from its checkpoint, with the merged model.
    let exported = |k: usize| root.join(format!("peft-resumed-{k}"));
    let merged_pp = root.join("merged-pp");
    for (k, extra) in [&["--tp", "1"][..], &["--tp", "1", "--pp", "2"][..]]
        .into_iter()
        .enumerate()
    {
        let peft_k = exported(k);
        let mut adapter = vec!["--lora-rank", "4", "--steps", "3", "--resume", &ckpt];
        adapter.extend_from_slice(extra);
        adapter.extend(["--export-peft", peft_k.to_str().unwrap()]);
        if k == 1 {
            adapter.extend(["--export-hf", merged_pp.to_str().unwrap(), "--merge-lora"]);
        }
        let resumed = run(&args_with(&adapter, &[], &format!("resumed-{k}")))
            .unwrap()
            .losses;
        assert_close(&resumed, &whole[3..], 1e-5, &format!("resumed {extra:?}"));
    }
    let unpiped = last_logits(&base, Some(&exported(0)));
    let piped = last_logits(&base, Some(&exported(1)));
    assert_close(&piped, &unpiped, 1e-4, "--pp 2's PEFT export");
    let merged_piped = last_logits(&merged_pp, None);
    assert_close(&merged_piped, &unpiped, 1e-4, "--pp 2's merged export");
    // `--peft-from` the exported adapter: it starts at the run's last held-out loss.
    let peft_from = ["--peft-from", peft.to_str().unwrap(), "--steps", "1"];
    let resumed = run(&args_with(&peft_from, &["--tp", "2"], "resumed")).unwrap();
    assert_close(
        &[resumed.held_out[0].1],
        &[last_held_out],
        1e-4,
        "--peft-from: the held-out loss it starts at",
    );
    let both = [&peft_from[..], &["--lora-rank", "4"]].concat();
    let e = run(&args_with(&both, &["--tp", "1"], "both"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--lora-rank and --peft-from"), "{e}");
    let lora4 = ["--lora-rank", "4", "--tp", "1"];
    let merged_s = merged.to_str().unwrap();
    for (extra, want) in [
        (&["--export-hf", merged_s][..], "add --merge-lora"),
        (&["--merge-lora"][..], "--merge-lora writes"),
        (
            &["--qlora", "--dtype", "bf16"][..],
            "--qlora with --dtype bf16",
        ),
    ] {
        let e = run(&args_with(&lora4, extra, "bad"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let e = run(&args_with(&["--qlora"], &[], "bad"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--qlora quantizes a LoRA run"), "{e}");
    let e = run(&train_gpt_args(
        &["--quiet", "--arch", "gpt", "--lora-rank", "4"],
        &root,
        "gpt",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("--lora-rank") && e.contains("Llama"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

/// The logits of the last position of a fixed prompt for the model in `dir` (with the PEFT
/// adapter in `peft` over it, if given), at tp 1.
fn last_logits(dir: &Path, peft: Option<&Path>) -> Vec<f64> {
    let (dir, peft) = (dir.to_path_buf(), peft.map(Path::to_path_buf));
    run_local(1, move |g| {
        let (model, hf) = init_llama(&dir, TpSettings::new(), &g, &device()).unwrap();
        let model = match &peft {
            Some(p) => burn_tp::hf::load_peft(model, p, &hf).unwrap(),
            None => model,
        };
        let prompt = vec![1i64, 5, 9, 13, 2, 7];
        let s = prompt.len();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(prompt, [s, 1]), &device());
        let logits = model.logits(ids).unwrap();
        let vocab = hf.vocab_size;
        f64s(
            logits
                .narrow(0, s - 1, 1)
                .narrow(2, 0, vocab)
                .reshape([vocab]),
        )
    })
    .unwrap()
    .remove(0)
}

/// QLoRA through `train_gpt --qlora` at tp 2 x dp 2: the base held in 8 bits follows the
/// LoRA run's losses within 2 % (not equal: the base is quantized); its checkpoint (the
/// adapters alone) resumes at tp 2 where the uninterrupted run goes on; its merged export is
/// the f32 base with the adapters merged, the same logits as its PEFT export over the base.
#[test]
fn train_gpt_fine_tunes_with_qlora_resumes_and_merges_into_the_full_precision_base() {
    use burn_tp_examples::train_gpt::run;
    let _rng = rng_lock();
    let (root, data) = scratch("qlora");
    let base = fixture("llama_tied");
    let args = |extra: &[&str], out: &str| {
        let mut flags = vec![
            "--quiet",
            "--init-from",
            base.to_str().unwrap(),
            "--batch",
            "4",
            "--seq",
            "8",
            "--tp",
            "2",
            "--dp",
            "2",
            "--lr",
            "1e-2",
            "--dropout",
            "0",
            "--sample-len",
            "0",
            "--lora-rank",
            "4",
            "--data",
            data.to_str().unwrap(),
        ];
        flags.extend_from_slice(extra);
        train_gpt_args(&flags, &root, out)
    };
    let lora = run(&args(&["--steps", "6"], "lora")).unwrap().losses;
    let (peft, merged) = (root.join("peft"), root.join("merged"));
    let exports = [
        "--export-peft",
        peft.to_str().unwrap(),
        "--export-hf",
        merged.to_str().unwrap(),
        "--merge-lora",
    ];
    let qlora = run(&args(
        &[&["--qlora", "--steps", "6"][..], &exports].concat(),
        "q",
    ))
    .unwrap()
    .losses;
    assert_close(&qlora, &lora, 2e-2, "QLoRA vs LoRA");
    assert!(qlora != lora, "the quantized base computes");
    assert!(qlora.last() < qlora.first(), "{qlora:?}");
    // Resumed from the adapters-only checkpoint at step 3, over the base quantized again.
    let first = run(&args(&["--qlora", "--steps", "3"], "first")).unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    let resumed = run(&args(
        &["--qlora", "--steps", "3", "--resume", &ckpt],
        "resumed",
    ))
    .unwrap()
    .losses;
    assert_close(&resumed, &qlora[3..], 1e-5, "QLoRA resumed at tp 2");
    let (adapted, merged_logits) = (last_logits(&base, Some(&peft)), last_logits(&merged, None));
    assert_close(
        &merged_logits,
        &adapted,
        1e-4,
        "merged vs f32 base + adapter",
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A LoRA fine-tune of the Qwen3 fixture (q / k norms, its own head) through `train_gpt`: tp 2
/// and 4, both modes, at dp 2 give tp 1's losses (f32, to 1e-5).
#[test]
fn train_gpt_lora_on_qwen3_gives_the_same_losses_at_tp_1_2_4() {
    use burn_tp_examples::train_gpt::run;
    let _rng = rng_lock();
    let (root, data) = scratch("lora-qwen3");
    let model = fixture("qwen3");
    let losses = |tp: &str, mode: &str| {
        let flags = [
            "--quiet",
            "--init-from",
            model.to_str().unwrap(),
            "--tp",
            tp,
            "--mode",
            mode,
            "--dp",
            "2",
            "--batch",
            "4",
            "--seq",
            "8",
            "--steps",
            "4",
            "--lr",
            "2e-2",
            "--dropout",
            "0",
            "--sample-len",
            "0",
            "--lora-rank",
            "4",
            "--data",
            data.to_str().unwrap(),
        ];
        run(&train_gpt_args(&flags, &root, &format!("{tp}-{mode}")))
            .unwrap()
            .losses
    };
    let want = losses("1", "all-reduce");
    assert!(want[3] < want[0], "the loss falls: {want:?}");
    for (tp, mode) in [
        ("2", "all-reduce"),
        ("2", "reduce-scatter"),
        ("4", "all-reduce"),
        ("4", "reduce-scatter"),
    ] {
        assert_close(&losses(tp, mode), &want, 1e-5, &format!("tp {tp} {mode}"));
    }
    let _ = std::fs::remove_dir_all(&root);
}
