//! `train_gpt` on the GPU: the loss falls; the Llama step at tp 1 and 2 (checks 5, 6).

use super::*;

/// A whole training step of the Llama (d 2048, 16 heads, 8 kv heads, 8 blocks, d_ff
/// 5632, seq 2048, batch 2, bf16 on f32 master weights, AdamW) at tp 1: tokens/s of the steps
/// after the first, and the model's TFLOP/s (Megatron's count: 6 N per token plus the causal
/// attention's 6 L s d). PyTorch's figure for the same model is `gpu_torch.py`'s, in the same
/// run. Uses the launch `train_gpt` set up (it runs after that check).
pub(super) fn llama_step(f: &mut Figures) -> Result<(), String> {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    let scratch = std::env::var("GPU_CHECK_SCRATCH").unwrap_or_else(|_| "/tmp/gpu-check".into());
    let dir = format!("{scratch}/llama_step");
    let (d, layers, seq, d_ff) = (2048usize, 8usize, 2048usize, 5632usize);
    let args = Args::try_parse_from([
        "train_gpt",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--arch",
        "llama",
        "--dtype",
        "bf16",
        "--d-model",
        "2048",
        "--heads",
        "16",
        "--kv-heads",
        "8",
        "--layers",
        "8",
        "--d-ff",
        "5632",
        "--seq",
        "2048",
        "--batch",
        "2",
        "--dropout",
        "0",
        "--steps",
        "3",
        "--eval-every",
        "1000",
        "--sample-len",
        "0",
        "--timeout",
        "120",
        "--quiet",
        "--out",
        &dir,
    ])
    .map_err(|e| e.to_string())?;
    let report = run(&args)?;
    // The vocabulary: about the corpus's characters, padded (a rounding of N here).
    let (n, flops) = llama_flops(128, d, layers, seq, d_ff);
    let tokens = report.step_tokens_per_s;
    println!(
        "  {tokens:.0} tokens/s, {:.1} model TFLOP/s (N about {:.0}M)",
        tokens * flops / 1e12,
        n / 1e6
    );
    f.num("llama_step.tokens_per_s", tokens.round());
    f.num(
        "llama_step.model_tflops",
        (tokens * flops / 1e10).round() / 100.0,
    );
    if !report.losses.iter().all(|l| l.is_finite()) {
        return Err(format!("losses {:?}", report.losses));
    }
    Ok(())
}

/// The check's Llama (8 kv heads of 16: k and v a quarter of q's width each): its parameters
/// N and its training FLOPs per token (Megatron's count: 6 N plus the causal attention's
/// 6 L s d).
fn llama_flops(vocab: usize, d: usize, layers: usize, seq: usize, d_ff: usize) -> (f64, f64) {
    let n = layers as f64 * (4.0 * (d * d) as f64 * 0.75 + 3.0 * (d * d_ff) as f64)
        + 2.0 * vocab as f64 * d as f64;
    (n, 6.0 * n + 6.0 * (layers * seq * d) as f64)
}

/// The Llama step at tp 2, ranks as threads sharing the GPU (the collectives through
/// the host: what one GPU can show of tp), and at tp 1 by the same code, bf16: tokens/s and
/// model TFLOP/s of each (`checks::llama_steps_on_threads`, 3 steps, the first a warm-up).
pub(super) fn llama_step_tp2(f: &mut Figures) -> Result<(), String> {
    use burn_tp::llama::LlamaConfig;
    use burn_tp_examples::checks::llama_steps_on_threads;
    let (vocab, d, layers, seq, d_ff, batch) = (128usize, 2048usize, 8usize, 2048, 5632, 2);
    let config = LlamaConfig::new(vocab, seq, d, 16, 8, layers, d_ff);
    let (_, flops) = llama_flops(vocab, d, layers, seq, d_ff);
    let device = Device::cuda(0);
    for tp in [1, 2] {
        let out = llama_steps_on_threads(&config, tp, &device, (batch, 3), FloatDType::BF16)?;
        if !out.losses.iter().all(|l| l.is_finite()) {
            return Err(format!("tp {tp}: losses {:?}", out.losses));
        }
        let tokens = (batch * seq) as f64 / out.step_s;
        println!(
            "  tp {tp} (threads on one GPU): {tokens:.0} tokens/s, {:.1} model TFLOP/s, \
             losses {:?}",
            tokens * flops / 1e12,
            out.losses
        );
        f.num(
            format!("llama_step_threads.tp{tp}.tokens_per_s"),
            tokens.round(),
        );
        f.num(
            format!("llama_step_threads.tp{tp}.model_tflops"),
            (tokens * flops / 1e10).round() / 100.0,
        );
    }
    Ok(())
}

pub(super) fn train_gpt(f: &mut Figures) -> Result<(), String> {
    use burn_tp_examples::train_gpt::{Args, run};
    use clap::Parser;
    // A launch of one rank, set up here: the store on a free port of this host.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // SAFETY: no other thread reads the environment while this check runs (the earlier checks'
    // threads have ended).
    unsafe {
        std::env::set_var("RANK", "0");
        std::env::set_var("WORLD_SIZE", "1");
        std::env::set_var("LOCAL_RANK", "0");
        std::env::set_var("MASTER_ADDR", "127.0.0.1");
        std::env::set_var("MASTER_PORT", port.to_string());
    }
    let scratch = std::env::var("GPU_CHECK_SCRATCH").unwrap_or_else(|_| "/tmp/gpu-check".into());
    let dir = format!("{scratch}/train_gpt");
    let args = Args::try_parse_from([
        "train_gpt",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--steps",
        "30",
        "--eval-every",
        "15",
        "--sample-len",
        "0",
        "--timeout",
        "60",
        "--quiet",
        "--out",
        &dir,
    ])
    .map_err(|e| e.to_string())?;
    let report = run(&args)?;
    let (first, last) = (report.losses[0], report.losses[report.losses.len() - 1]);
    println!(
        "  loss {first:.4} -> {last:.4} over {} steps, {:.0} tokens/s",
        report.losses.len(),
        report.tokens_per_s
    );
    f.num("train_gpt.first_loss", first);
    f.num("train_gpt.last_loss", last);
    f.num("train_gpt.tokens_per_s", report.tokens_per_s.round());
    // A NaN loss fails too.
    if last.is_nan() || last >= first - 0.5 {
        return Err(format!("the loss did not fall: {first} -> {last}"));
    }
    Ok(())
}
