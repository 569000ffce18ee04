//! Where the ranks run: threads of this process, one process per GPU (`burn-tp-launch`), or
//! one process per rank under `mpirun`.

use std::path::Path;

use burn::tensor::Device;
use burn_tp::comm::{LocalGroup, LocalGroupOptions};
use burn_tp::local::run_ranks;

use super::train::{RankOut, train_rank};
use super::trainable::Trainable;
use super::{Args, DeviceKind, Transport};
use crate::eval::Data;

/// Runs every rank of the run (threads on the CPU, or this process's GPU) with model `M`;
/// returns (this process's rank, what it brought back).
pub(super) fn launch<M: Trainable>(
    args: &Args,
    config: M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    match args.device {
        DeviceKind::Cpu if args.transport == Transport::Mpi => {
            mpi_rank::<M>(args, &config, data, checkpoint)
        }
        DeviceKind::Cpu => {
            let device = Device::flex().autodiff();
            // One device RNG for every rank thread: seed it once, before they start; the layers
            // draw from the seed's own stream, on every transport alike.
            device.seed(args.seed);
            burn_tp::local::set_init_seed(args.seed);
            let world = args.tp * args.dp * args.pp;
            let options = LocalGroupOptions {
                profile: args.profile,
                timeout: group_timeout(args),
                link: args
                    .link_latency_us
                    .map(|us| burn_tp::comm::LinkModel::new(args.link_gb_s, us)),
                ..Default::default()
            };
            let groups = LocalGroup::with_options(world, options).map_err(|e| e.to_string())?;
            let (args2, data2, ckpt) = (args.clone(), data.clone(), checkpoint.to_path_buf());
            // A training program: keep the step's freed buffers mapped (README; off with
            // BURN_TP_KEEP_FREED_MEMORY=0).
            burn_tp::local::keep_freed_memory_unless_disabled();
            let results = run_ranks(groups, move |world_group| {
                train_rank::<M>(&args2, &config, &data2, world_group, &device, &ckpt)
                    .map_err(|e| e.to_string())
            })?;
            let out = results.into_iter().next().expect("rank 0");
            Ok((0, out.map_err(|e| format!("rank 0: {e}"))?))
        }
        DeviceKind::Cuda => cuda_rank::<M>(args, &config, data, checkpoint),
    }
}

/// `--timeout`, else the default of every group (`BURN_TP_TIMEOUT_S`, else 300 s).
fn group_timeout(args: &Args) -> std::time::Duration {
    args.timeout
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(std::time::Duration::from_secs_f64)
        .unwrap_or_else(|| LocalGroupOptions::default().timeout)
}

/// This process's rank of a `--device cuda` launch: one GPU (`LOCAL_RANK`), NCCL over the
/// launch's store. Returns (rank, losses).
#[cfg(feature = "cuda")]
fn cuda_rank<M: Trainable>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    let (world, local_rank, _keep) = nccl_world((args.tp, args.dp), group_timeout(args))?;
    let rank = world.rank();
    let device = Device::cuda(local_rank).autodiff();
    device.seed(args.seed);
    burn_tp::local::set_init_seed(args.seed);
    let out = train_rank::<M>(args, config, data, world, &device, checkpoint)
        .map_err(|e| format!("rank {rank}: {e}"))?;
    Ok((rank, out))
}

/// This process's NCCL world under `burn-tp-launch` (one process per GPU), checked to hold
/// `tp x dp` processes and burn's kernels to be compilable; its GPU (`LOCAL_RANK`), and what
/// must live while it trains (the launch's store). `train_gpt` and `learner_llama` share it.
#[cfg(feature = "cuda")]
pub(crate) fn nccl_world(
    (tp, dp): (usize, usize),
    timeout: std::time::Duration,
) -> Result<(burn_tp::comm::ProcessGroup, usize, Box<dyn std::any::Any>), String> {
    use burn_tp::comm::nccl::NcclGroup;
    use burn_tp::comm::store::LaunchEnv;
    let env = LaunchEnv::from_env().map_err(|e| {
        format!("--device cuda runs one process per GPU: start it with burn-tp-launch ({e})")
    })?;
    if env.world_size != tp * dp {
        return Err(format!(
            "--device cuda: the launch has WORLD_SIZE {} but --tp {tp} x --dp {dp} = {}",
            env.world_size,
            tp * dp
        ));
    }
    // burn's kernels need NVRTC, no newer than the driver: say so now, not from deep in cubecl.
    let probe = burn_tp::comm::nccl::probe().map_err(|e| e.to_string())?;
    if let Some(problem) = probe.kernel_problem() {
        return Err(format!("--device cuda: {problem}"));
    }
    let (server, store) = env.rendezvous(timeout).map_err(|e| e.to_string())?;
    let nccl = NcclGroup::new(&env, &store, timeout).map_err(|e| e.to_string())?;
    let keep: Box<dyn std::any::Any> = Box::new((server, store));
    Ok((
        burn_tp::comm::ProcessGroup::from_nccl(nccl),
        env.local_rank,
        keep,
    ))
}

#[cfg(not(feature = "cuda"))]
fn cuda_rank<M: Trainable>(
    _: &Args,
    _: &M::Config,
    _: &Data,
    _: &Path,
) -> Result<(usize, RankOut), String> {
    Err(
        "--device cuda needs the `cuda` feature: cargo run --release --example train_gpt \
         --features cuda (see docs/guide/mpi-gpu.md: burn's CUDA backend cannot be linked on machines without \
         network access)"
            .into(),
    )
}

/// This process's rank of a `--transport mpi` run under `mpirun` (one rank per process, the
/// world from MPI). Returns (rank, what it brought back). A rank that fails ends the job
/// (`MPI_Abort`): its peers may be waiting for it in a collective.
#[cfg(feature = "mpi")]
fn mpi_rank<M: Trainable>(
    args: &Args,
    config: &M::Config,
    data: &Data,
    checkpoint: &Path,
) -> Result<(usize, RankOut), String> {
    use burn_tp::comm::mpi::MpiRuntime;
    let runtime = MpiRuntime::init().map_err(|e| e.to_string())?;
    let rank = runtime.rank();
    if runtime.world_size() != args.tp * args.dp * args.pp {
        let pp = match args.pp {
            1 => String::new(),
            pp => format!(" x --pp {pp}"),
        };
        eprintln!(
            "train_gpt: --transport mpi: mpirun started {} processes but --tp {} x --dp {}{pp} = \
             {}",
            runtime.world_size(),
            args.tp,
            args.dp,
            args.tp * args.dp * args.pp
        );
        runtime.abort(1);
    }
    let world = burn_tp::comm::ProcessGroup::from_mpi(&runtime);
    world.set_timeout(group_timeout(args));
    // Each process a training program, as the threads' launch above.
    burn_tp::local::keep_freed_memory_unless_disabled();
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    burn_tp::local::set_init_seed(args.seed);
    match train_rank::<M>(args, config, data, world, &device, checkpoint) {
        Ok(out) => Ok((rank, out)),
        Err(e) => {
            eprintln!("train_gpt: rank {rank}: {e}");
            runtime.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_rank<M: Trainable>(
    _: &Args,
    _: &M::Config,
    _: &Data,
    _: &Path,
) -> Result<(usize, RankOut), String> {
    Err(
        "--transport mpi needs the `mpi` feature and a system MPI: cargo build --release \
         --example train_gpt --features mpi, then mpirun -n TPxDPxPP (see docs/guide/mpi-gpu.md)"
            .into(),
    )
}
