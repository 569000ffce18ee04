//! The Llama trained through Burn's Learner (`SupervisedTraining`) at tp 2: see
//! `burn_tp_examples::learner_llama` and README ("Burn's Learner").
//!
//! ```text
//! cargo run --release -p burn-tp-examples --features train --example learner_llama
//! # ranks as processes:
//! cargo build --release -p burn-tp-examples --features train,mpi --example learner_llama
//! mpirun -n 2 target/release/examples/learner_llama --transport mpi --plain
//! ```

use burn_tp_examples::learner_llama::{LearnerArgs, run};
use clap::Parser;

fn main() {
    let args = LearnerArgs::parse();
    match run(&args) {
        // Under mpirun, world rank 0 speaks for the run.
        Ok(report) if report.rank != 0 => {}
        Ok(report) => {
            println!(
                "{} training sequences per epoch; mean loss per epoch: train {:?}, valid {:?}",
                report.sequences, report.train_loss, report.valid_loss
            );
            println!(
                "metrics: {}/train and {}/valid; checkpoints: {}/checkpoints",
                args.out.display(),
                args.out.display(),
                args.out.display()
            );
        }
        Err(e) => {
            eprintln!("learner_llama: {e}");
            std::process::exit(1);
        }
    }
}
