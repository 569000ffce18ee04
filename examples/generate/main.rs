//! `cargo run --release --example generate -- --model DIR --tp 2 --prompt-ids 1,2,3 \
//!     --max-new-tokens 12 --temperature 0`

use std::io::Write;

use burn_tp_examples::generate::{Args, run_streaming};
use clap::Parser;

fn main() {
    let args = Args::parse();
    let streamed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = streamed.clone();
    let stream = move |piece: &str| {
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{piece}");
        let _ = out.flush();
    };
    match run_streaming(&args, stream) {
        Ok(report) => {
            if streamed.load(std::sync::atomic::Ordering::Relaxed) {
                println!();
            }
            println!("{}", report.json(&args))
        }
        Err(e) => {
            eprintln!("generate: {e}");
            std::process::exit(1);
        }
    }
}
