//! `train_gpt` with mixtures of experts: ep against ep 1, the checkpoint at any ep.

use crate::common::{assert_close, rng_lock};
use crate::train_gpt::{temp_dir, tiny_args};
use burn_tp_examples::train_gpt::run;

/// A fresh MoE Llama (`--experts 4 --top-k 2`, the aux loss on) at dp 4 x ep 2 and ep 4, and
/// tp 2 x dp 2 x ep 2 in sequence-parallel mode, gives the ep 1 run's losses; its export holds
/// every expert; `--ep` that does not divide `--dp`, or without experts, is an error.
#[test]
fn train_gpt_moe_at_ep_gives_the_ep_1_losses() {
    let _rng = rng_lock();
    let out = temp_dir("moe-ep");
    let moe = |extra: &[&str]| {
        let mut argv = vec![
            "--arch",
            "moe",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--d-ff",
            "32",
        ];
        argv.extend_from_slice(extra);
        tiny_args(&argv, &out)
    };
    for (tp, dp, ep, mode) in [
        ("1", "4", "2", "all-reduce"),
        ("1", "4", "4", "all-reduce"),
        ("2", "2", "2", "reduce-scatter"),
    ] {
        let base = ["--tp", tp, "--dp", dp, "--mode", mode, "--steps", "4"];
        let plain = run(&moe(&base)).unwrap().losses;
        let mut with_ep = base.to_vec();
        with_ep.extend_from_slice(&["--ep", ep]);
        let report = run(&moe(&with_ep)).unwrap();
        let at = format!("tp {tp} x dp {dp} x ep {ep} {mode}");
        assert_close(&report.losses, &plain, 1e-5, &at);
        // Every token of every step reached its 2 experts in each of the 2 MoE layers:
        // 4 steps x batch 4 x seq 8 x 2 x 2, over the 4 experts.
        assert_eq!(report.expert_tokens.len(), 4, "{at}");
        assert_eq!(
            report.expert_tokens.iter().sum::<u64>(),
            4 * 4 * 8 * 2 * 2,
            "{at}"
        );
        let csv = std::fs::read_to_string(out.join("experts.csv")).unwrap();
        assert!(csv.starts_with("expert,tokens,share\n0,"), "{csv}");
    }
    // bf16 (the router in f32, the experts' rows in bf16), with dropout.
    let base = [
        "--tp",
        "1",
        "--dp",
        "2",
        "--steps",
        "3",
        "--dtype",
        "bf16",
        "--dropout",
        "0.1",
    ];
    let plain = run(&moe(&base)).unwrap().losses;
    let split = run(&moe(&[&base[..], &["--ep", "2"]].concat()))
        .unwrap()
        .losses;
    assert_close(&split, &plain, 1e-3, "bf16, dropout: ep 2 vs ep 1");
    // `--arch moe` alone: 8 experts.
    let report = run(&tiny_args(
        &["--arch", "moe", "--tp", "1", "--steps", "1"],
        &out,
    ))
    .unwrap();
    assert_eq!(report.expert_tokens.len(), 8);
    let export = out.join("export-moe");
    run(&moe(&[
        "--tp",
        "1",
        "--dp",
        "2",
        "--ep",
        "2",
        "--steps",
        "2",
        "--export-hf",
        export.to_str().unwrap(),
    ]))
    .unwrap();
    let hf = burn_tp::hf::HfConfig::from_dir(&export).unwrap();
    assert_eq!(hf.experts.map(|x| x.n_experts), Some(4));
    // The experts' gradients reduced in buckets during the backward, or sharded by the
    // distributed optimizer over the ranks holding the same experts.
    let base = ["--tp", "1", "--dp", "4", "--steps", "4"];
    let plain = run(&moe(&base)).unwrap().losses;
    for flag in ["--overlap-grad-reduce", "--distributed-optimizer"] {
        let got = run(&moe(&[&base[..], &["--ep", "2", flag]].concat()))
            .unwrap()
            .losses;
        assert_close(&got, &plain, 1e-5, &format!("dp 4 x ep 2 {flag}"));
    }
    // Pipeline stages holding the MoE layers (the routers' loss across them), the experts over
    // ep, their gradients in buckets; with one micro-batch a step, the unpipelined run's.
    let base = [
        "--tp",
        "1",
        "--dp",
        "2",
        "--steps",
        "3",
        "--micro-batches",
        "1",
    ];
    let plain = run(&moe(&base)).unwrap().losses;
    for extra in [
        &["--pp", "2"][..],
        &["--pp", "2", "--ep", "2"][..],
        &["--pp", "2", "--ep", "2", "--overlap-grad-reduce"][..],
    ] {
        let got = run(&moe(&[&base[..], extra].concat())).unwrap().losses;
        assert_close(&got, &plain, 1e-5, &format!("dp 2 {extra:?}"));
    }
    // A capacity below the even share drops assignments, counted; the same at ep 2.
    let capped = [
        "--tp",
        "1",
        "--dp",
        "4",
        "--steps",
        "2",
        "--capacity-factor",
        "0.5",
    ];
    let plain = run(&moe(&capped)).unwrap();
    let split = run(&moe(&[&capped[..], &["--ep", "2"]].concat())).unwrap();
    assert_close(&split.losses, &plain.losses, 1e-5, "capacity 0.5: ep 2");
    // 2 steps x batch 4 x seq 8 x 2 layers x top 2 assignments, each expert keeps at most
    // half of its even share: at least half of them dropped.
    assert!(
        plain.expert_dropped >= 2 * 4 * 8 * 2 * 2 / 2,
        "{}",
        plain.expert_dropped
    );
    assert_eq!(split.expert_dropped, plain.expert_dropped);
    let e = run(&tiny_args(&["--capacity-factor", "1.5"], &out))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--capacity-factor"), "{e}");
    let e = run(&moe(&["--dp", "2", "--ep", "4"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--ep 4") && e.contains("--dp 2"), "{e}");
    let e = run(&tiny_args(
        &["--arch", "llama", "--tp", "1", "--dp", "2", "--ep", "2"],
        &out,
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("no mixture-of-experts"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A MoE run at dp 2 x ep 2 checkpoints the whole model (every expert and its AdamW state
/// gathered over ep, from the distributed optimizer's shards too): resumed at ep 1 and at ep 2,
/// with either optimizer, it continues the uninterrupted run's losses.
#[test]
fn a_moe_checkpoint_at_ep_2_resumes_at_any_ep() {
    let _rng = rng_lock();
    let root = temp_dir("moe-ckpt");
    let moe = |extra: &[&str], out: &str| {
        let mut argv = vec![
            "--arch",
            "llama",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--d-ff",
            "32",
            "--tp",
            "1",
            "--dp",
            "2",
        ];
        argv.extend_from_slice(extra);
        tiny_args(&argv, &root.join(out))
    };
    let whole = run(&moe(&["--steps", "6"], "whole")).unwrap().losses;
    let first = run(&moe(&["--steps", "3", "--ep", "2"], "first")).unwrap();
    assert_close(
        &first.losses,
        &whole[..3],
        1e-5,
        "the first 3 steps at ep 2",
    );
    let ckpt = first.checkpoint.display().to_string();
    // The distributed optimizer's state (the experts' moments sharded over their own group)
    // saves the same whole-model state.
    let zero = ["--steps", "3", "--ep", "2", "--distributed-optimizer"];
    let first_zero = run(&moe(&zero, "first-zero")).unwrap();
    assert_close(&first_zero.losses, &whole[..3], 1e-5, "ep 2, distributed");
    let ckpt_zero = first_zero.checkpoint.display().to_string();
    // Each ep rank wrote its experts alone: the same tensors as ep 1's checkpoint, once.
    let at_ep1 = run(&moe(&["--steps", "3"], "first-ep1")).unwrap();
    let bytes = |c: &std::path::Path| -> Vec<u64> {
        let dir = c.join("step-3");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        files.sort_by_key(|e| e.file_name());
        files.iter().map(|e| e.metadata().unwrap().len()).collect()
    };
    let (split, one) = (bytes(&first.checkpoint), bytes(&at_ep1.checkpoint));
    assert_eq!(split.len(), 2, "a file for each ep rank: {split:?}");
    assert!(
        split[1] > 0 && split[1] < split[0],
        "rank 1: its experts alone: {split:?}"
    );
    let total = |b: &[u64]| b.iter().sum::<u64>() as f64;
    assert!(
        (total(&split) - total(&one)).abs() < 0.01 * total(&one),
        "ep 2 {split:?} against ep 1 {one:?}"
    );
    // Pipeline stages x ep: each stage's ep ranks write their experts under the whole
    // model's indices.
    let first_pp = run(&moe(
        &["--steps", "3", "--ep", "2", "--pp", "2"],
        "first-pp",
    ))
    .unwrap();
    assert_close(&first_pp.losses, &whole[..3], 1e-5, "pp 2 x ep 2");
    let ckpt_pp = first_pp.checkpoint.display().to_string();
    for (k, (ep, ckpt, extra)) in [
        ("1", &ckpt, &[][..]),
        ("2", &ckpt, &[][..]),
        ("2", &ckpt, &["--distributed-optimizer"][..]),
        ("1", &ckpt_zero, &[][..]),
        // Pipeline stages, each with its MoE layer's experts over ep.
        ("2", &ckpt, &["--pp", "2"][..]),
        ("1", &ckpt_pp, &[][..]),
        ("2", &ckpt_pp, &[][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let at = format!("resumed at ep {ep} {extra:?} from {ckpt}");
        let mut argv = vec!["--steps", "3", "--ep", ep, "--resume", ckpt];
        argv.extend_from_slice(extra);
        let resumed = run(&moe(&argv, &format!("resumed-{k}"))).unwrap().losses;
        assert_close(&resumed, &whole[3..], 1e-5, &at);
    }
    let _ = std::fs::remove_dir_all(&root);
}
