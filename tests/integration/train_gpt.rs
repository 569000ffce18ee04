//! The example `train_gpt` end to end: the same losses across tp, dp, modes and overlap paths,
//! the overlapped dp reduction and the distributed optimizer, checkpoints that resume at any
//! tp x dp, bf16 against f32, and the CLI's outputs and errors.

use crate::common::{Path, assert_close, device, f64s, rng_lock};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::local::run_local;
use burn_tp::reshard::Reshard;
use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;
use std::path::PathBuf;

pub(crate) fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-tp-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub(crate) fn tiny_args(extra: &[&str], out: &std::path::Path) -> Args {
    let mut argv = vec!["train_gpt", "--quiet"];
    let defaults = [
        ("--batch", "4"),
        ("--seq", "8"),
        ("--d-model", "16"),
        ("--heads", "4"),
        ("--layers", "2"),
        ("--lr", "1e-2"),
        ("--steps", "10"),
        ("--sample-len", "8"),
    ];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            argv.extend_from_slice(&[flag, value]);
        }
    }
    argv.extend_from_slice(extra);
    argv.extend_from_slice(&["--out", out.to_str().unwrap()]);
    Args::try_parse_from(argv).unwrap()
}

/// tp = 1, 2, 4 and tp = 2 x dp = 2 give the same losses, in both modes, async and sync.
#[test]
fn gpt_losses_agree_across_tp_dp_modes_and_async() {
    let _rng = rng_lock();
    let out = temp_dir("agree");
    let reference = run(&tiny_args(&["--tp", "1"], &out)).unwrap().losses;
    assert!(
        reference[9] < reference[0] - 0.3,
        "the model learns: {reference:?}"
    );
    for mode in ["all-reduce", "reduce-scatter"] {
        for asynch in [true, false] {
            for (tp, dp) in [("1", "1"), ("2", "1"), ("4", "1"), ("2", "2")] {
                // The async layers on each path (sync layers have no schedule to run).
                let paths = if asynch {
                    Path::at(tp.parse().unwrap())
                } else {
                    &Path::ALL[..1]
                };
                for path in paths {
                    let mut extra = vec!["--tp", tp, "--dp", dp, "--mode", mode];
                    if !asynch {
                        extra.push("--no-async");
                    }
                    extra.extend(path.args());
                    let report = run(&tiny_args(&extra, &out)).unwrap();
                    let tag = format!("tp {tp} dp {dp} {mode} async {asynch} {path:?}");
                    assert_close(&report.losses, &reference, 1e-4, &format!("losses {tag}"));
                    let linked = report.overlap.starts_with("simulated link");
                    assert_eq!(
                        linked,
                        asynch && matches!(path, Path::Overlapped(_)),
                        "{tag}: {}",
                        report.overlap
                    );
                }
            }
        }
    }
}

/// `--overlap-grad-reduce` (the dp average started in buckets during the backward) gives the
/// losses of the plain average after it, at tp 2 x dp 2 and tp 1 x dp 4, with one bucket and with
/// 1 KiB buckets, in bf16 too (the reducer averages in f32, as the plain path does after its
/// cast); a bucket size that is not positive is an error naming it.
#[test]
fn train_gpt_overlapped_grad_reduce_gives_the_same_losses() {
    let _rng = rng_lock();
    let out = temp_dir("overlap-grad");
    for (tp, dp) in [("2", "2"), ("1", "4")] {
        for dtype in ["f32", "bf16"] {
            let base = ["--tp", tp, "--dp", dp, "--arch", "llama", "--dtype", dtype];
            let plain = run(&tiny_args(&base, &out)).unwrap().losses;
            for bucket in ["4", "0.001"] {
                let mut extra = base.to_vec();
                extra.extend(["--overlap-grad-reduce", "--bucket-mb", bucket]);
                let report = run(&tiny_args(&extra, &out)).unwrap();
                let tag = format!("tp {tp} dp {dp} {dtype} bucket {bucket} MiB");
                assert_close(&report.losses, &plain, 1e-6, &tag);
            }
        }
    }
    let e = run(&tiny_args(&["--bucket-mb", "0"], &out)).unwrap_err();
    assert!(e.contains("--bucket-mb") && e.contains('0'), "{e}");
}

/// `--distributed-optimizer` (AdamW's moments sharded over dp) gives the plain run's losses at
/// tp 2 x dp 2 and tp 1 x dp 4, with and without `--overlap-grad-reduce`; its checkpoint (the
/// chunks gathered into the sharded format) resumes at tp 1 x dp 4 with the distributed
/// optimizer and at tp 2 x dp 1 without it, into the uninterrupted curve.
#[test]
fn train_gpt_distributed_optimizer_gives_the_same_curve_and_resumes_at_another_dp() {
    let _rng = rng_lock();
    for (tp, dp) in [("2", "2"), ("1", "4")] {
        let base = ["--tp", tp, "--dp", dp, "--steps", "20"];
        let plain = run(&tiny_args(&base, &temp_dir("zero-plain")))
            .unwrap()
            .losses;
        for extra in [
            &["--distributed-optimizer"][..],
            &[
                "--distributed-optimizer",
                "--overlap-grad-reduce",
                "--bucket-mb",
                "0.001",
            ],
        ] {
            let mut argv = base.to_vec();
            argv.extend_from_slice(extra);
            let report = run(&tiny_args(&argv, &temp_dir("zero"))).unwrap();
            assert_close(
                &report.losses,
                &plain,
                1e-5,
                &format!("tp {tp} dp {dp} {extra:?}"),
            );
        }
    }
    let whole = run(&tiny_args(
        &["--tp", "2", "--dp", "2", "--steps", "40"],
        &temp_dir("zero-whole"),
    ))
    .unwrap()
    .losses;
    let half = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--steps",
            "20",
            "--distributed-optimizer",
        ],
        &temp_dir("zero-half"),
    ))
    .unwrap();
    let ckpt = half.checkpoint.to_str().unwrap().to_string();
    for (tp, dp, zero) in [("1", "4", true), ("2", "1", false)] {
        let mut argv = vec!["--tp", tp, "--dp", dp, "--steps", "20", "--resume", &ckpt];
        if zero {
            argv.push("--distributed-optimizer");
        }
        let rest = run(&tiny_args(&argv, &temp_dir("zero-rest"))).unwrap();
        assert_close(
            &rest.losses,
            &whole[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} x dp {dp} (distributed {zero})"),
        );
    }
}

/// A model saved at tp = 2 resumes at tp = 1, 2 and 4 with the same loss, and continues the run
/// (optimizer state, step count) as if never interrupted; sharding and gathering round-trips the
/// parameters exactly.
#[test]
fn checkpoints_round_trip_across_tp_sizes() {
    let _rng = rng_lock();
    let out = temp_dir("ckpt");
    let first = run(&tiny_args(&["--tp", "2", "--steps", "6"], &out)).unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    let mut resumed = Vec::new();
    for tp in ["1", "2", "4"] {
        let o = temp_dir(&format!("resume-{tp}"));
        let report = run(&tiny_args(
            &["--tp", tp, "--steps", "1", "--resume", &ckpt],
            &o,
        ))
        .unwrap();
        resumed.push(report.losses[0]);
    }
    assert_close(
        &resumed[1..],
        &[resumed[0], resumed[0]],
        1e-5,
        "resumed loss at tp 2 and 4 vs tp 1",
    );
    assert!(
        resumed[0] < first.losses[0] - 0.2,
        "the resumed model is the trained one: {resumed:?} vs {:?}",
        first.losses
    );

    // The checkpoint carries the optimizer state and the step count: 20 steps, then a resume
    // for 20 more (at tp 2, and at tp 4 and 1), give the losses of 40 steps uninterrupted.
    let whole = run(&tiny_args(
        &["--tp", "2", "--steps", "40"],
        &temp_dir("whole"),
    ))
    .unwrap();
    // The first half saves every 7 steps (at 7 and 14), then at its end: the folder keeps the
    // last save only.
    let half_dir = temp_dir("half");
    let half = run(&tiny_args(
        &["--tp", "2", "--steps", "20", "--save-every", "7"],
        &half_dir,
    ))
    .unwrap();
    assert_eq!(half.losses[..], whole.losses[..20]);
    let mut saved: Vec<String> = std::fs::read_dir(&half.checkpoint)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    saved.sort();
    assert_eq!(saved, ["index.json", "step-20"]);
    let ckpt = half.checkpoint.to_str().unwrap().to_string();
    // Resumed on every path of the async layers, in both modes (the run above: reduce-scatter,
    // one block).
    let [one_block, split, ring] = Path::ALL;
    for (i, (tp, path, mode)) in [
        ("2", one_block, "reduce-scatter"),
        ("2", split, "reduce-scatter"),
        ("4", ring, "reduce-scatter"),
        ("4", split, "all-reduce"),
        ("2", ring, "all-reduce"),
        ("1", one_block, "all-reduce"),
    ]
    .into_iter()
    .enumerate()
    {
        let o = temp_dir(&format!("continue-{i}"));
        let mut extra = vec![
            "--tp", tp, "--mode", mode, "--steps", "20", "--resume", &ckpt,
        ];
        extra.extend(path.args());
        let rest = run(&tiny_args(&extra, &o)).unwrap();
        assert_eq!(rest.first_step, 20);
        assert_close(
            &rest.losses,
            &whole.losses[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} {mode} {path:?} vs uninterrupted"),
        );
        assert_eq!(rest.held_out.last().unwrap().0, 40);
        let csv = std::fs::read_to_string(o.join("loss.csv")).unwrap();
        assert!(csv.lines().nth(1).unwrap().starts_with("20,"), "{csv}");
    }
    // And with data parallelism: tp 2 x dp 2 and tp 4 x dp 2 (each replica reads the same
    // slices).
    for (tp, dp) in [("2", "2"), ("4", "2")] {
        let rest = run(&tiny_args(
            &["--tp", tp, "--dp", dp, "--steps", "20", "--resume", &ckpt],
            &temp_dir(&format!("continue-{tp}x{dp}")),
        ))
        .unwrap();
        assert_close(
            &rest.losses,
            &whole.losses[20..],
            1e-4,
            &format!("steps 20..40 resumed at tp {tp} x dp {dp} vs uninterrupted"),
        );
    }
    // A folder that is not a checkpoint (no index) is an error naming the missing index.
    let bare = temp_dir("bare");
    std::fs::create_dir_all(&bare).unwrap();
    let e = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--steps",
            "1",
            "--resume",
            bare.to_str().unwrap(),
        ],
        &temp_dir("bare-out"),
    ))
    .unwrap_err();
    assert!(e.contains("index.json"), "{e}");

    device().seed(3);
    let out = run_local(2, |g| {
        let model = GptConfig::new(24, 8, 16, 4, 1).init(&g, &device()).unwrap();
        let full = model.to_full_module().unwrap();
        let again = Gpt::shard_module(&full, &g)
            .unwrap()
            .to_full_module()
            .unwrap();
        let params = |m: &Gpt| {
            vec![
                f64s(m.tok.weight.val()),
                f64s(m.blocks[0].attn.qkv[0].weight.val()),
                f64s(m.head.as_ref().unwrap().weight.val()),
            ]
        };
        (params(&full), params(&again), full.tok.weight.val().dims())
    })
    .unwrap();
    for (full, again, dims) in out {
        assert_eq!(full, again);
        assert_eq!(dims, [24, 16], "the gathered table is the full vocabulary");
    }
}

#[test]
fn the_example_cli_runs_end_to_end_and_writes_its_outputs() {
    let _rng = rng_lock();
    let out = temp_dir("cli");
    let data = out.with_extension("txt");
    std::fs::write(&data, "hello tensor parallel world. ".repeat(20)).unwrap();
    let report = run(&tiny_args(
        &[
            "--tp",
            "2",
            "--steps",
            "4",
            "--mode",
            "reduce-scatter",
            "--schedule",
            "ring",
            "--eval-every",
            "3",
            "--sample-len",
            "40",
            "--profile",
            "--data",
            data.to_str().unwrap(),
        ],
        &out,
    ))
    .unwrap();
    assert_eq!(report.losses.len(), 4);
    // Held out before training, every 3 steps, and after the last.
    let steps: Vec<usize> = report.held_out.iter().map(|h| h.0).collect();
    assert_eq!(steps, vec![0, 3, 4]);
    assert!(report.held_out.iter().all(|h| h.1.is_finite() && h.1 > 0.0));
    // The values: the model learns the repeated sentence (measured 3.61 -> 2.98 -> 2.83), and the
    // checkpoint written at the end, evaluated afresh at tp = 1 and one block, gives the last
    // held-out loss (the held-out text, the evaluation batches, the trained weights).
    let held: Vec<f64> = report.held_out.iter().map(|h| h.1).collect();
    assert!(held[2] < held[1] && held[1] < held[0] - 0.3, "{held:?}");
    let again = run(&tiny_args(
        &[
            "--tp",
            "1",
            "--steps",
            "1",
            "--data",
            data.to_str().unwrap(),
            "--resume",
            out.join("checkpoint").to_str().unwrap(),
        ],
        &temp_dir("cli-eval"),
    ))
    .unwrap();
    assert_eq!(again.held_out[0].0, 4);
    assert_close(
        &[again.held_out[0].1],
        &[held[2]],
        1e-5,
        "held-out loss of the checkpoint at tp 1 vs at the end of the tp 2 run",
    );
    let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
    assert_eq!(csv.lines().count(), 6, "{csv}");
    assert!(csv.starts_with("step,loss,held_out_loss\n0,"), "{csv}");
    assert!(csv.lines().nth(5).unwrap().starts_with("4,,"), "{csv}");
    // The communication profile: the seed's path is there, and in comm.csv.
    let profile = report.profile.as_ref().expect("--profile");
    let row = |label: &str, op: &str| {
        profile
            .rows
            .iter()
            .find(|r| r.label == label && r.op == op)
            .unwrap_or_else(|| panic!("{label} {op} in\n{profile}"))
    };
    // 2 blocks x 2 row layers (attention out, MLP fc2) x 4 steps; the forward also runs in the
    // 3 held-out evaluations of 4 batches each.
    assert_eq!(
        row("RowParallelLinear.backward", "AllGather").calls,
        16,
        "{profile}"
    );
    let forwards = 4 * (4 + 3 * 4);
    assert_eq!(
        row("RowParallelLinear.forward", "ReduceScatter").calls,
        forwards
    );
    assert!(row("RowParallelLinear.backward", "AllGather").bytes > 0);
    let comm_csv = std::fs::read_to_string(out.join("comm.csv")).unwrap();
    assert!(
        comm_csv.contains("RowParallelLinear.backward,AllGather,16,"),
        "{comm_csv}"
    );
    // The sample: 40 characters of the data's own alphabet, also written to sample.txt.
    assert_eq!(report.sample.chars().count(), 40, "{:?}", report.sample);
    assert!(report.sample.chars().all(|c| "helo tnsrpawd.".contains(c)));
    assert_eq!(
        std::fs::read_to_string(out.join("sample.txt")).unwrap(),
        report.sample
    );
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(out.join("checkpoint/index.json").exists());
    assert!(report.tokens_per_s > 0.0);

    // Bad arguments are errors naming the values, not panics.
    let e = run(&tiny_args(&["--tp", "2", "--dp", "3"], &out)).unwrap_err();
    assert!(e.contains("--batch 4") && e.contains("--dp 3"), "{e}");
    let e = run(&tiny_args(&["--tp", "3"], &out)).unwrap_err();
    assert!(e.contains("not divisible") && e.contains('3'), "{e}");
    for (arg, value) in [("--lr", "nan"), ("--seq", "0"), ("--temperature", "inf")] {
        let e = run(&tiny_args(&[arg, value], &out)).unwrap_err();
        assert!(e.contains(arg) && e.to_lowercase().contains(value), "{e}");
    }
    // A diverging run stops with an error naming the step, and keeps its curve up to there.
    let diverge = temp_dir("diverge");
    let e = run(&tiny_args(&["--lr", "1e30", "--steps", "20"], &diverge)).unwrap_err();
    assert!(e.contains("at step") && e.contains("--keep-going"), "{e}");
    let step: usize = e
        .split("at step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    let csv = std::fs::read_to_string(diverge.join("loss.csv")).unwrap();
    let last_loss = csv
        .lines()
        .nth(step + 1)
        .unwrap()
        .split(',')
        .nth(1)
        .unwrap();
    assert!(!last_loss.parse::<f64>().unwrap().is_finite(), "{csv}");
    let kept = run(&tiny_args(
        &["--lr", "1e30", "--steps", "20", "--keep-going"],
        &temp_dir("keep-going"),
    ))
    .unwrap();
    assert_eq!(kept.losses.len(), 20);
    let e = run(&tiny_args(&["--data", "/nonexistent/file.txt"], &out)).unwrap_err();
    assert!(e.contains("/nonexistent/file.txt"), "{e}");
    // `--device cuda`: without the feature, or outside a launch, an error saying what to do.
    let e = run(&tiny_args(&["--device", "cuda"], &out)).unwrap_err();
    if cfg!(feature = "cuda") {
        assert!(
            e.contains("burn-tp-launch") || e.contains("WORLD_SIZE"),
            "{e}"
        );
    } else {
        assert!(e.contains("--features cuda"), "{e}");
    }
}

/// `train_gpt --dtype bf16` (bf16 forward and backward on f32 master weights) follows the f32 run:
/// over 100 steps at tp = 2 (the loss falls by more than 0.8 nats) the two curves stay within
/// 0.06 nats of each other at every step and end within 0.04. Measured: at most 0.021 apart; the
/// bf16 loss itself is a bf16 value (steps of 2^-7 near 1.5).
#[test]
fn train_gpt_in_bf16_follows_the_f32_curve() {
    let _rng = rng_lock();
    let out = std::env::temp_dir().join(format!("burn-tp-test-{}-bf16", std::process::id()));
    let args = |dtype: &str| {
        Args::try_parse_from([
            "train_gpt",
            "--quiet",
            "--tp",
            "2",
            "--steps",
            "100",
            "--batch",
            "4",
            "--seq",
            "16",
            "--d-model",
            "32",
            "--heads",
            "4",
            "--layers",
            "2",
            "--lr",
            "1e-2",
            "--eval-every",
            "100",
            "--sample-len",
            "0",
            "--dtype",
            dtype,
            "--out",
            out.to_str().unwrap(),
        ])
        .unwrap()
    };
    let f32_run = run(&args("f32")).unwrap().losses;
    let bf16_run = run(&args("bf16")).unwrap().losses;
    assert_eq!((f32_run.len(), bf16_run.len()), (100, 100));
    assert!(
        f32_run[99] < f32_run[0] - 0.8,
        "the model learns: {f32_run:?}"
    );
    // f64::max would drop a NaN: every step must be finite first.
    assert!(
        bf16_run.iter().all(|v| v.is_finite()),
        "a bf16 loss is not finite: {bf16_run:?}"
    );
    let worst = f32_run
        .iter()
        .zip(&bf16_run)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst < 0.06,
        "worst step differs by {worst}: {f32_run:?} vs {bf16_run:?}"
    );
    assert!(
        (f32_run[99] - bf16_run[99]).abs() < 0.04,
        "{f32_run:?} vs {bf16_run:?}"
    );
    assert_ne!(f32_run, bf16_run, "the bf16 run computes in bf16");
}
