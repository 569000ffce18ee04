//! `cargo run --release --example train_gpt -- --help`

use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;

// Freed blocks above glibc's 32 MiB kept for the next step's same-sized buffers instead of
// unmapped and page-faulted back (`burn_tp::alloc`); on once the run calls
// `keep_freed_memory` (off with BURN_TP_KEEP_FREED_MEMORY=0), at most 512 MiB held.
#[global_allocator]
static ALLOC: burn_tp::alloc::BlockCache = burn_tp::alloc::BlockCache::new(16 << 20, 512 << 20);

fn main() {
    let args = Args::parse();
    // Under mpirun (Open MPI, MPICH) only rank 0 introduces the run.
    let mpi_rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok());
    if mpi_rank.is_none_or(|r| r == "0") {
        println!(
            "{}\noverlap: {}",
            burn_tp_examples::train_gpt::describe(&args),
            burn_tp_examples::train_gpt::overlap_path(&args)
        );
    }
    match run(&args) {
        // Under mpirun every process gets here: rank 0 speaks for the run.
        Ok(report) if report.rank != 0 => {}
        Ok(report) => {
            let first = report.losses.first().copied().unwrap_or(f64::NAN);
            let last = report.losses.last().copied().unwrap_or(f64::NAN);
            let held = report.held_out.last().map_or(f64::NAN, |h| h.1);
            println!(
                "{}: train loss {first:.4} -> {last:.4}, held-out {held:.4} (unigram entropy \
                 {:.4}), {:.0} tokens/s ({:.0} in the steps after the first); wrote {}",
                burn_tp_examples::train_gpt::describe(&args),
                report.unigram_entropy,
                report.tokens_per_s,
                report.step_tokens_per_s,
                args.out.display()
            );
            let t = report.checkpoint_times;
            println!(
                "checkpoint {}: saved in {:.2} s{}",
                report.checkpoint.display(),
                t.save_s,
                if args.resume.is_some() {
                    format!(", resumed from --resume in {:.2} s", t.load_s)
                } else {
                    String::new()
                },
            );
            if !report.stage_idle.is_empty() {
                let each: Vec<String> = report
                    .stage_idle
                    .iter()
                    .enumerate()
                    .map(|(s, (idle, step))| {
                        format!("stage {s} {:.0}%", 100.0 * idle / step.max(1e-12))
                    })
                    .collect();
                println!(
                    "pipeline: idle waiting for activations or gradients: {} (pipeline.csv)",
                    each.join(", ")
                );
            }
            if !report.expert_tokens.is_empty() {
                let routed: u64 = report.expert_tokens.iter().sum();
                let (min, max) = report
                    .expert_tokens
                    .iter()
                    .fold((u64::MAX, 0), |(a, b), &t| (a.min(t), b.max(t)));
                println!(
                    "experts: {routed} assignments, {min} to {max} per expert (experts.csv); \
                     {} dropped by the capacity",
                    report.expert_dropped
                );
            }
            if let Some(profile) = &report.profile {
                println!("communication of rank 0 (also in comm.csv):\n{profile}");
            }
            if !report.sample.is_empty() {
                println!(
                    "sample (temperature {}):\n{}",
                    args.temperature, report.sample
                );
            }
        }
        Err(e) => {
            eprintln!("train_gpt: {e}");
            std::process::exit(1);
        }
    }
}
