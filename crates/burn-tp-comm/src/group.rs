//! [`LocalGroup`]: ranks as threads of one process, meeting in shared memory.
//!
//! Every call posts this rank's buffer (moved, not copied) into a slot keyed by the group's
//! sequence number and returns a [`Work`] handle at once. `wait` blocks until every rank has
//! posted, then copies each peer's shard once, straight into this rank's output. No thread is
//! spawned per call: a collective is "in flight" from the post to the wait, which is the window
//! the parallel layers fill with compute.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{CommElement, CommError, DType, ReduceOp, Result};

/// Default timeout of every wait, overridden by `BURN_TP_TIMEOUT_S` or [`ProcessGroup::set_timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The kind of a collective call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Rank-order concatenation.
    AllGather,
    /// Sum, chunk `r` to rank `r`.
    ReduceScatter,
    /// Reduction to every rank.
    AllReduce(ReduceOp),
    /// Root's buffer to every rank.
    Broadcast {
        /// The sending rank.
        root: usize,
    },
    /// Synchronisation only.
    Barrier,
    /// `ProcessGroup::split` exchanging colours and keys.
    Split,
}

/// What one rank passed to one collective; ranks must agree on all of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// The collective.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Logical shape of this rank's input (`[len]` for plain buffers).
    pub shape: Vec<usize>,
}

impl OpDesc {
    fn new(kind: OpKind, dtype: DType, shape: Vec<usize>) -> Self {
        Self { kind, dtype, shape }
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes this rank receives in the call, for the link model (ring algorithms).
    fn recv_bytes(&self, rank: usize, world: usize) -> usize {
        let bytes = self.len() * self.dtype.size();
        match self.kind {
            OpKind::AllGather | OpKind::Split => bytes * (world - 1),
            OpKind::ReduceScatter => bytes / world * (world - 1),
            OpKind::AllReduce(_) => 2 * bytes / world * (world - 1),
            OpKind::Broadcast { root } if root != rank => bytes,
            OpKind::Broadcast { .. } | OpKind::Barrier => 0,
        }
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            OpKind::AllGather => "all_gather".to_string(),
            OpKind::ReduceScatter => "reduce_scatter".to_string(),
            OpKind::AllReduce(op) => format!("all_reduce({op:?})"),
            OpKind::Broadcast { root } => format!("broadcast(root={root})"),
            OpKind::Barrier => "barrier".to_string(),
            OpKind::Split => "split".to_string(),
        };
        write!(f, "{kind} of {:?} {:?}", self.dtype, self.shape)
    }
}

/// A simulated network link for [`LocalGroup`]: a delivery is delayed by
/// `latency + bytes_received / bandwidth`, counted from the last peer's post. The delay is a
/// timed sleep, not a busy loop, so it costs no CPU and compute can overlap it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Per-message latency.
    pub latency: Duration,
    /// Bandwidth in bytes per second.
    pub bandwidth: f64,
}

impl LinkModel {
    /// A link of `gb_per_s` GB/s (10^9 bytes) and `latency_us` microseconds.
    pub fn new(gb_per_s: f64, latency_us: f64) -> Self {
        Self {
            latency: Duration::from_secs_f64(latency_us * 1e-6),
            bandwidth: gb_per_s * 1e9,
        }
    }

    fn delay(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }
}

/// Options of a [`LocalGroup`].
#[derive(Clone, Debug)]
pub struct LocalGroupOptions {
    /// Timeout of every wait (default [`DEFAULT_TIMEOUT`] or `BURN_TP_TIMEOUT_S`).
    pub timeout: Duration,
    /// How often a waiting rank re-checks for timeouts.
    pub poll_interval: Duration,
    /// Optional simulated link (off by default).
    pub link: Option<LinkModel>,
}

impl Default for LocalGroupOptions {
    fn default() -> Self {
        let timeout = std::env::var("BURN_TP_TIMEOUT_S")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Self {
            timeout,
            poll_interval: Duration::from_millis(50),
            link: None,
        }
    }
}

/// Builds the handles of a group of ranks living as threads in one process.
pub struct LocalGroup;

impl LocalGroup {
    /// One [`ProcessGroup`] per rank, in rank order; move each into its own thread.
    ///
    /// # Errors
    /// [`CommError::InvalidWorldSize`] for a world size of zero.
    #[allow(clippy::new_ret_no_self)] // a group is its ranks' handles
    pub fn new(world_size: usize) -> Result<Vec<ProcessGroup>> {
        Self::with_options(world_size, LocalGroupOptions::default())
    }

    /// Like [`LocalGroup::new`], with a timeout and an optional link model.
    ///
    /// # Errors
    /// [`CommError::InvalidWorldSize`] for a world size of zero.
    pub fn with_options(
        world_size: usize,
        options: LocalGroupOptions,
    ) -> Result<Vec<ProcessGroup>> {
        if world_size == 0 {
            return Err(CommError::InvalidWorldSize(0));
        }
        let shared = Shared::new(world_size, options.clone());
        Ok((0..world_size)
            .map(|rank| ProcessGroup::member(shared.clone(), rank, options.timeout))
            .collect())
    }
}

type Payload = Arc<dyn Any + Send + Sync>;
type FinishFn<T> = Box<dyn FnOnce(&[Payload]) -> T + Send>;

struct Post {
    desc: OpDesc,
    data: Payload,
    at: Instant,
}

struct Slot {
    posts: Vec<Option<Post>>,
    consumed: usize,
    /// Incomplete when the group was aborted: it can never succeed, even if the rest arrive.
    dead: bool,
}

struct State {
    slots: HashMap<u64, Slot>,
    gone: Vec<bool>,
    aborted: Option<String>,
    /// Sub-groups being built by `split`: (split's sequence number, colour) -> group, members left.
    splits: HashMap<(u64, usize), (Arc<Shared>, usize)>,
}

struct Shared {
    world: usize,
    options: LocalGroupOptions,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn new(world: usize, options: LocalGroupOptions) -> Arc<Self> {
        Arc::new(Self {
            world,
            options,
            state: Mutex::new(State {
                slots: HashMap::new(),
                gone: vec![false; world],
                aborted: None,
                splits: HashMap::new(),
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves consistent state behind: every
        // update under the lock is a single insert/remove, so poisoning carries no information.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn abort(&self, st: &mut State, reason: &CommError) {
        st.aborted.get_or_insert_with(|| reason.to_string());
        for slot in st.slots.values_mut() {
            if slot.posts.iter().any(Option::is_none) {
                slot.dead = true;
            }
        }
        self.cv.notify_all();
    }
}

/// Marks the rank gone when the last clone of its handle (or of a pending [`Work`]) drops,
/// including while its thread unwinds from a panic.
struct Membership {
    shared: Arc<Shared>,
    rank: usize,
}

impl Drop for Membership {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.gone[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

/// One rank's handle on a group. Cheap to clone; clones share the sequence counter, so one rank's
/// collectives must be issued in the same order on every rank (as with NCCL), from one thread at
/// a time.
#[derive(Clone)]
pub struct ProcessGroup {
    rank: usize,
    shared: Arc<Shared>,
    seq: Arc<AtomicU64>,
    timeout: Arc<Mutex<Duration>>,
    /// `None` for [`ProcessGroup::weak`] handles; held for its `Drop`.
    #[allow(dead_code)]
    membership: Option<Arc<Membership>>,
    /// Set for a group over NCCL ([`ProcessGroup::from_nccl`]): host buffers are staged through
    /// the GPU, and device backends take the communicator itself.
    #[cfg(feature = "nccl")]
    nccl: Option<Arc<crate::nccl::NcclGroup>>,
}

/// Routes a host-buffer collective of an NCCL-backed group through the GPU (blocking).
macro_rules! via_nccl {
    ($self:ident, $desc:expr, $op:expr, $input:expr) => {
        #[cfg(feature = "nccl")]
        if let Some(n) = &$self.nccl {
            return Work::done($self, $desc, n.host_collective($op, &$input));
        }
    };
    (Ok $self:ident, $desc:expr, $op:expr, $input:expr) => {
        #[cfg(feature = "nccl")]
        if let Some(n) = &$self.nccl {
            return Ok(Work::done($self, $desc, n.host_collective($op, &$input)));
        }
    };
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world)
            .finish()
    }
}

impl ProcessGroup {
    fn member(shared: Arc<Shared>, rank: usize, timeout: Duration) -> Self {
        Self {
            rank,
            membership: Some(Arc::new(Membership {
                shared: shared.clone(),
                rank,
            })),
            shared,
            seq: Arc::new(AtomicU64::new(0)),
            timeout: Arc::new(Mutex::new(timeout)),
            #[cfg(feature = "nccl")]
            nccl: None,
        }
    }

    /// This rank's handle on an NCCL group (one process per GPU, see
    /// [`NcclGroup::new`](crate::nccl::NcclGroup::new)). Device backends (burn-tp's CUDA ops)
    /// run their collectives on the GPU buffers directly; host-buffer calls on this handle are
    /// staged through the GPU and block. [`split`](Self::split) is not supported on it yet.
    #[cfg(feature = "nccl")]
    pub fn from_nccl(group: crate::nccl::NcclGroup) -> ProcessGroup {
        let (rank, world) = (group.rank(), group.world_size());
        let timeout = group.timeout();
        let mut pg = Self::member(
            Shared::new(world, LocalGroupOptions::default()),
            rank,
            timeout,
        );
        pg.nccl = Some(Arc::new(group));
        pg
    }

    /// The NCCL communicator of a group made by [`from_nccl`](Self::from_nccl).
    #[cfg(feature = "nccl")]
    pub fn nccl(&self) -> Option<&Arc<crate::nccl::NcclGroup>> {
        self.nccl.as_ref()
    }

    /// A handle on the same rank that does not keep it in the group: once every ordinary handle
    /// is dropped (or its thread panicked), peers see this rank as gone even while weak handles
    /// live on. For long-lived holders the owner does not control, such as autodiff graph nodes.
    pub fn weak(&self) -> ProcessGroup {
        Self {
            membership: None,
            ..self.clone()
        }
    }

    /// This rank's index in `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// The timeout of every wait on this rank's handle (and its clones).
    pub fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the timeout of every later wait on this rank's handle (and its clones).
    pub fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
    }

    /// The simulated link of the group, if any.
    pub fn link(&self) -> Option<LinkModel> {
        self.shared.options.link
    }

    fn post<T: Send + 'static>(
        &self,
        desc: OpDesc,
        data: Payload,
        finish: impl FnOnce(&[Payload]) -> T + Send + 'static,
    ) -> Work<T> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mut st = self.shared.lock();
        let world = self.shared.world;
        let dead = st.aborted.is_some();
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            posts: (0..world).map(|_| None).collect(),
            consumed: 0,
            dead,
        });
        slot.posts[self.rank] = Some(Post {
            desc: desc.clone(),
            data,
            at: Instant::now(),
        });
        self.shared.cv.notify_all();
        drop(st);
        Work {
            group: self.clone(),
            seq,
            desc,
            finish: Some(Box::new(finish)),
            consumed: false,
            done: None,
        }
    }

    /// Starts an all-gather: every rank receives the rank-order concatenation of all inputs
    /// (`[len] -> [world_size * len]`).
    pub fn all_gather_async<T: CommElement>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let shape = vec![input.len()];
        self.all_gather_shaped_async(input, shape)
    }

    /// [`all_gather_async`](Self::all_gather_async) with the caller's logical shape, checked across
    /// ranks and named in errors.
    pub fn all_gather_shaped_async<T: CommElement>(
        &self,
        input: Vec<T>,
        shape: Vec<usize>,
    ) -> Work<Vec<T>> {
        self.gather_kind(OpKind::AllGather, input, shape)
    }

    fn gather_kind<T: CommElement>(
        &self,
        kind: OpKind,
        input: Vec<T>,
        shape: Vec<usize>,
    ) -> Work<Vec<T>> {
        let desc = OpDesc::new(kind, T::DTYPE, shape);
        via_nccl!(self, desc, crate::nccl::RawOp::AllGather, input);
        self.post(desc, Arc::new(input), |posts| {
            let parts: Vec<&Vec<T>> = posts.iter().map(downcast::<T>).collect();
            let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
            parts.iter().for_each(|p| out.extend_from_slice(p));
            out
        })
    }

    /// [`all_gather_async`](Self::all_gather_async) into a caller-provided buffer of
    /// `world_size * len` elements (say, one reused across calls, as NCCL's `recvbuff`), returned
    /// filled by the wait: no allocation, and no page faults on a warm buffer.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] (before any communication) if `out` has the wrong length.
    pub fn all_gather_into_async<T: CommElement>(
        &self,
        input: Vec<T>,
        mut out: Vec<T>,
    ) -> Result<Work<Vec<T>>> {
        let want = input.len() * self.world_size();
        if out.len() != want {
            return Err(CommError::BufferSize {
                op: "all_gather_into",
                expected: want,
                got: out.len(),
            });
        }
        let desc = OpDesc::new(OpKind::AllGather, T::DTYPE, vec![input.len()]);
        via_nccl!(Ok self, desc, crate::nccl::RawOp::AllGather, input);
        Ok(self.post(desc, Arc::new(input), move |posts| {
            for (chunk, post) in out.chunks_exact_mut(want / posts.len()).zip(posts) {
                chunk.copy_from_slice(downcast::<T>(post));
            }
            out
        }))
    }

    /// Blocking [`all_gather_async`](Self::all_gather_async).
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn all_gather<T: CommElement>(&self, input: Vec<T>) -> Result<Vec<T>> {
        self.all_gather_async(input).wait()
    }

    /// Starts a reduce-scatter (sum): the input is split into `world_size` equal chunks and rank `r`
    /// receives the rank-order sum of every rank's chunk `r` (`[len] -> [len / world_size]`).
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] (before any communication) if `len % world_size != 0`.
    pub fn reduce_scatter_async<T: CommElement>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let shape = vec![input.len()];
        self.reduce_scatter_shaped_async(input, shape)
    }

    /// [`reduce_scatter_async`](Self::reduce_scatter_async) with the caller's logical shape.
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] if `len % world_size != 0`.
    pub fn reduce_scatter_shaped_async<T: CommElement>(
        &self,
        input: Vec<T>,
        shape: Vec<usize>,
    ) -> Result<Work<Vec<T>>> {
        let world = self.world_size();
        if !input.len().is_multiple_of(world) {
            return Err(CommError::NotDivisible {
                op: "reduce_scatter",
                len: input.len(),
                world_size: world,
            });
        }
        let desc = OpDesc::new(OpKind::ReduceScatter, T::DTYPE, shape);
        via_nccl!(Ok self, desc, crate::nccl::RawOp::ReduceScatter, input);
        let rank = self.rank;
        Ok(self.post(desc, Arc::new(input), move |posts| {
            let chunk = downcast::<T>(&posts[0]).len() / posts.len();
            let range = rank * chunk..(rank + 1) * chunk;
            reduce_in_rank_order(ReduceOp::Sum, posts, range)
        }))
    }

    /// Blocking [`reduce_scatter_async`](Self::reduce_scatter_async).
    ///
    /// # Errors
    /// See [`reduce_scatter_async`](Self::reduce_scatter_async) and [`Work::wait`].
    pub fn reduce_scatter<T: CommElement>(&self, input: Vec<T>) -> Result<Vec<T>> {
        self.reduce_scatter_async(input)?.wait()
    }

    /// Starts an all-reduce: every rank receives the element-wise reduction of all inputs, in
    /// rank order, bit-identical on every rank.
    pub fn all_reduce_async<T: CommElement>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let shape = vec![input.len()];
        self.all_reduce_shaped_async(input, shape, op)
    }

    /// [`all_reduce_async`](Self::all_reduce_async) with the caller's logical shape.
    pub fn all_reduce_shaped_async<T: CommElement>(
        &self,
        input: Vec<T>,
        shape: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let desc = OpDesc::new(OpKind::AllReduce(op), T::DTYPE, shape);
        via_nccl!(self, desc, crate::nccl::RawOp::AllReduce(op), input);
        self.post(desc, Arc::new(input), move |posts| {
            let len = downcast::<T>(&posts[0]).len();
            let mut out: Vec<T> = reduce_in_rank_order(op, posts, 0..len);
            if op == ReduceOp::Avg {
                out.iter_mut().for_each(|v| *v = v.div_count(posts.len()));
            }
            out
        })
    }

    /// Blocking [`all_reduce_async`](Self::all_reduce_async).
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn all_reduce<T: CommElement>(&self, input: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        self.all_reduce_async(input, op).wait()
    }

    /// Starts a broadcast: every rank receives `root`'s buffer. Every rank passes a buffer of the
    /// same length; only the root's contents matter.
    ///
    /// # Errors
    /// [`CommError::InvalidRoot`] if `root >= world_size`.
    pub fn broadcast_async<T: CommElement>(
        &self,
        input: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        if root >= self.world_size() {
            return Err(CommError::InvalidRoot {
                op: "broadcast",
                root,
                world_size: self.world_size(),
            });
        }
        let desc = OpDesc::new(OpKind::Broadcast { root }, T::DTYPE, vec![input.len()]);
        via_nccl!(Ok self, desc, crate::nccl::RawOp::Broadcast { root }, input);
        // Non-roots post nothing: their contents are never read.
        let data: Payload = if root == self.rank {
            Arc::new(input)
        } else {
            Arc::new(Vec::<T>::new())
        };
        Ok(self.post(desc, data, move |posts| downcast::<T>(&posts[root]).clone()))
    }

    /// Blocking [`broadcast_async`](Self::broadcast_async).
    ///
    /// # Errors
    /// See [`broadcast_async`](Self::broadcast_async) and [`Work::wait`].
    pub fn broadcast<T: CommElement>(&self, input: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.broadcast_async(input, root)?.wait()
    }

    /// Starts a barrier: completes once every rank has arrived.
    pub fn barrier_async(&self) -> Work<()> {
        let desc = OpDesc::new(OpKind::Barrier, DType::I64, vec![0]);
        #[cfg(feature = "nccl")]
        if let Some(n) = &self.nccl {
            return Work::done(self, desc, n.barrier());
        }
        self.post(desc, Arc::new(()), |_| ())
    }

    /// Blocks until every rank has arrived.
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async().wait()
    }

    /// Splits the group like `MPI_Comm_split`: ranks passing the same `color` form a new group,
    /// ordered by `(key, rank)`. Collective over this group. A world of 4 split with
    /// `color = rank / 2` gives two groups of 2 (tensor parallel), `color = rank % 2` the
    /// orthogonal ones (data parallel).
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn split(&self, color: usize, key: usize) -> Result<ProcessGroup> {
        #[cfg(feature = "nccl")]
        if self.nccl.is_some() {
            return Err(CommError::Backend(format!(
                "split({color}, {key}) of an NCCL group is not supported yet: run one job per \
                 tensor-parallel group (world = tp)"
            )));
        }
        let work = self.gather_kind(OpKind::Split, vec![color as i64, key as i64], vec![2]);
        let seq = work.seq;
        let all = work.wait()?;
        let mut members: Vec<(i64, usize)> = (0..self.world_size())
            .filter(|&r| all[2 * r] == color as i64)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank is a member of its colour");
        let mut st = self.shared.lock();
        let entry = st.splits.entry((seq, color)).or_insert_with(|| {
            (
                Shared::new(members.len(), self.shared.options.clone()),
                members.len(),
            )
        });
        let shared = entry.0.clone();
        entry.1 -= 1;
        if entry.1 == 0 {
            st.splits.remove(&(seq, color));
        }
        drop(st);
        Ok(ProcessGroup::member(shared, new_rank, self.timeout()))
    }
}

fn downcast<T: CommElement>(payload: &Payload) -> &Vec<T> {
    payload
        .downcast_ref::<Vec<T>>()
        .expect("dtype was checked across ranks before reading")
}

/// `op` over `posts[*][range]`, one rank at a time in rank order (deterministic bits).
fn reduce_in_rank_order<T: CommElement>(
    op: ReduceOp,
    posts: &[Payload],
    range: std::ops::Range<usize>,
) -> Vec<T> {
    let mut out = downcast::<T>(&posts[0])[range.clone()].to_vec();
    for post in &posts[1..] {
        T::combine(op, &mut out, &downcast::<T>(post)[range.clone()]);
    }
    out
}

/// A collective in flight. `wait` completes it; dropping it without waiting releases this rank's
/// part without reading the result.
#[must_use = "a collective completes only when its Work is waited on"]
pub struct Work<T> {
    group: ProcessGroup,
    seq: u64,
    desc: OpDesc,
    finish: Option<FinishFn<T>>,
    consumed: bool,
    /// A call that completed when it was issued (staged through NCCL).
    done: Option<Result<T>>,
}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Work({} #{} on rank {})",
            self.desc, self.seq, self.group.rank
        )
    }
}

enum Ready {
    Yes(Vec<Payload>),
    No {
        missing: Vec<usize>,
        until: Option<Instant>,
    },
}

impl<T> Work<T> {
    /// A call that completed (or failed) when it was issued.
    #[cfg(feature = "nccl")]
    fn done(group: &ProcessGroup, desc: OpDesc, result: Result<T>) -> Self {
        Work {
            group: group.clone(),
            seq: group.seq.fetch_add(1, Ordering::SeqCst),
            desc,
            finish: None,
            consumed: true,
            done: Some(result),
        }
    }

    /// Per-group sequence number of this call.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether [`wait`](Self::wait) would return without blocking (done, or failed).
    pub fn is_completed(&self) -> bool {
        if self.done.is_some() {
            return true;
        }
        let st = self.group.shared.lock();
        match self.poll(&st, None) {
            Ok(Ready::Yes(_)) | Err(_) => true,
            Ok(Ready::No { .. }) => false,
        }
    }

    /// Waits with the group's timeout and returns the result.
    ///
    /// # Errors
    /// [`CommError::Mismatch`], [`CommError::PeerGone`], [`CommError::Timeout`] or
    /// [`CommError::Aborted`]; any of them aborts the group, so every rank fails.
    pub fn wait(self) -> Result<T> {
        let timeout = self.group.timeout();
        self.wait_timeout(timeout)
    }

    /// Waits at most `timeout` and returns the result.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<T> {
        if let Some(done) = self.done.take() {
            return done;
        }
        let payloads = self.wait_ready(timeout, None)?;
        let finish = self.finish.take().expect("a Work completes once");
        let out = finish(&payloads);
        drop(payloads);
        self.consume();
        Ok(out)
    }

    /// Blocks until the call is complete (`part = None`) or rank `part`'s buffer has arrived,
    /// and returns the posted buffers (only `part`'s is meaningful in the second case).
    fn wait_ready(&self, timeout: Duration, part: Option<usize>) -> Result<Vec<Payload>> {
        let shared = self.group.shared.clone();
        let deadline = Instant::now() + timeout;
        let mut st = shared.lock();
        loop {
            let now = Instant::now();
            match self.poll(&st, part) {
                Ok(Ready::Yes(p)) => return Ok(p),
                Err(e) => {
                    shared.abort(&mut st, &e);
                    return Err(e);
                }
                Ok(Ready::No { missing, until }) => {
                    if now >= deadline {
                        let e = CommError::Timeout {
                            op: self.desc.clone(),
                            seq: self.seq,
                            rank: self.group.rank,
                            timeout,
                            missing,
                        };
                        shared.abort(&mut st, &e);
                        return Err(e);
                    }
                    let wake = until
                        .unwrap_or(now + shared.options.poll_interval)
                        .min(deadline);
                    if until.is_some() {
                        // Simulated transfer: sleep without holding the lock.
                        drop(st);
                        std::thread::sleep(wake.saturating_duration_since(now));
                        st = shared.lock();
                    } else {
                        st = shared
                            .cv
                            .wait_timeout(st, wake.saturating_duration_since(now))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
            }
        }
    }

    /// With the link model, when rank `p`'s all-gather shard reaches this rank: a ring moves it
    /// `k = (rank - p) mod n` hops, each `latency + shard / bandwidth`, after every rank on its
    /// path has posted.
    fn ring_arrival(&self, slot: &Slot, link: &LinkModel, p: usize) -> Option<Instant> {
        let n = slot.posts.len();
        let rank = self.group.rank;
        let hops = (rank + n - p) % n;
        if hops == 0 {
            return None;
        }
        let shard = self.desc.len() * self.desc.dtype.size();
        let start = (0..hops)
            .filter_map(|h| slot.posts[(p + h) % n].as_ref().map(|q| q.at))
            .max()?;
        Some(start + (link.delay(shard)) * hops as u32)
    }

    fn poll(&self, st: &State, part: Option<usize>) -> Result<Ready> {
        let rank = self.group.rank;
        let slot = st
            .slots
            .get(&self.seq)
            .expect("a posted slot lives until every rank consumed it");
        let mut missing = Vec::new();
        let mut first: Option<(usize, &OpDesc)> = None;
        for (r, post) in slot.posts.iter().enumerate() {
            match post {
                None => missing.push(r),
                Some(p) => match first {
                    None => first = Some((r, &p.desc)),
                    Some((r0, d0)) if *d0 != p.desc => {
                        return Err(CommError::Mismatch {
                            seq: self.seq,
                            rank: r,
                            ours: p.desc.clone(),
                            other_rank: r0,
                            theirs: d0.clone(),
                        });
                    }
                    Some(_) => {}
                },
            }
        }
        if let Some(p) = part.filter(|p| !slot.dead && !missing.contains(p)) {
            if let Some(ready) = self
                .group
                .shared
                .options
                .link
                .and_then(|l| self.ring_arrival(slot, &l, p))
                && Instant::now() < ready
            {
                return Ok(Ready::No {
                    missing,
                    until: Some(ready),
                });
            }
            return Ok(Ready::Yes(
                slot.posts
                    .iter()
                    .map(|q| {
                        q.as_ref()
                            .map_or_else(|| Arc::new(()) as Payload, |q| q.data.clone())
                    })
                    .collect(),
            ));
        }
        if missing.is_empty() && !slot.dead {
            if let Some(link) = self
                .group
                .shared
                .options
                .link
                .filter(|_| self.desc.kind == OpKind::AllGather)
            {
                // Ring all-gather: complete when the farthest shard has arrived.
                let ready = (0..slot.posts.len())
                    .filter_map(|p| self.ring_arrival(slot, &link, p))
                    .max();
                if let Some(ready) = ready.filter(|r| Instant::now() < *r) {
                    return Ok(Ready::No {
                        missing,
                        until: Some(ready),
                    });
                }
            } else if let Some(link) = self.group.shared.options.link {
                let last = slot
                    .posts
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| *r != rank)
                    .filter_map(|(_, p)| p.as_ref().map(|p| p.at))
                    .max();
                if let Some(last) = last {
                    let ready = last + link.delay(self.desc.recv_bytes(rank, st.gone.len()));
                    if Instant::now() < ready {
                        return Ok(Ready::No {
                            missing,
                            until: Some(ready),
                        });
                    }
                }
            }
            return Ok(Ready::Yes(
                slot.posts
                    .iter()
                    .map(|p| p.as_ref().expect("complete").data.clone())
                    .collect(),
            ));
        }
        let gone: Vec<usize> = missing.iter().copied().filter(|&r| st.gone[r]).collect();
        if !gone.is_empty() {
            return Err(CommError::PeerGone {
                op: self.desc.clone(),
                seq: self.seq,
                rank,
                gone,
            });
        }
        if let Some(reason) = &st.aborted {
            return Err(CommError::Aborted {
                op: self.desc.clone(),
                seq: self.seq,
                rank,
                reason: reason.clone(),
            });
        }
        Ok(Ready::No {
            missing,
            until: None,
        })
    }

    fn consume(&mut self) {
        if self.consumed {
            return;
        }
        self.consumed = true;
        let shared = &self.group.shared;
        let mut st = shared.lock();
        let world = shared.world;
        if let Some(slot) = st.slots.get_mut(&self.seq) {
            slot.consumed += 1;
            if slot.consumed == world {
                st.slots.remove(&self.seq);
            }
        }
    }
}

impl<T: CommElement> Work<Vec<T>> {
    /// For an all-gather: waits (with the group's timeout) until rank `part`'s shard has arrived
    /// and returns a copy of it, without waiting for the others. Shards arrive in ring order
    /// (own, rank - 1, rank - 2, ...): consuming them in that order overlaps compute with the
    /// rest of the gather. The `Work` still completes (or is dropped) as usual afterwards.
    ///
    /// # Errors
    /// As [`Work::wait`]; [`CommError::Backend`] if the call is not an all-gather or `part` is
    /// not a rank.
    pub fn wait_part(&self, part: usize) -> Result<Vec<T>> {
        if self.desc.kind != OpKind::AllGather || part >= self.group.world_size() {
            return Err(CommError::Backend(format!(
                "wait_part({part}) on {} of a group of {}: only all-gathers have parts",
                self.desc,
                self.group.world_size()
            )));
        }
        if let Some(done) = &self.done {
            let all = done.as_ref().map_err(Clone::clone)?;
            let n = all.len() / self.group.world_size();
            return Ok(all[part * n..(part + 1) * n].to_vec());
        }
        let payloads = self.wait_ready(self.group.timeout(), Some(part))?;
        Ok(downcast::<T>(&payloads[part]).clone())
    }
}

impl<T> Drop for Work<T> {
    fn drop(&mut self) {
        self.consume();
    }
}
