//! `cargo run --release --example generate -- --model DIR --tp 2 --prompt-ids 1,2,3 \
//!     --max-new-tokens 12 --temperature 0`

use burn_tp_examples::generate::{Args, run};
use clap::Parser;

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(report) => println!("{}", report.json(&args)),
        Err(e) => {
            eprintln!("generate: {e}");
            std::process::exit(1);
        }
    }
}
