//! The checks of `train_gpt`'s arguments before anything runs: each an error naming the
//! flags and values.

use std::path::Path;

use super::args::{Arch, Args, DeviceKind, PpSchedule, Precision, Transport};

/// With a model imported from `init_from`, the first size flag given among `sizes` (`(flag,
/// value if given)`) as an error naming it: the sizes are the model's config's (`train_gpt` and
/// `learner_llama` alike).
pub(crate) fn refuse_sizes(
    init_from: Option<&Path>,
    sizes: &[(&str, Option<usize>)],
) -> Result<(), String> {
    let given = sizes.iter().find_map(|(f, v)| v.map(|v| (f, v)));
    match (init_from, given) {
        (Some(dir), Some((flag, value))) => Err(format!(
            "{flag} {value} with --init-from {}: the model's sizes come from its config.json \
             (drop {flag})",
            dir.display()
        )),
        _ => Ok(()),
    }
}

pub(super) fn check(args: &Args) -> Result<(), String> {
    if let Some(us) = args.link_latency_us {
        if !(us.is_finite() && us >= 0.0 && args.link_gb_s.is_finite() && args.link_gb_s > 0.0) {
            return Err(format!(
                "--link-latency-us must be >= 0 and --link-gb-s > 0 (got {us}, {})",
                args.link_gb_s
            ));
        }
        if args.device == DeviceKind::Cuda {
            return Err(
                "--link-latency-us simulates a link between CPU ranks; with --device \
                        cuda the ranks talk over NCCL"
                    .into(),
            );
        }
    }
    if args.transport == Transport::Mpi && args.device == DeviceKind::Cuda {
        return Err("--transport mpi runs CPU ranks; --device cuda ranks talk over NCCL".into());
    }
    if args.transport == Transport::Mpi && args.link_latency_us.is_some() {
        return Err(
            "--link-latency-us simulates a link between ranks as threads; with --transport mpi \
             the ranks talk over MPI"
                .into(),
        );
    }
    if args.tp == 0 || args.dp == 0 || args.pp == 0 || args.micro_batches == 0 {
        return Err(format!(
            "--tp, --dp, --pp and --micro-batches must be at least 1 (got tp {} dp {} pp {} \
             micro-batches {})",
            args.tp, args.dp, args.pp, args.micro_batches
        ));
    }
    // A replica's sequences (`--cp` dp ranks share one replica's).
    let replicas = (args.dp / args.cp.max(1)).max(1);
    if !(args.batch / replicas).is_multiple_of(args.micro_batches) {
        return Err(format!(
            "--batch {} / (--dp {} / --cp {}) is not divisible by --micro-batches {}",
            args.batch, args.dp, args.cp, args.micro_batches
        ));
    }
    if args.pp > 1 {
        let layers = args.layers();
        let v = match args.pp_schedule {
            PpSchedule::Interleaved => args.virtual_stages,
            _ => 1,
        };
        if v == 0 {
            return Err("--virtual-stages must be at least 1".into());
        }
        if args.init_from.is_none() && args.pp * v > layers {
            return Err(format!(
                "--pp {} x --virtual-stages {v} is more stages than --layers {layers} (each \
                 stage needs a block)",
                args.pp
            ));
        }
        if v > 1 && !args.micro_batches.is_multiple_of(args.pp) {
            return Err(format!(
                "--pp-schedule interleaved needs --micro-batches ({}) to be a multiple of --pp \
                 ({})",
                args.micro_batches, args.pp
            ));
        }
        // What the pipeline does not run yet.
        let refused = [(args.device == DeviceKind::Cuda, "--device cuda")];
        if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
            return Err(format!(
                "--pp {} does not run with {flag} yet (CPU ranks)",
                args.pp
            ));
        }
    }
    if args.cp == 0 || !args.dp.is_multiple_of(args.cp) {
        return Err(format!(
            "--cp {} must divide --dp {} (sequences are split over data-parallel ranks)",
            args.cp, args.dp
        ));
    }
    if args.cp > 1 {
        if !args.seq.is_multiple_of(2 * args.cp) {
            return Err(format!(
                "--seq {} is not a multiple of 2 x --cp {} (each cp rank holds two equal chunks)",
                args.seq, args.cp
            ));
        }
        // What context parallelism does not run with yet.
        let refused = [
            (args.ep > 1, "--ep"),
            (args.device == DeviceKind::Cuda, "--device cuda"),
        ];
        if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
            return Err(format!("--cp {} does not run with {flag} yet", args.cp));
        }
    }
    let replicas = args.dp / args.cp.max(1);
    if !args.batch.is_multiple_of(replicas) {
        return Err(format!(
            "--batch {} is not divisible by --dp {} / --cp {} (the batches of a step)",
            args.batch, args.dp, args.cp
        ));
    }
    if args.ep == 0 || !args.dp.is_multiple_of(args.ep) {
        return Err(format!(
            "--ep {} must divide --dp {} (experts are split over data-parallel ranks)",
            args.ep, args.dp
        ));
    }
    if args.experts().is_some() && (!args.is_llama() || args.init_from.is_some()) {
        return Err(
            "--experts / --arch moe build a fresh MoE Llama (without --init-from: an imported \
             model brings its own experts)"
                .into(),
        );
    }
    if args.is_lora() && !args.is_llama() {
        return Err(
            "--lora-rank / --peft-from fine-tune a Llama-family model (--arch llama)".into(),
        );
    }
    if args.lora_rank.is_some() && args.peft_from.is_some() {
        return Err(
            "--lora-rank and --peft-from both given: a PEFT adapter brings its own rank".into(),
        );
    }
    if args.peft_from.is_some() && args.init_from.is_none() {
        return Err("--peft-from reads an adapter over --init-from's model".into());
    }
    if args.export_peft.is_some() && !args.is_lora() {
        return Err("--export-peft writes LoRA adapters: with --lora-rank or --peft-from".into());
    }
    if args.merge_lora && (!args.is_lora() || args.export_hf.is_none()) {
        return Err(
            "--merge-lora writes a LoRA run's merged model: with --lora-rank or --peft-from, and \
             --export-hf DIR"
                .into(),
        );
    }
    if args.is_lora() && args.export_hf.is_some() && !args.merge_lora {
        return Err(
            "--export-hf of a LoRA run: add --merge-lora to write the base with the adapters \
             merged in (or --export-peft DIR for the adapters alone)"
                .into(),
        );
    }
    if args.qlora && !args.is_lora() {
        return Err("--qlora quantizes a LoRA run's base: with --lora-rank or --peft-from".into());
    }
    if args.qlora && args.dtype != Precision::F32 {
        return Err(
            "--qlora with --dtype bf16: the dequantized base is f32 (run it with --dtype f32)"
                .into(),
        );
    }
    if let Some(c) = args.lora() {
        c.short_targets()
            .map_err(|e| format!("--lora-rank / --lora-targets: {e}"))?;
    }
    if args.capacity_factor.is_some() && args.experts().is_none() && args.init_from.is_none() {
        return Err(
            "--capacity-factor limits a mixture of experts' tokens: with --experts / --arch moe \
             or an imported MoE model"
                .into(),
        );
    }
    if let Some(n) = args.experts()
        && (args.top_k == 0 || args.top_k > n)
    {
        return Err(format!(
            "--top-k {} must be between 1 and --experts {n}",
            args.top_k
        ));
    }
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    if !(args.bucket_mb.is_finite() && args.bucket_mb > 0.0) {
        return Err(format!(
            "--bucket-mb must be a positive number (got {})",
            args.bucket_mb
        ));
    }
    if args.save_every == Some(0) {
        return Err("--save-every must be at least 1".into());
    }
    if !args.is_llama() && (args.init_from.is_some() || args.export_hf.is_some()) {
        return Err(
            "--init-from and --export-hf read and write Hugging Face models (the Llama \
                    and Gemma families): use --arch llama"
                .into(),
        );
    }
    refuse_sizes(args.init_from.as_deref(), &args.size_flags())?;
    if let Some(c) = args.clip_grad
        && !(c.is_finite() && c > 0.0)
    {
        return Err(format!("--clip-grad must be a positive number (got {c})"));
    }
    if args.reshard_after_forward && args.fsdp_shard().is_none() {
        return Err("--reshard-after-forward is an --fsdp option (add --fsdp)".into());
    }
    if let Some(n) = args.fsdp_shard() {
        if n == 0 || !args.dp.is_multiple_of(n) {
            return Err(format!(
                "--hsdp {n} must divide --dp {} (parameters are split over data-parallel ranks)",
                args.dp
            ));
        }
        // What fully sharded data parallelism does not run with yet.
        let refused = [
            (
                args.recompute_layers,
                "--recompute-layers (use --reshard-after-forward)",
            ),
            (
                args.overlap_grad_reduce,
                "--overlap-grad-reduce (its reduce-scatters overlap already)",
            ),
            (
                args.distributed_optimizer,
                "--distributed-optimizer (its state is already sharded)",
            ),
        ];
        if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
            return Err(format!("--fsdp does not run with {flag}"));
        }
    }
    if args.recompute_layers && (args.overlap_grad_reduce || args.distributed_optimizer) {
        return Err(
            "--recompute-layers runs one backward per block: its gradients are averaged over dp \
             after them (drop --overlap-grad-reduce / --distributed-optimizer)"
                .into(),
        );
    }
    if args.seq == 0 || args.batch == 0 || args.eval_every == 0 {
        return Err(format!(
            "--seq, --batch and --eval-every must be at least 1 (got {}, {}, {})",
            args.seq, args.batch, args.eval_every
        ));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr must be a positive number (got {})", args.lr));
    }
    if let Some(p) = args.dropout {
        if args.arch == Arch::Gpt && p != 0.0 {
            return Err(format!(
                "--dropout {p}: the GPT has no dropout (use --arch llama)"
            ));
        }
        if !(0.0..1.0).contains(&p) {
            return Err(format!("--dropout must be in [0, 1) (got {p})"));
        }
    }
    if args.arch == Arch::Gpt && (args.kv_heads.is_some() || args.d_ff.is_some()) {
        return Err("--kv-heads and --d-ff are Llama options (use --arch llama)".into());
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(format!(
            "--temperature must be a number >= 0 (got {})",
            args.temperature
        ));
    }
    Ok(())
}
