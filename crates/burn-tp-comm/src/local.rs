//! [`LocalGroup`]: ranks as threads of one process, meeting in shared memory.
//!
//! Every call posts this rank's buffer (moved, not copied) into a slot keyed by the group's
//! sequence number and returns a [`Work`](crate::Work) handle at once. `wait` blocks until every
//! rank has posted, then copies each peer's shard once, straight into this rank's output. No
//! thread is spawned per call: a collective is "in flight" from the post to the wait, which is the
//! window the parallel layers fill with compute.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::buffer::{BoxedSendBuf, SendBuf};
use crate::{CommElement, CommError, LinkModel, OpDesc, ProcessGroup, ReduceOp, Result};

/// Default timeout of every wait, overridden by `BURN_TP_TIMEOUT_S` or [`ProcessGroup::set_timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Options of a [`LocalGroup`].
#[derive(Clone, Debug)]
pub struct LocalGroupOptions {
    /// Timeout of every wait (default [`DEFAULT_TIMEOUT`] or `BURN_TP_TIMEOUT_S`).
    pub timeout: Duration,
    /// How often a waiting rank re-checks for timeouts.
    pub poll_interval: Duration,
    /// Optional simulated link (off by default).
    pub link: Option<LinkModel>,
    /// Count every call in a [`Profile`](crate::profile::Profile) (off by default, or `BURN_TP_PROFILE=1`).
    pub profile: bool,
}

impl Default for LocalGroupOptions {
    fn default() -> Self {
        let timeout = std::env::var("BURN_TP_TIMEOUT_S")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        let profile = std::env::var("BURN_TP_PROFILE").is_ok_and(|v| v.trim() == "1");
        Self {
            timeout,
            poll_interval: Duration::from_millis(50),
            link: None,
            profile,
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
        let shared = Shared::new(
            world_size,
            options.clone(),
            Some(std::thread::current().id()),
        );
        Ok((0..world_size)
            .map(|rank| {
                let profile = options.profile.then(Default::default);
                ProcessGroup::member(shared.clone(), rank, options.timeout, profile)
            })
            .collect())
    }
}

pub(crate) type Payload = Arc<dyn Any + Send + Sync>;
pub(crate) type FinishFn<T> = Box<dyn FnOnce(&[Payload]) -> T + Send>;

pub(crate) struct Post {
    pub(crate) desc: OpDesc,
    pub(crate) data: Payload,
    pub(crate) at: Instant,
}

pub(crate) struct Slot {
    pub(crate) posts: Vec<Option<Post>>,
    pub(crate) consumed: usize,
    /// Incomplete when the group was aborted: it can never succeed, even if the rest arrive.
    pub(crate) dead: bool,
}

pub(crate) struct State {
    pub(crate) slots: HashMap<u64, Slot>,
    pub(crate) gone: Vec<bool>,
    pub(crate) aborted: Option<String>,
    /// Sub-groups being built by `split`: (split's sequence number, colour) -> group, members left.
    pub(crate) splits: HashMap<(u64, usize), (Arc<Shared>, usize)>,
    /// Per rank: the thread that last posted for it, or that runs it
    /// ([`ProcessGroup::bind_thread`]): a rank waiting on ranks its own thread serves waits
    /// forever, and says so at once.
    pub(crate) threads: Vec<Option<ThreadId>>,
}

pub(crate) struct Shared {
    pub(crate) world: usize,
    pub(crate) options: LocalGroupOptions,
    /// The thread that made the group ([`LocalGroup::new`]; `None` for a split's).
    pub(crate) creator: Option<ThreadId>,
    state: Mutex<State>,
    pub(crate) cv: Condvar,
}

impl Shared {
    pub(crate) fn new(
        world: usize,
        options: LocalGroupOptions,
        creator: Option<ThreadId>,
    ) -> Arc<Self> {
        Arc::new(Self {
            world,
            options,
            creator,
            state: Mutex::new(State {
                slots: HashMap::new(),
                gone: vec![false; world],
                aborted: None,
                splits: HashMap::new(),
                threads: vec![None; world],
            }),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock leaves consistent state behind: every
        // update under the lock is a single insert/remove, so poisoning carries no information.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts `rank`'s buffer for call `seq` and wakes the waiters.
    pub(crate) fn post(&self, seq: u64, rank: usize, desc: OpDesc, data: Payload) {
        let mut st = self.lock();
        let dead = st.aborted.is_some();
        let world = self.world;
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            posts: (0..world).map(|_| None).collect(),
            consumed: 0,
            dead,
        });
        slot.posts[rank] = Some(Post {
            desc,
            data,
            at: Instant::now(),
        });
        st.threads[rank] = Some(std::thread::current().id());
        self.cv.notify_all();
    }

    pub(crate) fn abort(&self, st: &mut State, reason: &CommError) {
        self.abort_with(st, reason.to_string());
    }

    pub(crate) fn abort_with(&self, st: &mut State, reason: String) {
        st.aborted.get_or_insert(reason);
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
pub(crate) struct Membership {
    pub(crate) shared: Arc<Shared>,
    pub(crate) rank: usize,
}

impl Drop for Membership {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.gone[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

/// A rank's posted buffer as a payload.
pub(crate) fn payload<T: CommElement>(buf: impl SendBuf<T>) -> Payload {
    Arc::new(Box::new(buf) as BoxedSendBuf<T>)
}

/// An all-reduce post: the buffer, and (read from rank 0's post) the reduced chunks, each
/// computed once by the first rank that needs it.
pub(crate) struct SharedReduce<T: Send + 'static> {
    buf: BoxedSendBuf<T>,
    pub(crate) chunks: Box<[OnceLock<Vec<T>>]>,
}

impl<T: Send + 'static> SharedReduce<T> {
    pub(crate) fn new(buf: BoxedSendBuf<T>, world: usize) -> Self {
        Self {
            buf,
            chunks: (0..world).map(|_| OnceLock::new()).collect(),
        }
    }
}

impl<T: Send + 'static> Drop for SharedReduce<T> {
    fn drop(&mut self) {
        for chunk in self.chunks.iter_mut() {
            if let Some(v) = chunk.take() {
                give_chunk(v);
            }
        }
    }
}

/// Free buffers of reduced chunks by (element type, capacity): the all-reduce reuses warm memory
/// instead of allocating (and page-faulting) a fresh chunk every call.
type ChunkPool = HashMap<(std::any::TypeId, usize), Vec<Box<dyn Any + Send>>>;
static CHUNK_POOL: std::sync::LazyLock<Mutex<ChunkPool>> =
    std::sync::LazyLock::new(Default::default);
const CHUNKS_KEPT: usize = 8;

/// An empty `Vec<T>` with room for `len` elements, reused when one is free.
pub(crate) fn take_chunk<T: Send + 'static>(len: usize) -> Vec<T> {
    let key = (std::any::TypeId::of::<T>(), len);
    let reused = CHUNK_POOL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&key)
        .and_then(Vec::pop)
        .and_then(|b| b.downcast::<Vec<T>>().ok());
    reused.map_or_else(|| Vec::with_capacity(len), |b| *b)
}

fn give_chunk<T: Send + 'static>(mut v: Vec<T>) {
    v.clear();
    let key = (std::any::TypeId::of::<T>(), v.capacity());
    let mut pool = CHUNK_POOL.lock().unwrap_or_else(|e| e.into_inner());
    let free = pool.entry(key).or_default();
    if free.len() < CHUNKS_KEPT {
        free.push(Box::new(v));
    }
}

pub(crate) fn downcast<T: CommElement>(payload: &Payload) -> &[T] {
    payload
        .downcast_ref::<BoxedSendBuf<T>>()
        .map(|b| b.as_slice())
        .or_else(|| {
            payload
                .downcast_ref::<SharedReduce<T>>()
                .map(|s| s.buf.as_slice())
        })
        .expect("dtype was checked across ranks before reading")
}

/// `op` over `posts[*][range]` into `out`, one rank at a time in rank order (deterministic
/// bits); `Avg` divides at the end.
pub(crate) fn reduce_in_rank_order<T: CommElement>(
    op: ReduceOp,
    posts: &[Payload],
    range: std::ops::Range<usize>,
    out: &mut [T],
) {
    out.copy_from_slice(&downcast::<T>(&posts[0])[range.clone()]);
    fold_rest_in_rank_order(op, posts, range, out);
}

/// [`reduce_in_rank_order`] where `acc` already holds rank 0's `range`.
pub(crate) fn fold_rest_in_rank_order<T: CommElement>(
    op: ReduceOp,
    posts: &[Payload],
    range: std::ops::Range<usize>,
    acc: &mut [T],
) {
    for post in &posts[1..] {
        T::combine(op, acc, &downcast::<T>(post)[range.clone()]);
    }
    T::finish(op, acc, posts.len());
}
