//! Ranks as threads of one process: the runner that gives each rank its thread and its
//! [`ProcessGroup`] handle (the embedded default on the CPU; no setup).

use std::sync::Arc;

use burn_tp_comm::{LocalGroup, ProcessGroup};

/// Runs `f` once per rank, each on its own thread with its own [`ProcessGroup`], and returns the
/// results in rank order.
///
/// # Errors
/// The panic message of the first rank that panicked, prefixed with its rank.
pub fn run_ranks<T: Send + 'static>(
    groups: Vec<ProcessGroup>,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, String> {
    let f = Arc::new(f);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| {
            let f = f.clone();
            std::thread::Builder::new()
                .name(format!("tp-rank-{}", group.rank()))
                .spawn(move || f(group))
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
