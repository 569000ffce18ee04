//! What a run describes of itself: the banner (and the plot's title), with an imported model's
//! own architecture, sizes and dropout; which path the parallel layers take.

use std::path::Path;

use burn_tp::hf::HfConfig;

use super::args::{Arch, Args, DEFAULT_DROPOUT, DeviceKind, Transport};

/// A one-line description of the run, for the banner and the plot's title: with `--init-from`,
/// the imported model's own architecture, sizes and dropout, and the folder it came from.
pub fn describe(args: &Args) -> String {
    let arch = match (&args.init_from, args.arch) {
        (Some(dir), _) => describe_imported(args, dir),
        (None, Arch::Gpt) => "tiny GPT".to_string(),
        (None, Arch::Llama | Arch::Moe) => format!(
            "Llama (kv heads {}, dropout {}{})",
            args.kv_heads(),
            args.dropout.unwrap_or(DEFAULT_DROPOUT),
            match args.experts() {
                Some(n) => format!(", {n} experts, top {}, ep {}", args.top_k, args.ep),
                None => String::new(),
            }
        ),
    };
    let pp = match args.pp {
        1 => String::new(),
        pp => format!(
            " pp={pp} ({} micro-batches, {:?})",
            args.micro_batches, args.pp_schedule
        ),
    };
    let cp = match args.cp {
        1 => String::new(),
        cp => format!(" (cp={cp}: each sequence split over {cp} of them)"),
    };
    let fsdp = match args.fsdp_shard() {
        None => String::new(),
        Some(n) if n == args.dp => format!(" fsdp{}", reshard(args)),
        Some(n) => format!(
            " hsdp (sharded over {n}, {} replicas){}",
            args.dp / n,
            reshard(args)
        ),
    };
    format!(
        "{arch}: tp={} dp={}{fsdp}{cp}{pp} {:?} {}schedule {:?}, {:?}, {} steps",
        args.tp,
        args.dp,
        args.mode,
        if args.no_async { "sync, " } else { "async, " },
        args.schedule,
        args.dtype.dtype(),
        args.steps
    )
}

/// The model of `--init-from DIR` as it will train: architecture, layers, width, heads / kv
/// heads, d_ff, vocabulary, dropout (and where it comes from), the weights' dtype, the folder.
fn describe_imported(args: &Args, dir: &Path) -> String {
    let hf = match HfConfig::from_dir(dir) {
        Ok(hf) => hf,
        Err(e) => return format!("the model of {}: {e}", dir.display()),
    };
    // `--dropout` replaces both of the config's rates (imported_llama_config,
    // imported_gemma_config).
    let (attention, residual) = match args.dropout {
        Some(p) => (p, p),
        None => (hf.attention_dropout, hf.residual_dropout),
    };
    let dropout = match args.dropout {
        Some(p) => format!(
            "dropout {p} (--dropout, over the config's attention {} / residual {})",
            hf.attention_dropout, hf.residual_dropout
        ),
        None if attention == residual => format!("dropout {attention} (its config)"),
        None => format!("dropout: attention {attention}, residual {residual} (its config)"),
    };
    let weights = weights_dtype(dir).map_or(String::new(), |d| format!(", {d} weights"));
    format!(
        "{} from {}: {} layers, d {}, {} heads / {} kv heads of {}, d_ff {}, vocabulary {}, \
         {dropout}{weights}",
        hf.architecture.names().0,
        dir.display(),
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_size(),
        hf.intermediate_size,
        hf.vocab_size,
    )
}

/// The dtype config.json says the weights are stored in (`dtype`, or the older `torch_dtype`).
fn weights_dtype(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    ["dtype", "torch_dtype"]
        .iter()
        .find_map(|k| v.get(*k)?.as_str().map(str::to_string))
}

/// Which path the parallel layers take in this run: whether their overlap schedules run block
/// by block (NCCL, or a simulated link) or take one block (ranks as threads without a link).
pub fn overlap_path(args: &Args) -> String {
    let schedule = format!("{:?}", args.schedule).to_lowercase();
    if args.no_async {
        "sync layers (--no-async): each collective completes before the compute that uses it".into()
    } else if args.tp == 1 {
        "tp 1: the layers communicate nothing".into()
    } else if args.device == DeviceKind::Cuda {
        format!("NCCL: the {schedule} schedule overlaps communication with compute on the GPU")
    } else if args.transport == Transport::Mpi {
        format!(
            "MPI: the {schedule} schedule overlaps communication with compute where each rank \
             has a spare core (else the async layers take one block; BURN_TP_MPI_OVERLAP=1|0 \
             decides)"
        )
    } else if let Some(us) = args.link_latency_us {
        format!(
            "simulated link ({us} us, {} GB/s): the {schedule} schedule overlaps communication \
             with compute, block by block",
            args.link_gb_s
        )
    } else {
        "ranks as threads without a link: the async layers take one block (the data moves on \
         the waiting thread, nothing to hide; --link-latency-us runs the schedules)"
            .into()
    }
}

/// How `--fsdp` keeps a block's gathered weights, for the banner.
fn reshard(args: &Args) -> &'static str {
    match args.reshard_after_forward {
        true => " (resharded after the forward)",
        false => "",
    }
}
