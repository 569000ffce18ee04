//! One conformance check of the `Communicator` trait, run on every transport.

use burn_tp_comm::{
    CommError, Communicator, LocalGroup, LocalGroupOptions, ProcessGroup, ReduceOp,
};

/// Every collective of the trait on one rank, with values that differ per rank and position, so a
/// wrong order, a missing rank or a wrong chunk changes the result. `to` / `from` move host values
/// into and out of the transport's buffers.
#[allow(dead_code)] // not every test binary checks a transport
pub fn conformance<C: Communicator<f32>>(
    c: &C,
    to: impl Fn(&[f32]) -> C::Buffer,
    from: impl Fn(C::Buffer) -> Vec<f32>,
) {
    let (rank, n) = (c.rank(), c.world_size());
    let len = 2 * n;
    let value = |r: usize, i: usize| (100 * r + i) as f32;
    let mine: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();

    let gathered = from(c.all_gather(to(&mine)).unwrap());
    let want: Vec<f32> = (0..n)
        .flat_map(|r| (0..len).map(move |i| value(r, i)))
        .collect();
    assert_eq!(gathered, want, "all_gather on rank {rank}");

    let work = c.reduce_scatter_async(to(&mine)).unwrap();
    let scattered = from(
        c.wait(work, Some(std::time::Duration::from_secs(30)))
            .unwrap(),
    );
    let chunk = len / n;
    let want: Vec<f32> = (rank * chunk..(rank + 1) * chunk)
        .map(|i| (0..n).map(|r| value(r, i)).sum())
        .collect();
    assert_eq!(scattered, want, "reduce_scatter on rank {rank}");

    let summed = from(c.all_reduce(to(&mine), ReduceOp::Sum).unwrap());
    let want: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| value(r, i)).sum())
        .collect();
    assert_eq!(summed, want, "all_reduce(sum) on rank {rank}");
    let max = from(c.all_reduce(to(&mine), ReduceOp::Max).unwrap());
    let want: Vec<f32> = (0..len).map(|i| value(n - 1, i)).collect();
    assert_eq!(max, want, "all_reduce(max) on rank {rank}");

    let root = n - 1;
    let got = from(c.broadcast(to(&mine), root).unwrap());
    let want: Vec<f32> = (0..len).map(|i| value(root, i)).collect();
    assert_eq!(got, want, "broadcast from {root} on rank {rank}");
    assert!(matches!(
        c.broadcast_async(to(&mine), n),
        Err(CommError::InvalidRoot { root, world_size, .. }) if root == n && world_size == n
    ));
    c.barrier().unwrap();
}

#[allow(dead_code)] // not every test binary runs ranks
/// Runs `f` on every rank of a fresh group, one thread per rank, and returns the results in rank order.
pub fn run<T: Send + 'static>(
    world: usize,
    options: LocalGroupOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<std::thread::Result<T>> {
    let groups = LocalGroup::with_options(world, options).unwrap();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let f = f.clone();
            std::thread::spawn(move || f(pg))
        })
        .collect();
    handles.into_iter().map(|h| h.join()).collect()
}

#[allow(dead_code)]
pub fn run_ok<T: Send + 'static>(
    world: usize,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    run(world, LocalGroupOptions::default(), f)
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}
