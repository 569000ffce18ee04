//! Ranks as threads of one process: the runner that gives each rank its thread, its
//! [`ProcessGroup`] handle and its own share of the cores (the embedded default on the CPU; no
//! setup).
//!
//! Burn's Flex kernels (GEMMs through `gemm`, elementwise through rayon) use the rayon pool they
//! run in. Rank threads that shared the global pool would oversubscribe the cores `world` times
//! over; instead each rank runs inside a pool of its own (`max(1, cores / world)` threads).
//!
//! # Configuration
//! Two process-wide settings, each with one switch in code and one in the environment:
//!
//! | setting | in code | environment |
//! |---|---|---|
//! | threads of each rank's pool | [`RunOptions::threads_per_rank`] | `BURN_TP_THREADS_PER_RANK=N` |
//! | freed memory kept mapped (glibc) | [`keep_freed_memory`], [`RunOptions::keep_freed_memory`] | `BURN_TP_KEEP_FREED_MEMORY=1` / `0` |
//!
//! A library does not change the process's allocator unasked: the runner keeps freed memory
//! only when asked (the option, or `=1`); a training program (the example, the benches) calls
//! [`keep_freed_memory_unless_disabled`] at start, which `=0` turns off.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use burn::tensor::{Device, Distribution, Tensor};
use burn_std::rand::{SeedableRng, StdRng};

use burn_tp_comm::{LocalGroup, ProcessGroup};

/// Environment variable overriding the threads of each rank's pool.
pub(crate) const THREADS_PER_RANK_ENV: &str = "BURN_TP_THREADS_PER_RANK";

/// How many threads each of `world` rank threads gets: `BURN_TP_THREADS_PER_RANK` if set (and
/// positive), else `max(1, cores / world)`.
fn threads_per_rank(world: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    threads_for(
        std::env::var(THREADS_PER_RANK_ENV).ok().as_deref(),
        cores,
        world,
    )
}

fn threads_for(env: Option<&str>, cores: usize, world: usize) -> usize {
    env.and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or((cores / world.max(1)).max(1))
}

/// Environment variable: `1` makes the runner call [`keep_freed_memory`] (a library does not
/// change the process's allocator unasked); `0` stops [`keep_freed_memory_unless_disabled`], which
/// the example and the benches call.
pub(crate) const KEEP_FREED_MEMORY_ENV: &str = "BURN_TP_KEEP_FREED_MEMORY";

/// Options of [`run_ranks_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Threads of each rank's rayon pool; `None`: `BURN_TP_THREADS_PER_RANK` if set, else
    /// `max(1, cores / world)`.
    pub threads_per_rank: Option<usize>,
    /// Whether to call [`keep_freed_memory`] first; `None`: only if
    /// `BURN_TP_KEEP_FREED_MEMORY=1` (it changes the whole process's allocator settings).
    pub keep_freed_memory: Option<bool>,
}

/// Tells the allocator to keep freed memory mapped, so that the buffers of one training step
/// are reused by the next instead of being returned to the OS and page-faulted back: with
/// glibc, blocks up to 32 MiB come from the heap (`M_MMAP_THRESHOLD`) and the heap is not
/// trimmed (`M_TRIM_THRESHOLD`); larger blocks are kept by a [`crate::alloc::BlockCache`]
/// where the program installed one as its global allocator (the example does). The process
/// then keeps its peak heap, which a training loop reaches every step anyway. Process-wide and lasting, so opt-in: a training program calls it
/// (or [`keep_freed_memory_unless_disabled`]), or asks the runner to
/// ([`RunOptions::keep_freed_memory`]). Returns whether it applied (false off glibc, where it
/// does nothing).
pub fn keep_freed_memory() -> bool {
    // Blocks above glibc's ceiling: the program's `BlockCache`, if it installed one.
    crate::alloc::set_block_cache(true);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc's ceiling for the mmap threshold on 64-bit targets.
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        // Safety: mallopt only sets malloc parameters; any value is accepted or refused.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// [`keep_freed_memory`] unless `BURN_TP_KEEP_FREED_MEMORY=0`: what a training program (the
/// example, the benches) calls at start. Returns whether it applied.
pub fn keep_freed_memory_unless_disabled() -> bool {
    let env = std::env::var(KEEP_FREED_MEMORY_ENV).ok();
    env.as_deref().is_none_or(|v| v.trim() != "0") && keep_freed_memory()
}

fn keep_for(option: Option<bool>, env: Option<&str>) -> bool {
    option.unwrap_or_else(|| env.is_some_and(|v| v.trim() == "1"))
}

/// A thread's initialization stream: seeded, or (a rank thread of [`run_ranks`] before its
/// first draw) waiting for the seed its run shares, drawn from the device's RNG by the first
/// of its ranks to need it (a run that draws nothing leaves the device's RNG alone).
enum Stream {
    Seeded(u64, Box<StdRng>),
    Shared(Arc<OnceLock<u64>>),
}

thread_local! {
    /// This thread's initialization stream (see [`set_init_seed`]).
    static STREAM: RefCell<Option<Stream>> = const { RefCell::new(None) };
}

/// Seeds this thread's initialization stream: from now on every draw of
/// [`crate::init::init_replicated`] on this thread (every burn-tp layer's weights) comes from
/// `StdRng::seed_from_u64(seed)`, exactly the values Burn's Flex device draws after
/// `device.seed(seed)`, but on this thread alone, whatever other threads draw. [`run_ranks`]
/// starts every rank thread of a run from one seed: the calling thread's (so after
/// `set_init_seed(s)` there, every rank draws what burn-nn draws after `device.seed(s)`), else
/// one value drawn from the device's RNG when a rank first draws. So after one
/// `device.seed(s)` before it, every data-parallel replica draws the same model, and every run
/// the same one. A rank of its own process (MPI, NCCL) may call it at start; without it, draws
/// come from the device's RNG.
pub fn set_init_seed(seed: u64) {
    STREAM.with(|s| {
        *s.borrow_mut() = Some(Stream::Seeded(seed, Box::new(StdRng::seed_from_u64(seed))))
    });
}

/// Makes this thread draw as a rank thread of [`run_ranks`] does when no seed was set: from a
/// stream seeded, at its first draw, by one draw of the device's RNG (a rank of its own
/// process). Keeps a stream already set.
pub fn start_rank_stream() {
    STREAM.with(|s| {
        let mut s = s.borrow_mut();
        if s.is_none() {
            *s = Some(Stream::Shared(Arc::new(OnceLock::new())));
        }
    });
}

/// Stops this thread's initialization stream (draws come from the device's RNG again).
pub fn clear_init_seed() {
    STREAM.with(|s| *s.borrow_mut() = None);
}

/// The seed a run's rank threads start from: the calling thread's, or one drawn when needed.
fn run_seed() -> Arc<OnceLock<u64>> {
    STREAM.with(|s| match &*s.borrow() {
        Some(Stream::Seeded(seed, _)) => Arc::new(OnceLock::from(*seed)),
        Some(Stream::Shared(seed)) => seed.clone(),
        None => Arc::new(OnceLock::new()),
    })
}

/// A seed from the Flex device's RNG (deterministic after `device.seed`; entropy otherwise).
fn device_seed() -> u64 {
    let bits = Tensor::<1>::random([4], Distribution::Default, &Device::flex())
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default();
    bits.iter().fold(0x5EED_u64, |h, v| {
        crate::rng::splitmix64(h ^ u64::from(v.to_bits()))
    })
}

/// Runs `f` on this thread's initialization stream, if it has one.
pub(crate) fn with_init_stream<R>(f: impl FnOnce(&mut StdRng) -> R) -> Option<R> {
    STREAM.with(|s| {
        let mut s = s.borrow_mut();
        if let Some(Stream::Shared(seed)) = &*s {
            let seed = *seed.get_or_init(device_seed);
            *s = Some(Stream::Seeded(seed, Box::new(StdRng::seed_from_u64(seed))));
        }
        match &mut *s {
            Some(Stream::Seeded(_, rng)) => Some(f(rng.as_mut())),
            _ => None,
        }
    })
}

/// Runs `f` once per rank, each on its own thread with its own [`ProcessGroup`] and its own rayon
/// pool (see [`RunOptions::threads_per_rank`]), and returns the results in rank order.
///
/// # Errors
/// The panic message of the first rank that panicked, prefixed with its rank.
pub fn run_ranks<T: Send + 'static>(
    groups: Vec<ProcessGroup>,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, String> {
    run_ranks_with(groups, RunOptions::default(), f)
}

/// [`run_ranks`] with options (the threads of each rank's pool).
///
/// # Errors
/// As [`run_ranks`]; a pool that cannot be built.
pub fn run_ranks_with<T: Send + 'static>(
    groups: Vec<ProcessGroup>,
    options: RunOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, String> {
    let threads = options
        .threads_per_rank
        .unwrap_or_else(|| threads_per_rank(groups.len()));
    let env = std::env::var(KEEP_FREED_MEMORY_ENV).ok();
    if keep_for(options.keep_freed_memory, env.as_deref()) {
        keep_freed_memory();
    }
    let f = Arc::new(f);
    let seed = run_seed();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| {
            let f = f.clone();
            let rank = group.rank();
            let seed = seed.clone();
            std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .thread_name(move |i| format!("tp-rank-{rank}-worker-{i}"))
                        .build()
                        .unwrap_or_else(|e| panic!("building the rayon pool of rank {rank}: {e}"));
                    // Flex's kernels called from `f` run on this rank's pool (`f` itself on
                    // one of its threads), and every rank draws its layers' weights from the
                    // same stream.
                    pool.install(move || {
                        group.bind_thread();
                        STREAM.with(|s| *s.borrow_mut() = Some(Stream::Shared(seed)));
                        f(group)
                    })
                })
                .expect("spawning a rank thread")
        })
        .collect();
    let mut out = Vec::new();
    let mut first_err = None;
    for (rank, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(v) => out.push(v),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "non-string panic".into());
                first_err.get_or_insert(format!("rank {rank} panicked: {msg}"));
            }
        }
    }
    first_err.map_or(Ok(out), Err)
}

/// [`run_ranks`] on a fresh [`LocalGroup`] of `world_size` threads.
///
/// # Errors
/// As [`run_ranks`]; a world size of zero.
pub fn run_local<T: Send + 'static>(
    world_size: usize,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, String> {
    let groups = LocalGroup::new(world_size).map_err(|e| e.to_string())?;
    run_ranks(groups, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_runs_in_a_pool_of_its_own_share_of_the_cores() {
        assert_eq!(threads_for(None, 16, 4), 4);
        assert_eq!(threads_for(None, 2, 4), 1);
        assert_eq!(threads_for(Some(" 3 "), 2, 4), 3);
        assert_eq!(threads_for(Some("0"), 8, 2), 4);
        assert_eq!(threads_for(Some("many"), 8, 2), 4);
        let groups = LocalGroup::new(2).unwrap();
        let options = RunOptions {
            threads_per_rank: Some(3),
            ..Default::default()
        };
        let seen = run_ranks_with(groups, options, |_| {
            let name = std::thread::current().name().map(str::to_string);
            (rayon::current_num_threads(), name)
        })
        .unwrap();
        for (rank, (threads, name)) in seen.into_iter().enumerate() {
            assert_eq!(threads, 3);
            // `f` itself runs on one of the rank's pool workers.
            assert!(
                name.as_deref()
                    .is_some_and(|n| n.starts_with(&format!("tp-rank-{rank}-worker-"))),
                "{name:?}"
            );
        }
        let default = run_local(2, |_| rayon::current_num_threads()).unwrap();
        assert_eq!(default, vec![threads_per_rank(2); 2]);
    }

    #[test]
    fn the_runner_keeps_freed_memory_only_when_asked() {
        assert!(!keep_for(None, None));
        assert!(keep_for(None, Some(" 1 ")));
        assert!(!keep_for(None, Some("0")));
        assert!(keep_for(Some(true), Some("0")));
        assert!(!keep_for(Some(false), None));
        // glibc accepts both settings (this machine and CI run glibc).
        assert_eq!(
            keep_freed_memory(),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
    }
}
