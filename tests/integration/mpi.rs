//! `train_gpt --transport mpi` under `mpirun` (feature `mpi`): the thread run's losses from 4
//! processes (tp x dp) and 8 (tp x dp x pp), and a checkpoint written by 4 processes resumed by 2 and by
//! threads. The ranks are
//! this test binary running only `mpi_train_gpt_rank` (a no-op in a normal test run).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;

use crate::common::{assert_close, rng_lock};

const ARGS_VAR: &str = "BURN_TP_TEST_MPI_TRAIN_ARGS";

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-tp-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `base`, then `extra`, then `--out out`.
fn command_line(base: &[&str], extra: &[&str], out: &Path) -> Vec<String> {
    let mut v: Vec<String> = base.iter().chain(extra).map(|s| s.to_string()).collect();
    v.extend(["--out".to_string(), out.display().to_string()]);
    v
}

/// The tiny run of the other train_gpt tests, with `extra` and `--out out`.
fn argv(extra: &[&str], out: &Path) -> Vec<String> {
    let base = [
        "train_gpt",
        "--quiet",
        "--batch",
        "4",
        "--seq",
        "8",
        "--d-model",
        "16",
        "--heads",
        "4",
        "--layers",
        "2",
        "--lr",
        "1e-2",
        "--sample-len",
        "8",
    ];
    command_line(&base, extra, out)
}

/// `mpirun -n n` of this binary running only `test` (one rank), `argv` handed over in `var`;
/// its output. `overlap` sets `BURN_TP_MPI_OVERLAP` (the overlap schedules on or off; unset: by
/// the node's cores).
fn mpirun_test(
    n: usize,
    (test, var): (&str, &str),
    argv: &[String],
    overlap: Option<bool>,
) -> std::process::Output {
    let mut cmd = Command::new("mpirun");
    if let Some(on) = overlap {
        cmd.env("BURN_TP_MPI_OVERLAP", if on { "1" } else { "0" });
    }
    cmd.args(["--oversubscribe", "-n", &n.to_string()])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(var, argv.join("\u{1f}"))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl", "self,vader,tcp")
        .env("OMPI_MCA_pml", "ob1")
        .output()
        .expect(
            "mpirun (Open MPI) must be installed to test feature `mpi`: see docs/guide/mpi-gpu.md",
        )
}

/// `mpirun -n n` of this binary running train_gpt with `argv`, its output.
fn mpirun_output(n: usize, argv: &[String], overlap: Option<bool>) -> std::process::Output {
    mpirun_test(n, ("mpi::mpi_train_gpt_rank", ARGS_VAR), argv, overlap)
}

/// `mpirun -n n` of this binary running train_gpt with `argv` (and `--transport mpi`); the
/// losses rank 0 wrote to `loss.csv`.
fn mpirun(n: usize, mut argv: Vec<String>, overlap: Option<bool>) -> Vec<f64> {
    argv.extend(["--transport".into(), "mpi".into()]);
    let out_dir = PathBuf::from(&argv[argv.iter().position(|a| a == "--out").unwrap() + 1]);
    let out = mpirun_output(n, &argv, overlap);
    assert!(
        out.status.success(),
        "mpirun -n {n}: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let csv = std::fs::read_to_string(out_dir.join("loss.csv")).unwrap();
    csv.lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(1).and_then(|v| v.parse().ok()))
        .collect()
}

/// 4 MPI processes at tp 2 x dp 2 give the thread run's losses (to float tolerance: the
/// autodiff graph differs with the schedule), with the overlap schedules on and off; their
/// checkpoint resumes at 2 processes (tp 2) and at threads (tp 1 x dp 2)
/// on the uninterrupted curve.
#[test]
fn train_gpt_over_mpi_gives_the_thread_losses_and_its_checkpoint_resumes_anywhere() {
    let _rng = rng_lock();
    let threads = |extra: &[&str], name: &str| {
        run(&Args::try_parse_from(argv(extra, &temp_dir(name))).unwrap())
            .unwrap()
            .losses
    };
    let whole = threads(&["--tp", "2", "--dp", "2", "--steps", "20"], "whole");
    let first = temp_dir("first");
    // The overlap schedules on (the ring's parts read from the whole gather), then off (one
    // block), as the node's cores would decide.
    for overlap in [true, false] {
        let losses = mpirun(
            4,
            argv(&["--tp", "2", "--dp", "2", "--steps", "10"], &first),
            Some(overlap),
        );
        assert_close(
            &losses,
            &whole[..10],
            1e-5,
            &format!("mpirun -n 4 (tp 2 x dp 2, overlap {overlap}) vs threads"),
        );
    }

    let ckpt = first.join("checkpoint").display().to_string();
    let resume = ["--steps", "10", "--resume", &ckpt];
    let at_2 = mpirun(
        2,
        argv(
            &[&["--tp", "2", "--dp", "1"][..], &resume].concat(),
            &temp_dir("r2"),
        ),
        None,
    );
    assert_close(&at_2, &whole[10..], 1e-4, "resumed by 2 MPI processes");
    let at_threads = threads(&[&["--tp", "1", "--dp", "2"][..], &resume].concat(), "rt");
    assert_close(
        &at_threads,
        &whole[10..],
        1e-4,
        "resumed by threads (tp 1 x dp 2)",
    );

    // The other paths over MPI: the Llama in bf16 (16-bit sums by MPI's user ops), the dp
    // gradient buckets overlapped with the backward and the distributed optimizer, a mixture
    // of experts split over ep 2 (its tokens by MPI's all-to-all), context parallelism at cp 2,
    // fsdp 2.
    for extra in [
        &["--arch", "llama", "--dtype", "bf16"][..],
        &[
            "--arch",
            "llama",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--d-ff",
            "32",
            "--ep",
            "2",
        ],
        &[
            "--overlap-grad-reduce",
            "--distributed-optimizer",
            "--bucket-mb",
            "0.001",
        ],
        // Context parallelism: each sequence split over the 2 dp ranks, the keys and values
        // around their ring over MPI.
        &["--arch", "llama", "--cp", "2"],
        // Fully sharded: each block's weights gathered over MPI, their gradients
        // reduce-scattered back.
        &["--arch", "llama", "--fsdp", "--reshard-after-forward"],
    ] {
        let base = [&["--tp", "2", "--dp", "2", "--steps", "6"][..], extra].concat();
        let want = threads(&base, "paths");
        let got = mpirun(4, argv(&base, &temp_dir("paths-mpi")), None);
        assert_close(
            &got,
            &want,
            1e-5,
            &format!("mpirun -n 4 {extra:?} vs threads"),
        );
    }

    // Pipeline stages as processes: tp 2 x dp 2 x pp 2 (the Llama with dropout, 2 micro-batches
    // of one sequence per replica).
    let base = [
        "--arch",
        "llama",
        "--tp",
        "2",
        "--dp",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "2",
        "--steps",
        "6",
    ];
    let want = threads(&base, "pp");
    let got = mpirun(8, argv(&base, &temp_dir("pp-mpi")), None);
    assert_close(
        &got,
        &want,
        1e-5,
        "mpirun -n 8 tp 2 x dp 2 x pp 2 vs threads",
    );
    // Each stage's blocks fully sharded, the next part's gathers posted across the stages'
    // transfers (the prefetch); a mixture of experts at fsdp x ep, under a pipeline (each
    // micro-batch's leaves reduce-scattered after its backward) and at HSDP x ep; the last
    // two clipped (one sum over the world).
    let moe = [
        "--arch",
        "moe",
        "--experts",
        "4",
        "--tp",
        "1",
        "--dp",
        "4",
        "--ep",
        "2",
    ];
    let clip = ["--clip-grad", "0.05"];
    let pp = [
        "--dp",
        "2",
        "--ep",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "2",
    ];
    let pp_moe = [&moe[..6], &pp, &clip].concat();
    let hsdp_moe = [&moe[..], &["--hsdp", "2"], &clip].concat();
    for (n, extra) in [(8, &base[..]), (4, &moe), (4, &pp_moe), (4, &hsdp_moe)] {
        let extra = [extra, &["--fsdp"]].concat();
        let want = threads(&extra, "fsdp-more");
        let got = mpirun(n, argv(&extra, &temp_dir("fsdp-more-mpi")), None);
        assert_close(&got, &want, 1e-5, &format!("mpirun -n {n} {extra:?}"));
    }

    // A world that does not match tp x dp is an error naming both, on every process.
    let bad = argv(
        &["--tp", "2", "--dp", "2", "--transport", "mpi"],
        &temp_dir("bad"),
    );
    let out = mpirun_output(3, &bad, None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("mpirun started 3 processes but --tp 2 x --dp 2 = 4"),
        "{stderr}"
    );
}

const LEARNER_VAR: &str = "BURN_TP_TEST_MPI_LEARNER_ARGS";

/// `learner_llama`'s tiny run (2 epochs) with `extra`, into `out`.
fn learner_argv(extra: &[&str], out: &Path) -> Vec<String> {
    let base = [
        "learner_llama",
        "--plain",
        "--max-sequences",
        "32",
        "--batch",
        "4",
        "--seq",
        "16",
        "--d-model",
        "32",
        "--layers",
        "2",
        "--epochs",
        "2",
    ];
    command_line(&base, extra, out)
}

/// `mpirun -n n` of this binary running `learner_llama --transport mpi` with `argv`.
fn mpirun_learner(n: usize, argv: &[String]) -> std::process::Output {
    mpirun_test(n, ("mpi::mpi_learner_rank", LEARNER_VAR), argv, None)
}

/// Burn's Learner with ranks as MPI processes (`TensorParallel::on_processes`): 2 processes at
/// tp 2 and 4 at tp 2 x dp 2 (and fully sharded) log the thread run's per-step losses
/// (averaged over dp) and validation losses, and the 4 processes' checkpoint resumes on
/// threads at tp 1 on the uninterrupted curve. A world that is not
/// tp x dp is an error naming both.
#[test]
fn the_learner_over_mpi_gives_the_thread_runs_losses() {
    use crate::learner::logged;
    use burn_tp_examples::learner_llama::{LearnerArgs, run as learner};
    let _rng = rng_lock();
    let threads = |extra: &[&str], out: &Path| {
        learner(&LearnerArgs::try_parse_from(learner_argv(extra, out)).unwrap()).unwrap()
    };
    let ok = |out: &std::process::Output, what: &str| {
        assert!(
            out.status.success(),
            "{what}: {:?}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // The last fully sharded: each process writes its rows of the checkpoint.
    for (tp, dp, fsdp) in [(2, 1, false), (2, 2, false), (2, 2, true)] {
        let layout = ["--tp", &tp.to_string(), "--dp", &dp.to_string()].map(String::from);
        let mut layout: Vec<&str> = layout.iter().map(String::as_str).collect();
        if fsdp {
            layout.push("--fsdp");
        }
        let (t_dir, m_dir) = (temp_dir("learner-t"), temp_dir("learner-m"));
        threads(&layout, &t_dir);
        let mpi = [&layout[..], &["--transport", "mpi"]].concat();
        ok(
            &mpirun_learner(tp * dp, &learner_argv(&mpi, &m_dir)),
            "mpirun learner",
        );
        for epoch in [1, 2] {
            let what = format!("tp {tp} x dp {dp} (fsdp {fsdp}), epoch {epoch}");
            let (t_valid, m_valid) = (
                logged(&t_dir, "valid", epoch, "Loss"),
                logged(&m_dir, "valid", epoch, "Loss"),
            );
            assert_close(&m_valid, &t_valid, 1e-5, &format!("valid losses, {what}"));
            let (t_train, m_train) = (
                logged(&t_dir, "train", epoch, "Loss"),
                logged(&m_dir, "train", epoch, "Loss"),
            );
            // One item per step, the replicas' losses averaged, in both.
            assert_close(&m_train, &t_train, 1e-5, &format!("train losses, {what}"));
        }
        if dp == 2 {
            // The processes' epoch-1 checkpoint, resumed by one thread (tp 1).
            let resumed = temp_dir("learner-r");
            std::fs::create_dir_all(&resumed).unwrap();
            let from = m_dir.join("checkpoints");
            let to = resumed.join("checkpoints");
            std::fs::create_dir_all(&to).unwrap();
            std::fs::rename(from.join("epoch-1"), to.join("epoch-1")).unwrap();
            let report = threads(&["--tp", "1", "--dp", "2", "--resume", "1"], &resumed);
            let want = logged(&t_dir, "valid", 2, "Loss");
            let got = logged(&resumed, "valid", 2, "Loss");
            assert_close(&got, &want, 1e-4, "resumed at tp 1 x dp 2 from 4 processes");
            assert_eq!(report.valid_loss.len(), 1);
        }
    }
    let out = mpirun_learner(
        3,
        &learner_argv(
            &["--tp", "2", "--dp", "2", "--transport", "mpi"],
            &temp_dir("bad"),
        ),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("mpirun started 3 processes but --tp 2 x --dp 2 = 4"),
        "{stderr}"
    );
}

/// One rank of the Learner runs above, under mpirun (a no-op in a normal test run).
#[test]
fn mpi_learner_rank() {
    let Ok(joined) = std::env::var(LEARNER_VAR) else {
        return;
    };
    let args = burn_tp_examples::learner_llama::LearnerArgs::try_parse_from(joined.split('\u{1f}'))
        .unwrap();
    match burn_tp_examples::learner_llama::run(&args) {
        Ok(_) => std::process::exit(0),
        Err(e) => {
            eprintln!("learner_llama: {e}");
            std::process::exit(1);
        }
    }
}

/// One rank of the runs above, under mpirun (a no-op in a normal test run).
#[test]
fn mpi_train_gpt_rank() {
    let Ok(joined) = std::env::var(ARGS_VAR) else {
        return;
    };
    let args = Args::try_parse_from(joined.split('\u{1f}')).unwrap();
    match run(&args) {
        Ok(_) => std::process::exit(0),
        Err(e) => {
            eprintln!("train_gpt: {e}");
            std::process::exit(1);
        }
    }
}
