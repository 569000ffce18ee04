//! [`ProcessGroup`]: one rank's handle on a group, over one of the transports (ranks as threads,
//! MPI processes with feature `mpi`, or NCCL with feature `nccl`), with every collective in an
//! async and a blocking form.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(feature = "mpi")]
use crate::ReduceOp;
use crate::buffer::RecvBuf;
use crate::local::{Membership, Payload, Shared};
use crate::profile::{Profile, ProfileStore};
use crate::{CommElement, CommError, LinkModel, OpDesc, OpKind, Result, Work};

/// How a [`ProcessGroup`]'s collectives travel.
#[derive(Clone)]
pub(crate) enum Transport {
    /// Ranks as threads of one process, meeting in shared memory ([`crate::LocalGroup`]).
    Local(Arc<Shared>),
    /// One process per GPU over NCCL: device backends take the communicator itself; host buffers
    /// are staged through the GPU (blocking).
    #[cfg(feature = "nccl")]
    Nccl(Arc<crate::nccl::NcclGroup>),
    /// One process per rank over MPI: host buffers, non-blocking collectives advanced by the
    /// process's MPI thread ([`crate::mpi`]).
    #[cfg(feature = "mpi")]
    Mpi(crate::mpi::MpiGroup),
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

    /// Tells a group of rank threads ([`crate::LocalGroup`]) that the calling thread runs this
    /// rank (burn-tp's runner does it at each rank thread's start), so that a rank waiting on
    /// it from another thread waits, and one waiting on it from this same thread fails at once
    /// ([`CommError::SameThread`]). Nothing on the other transports.
    pub fn bind_thread(&self) {
        #[allow(irrefutable_let_patterns)]
        if let Transport::Local(shared) = &self.transport {
            shared.lock().threads[self.rank] = Some(std::thread::current().id());
        }
    }

    /// This rank's handle on an NCCL group (one process per GPU, see
    /// [`NcclGroup::new`](crate::nccl::NcclGroup::new)). Device backends (burn-tp's CUDA ops)
    /// run their collectives on the GPU buffers directly; host-buffer calls on this handle are
    /// staged through the GPU and block. [`split`](Self::split) makes a new NCCL communicator
    /// per colour.
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
            _ => None,
        }
    }

    /// This process's handle on `MPI_COMM_WORLD` (one rank per process, under `mpirun`): every
    /// collective runs on MPI's non-blocking collectives, advanced by the runtime's MPI thread so
    /// compute between the start and the wait overlaps them. The timeout of every wait is
    /// `BURN_TP_TIMEOUT_S`, else [`DEFAULT_TIMEOUT`](crate::DEFAULT_TIMEOUT); what MPI cannot
    /// do that threads do (cancel a timed-out call, abort one group) is in [`crate::mpi`].
    #[cfg(feature = "mpi")]
    pub fn from_mpi(runtime: &crate::mpi::MpiRuntime) -> ProcessGroup {
        Self::over_mpi(runtime.world(), crate::LocalGroupOptions::default().timeout)
    }

    /// The MPI communicator of a group over MPI (where remote `Work` lives).
    #[cfg(feature = "mpi")]
    pub(crate) fn mpi(&self) -> &crate::mpi::MpiGroup {
        match &self.transport {
            Transport::Mpi(m) => m,
            _ => unreachable!("MPI work lives on MPI groups"),
        }
    }

    #[cfg(feature = "mpi")]
    fn over_mpi(group: crate::mpi::MpiGroup, timeout: Duration) -> ProcessGroup {
        Self {
            rank: group.rank(),
            world: group.world_size(),
            timeout: Arc::new(Mutex::new(timeout)),
            transport: Transport::Mpi(group),
            seq: Arc::new(AtomicU64::new(0)),
            membership: None,
            profile: None,
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
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Aborts the group because of `error` on this rank (say, a collective that failed before it
    /// could be posted): every peer's pending and next call fails at once with
    /// [`CommError::Aborted`] naming this rank and the error, instead of waiting for a post that
    /// never comes. A no-op on NCCL groups (their calls fail by their own timeout). On MPI
    /// groups it prints `error` and ends the whole job (`MPI_Abort`: MPI cannot abort one
    /// group), so every process exits non-zero at once.
    pub fn abort(&self, error: &CommError) {
        match &self.transport {
            Transport::Local(shared) => {
                let mut st = shared.lock();
                shared.abort_with(&mut st, format!("rank {}: {error}", self.rank));
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(_) => {}
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.abort(error),
        }
    }

    /// This rank's communication profile so far (of this group and the groups split from it),
    /// or `None` when profiling is off.
    pub fn profile(&self) -> Option<Profile> {
        self.profile.as_ref().map(|p| p.snapshot())
    }

    /// Whether the ranks are threads of one process ([`crate::LocalGroup`]), sharing its
    /// memory: what one rank holds for a while, every rank does at once in the same memory
    /// (a checkpoint's writers then take turns).
    pub fn shares_process(&self) -> bool {
        matches!(self.transport, Transport::Local(_))
    }

    /// Whether a collective in flight makes progress without the thread that posted it (NCCL on
    /// its own stream, MPI on its own thread where the node has cores to spare, see
    /// `mpi::MpiRuntime::overlaps`, or the simulated [`LinkModel`]), so that compute placed
    /// between the start and the wait hides it. Ranks as threads without a link move the data
    /// inside `wait`, on the caller's thread: there the overlap schedules would only add work.
    pub fn progresses_in_background(&self) -> bool {
        match &self.transport {
            Transport::Local(shared) => shared.options.link.is_some(),
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.overlaps(),
            #[allow(unreachable_patterns)]
            _ => true,
        }
    }

    /// Posts this rank's `data` for the call `desc` on the local transport; `finish` builds the
    /// output from every rank's posts once they are all there.
    pub(crate) fn post<T: Send + 'static>(
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
            #[allow(unreachable_patterns)]
            _ => unreachable!("NCCL and MPI calls start in `remote`"),
        }
    }

    /// On a transport that is not local, starts the call from `input` into `out`: over NCCL
    /// at once, with the host buffer staged through the GPU; over MPI on the MPI thread. Gives
    /// both buffers back on the local transport, which posts instead.
    #[allow(clippy::result_large_err)]
    pub(crate) fn remote<T: CommElement, I: crate::SendBuf<T>, O: RecvBuf<T>>(
        &self,
        desc: &OpDesc,
        input: I,
        out: O,
    ) -> std::result::Result<Work<O>, (I, O)> {
        match &self.transport {
            Transport::Local(_) => {
                let _ = desc;
                Err((input, out))
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(n) => {
                let mut out = out;
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let result = crate::nccl::RawOp::try_from(desc.kind)
                    .and_then(|op| n.host_collective(op, input.as_slice()))
                    .map(|v| {
                        out.as_mut_slice().copy_from_slice(&v);
                        out
                    });
                Ok(Work::done(self.clone(), seq, desc.clone(), result))
            }
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let world = self.world;
                // MPI has no average: a sum, finished here as the thread transport finishes it.
                let op = match desc.kind {
                    OpKind::AllReduce(op) => op,
                    _ => ReduceOp::Sum,
                };
                let finish = move |mut out: O| {
                    T::finish(op, out.as_mut_slice(), world);
                    out
                };
                let done = m.start(desc.clone(), seq, input, out, finish);
                Ok(Work::remote(self.clone(), seq, desc.clone(), done))
            }
        }
    }

    pub(crate) fn is_local(&self) -> bool {
        matches!(self.transport, Transport::Local(_))
    }

    pub(crate) fn check_out(op: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(CommError::BufferSize { op, expected, got });
        }
        Ok(())
    }

    pub(crate) fn check_divisible(&self, op: &'static str, len: usize) -> Result<()> {
        if !len.is_multiple_of(self.world_size()) {
            return Err(CommError::NotDivisible {
                op,
                len,
                world_size: self.world_size(),
            });
        }
        Ok(())
    }

    /// Splits the group like `MPI_Comm_split`: ranks passing the same `color` form a new group,
    /// ordered by `(key, rank)`. Collective over this group. Over NCCL the new group is a new
    /// communicator (`nccl::NcclGroup::split`, feature `nccl`); over MPI, `MPI_Comm_split`. A
    /// world of 4 split with `color = rank / 2` gives two groups of 2 (tensor parallel),
    /// `color = rank % 2` the orthogonal ones (data parallel).
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn split(&self, color: usize, key: usize) -> Result<ProcessGroup> {
        let parent = match &self.transport {
            Transport::Local(shared) => shared.clone(),
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let group = m.split(seq, color, key, self.timeout())?;
                return Ok(ProcessGroup::over_mpi(group, self.timeout()));
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(n) => {
                let group = ProcessGroup::from_nccl(n.split(color, key)?);
                group.set_timeout(self.timeout());
                return Ok(group);
            }
        };
        let work = self.gather_kind(OpKind::Split, vec![color as i64, key as i64], vec![2]);
        let seq = work.seq();
        let all = work.wait()?;
        let (members, new_rank) = crate::op::split_members(&all, color, self.rank);
        let mut st = parent.lock();
        let entry = st.splits.entry((seq, color)).or_insert_with(|| {
            (
                Shared::new(members.len(), parent.options.clone(), None),
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
