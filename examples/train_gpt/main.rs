//! `cargo run --release --example train_gpt -- --help`

use burn_tp_examples::train_gpt::{Args, run};
use clap::Parser;

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(report) => {
            let first = report.losses.first().copied().unwrap_or(f64::NAN);
            let last = report.losses.last().copied().unwrap_or(f64::NAN);
            println!(
                "tp={} dp={} {:?}: loss {first:.4} -> {last:.4} (unigram entropy {:.4}), {:.0} tokens/s; wrote {}",
                args.tp,
                args.dp,
                args.mode,
                report.unigram_entropy,
                report.tokens_per_s,
                args.out.display()
            );
        }
        Err(e) => {
            eprintln!("train_gpt: {e}");
            std::process::exit(1);
        }
    }
}
