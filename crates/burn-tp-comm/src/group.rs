//! [`ProcessGroup`]: one rank's handle on a group, over one of the transports (ranks as threads,
//! or NCCL with feature `nccl`), with every collective in an async and a blocking form.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::buffer::{RecvBuf, SendBuf};
use crate::local::{
    Membership, Payload, Shared, SharedReduce, downcast, fold_rest_in_rank_order, payload,
    reduce_in_rank_order, take_chunk,
};
use crate::profile::{Profile, ProfileStore};
use crate::{CommElement, CommError, DType, LinkModel, OpDesc, OpKind, ReduceOp, Result, Work};

/// How a [`ProcessGroup`]'s collectives travel.
#[derive(Clone)]
pub(crate) enum Transport {
    /// Ranks as threads of one process, meeting in shared memory ([`crate::LocalGroup`]).
    Local(Arc<Shared>),
    /// One process per GPU over NCCL: device backends take the communicator itself; host buffers
    /// are staged through the GPU (blocking).
    #[cfg(feature = "nccl")]
    Nccl(Arc<crate::nccl::NcclGroup>),
}

/// One rank's handle on a group. Cheap to clone; clones share the sequence counter, so one rank's
/// collectives must be issued in the same order on every rank (as with NCCL), from one thread at
/// a time.
#[derive(Clone)]
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    pub(crate) transport: Transport,
    pub(crate) seq: Arc<AtomicU64>,
    timeout: Arc<Mutex<Duration>>,
    /// `None` for [`ProcessGroup::weak`] handles and NCCL groups; held for its `Drop`.
    #[allow(dead_code)]
    membership: Option<Arc<Membership>>,
    /// This rank's communication profile, when on (shared with the groups split from this one).
    pub(crate) profile: Option<Arc<ProfileStore>>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .finish()
    }
}

impl ProcessGroup {
    pub(crate) fn member(
        shared: Arc<Shared>,
        rank: usize,
        timeout: Duration,
        profile: Option<Arc<ProfileStore>>,
    ) -> Self {
        Self {
            profile,
            rank,
            world: shared.world,
            membership: Some(Arc::new(Membership {
                shared: shared.clone(),
                rank,
            })),
            transport: Transport::Local(shared),
            seq: Arc::new(AtomicU64::new(0)),
            timeout: Arc::new(Mutex::new(timeout)),
        }
    }

    /// This rank's handle on an NCCL group (one process per GPU, see
    /// [`NcclGroup::new`](crate::nccl::NcclGroup::new)). Device backends (burn-tp's CUDA ops)
    /// run their collectives on the GPU buffers directly; host-buffer calls on this handle are
    /// staged through the GPU and block. [`split`](Self::split) is not supported on it yet.
    #[cfg(feature = "nccl")]
    pub fn from_nccl(group: crate::nccl::NcclGroup) -> ProcessGroup {
        Self {
            rank: group.rank(),
            world: group.world_size(),
            timeout: Arc::new(Mutex::new(group.timeout())),
            transport: Transport::Nccl(Arc::new(group)),
            seq: Arc::new(AtomicU64::new(0)),
            membership: None,
            profile: None,
        }
    }

    /// The NCCL communicator of a group made by [`from_nccl`](Self::from_nccl).
    #[cfg(feature = "nccl")]
    pub fn nccl(&self) -> Option<&Arc<crate::nccl::NcclGroup>> {
        match &self.transport {
            Transport::Nccl(n) => Some(n),
            Transport::Local(_) => None,
        }
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
        self.world
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
        match &self.transport {
            Transport::Local(shared) => shared.options.link,
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => None,
        }
    }

    /// Aborts the group because of `error` on this rank (say, a collective that failed before it
    /// could be posted): every peer's pending and next call fails at once with
    /// [`CommError::Aborted`] naming this rank and the error, instead of waiting for a post that
    /// never comes. A no-op on NCCL groups (their calls fail by their own timeout).
    pub fn abort(&self, error: &CommError) {
        match &self.transport {
            Transport::Local(shared) => {
                let mut st = shared.lock();
                shared.abort_with(&mut st, format!("rank {}: {error}", self.rank));
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => {}
        }
    }

    /// This rank's communication profile so far (of this group and the groups split from it),
    /// or `None` when profiling is off.
    pub fn profile(&self) -> Option<Profile> {
        self.profile.as_ref().map(|p| p.snapshot())
    }

    /// Whether a collective in flight makes progress without the thread that posted it (NCCL on
    /// its own stream, or the simulated [`LinkModel`]), so that compute placed between the start
    /// and the wait hides it. Ranks as threads without a link move the data inside `wait`, on
    /// the caller's thread: there the overlap schedules would only add work.
    pub fn progresses_in_background(&self) -> bool {
        match &self.transport {
            Transport::Local(shared) => shared.options.link.is_some(),
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => true,
        }
    }

    /// Posts this rank's `data` for the call `desc` on the local transport; `finish` builds the
    /// output from every rank's posts once they are all there.
    fn post<T: Send + 'static>(
        &self,
        desc: OpDesc,
        data: Payload,
        finish: impl FnOnce(&[Payload]) -> T + Send + 'static,
    ) -> Work<T> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        match &self.transport {
            Transport::Local(shared) => {
                shared.post(seq, self.rank, desc.clone(), data);
                Work::posted(self.clone(), shared.clone(), seq, desc, Box::new(finish))
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => unreachable!("NCCL calls complete in `staged`"),
        }
    }

    /// On a transport that is not local (NCCL), runs the call at once with the host buffer staged
    /// through the GPU, into `out`; `Err(out)` on the local transport, which posts instead.
    fn staged<T: CommElement, O: RecvBuf<T>>(
        &self,
        desc: &OpDesc,
        input: &[T],
        out: O,
    ) -> std::result::Result<Work<O>, O> {
        match &self.transport {
            Transport::Local(_) => {
                let _ = (desc, input);
                Err(out)
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(n) => {
                let mut out = out;
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let result = crate::nccl::RawOp::try_from(desc.kind)
                    .and_then(|op| n.host_collective(op, input))
                    .map(|v| {
                        out.as_mut_slice().copy_from_slice(&v);
                        out
                    });
                Ok(Work::done(self.clone(), seq, desc.clone(), result))
            }
        }
    }

    fn is_local(&self) -> bool {
        matches!(self.transport, Transport::Local(_))
    }

    fn check_out(op: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(CommError::BufferSize { op, expected, got });
        }
        Ok(())
    }

    fn check_divisible(&self, op: &'static str, len: usize) -> Result<()> {
        if !len.is_multiple_of(self.world_size()) {
            return Err(CommError::NotDivisible {
                op,
                len,
                world_size: self.world_size(),
            });
        }
        Ok(())
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
        if !self.is_local() {
            // Staged through the GPU into a buffer of the output's length.
            let out = input.repeat(self.world_size());
            if let Ok(work) = self.staged(&desc, &input, out) {
                return work;
            }
        }
        self.post(desc, payload(input), |posts| {
            let parts: Vec<&[T]> = posts.iter().map(downcast::<T>).collect();
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
    pub fn all_gather_into_async<T: CommElement, O: RecvBuf<T>>(
        &self,
        input: Vec<T>,
        out: O,
    ) -> Result<Work<O>> {
        let shape = vec![input.len()];
        self.all_gather_shaped_into_async(input, shape, out)
    }

    /// The all-gather in its most general form: `input` (`shape`, read in place until every rank
    /// has read it) gathered straight into `out` (`world_size` times its length): each byte is
    /// copied once, by the wait.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] (before any communication) if `out` has the wrong length.
    pub fn all_gather_shaped_into_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        shape: Vec<usize>,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        Self::check_out(
            "all_gather_into",
            len * self.world_size(),
            out.as_mut_slice().len(),
        )?;
        let desc = OpDesc::new(OpKind::AllGather, T::DTYPE, shape);
        let out = match self.staged(&desc, input.as_slice(), out) {
            Ok(work) => return Ok(work),
            Err(out) => out,
        };
        Ok(self.post(desc, payload(input), move |posts| {
            let mut out = out;
            for (chunk, post) in out.as_mut_slice().chunks_exact_mut(len.max(1)).zip(posts) {
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
        self.check_divisible("reduce_scatter", input.len())?;
        let out = input[..input.len() / self.world_size()].to_vec();
        self.reduce_scatter_shaped_into_async(input, shape, out)
    }

    /// The reduce-scatter in its most general form: every rank's `input` (`shape`) read in place,
    /// this rank's chunk summed in rank order straight into `out` (`len / world_size`).
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] if `len % world_size != 0`, [`CommError::BufferSize`] if `out`
    /// has the wrong length (both before any communication).
    pub fn reduce_scatter_shaped_into_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        shape: Vec<usize>,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        self.check_divisible("reduce_scatter", len)?;
        let chunk = len / self.world_size();
        Self::check_out("reduce_scatter_into", chunk, out.as_mut_slice().len())?;
        let desc = OpDesc::new(OpKind::ReduceScatter, T::DTYPE, shape);
        let out = match self.staged(&desc, input.as_slice(), out) {
            Ok(work) => return Ok(work),
            Err(out) => out,
        };
        let rank = self.rank;
        Ok(self.post(desc, payload(input), move |posts| {
            let mut out = out;
            let range = rank * chunk..(rank + 1) * chunk;
            reduce_in_rank_order(ReduceOp::Sum, posts, range, out.as_mut_slice());
            out
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
        let out = input.clone();
        self.all_reduce_shaped_into_async(input, shape, op, out)
            .expect("the output has the input's length")
    }

    /// The all-reduce in its most general form, as a reduce-scatter then an all-gather (the ring
    /// algorithm's data movement): each of `world_size` chunks is reduced once, in rank order, from
    /// every rank's input read in place, and every rank copies the reduced chunks straight into
    /// `out`. A rank reduces its own chunk (and any a slower peer has not reached yet), so it reads
    /// about `world_size` times less than a full reduction; every rank gets the same bits.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] (before any communication) if `out` is not as long as `input`.
    pub fn all_reduce_shaped_into_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        shape: Vec<usize>,
        op: ReduceOp,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        Self::check_out("all_reduce_into", len, out.as_mut_slice().len())?;
        let desc = OpDesc::new(OpKind::AllReduce(op), T::DTYPE, shape);
        let out = match self.staged(&desc, input.as_slice(), out) {
            Ok(work) => return Ok(work),
            Err(out) => out,
        };
        let world = self.world_size();
        // Chunks of `ceil(len / world)`; the last ones may be shorter (or empty).
        let chunk = len.div_ceil(world.max(1));
        let rank = self.rank;
        let data = Arc::new(SharedReduce::new(Box::new(input), world));
        Ok(self.post(desc, data, move |posts| {
            let mut out = out;
            let dst = out.as_mut_slice();
            // Rank 0's post holds the reduced chunks, shared by every rank.
            let shared = posts[0]
                .downcast_ref::<SharedReduce<T>>()
                .expect("every rank posted an all-reduce");
            for c in (0..world).map(|k| (rank + k) % world) {
                let range = (c * chunk).min(len)..((c + 1) * chunk).min(len);
                // Reduced once, in rank order, by whichever rank gets there first (its own chunk
                // first): every rank copies the same bits, and none waits for a peer's wait.
                let reduced = shared.chunks[c].get_or_init(|| {
                    let mut v = take_chunk::<T>(range.len());
                    v.extend_from_slice(&downcast::<T>(&posts[0])[range.clone()]);
                    fold_rest_in_rank_order(op, posts, range.clone(), &mut v);
                    v
                });
                dst[range].copy_from_slice(reduced);
            }
            out
        }))
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
        if !self.is_local()
            && let Ok(work) = self.staged(&desc, &input, input.clone())
        {
            return Ok(work);
        }
        // Non-roots post nothing: their contents are never read.
        let data: Payload = if root == self.rank {
            payload(input)
        } else {
            payload(Vec::<T>::new())
        };
        Ok(self.post(desc, data, move |posts| {
            downcast::<T>(&posts[root]).to_vec()
        }))
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
        match &self.transport {
            Transport::Local(_) => self.post(desc, Arc::new(()), |_| ()),
            #[cfg(feature = "nccl")]
            Transport::Nccl(n) => {
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                Work::done(self.clone(), seq, desc, n.barrier())
            }
        }
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
        let parent = match &self.transport {
            Transport::Local(shared) => shared.clone(),
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => {
                return Err(CommError::Backend(format!(
                    "split({color}, {key}) of an NCCL group is not supported yet: run one job \
                     per tensor-parallel group (world = tp)"
                )));
            }
        };
        let work = self.gather_kind(OpKind::Split, vec![color as i64, key as i64], vec![2]);
        let seq = work.seq();
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
        let mut st = parent.lock();
        let entry = st.splits.entry((seq, color)).or_insert_with(|| {
            (
                Shared::new(members.len(), parent.options.clone()),
                members.len(),
            )
        });
        let shared = entry.0.clone();
        entry.1 -= 1;
        if entry.1 == 0 {
            st.splits.remove(&(seq, color));
        }
        drop(st);
        Ok(ProcessGroup::member(
            shared,
            new_rank,
            self.timeout(),
            self.profile.clone(),
        ))
    }
}
