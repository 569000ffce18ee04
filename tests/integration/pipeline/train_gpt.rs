//! `train_gpt --pp` end to end: the unpipelined run's curve at every pipeline layout, its
//! checkpoints across pp, what the pipeline refuses.

use super::*;

/// `train_gpt --pp` (the Llama with dropout 0.1, 4 blocks) gives the loss curve and held-out
/// losses of the unpipelined run at pp 2 and 4, with tp 2 or dp 2 beside it, every schedule, and
/// in bf16, with each block recomputed, with the dp reduction overlapped in buckets or sharded
/// (the distributed optimizer), and its sample through the pipeline is the same text; its
/// checkpoint (the whole model's, each stage writing its blocks) resumes at pp 1
/// and 4 on the uninterrupted curve;
/// what the pipeline does not run yet is refused, naming the flag.
#[test]
fn train_gpt_pipelined_gives_the_unpipelined_curve() {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let _rng = rng_lock();
    let root = std::env::temp_dir().join(format!("burn-tp-pp-{}", std::process::id()));
    let args = |extra: &[&str], out: &str| {
        let out = root.join(out);
        let mut argv = vec![
            "train_gpt",
            "--quiet",
            "--arch",
            "llama",
            "--layers",
            "4",
            "--batch",
            "8",
            "--seq",
            "16",
            "--eval-every",
            "2",
            "--out",
            out.to_str().unwrap(),
        ];
        argv.extend_from_slice(extra);
        if !extra.contains(&"--sample-len") {
            argv.extend(["--sample-len", "0"]);
        }
        if !extra.contains(&"--steps") {
            argv.extend(["--steps", "4"]);
        }
        Args::try_parse_from(argv)
    };
    // A sample longer than the context (--seq 16), so the text restarts once.
    let base = run(&args(&["--tp", "1", "--sample-len", "24"], "base").unwrap()).unwrap();
    assert_eq!(base.sample.chars().count(), 24);
    assert!(base.losses[3] < base.losses[0], "{:?}", base.losses);
    for (i, extra) in [
        &["--tp", "1", "--pp", "2", "--micro-batches", "4"][..],
        &[
            "--tp",
            "1",
            "--pp",
            "4",
            "--micro-batches",
            "8",
            "--profile",
        ],
        &[
            "--tp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--pp-schedule",
            "gpipe",
        ],
        &[
            "--tp",
            "1",
            "--dp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
        ],
        &[
            "--pp",
            "2",
            "--micro-batches",
            "4",
            "--pp-schedule",
            "interleaved",
            "--sample-len",
            "24",
        ],
        // Each block recomputed in its backward.
        &[
            "--pp",
            "2",
            "--micro-batches",
            "4",
            "--pp-schedule",
            "interleaved",
            "--recompute-layers",
        ],
        // The dp reduction in buckets overlapped with the backwards, and sharded.
        &[
            "--tp",
            "1",
            "--dp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--overlap-grad-reduce",
            "--bucket-mb",
            "0.01",
        ],
        &[
            "--dp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--pp-schedule",
            "interleaved",
            "--distributed-optimizer",
        ],
    ]
    .into_iter()
    .enumerate()
    {
        let r = run(&args(extra, &format!("pp{i}")).unwrap()).unwrap();
        let tag = format!("{extra:?}");
        // The sample through the pipeline (no KV cache): the unpipelined model's text.
        if extra.contains(&"--sample-len") {
            assert_eq!(r.sample, base.sample, "{tag}: sample");
        }
        assert_close(&r.losses, &base.losses, 1e-5, &format!("{tag}: losses"));
        let held = |h: &[(usize, f64)]| h.iter().map(|x| x.1).collect::<Vec<_>>();
        assert_close(
            &held(&r.held_out),
            &held(&base.held_out),
            1e-5,
            &format!("{tag}: held-out"),
        );
        // Each stage's idle time: some (the fill or the drain), less than its steps; in
        // pipeline.csv; with --profile each stage's transfers in its own profile.
        let pp: usize = extra[extra.iter().position(|a| *a == "--pp").unwrap() + 1]
            .parse()
            .unwrap();
        assert_eq!(r.stage_idle.len(), pp, "{tag}");
        for (s, (idle, step)) in r.stage_idle.iter().enumerate() {
            assert!(
                *idle > 0.0 && idle < step,
                "{tag}: stage {s}: {idle} of {step} s"
            );
        }
        let out = root.join(format!("pp{i}"));
        let csv = std::fs::read_to_string(out.join("pipeline.csv")).unwrap();
        assert_eq!(csv.lines().count(), pp + 1, "{csv}");
        if extra.contains(&"--profile") {
            let stage_3 = std::fs::read_to_string(out.join("comm-stage-3.csv")).unwrap();
            let transfers = stage_3
                .lines()
                .find(|l| l.starts_with("pipeline transfers"))
                .unwrap_or_else(|| panic!("{stage_3}"));
            // Per step the last stage receives 8 activations and sends 8 gradients (a 2-rank
            // broadcast each): 4 steps, and the held-out evaluations' activations.
            let calls: usize = transfers.split(',').nth(2).unwrap().parse().unwrap();
            assert!(calls >= 4 * 16, "{transfers}");
        }
    }
    // A checkpoint written at pp 2 after 2 steps resumes at pp 1 and at pp 4 on the curve.
    let first = run(&args(
        &[
            "--tp",
            "1",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--steps",
            "2",
        ],
        "first",
    )
    .unwrap())
    .unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    for (i, extra) in [
        &["--tp", "1"][..],
        &["--tp", "1", "--pp", "4", "--micro-batches", "4"],
    ]
    .into_iter()
    .enumerate()
    {
        let extra = [extra, &["--steps", "2", "--resume", &ckpt]].concat();
        let r = run(&args(&extra, &format!("resumed{i}")).unwrap()).unwrap();
        assert_close(
            &r.losses,
            &base.losses[2..4],
            1e-5,
            &format!("{extra:?}: resumed"),
        );
    }
    // bf16: activations travel widened and come back in the model's dtype; the micro-batches'
    // losses round on their own, so bf16's tolerance.
    let bf16 = |extra: &[&str], out: &str| {
        let extra = [&["--dtype", "bf16", "--tp", "1"][..], extra].concat();
        run(&args(&extra, out).unwrap()).unwrap().losses
    };
    let want = bf16(&[], "bf16");
    let got = bf16(&["--pp", "2", "--micro-batches", "2"], "bf16-pp");
    assert_close(&got, &want, 1e-2, "bf16 at pp 2");
    for (extra, named) in [
        (&["--pp", "8"][..], "--layers 4"),
        (&["--pp", "2", "--micro-batches", "3"], "--micro-batches 3"),
        (
            &[
                "--pp",
                "2",
                "--micro-batches",
                "1",
                "--pp-schedule",
                "interleaved",
            ],
            "multiple of --pp",
        ),
        (
            &[
                "--pp",
                "4",
                "--micro-batches",
                "4",
                "--pp-schedule",
                "interleaved",
            ],
            "--virtual-stages 2",
        ),
    ] {
        let e = run(&args(extra, "refused").unwrap()).unwrap_err();
        assert!(e.contains(named), "{extra:?}: {e}");
    }
    std::fs::remove_dir_all(&root).ok();
}
