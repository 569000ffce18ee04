//! `train_gpt --fsdp`: the losses and held-out losses of plain dp at every layout it composes
//! with (tp, both modes, HSDP, cp, pp, bf16, clipping), its checkpoint resuming at other
//! layouts with or without fsdp, and its errors.

use burn_tp_examples::train_gpt::run as run_gpt;

use crate::common::{assert_close, rng_lock};
use crate::train_gpt::{temp_dir, tiny_args};

#[test]
fn train_gpt_at_fsdp_gives_plain_dp_losses_and_resumes_at_any_layout() {
    let _rng = rng_lock();
    let args = |extra: &[&str], name: &str| {
        let mut argv = vec!["--arch", "llama", "--dropout", "0.1"];
        if !extra.contains(&"--steps") {
            argv.extend_from_slice(&["--steps", "6"]);
        }
        argv.extend_from_slice(extra);
        tiny_args(&argv, &temp_dir(name))
    };
    let want_run = run_gpt(&args(&["--tp", "1", "--dp", "1"], "fsdp-1")).unwrap();
    let want = want_run.losses.clone();
    let held_out = |r: &burn_tp_examples::train_gpt::Report| -> Vec<f64> {
        r.held_out.iter().map(|h| h.1).collect()
    };
    for extra in [
        &["--tp", "1", "--dp", "2", "--fsdp"][..],
        &[
            "--tp",
            "1",
            "--dp",
            "4",
            "--fsdp",
            "--reshard-after-forward",
        ],
        &["--tp", "1", "--dp", "4", "--hsdp", "2"],
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--fsdp",
            "--mode",
            "reduce-scatter",
        ],
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--fsdp",
            "--reshard-after-forward",
            "--mode",
            "all-reduce",
        ],
        // Context parallelism carved out of the same dp ranks the parameters are split over.
        &[
            "--tp",
            "1",
            "--dp",
            "4",
            "--cp",
            "2",
            "--fsdp",
            "--reshard-after-forward",
        ],
        // Pipeline stages, each stage's blocks sharded over its dp ranks.
        &[
            "--tp",
            "1",
            "--dp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--fsdp",
        ],
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
            "--fsdp",
            "--reshard-after-forward",
        ],
    ] {
        let got = run_gpt(&args(extra, "fsdp")).unwrap();
        assert_close(&got.losses, &want, 1e-5, &format!("{extra:?}"));
        // The evaluation runs on the shards too (each part gathered in turn).
        let what = format!("held-out, {extra:?}");
        assert_close(&held_out(&got), &held_out(&want_run), 1e-5, &what);
    }
    // Clipped by the global norm: the curve moves, and fsdp x tp 2 keeps it.
    let clip = ["--clip-grad", "0.05"];
    let want_clipped = run_gpt(&args(
        &[&["--tp", "1", "--dp", "1"][..], &clip].concat(),
        "fsdp-c",
    ))
    .unwrap()
    .losses;
    let moved = want_clipped
        .iter()
        .zip(&want)
        .any(|(c, w)| (c - w).abs() > 1e-5 * w.abs());
    assert!(
        moved,
        "clipping changes the curve: {want_clipped:?} vs {want:?}"
    );
    let at = [
        &["--tp", "2", "--dp", "2", "--fsdp", "--kv-heads", "2"][..],
        &clip,
    ]
    .concat();
    let got = run_gpt(&args(&at, "fsdp-c2")).unwrap().losses;
    assert_close(&got, &want_clipped, 1e-5, "clipped, tp 2 x fsdp 2");
    // bf16 compute over f32 shards: plain dp's bf16 curve within bf16's rounding.
    let bf16 = |extra: &[&str]| {
        let argv = [&["--tp", "1", "--dp", "2", "--dtype", "bf16"][..], extra].concat();
        run_gpt(&args(&argv, "fsdp-bf16")).unwrap().losses
    };
    let want_bf16 = bf16(&[]);
    assert_close(&bf16(&["--fsdp"]), &want_bf16, 2e-2, "bf16 fsdp");
    // bf16 compute gathers bf16 (half the bytes) and reduce-scatters f32 (the same bytes).
    let bytes = |extra: &[&str]| {
        let argv = [
            &["--tp", "1", "--dp", "2", "--fsdp", "--profile"][..],
            extra,
        ]
        .concat();
        let profile = run_gpt(&args(&argv, "fsdp-prof")).unwrap().profile.unwrap();
        let sum = |op: &str| -> u64 {
            let rows = profile.rows.iter().filter(|r| r.op == op);
            rows.map(|r| r.bytes).sum()
        };
        (sum("AllGather"), sum("ReduceScatter"))
    };
    for reshard in [&[][..], &["--reshard-after-forward"]] {
        let (f32_gather, f32_scatter) = bytes(reshard);
        let (bf16_gather, bf16_scatter) = bytes(&[reshard, &["--dtype", "bf16"]].concat());
        assert!(f32_gather > 0 && f32_scatter > 0, "{reshard:?}");
        assert_eq!(2 * bf16_gather, f32_gather, "{reshard:?}: gathers in bf16");
        assert_eq!(
            bf16_scatter, f32_scatter,
            "{reshard:?}: reduce-scatters in f32"
        );
    }
    // 3 steps fully sharded (each rank writing its rows), then 3 more at other layouts, the
    // rows read straight into the shards where the resumed run is fully sharded too.
    let pp = ["--pp", "2", "--micro-batches", "2"];
    let half = |first: &[&str], then: &[&[&str]]| halves(&args, &want, first, then);
    half(
        &["--tp", "1", "--dp", "4", "--fsdp"],
        &[
            &["--tp", "1", "--dp", "2"],
            &[
                "--tp",
                "2",
                "--dp",
                "2",
                "--fsdp",
                "--reshard-after-forward",
            ],
            &[&["--tp", "1", "--dp", "2", "--fsdp"][..], &pp].concat(),
        ],
    );
    half(
        &[&["--tp", "2", "--dp", "2", "--fsdp"][..], &pp].concat(),
        &[
            &["--tp", "1", "--dp", "1"],
            &["--tp", "1", "--dp", "4", "--hsdp", "2"],
        ],
    );
    half(
        &["--tp", "2", "--dp", "1"],
        &[&["--tp", "1", "--dp", "4", "--fsdp"]],
    );
    for (extra, needle) in [
        (
            &["--dp", "4", "--hsdp", "3"][..],
            "--hsdp 3 must divide --dp 4",
        ),
        (
            &["--dp", "2", "--reshard-after-forward"],
            "is an --fsdp option",
        ),
        (
            &[
                "--dp",
                "6",
                "--batch",
                "6",
                "--hsdp",
                "2",
                "--experts",
                "6",
                "--ep",
                "3",
            ],
            "the fsdp shard size 2 and ep 3 must each divide dp 6 and one of them the other",
        ),
        (
            &["--dp", "2", "--fsdp", "--distributed-optimizer"],
            "--fsdp does not run with --distributed-optimizer",
        ),
        (
            &["--clip-grad=-1"],
            "--clip-grad must be a positive number (got -1)",
        ),
    ] {
        let err = run_gpt(&args(extra, "fsdp-err")).unwrap_err().to_string();
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
}

/// `first` for the first half of `want`'s steps on its curve, then each of `then` resumed
/// from its checkpoint for the second half (`args`: a run's arguments, given the flags and a
/// scratch folder's name).
fn halves(
    args: &dyn Fn(&[&str], &str) -> burn_tp_examples::train_gpt::Args,
    want: &[f64],
    first: &[&str],
    then: &[&[&str]],
) {
    let at = want.len() / 2;
    let steps = at.to_string();
    let argv = [first, &["--steps", &steps]].concat();
    let run = run_gpt(&args(&argv, "fsdp-half")).unwrap();
    let what = format!("{first:?}, first half");
    assert_close(&run.losses, &want[..at], 1e-5, &what);
    let ckpt = run.checkpoint.to_str().unwrap().to_string();
    let rest_steps = (want.len() - at).to_string();
    for extra in then {
        let argv = [extra, &["--steps", &rest_steps, "--resume", &ckpt][..]].concat();
        let rest = run_gpt(&args(&argv, "fsdp-rest")).unwrap().losses;
        let what = format!("{first:?} resumed at {extra:?}");
        assert_close(&rest, &want[at..], 1e-5, &what);
    }
}

/// LoRA over a fully sharded base: the frozen base's rows split over dp like any parameter
/// (gathered untracked, no gradient), the adapters sharded and trained; the losses are plain
/// dp's; QLoRA's 8-bit base stays whole on every rank; the checkpoint holds the adapters alone
/// (the same tensors as plain dp's) and resumes without fsdp; a full fine-tune cannot resume
/// from it.
#[test]
fn a_lora_fine_tune_at_fsdp_gives_plain_dp_losses_and_saves_the_adapters_alone() {
    use burn_tp::checkpoint::INDEX;
    let _rng = rng_lock();
    let args = |extra: &[&str], name: &str| {
        let mut argv = vec!["--arch", "llama", "--kv-heads", "2", "--lora-rank", "4"];
        if !extra.contains(&"--steps") {
            argv.extend_from_slice(&["--steps", "4"]);
        }
        argv.extend_from_slice(extra);
        tiny_args(&argv, &temp_dir(name))
    };
    let plain = run_gpt(&args(&["--tp", "1", "--dp", "2"], "fsdp-lora-dp")).unwrap();
    let want = plain.losses.clone();
    for extra in [
        &["--tp", "1", "--dp", "2", "--fsdp"][..],
        &["--tp", "1", "--dp", "4", "--hsdp", "2"],
        &[
            "--tp",
            "2",
            "--dp",
            "2",
            "--fsdp",
            "--reshard-after-forward",
            "--mode",
            "reduce-scatter",
        ],
    ] {
        let got = run_gpt(&args(extra, "fsdp-lora")).unwrap().losses;
        assert_close(&got, &want, 1e-5, &format!("LoRA, {extra:?}"));
    }
    // QLoRA: the quantized base moves the curve, and fsdp keeps the moved curve.
    let qlora = |extra: &[&str]| {
        let argv = [&["--tp", "1", "--dp", "2", "--qlora"][..], extra].concat();
        run_gpt(&args(&argv, "fsdp-qlora")).unwrap().losses
    };
    let want_q = qlora(&[]);
    let moved = want_q.iter().zip(&want).any(|(q, w)| q != w);
    assert!(moved, "the 8-bit base changes the curve: {want_q:?}");
    assert_close(&qlora(&["--fsdp"]), &want_q, 1e-5, "QLoRA at fsdp 2");

    // Two steps at fsdp 2 x tp 2, then two at plain dp 2.
    let first = ["--tp", "2", "--dp", "2", "--fsdp", "--steps", "2"];
    let run = run_gpt(&args(&first, "fsdp-lora-half")).unwrap();
    assert_close(&run.losses, &want[..2], 1e-5, "fsdp LoRA, first half");
    let names = |dir: &std::path::Path| -> (std::collections::BTreeSet<String>, String) {
        let text = std::fs::read_to_string(dir.join(INDEX)).unwrap();
        let index: serde_json::Value = serde_json::from_str(&text).unwrap();
        let names = index["tensors"].as_object().unwrap().keys().cloned();
        (names.collect(), index["info"]["frozen_base"].to_string())
    };
    let (got, base) = names(&run.checkpoint);
    let (plain_names, plain_base) = names(&plain.checkpoint);
    // 2 blocks x 7 adapted linears x (A, B), each with AdamW's two moments.
    assert_eq!(got.len(), 2 * 7 * 2 * 3, "{got:?}");
    assert_eq!(
        got, plain_names,
        "the adapters and their moments, as plain dp saves them"
    );
    assert_eq!(base, plain_base);
    let ckpt = run.checkpoint.to_str().unwrap().to_string();
    let resume = ["--tp", "1", "--dp", "2", "--steps", "2", "--resume", &ckpt];
    let rest = run_gpt(&args(&resume, "fsdp-lora-rest")).unwrap().losses;
    assert_close(&rest, &want[2..], 1e-5, "fsdp LoRA resumed at plain dp");
    // The adapters alone are no full model: a full fine-tune cannot resume from them.
    let full = [
        &["--arch", "llama", "--kv-heads", "2", "--fsdp"][..],
        &resume,
    ]
    .concat();
    let err = run_gpt(&tiny_args(&full, &temp_dir("fsdp-lora-err")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("43 parameters, this model has 15"), "{err}");
}

/// Every part's gathers are posted ahead, while the part before it runs: unpipelined, and
/// under a pipeline (whose schedule fixes the order a stage asks for its parts), 1F1B and
/// interleaved, keeping the weights or resharding, on every stage. Counted in the
/// communication profile: no gather is issued when its part is asked for (a wrong prefetch
/// would leave its part to be gathered then, a missing one too).
#[test]
fn train_gpt_at_fsdp_gathers_every_part_ahead() {
    use burn_tp::fsdp::{ON_DEMAND, PREFETCHED};
    let _rng = rng_lock();
    // Two blocks a stage (a chunk, interleaved), so a stage's order has something to get wrong.
    let pp = ["--pp", "2", "--micro-batches", "2", "--layers", "4"];
    let interleaved = [
        &pp[..4],
        &[
            "--pp-schedule",
            "interleaved",
            "--virtual-stages",
            "2",
            "--layers",
            "8",
        ],
    ]
    .concat();
    for layout in [&[][..], &pp, &interleaved] {
        for reshard in [&[][..], &["--reshard-after-forward"]] {
            let argv = [
                &[
                    "--arch",
                    "llama",
                    "--steps",
                    "2",
                    "--dp",
                    "2",
                    "--fsdp",
                    "--profile",
                ][..],
                layout,
                reshard,
            ]
            .concat();
            let run = run_gpt(&tiny_args(&argv, &temp_dir("fsdp-ahead"))).unwrap();
            // (label, op, calls) of rank 0's profile and, pipelined, stage 1's first rank's.
            let rows = run.profile.unwrap().rows.into_iter();
            let mut rows: Vec<(String, String, u64)> =
                rows.map(|r| (r.label, r.op, r.calls)).collect();
            let out = run.checkpoint.parent().unwrap();
            if !layout.is_empty() {
                let csv = std::fs::read_to_string(out.join("comm-stage-1.csv")).unwrap();
                for line in csv.lines().skip(1) {
                    let f: Vec<&str> = line.split(',').collect();
                    rows.push((f[0].into(), f[1].into(), f[2].parse().unwrap()));
                }
            }
            let calls = |label: &str| -> u64 {
                let rows = rows.iter().filter(|r| r.0 == label && r.1 == "AllGather");
                rows.map(|r| r.2).sum()
            };
            let what = format!("{layout:?} {reshard:?}");
            assert!(calls(PREFETCHED) > 0, "{what}: gathers posted ahead");
            assert_eq!(calls(ON_DEMAND), 0, "{what}: gathers when asked");
        }
    }
}

/// A mixture of experts at fsdp, alone and x ep: the experts' rows split over the ranks
/// holding the same experts, the rest over dp; the losses are plain dp's and plain expert
/// parallelism's (dp 2 and 4, tp 1 and 2, HSDP, kept or resharded: at dp 4 some expert gets
/// no token on some rank, which once paired the ranks' reduce-scatters out of order); its
/// checkpoint (the whole model's, as `--ep` writes) resumes without fsdp, and plain ep's
/// resumes at fsdp.
#[test]
fn a_mixture_of_experts_at_fsdp_x_ep_gives_plain_eps_losses_and_resumes() {
    let _rng = rng_lock();
    let args = moe_args(&[]);
    for (plain, sharded) in [
        (&["--dp", "2"][..], &["--dp", "2", "--fsdp"][..]),
        (&["--dp", "2"], &["--tp", "2", "--dp", "2", "--fsdp"]),
        (&["--dp", "4"], &["--dp", "4", "--fsdp"]),
        (
            &["--dp", "4"],
            &["--dp", "4", "--fsdp", "--reshard-after-forward"],
        ),
        (
            &["--dp", "4", "--ep", "1"],
            &["--dp", "4", "--ep", "1", "--fsdp"],
        ),
        (
            &["--dp", "4", "--ep", "1"],
            &["--dp", "4", "--ep", "1", "--hsdp", "2"],
        ),
    ] {
        let want = run_gpt(&args(plain, "fsdp-ep-plain")).unwrap().losses;
        let got = run_gpt(&args(sharded, "fsdp-ep")).unwrap().losses;
        assert_close(&got, &want, 1e-5, &format!("{sharded:?} against {plain:?}"));
    }
    let want = run_gpt(&args(&["--dp", "2"], "fsdp-ep-want"))
        .unwrap()
        .losses;
    // Two steps at fsdp x ep, two more at plain ep; and the other way round.
    halves(&args, &want, &["--dp", "2", "--fsdp"], &[&["--dp", "2"]]);
    let resharded = ["--dp", "2", "--fsdp", "--reshard-after-forward"];
    halves(&args, &want, &["--dp", "2"], &[&resharded]);
}

/// A mixture of experts at fsdp under a pipeline (1F1B and interleaved, alone and x ep, kept
/// or resharded): each backward's gathered wholes reduce-scattered in the gathers' order
/// (micro-batches of two sequences leave some expert without a token on some rank, which pairs
/// autodiff's order of them out across ranks); the losses are the plain pipeline's, and the
/// checkpoint resumes without fsdp, and plain ep's at fsdp.
#[test]
fn a_mixture_of_experts_at_fsdp_under_a_pipeline_gives_the_plain_pipelines_losses() {
    let _rng = rng_lock();
    let pipeline = [
        "--tp",
        "1",
        "--dp",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "2",
    ];
    let args = moe_args(&pipeline);
    let interleaved = [
        "--ep",
        "1",
        "--layers",
        "4",
        "--pp-schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ];
    let interleaved_fsdp = [&interleaved[..], &["--fsdp"]].concat();
    for (plain, sharded) in [
        (&[][..], &["--fsdp"][..]),
        (
            &["--ep", "1"],
            &["--ep", "1", "--fsdp", "--reshard-after-forward"],
        ),
        (&interleaved, &interleaved_fsdp),
    ] {
        let want = run_gpt(&args(plain, "fsdp-pp-moe-plain")).unwrap().losses;
        let got = run_gpt(&args(sharded, "fsdp-pp-moe")).unwrap().losses;
        assert_close(&got, &want, 1e-5, &format!("{sharded:?} against {plain:?}"));
    }
    let want = run_gpt(&args(&[], "fsdp-pp-moe-want")).unwrap().losses;
    halves(&args, &want, &["--fsdp"], &[&[]]);
    halves(&args, &want, &[], &[&["--fsdp", "--reshard-after-forward"]]);
}

/// HSDP x ep: the dense rows split over a shard group and replicated over the groups, the
/// experts' rows over the ranks of a shard group holding them and replicated likewise (at
/// shard 4, ep 2 two ranks split each expert; at shard = ep none does; at shard 2, ep 4 a
/// shard group holds half the experts); the losses are plain ep's; the checkpoint (written by
/// each shard's first replica: at shard 2, ep 4 the experts' writers are not the dense
/// rows') resumes at plain ep.
#[test]
fn a_mixture_of_experts_at_hsdp_x_ep_gives_plain_eps_losses_and_resumes() {
    let _rng = rng_lock();
    let args = moe_args(&["--tp", "1", "--batch", "8"]);
    for (dp, shard, ep) in [("4", "2", "2"), ("8", "4", "2"), ("8", "2", "4")] {
        let plain = ["--dp", dp, "--ep", ep];
        let want = run_gpt(&args(&plain, "hsdp-ep-plain")).unwrap().losses;
        let hsdp = ["--dp", dp, "--ep", ep, "--hsdp", shard];
        let got = run_gpt(&args(&hsdp, "hsdp-ep")).unwrap().losses;
        assert_close(&got, &want, 1e-5, &format!("{hsdp:?} against {plain:?}"));
        halves(&args, &want, &hsdp, &[&plain]);
    }
}

/// The arguments of a tiny mixture of experts (4 experts, top 2, ep 2 and 4 steps unless
/// `extra` says otherwise) with `fixed` and a run's `extra`, writing to a scratch folder
/// `name`.
fn moe_args<'a>(
    fixed: &'a [&'a str],
) -> impl Fn(&[&str], &str) -> burn_tp_examples::train_gpt::Args + 'a {
    move |extra: &[&str], name: &str| {
        let mut argv = vec!["--arch", "moe", "--experts", "4", "--top-k", "2"];
        argv.extend_from_slice(fixed);
        if !extra.contains(&"--ep") {
            argv.extend_from_slice(&["--ep", "2"]);
        }
        if !extra.contains(&"--steps") {
            argv.extend_from_slice(&["--steps", "4"]);
        }
        argv.extend_from_slice(extra);
        tiny_args(&argv, &temp_dir(name))
    }
}
