//! MPI between processes on CPUs (feature `mpi`): one rank per process, started by `mpirun`,
//! over a system MPI (Open MPI from the distribution's packages) through the `mpi` crate
//! (rsmpi).
//!
//! ```text
//!  caller threads (model, autodiff)            the MPI thread (owns every MPI call)
//!  ───────────────────────────────            ─────────────────────────────────────
//!  all_gather_async(x, out) ──Job(seq, ptrs)──▶ per communicator, in issue order:
//!        │  (x and out live in the Job)          1. MPI_Iallgather of the 11-word call
//!        ▼                                          descriptor (check: same op, dtype, shape)
//!  matmul on this rank's shard                   2. MPI_Iallgather / Ireduce_scatter_block /
//!        │                                          Iallreduce / Ibcast / Ibarrier on the data
//!  Work::wait(timeout) ◀──── output ──────────   3. MPI_Test every in-flight request until done
//! ```
//!
//! One thread makes every MPI call (`MPI_THREAD_FUNNELED`: it is the thread that called
//! `MPI_Init_thread`), so callers on any thread, autodiff's included, never touch MPI. It polls
//! its requests while the callers compute: Open MPI advances a non-blocking collective only
//! inside an MPI call on that process, so without this thread an all-gather posted before a
//! matmul would move no byte until the wait.
//!
//! Every collective first exchanges a small descriptor (sequence number, kind, element type,
//! shape) so ranks that disagree get [`CommError::Mismatch`] naming both calls, as with threads,
//! instead of MPI's undefined behaviour. Data collectives on one communicator are posted in issue
//! order (MPI matches collectives by order), each after its descriptor check; several can be in
//! flight at once.
//!
//! Why raw calls (`mpi::ffi`) beside rsmpi: rsmpi's non-blocking collectives tie their buffers to
//! a lexical `Scope`, but a [`Work`](crate::Work) outlives any scope of the caller (it is waited
//! on after the overlapped compute). Here the job owns the input and output buffers until MPI is
//! done with them. rsmpi provides the bindings (built against the system MPI by its build
//! script), initialisation, finalisation and `MPI_Comm_split`.
//!
//! What MPI cannot do that ranks as threads do:
//! - a collective cannot be cancelled: after a [timeout](crate::CommError::Timeout) the group
//!   is unusable (every later call fails at once with [`CommError::Aborted`]), the ranks that
//!   were missing are unknown (`missing` is empty), and the process should exit; `mpirun` then
//!   ends the other ranks;
//! - a group cannot be aborted alone: [`ProcessGroup::abort`](crate::ProcessGroup::abort) ends
//!   the whole job (`MPI_Abort`), after printing the error;
//! - a rank that panics or is killed ends the job: its process exits without `MPI_Finalize`
//!   and `mpirun` kills the others (exit status non-zero everywhere), instead of
//!   [`CommError::PeerGone`];
//! - an all-gather's parts arrive together: [`Work::wait_part`](crate::Work::wait_part) waits
//!   for the whole gather (the ring schedule then runs as the split one).

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};

use crate::{CommError, DType, OpDesc, OpKind, ReduceOp, Result};

/// Words of a call's descriptor: seq, kind, kind's argument, dtype, rank count of the shape, six
/// dimensions (a longer shape folds its tail into the last).
const HEADER: usize = 11;
const MAX_DIMS: usize = 6;

/// Whether this process has initialised MPI (it can only once).
static STARTED: AtomicBool = AtomicBool::new(false);

/// This process's MPI: the thread that makes every MPI call, and the world communicator.
/// Keep it alive for the whole run (in `main`): dropping it finalises MPI, after which the
/// groups made from it fail every call.
pub struct MpiRuntime {
    engine: Arc<Engine>,
    rank: usize,
    world_size: usize,
    background: bool,
}

impl std::fmt::Debug for MpiRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiRuntime")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl MpiRuntime {
    /// Initialises MPI (`MPI_Init_thread`) on a new thread that then makes every MPI call of
    /// this process.
    ///
    /// # Errors
    /// A second initialisation in one process, or an MPI without thread support.
    pub fn init() -> Result<Self> {
        if STARTED.swap(true, Ordering::SeqCst) {
            return Err(CommError::Backend(
                "MPI: MpiRuntime::init was already called in this process (MPI initialises once)"
                    .into(),
            ));
        }
        let (tx, rx) = mpsc::channel::<Msg>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let failed = Arc::new(Mutex::new(None));
        let failed2 = failed.clone();
        let thread = std::thread::Builder::new()
            .name("burn-tp-mpi".into())
            .spawn(move || engine_main(rx, ready_tx, failed2))
            .map_err(|e| CommError::Backend(format!("MPI: cannot start its thread: {e}")))?;
        let (rank, world_size, local_ranks) = ready_rx
            .recv()
            .map_err(|_| CommError::Backend("MPI: its thread ended during MPI_Init".into()))??;
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let background = match std::env::var("BURN_TP_MPI_OVERLAP").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => cores >= 2 * local_ranks,
        };
        Ok(Self {
            engine: Arc::new(Engine {
                tx: Mutex::new(Some(tx)),
                failed,
                thread: Mutex::new(Some(thread)),
            }),
            rank,
            world_size,
            background,
        })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in `MPI_COMM_WORLD`.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether the groups tell the parallel layers to run their overlap schedules
    /// ([`ProcessGroup::progresses_in_background`](crate::ProcessGroup::progresses_in_background)):
    /// when this node has at least two cores per rank on it, so a rank's MPI copies can run
    /// beside its compute. With fewer, shared-memory MPI's copies and the compute take turns on
    /// the same cores, and the schedules' extra blocks are pure cost (PERFORMANCE.md: 9% of
    /// train_gpt's throughput at 2 ranks on 2 cores). `BURN_TP_MPI_OVERLAP=1` or `0` decides
    /// instead.
    pub fn overlaps(&self) -> bool {
        self.background
    }

    pub(crate) fn world(&self) -> MpiGroup {
        MpiGroup {
            engine: self.engine.clone(),
            comm: 0,
            rank: self.rank,
            world_size: self.world_size,
            background: self.background,
            scratch: Scratch::default(),
        }
    }

    /// Ends the whole job at once (`MPI_Abort` with `code`): every process exits non-zero.
    /// For a rank that failed while its peers may be waiting on it.
    pub fn abort(&self, code: i32) -> ! {
        self.engine.abort(code)
    }
}

impl Drop for MpiRuntime {
    /// Finalises MPI; while unwinding from a panic, ends the job instead (`MPI_Abort`): the
    /// peers may be waiting in a collective for this rank, and `MPI_Finalize` would wait for
    /// them in turn.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("burn-tp: rank {} panicked: aborting the MPI job", self.rank);
            self.engine.abort(101);
        }
        self.engine.shutdown();
    }
}

/// The handle every group of the process shares on the MPI thread.
pub(crate) struct Engine {
    /// `None` once MPI is finalised.
    tx: Mutex<Option<Sender<Msg>>>,
    /// Why the groups of this process can no longer communicate (a timeout, a mismatch).
    failed: Failed,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    fn send(&self, msg: Msg) -> std::result::Result<(), Msg> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref() {
            Some(tx) => tx.send(msg).map_err(|e| e.0),
            None => Err(msg),
        }
    }

    fn fail(&self, why: String) {
        fail(&self.failed, why);
    }

    fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn abort(&self, code: i32) -> ! {
        let _ = self.send(Msg::Abort(code));
        // MPI_Abort does not return; if the MPI thread is gone, end the process ourselves.
        std::thread::sleep(Duration::from_secs(5));
        std::process::exit(code.max(1));
    }

    fn shutdown(&self) {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(tx) = tx {
            let _ = tx.send(Msg::Shutdown);
        }
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

/// The first reason the process's groups stopped communicating, shared with the MPI thread.
type Failed = Arc<Mutex<Option<String>>>;

fn fail(failed: &Failed, why: String) {
    failed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert(why);
}

/// A communicator of this process: its index in the MPI thread's table, this rank, its size.
#[derive(Clone)]
pub(crate) struct MpiGroup {
    engine: Arc<Engine>,
    comm: usize,
    rank: usize,
    world_size: usize,
    /// See [`MpiRuntime::overlaps`].
    background: bool,
    /// The reduce-scatters' receive buffers, reused (`Vec<T>`s of any element type): a fresh
    /// 16 MiB buffer costs more in page faults than the transfer.
    scratch: Scratch,
}

type Scratch = Arc<Mutex<Vec<Box<dyn std::any::Any + Send>>>>;

/// Keeps `v` for a later reduce-scatter (at most four buffers).
fn give_back<T: Send + 'static>(pool: &Scratch, v: Vec<T>) {
    let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < 4 {
        pool.push(Box::new(v));
    }
}

/// The output of a call in flight, filled by the MPI thread.
pub(crate) struct Completion<T> {
    value: Mutex<Option<Result<T>>>,
    cv: Condvar,
}

impl<T> Completion<T> {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            value: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    fn set(&self, value: Result<T>) {
        *self.value.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
        self.cv.notify_all();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Blocks until the value is set or `timeout` passes; then lends it to `read`.
    pub(crate) fn with<R>(
        &self,
        timeout: Duration,
        read: impl FnOnce(&mut Option<Result<T>>) -> R,
    ) -> Option<R> {
        let deadline = Instant::now() + timeout;
        let mut value = self.value.lock().unwrap_or_else(|e| e.into_inner());
        while value.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            value = self
                .cv
                .wait_timeout(value, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Some(read(&mut value))
    }
}

/// A raw pointer the job's owner keeps valid until the job completes.
#[derive(Clone, Copy)]
struct Ptr(*mut c_void);
// Safety: the pointed-to buffers are owned by the job's `complete` closure, which moves with the
// job to the MPI thread and is only dropped after MPI is done with them.
unsafe impl Send for Ptr {}

/// One data collective: MPI's view of the buffers.
struct Call {
    kind: OpKind,
    dtype: DType,
    send: Ptr,
    recv: Ptr,
    /// Elements of this rank's input (the broadcast's buffer).
    count: c_int,
}

type NewComm = (usize, usize, usize);

enum Action {
    Collective {
        call: Call,
        /// A second phase: run once `call` is done, it gives the call to post next (the
        /// all-reduce's all-gather after its all-to-all and local reduction).
        then: Option<Box<dyn FnOnce() -> Call + Send>>,
        /// Runs once MPI is done with the buffers (it owns them), with MPI's verdict.
        complete: Box<dyn FnOnce(Result<()>) + Send>,
    },
    Split {
        color: c_int,
        key: c_int,
        /// This rank's new communicator: (index in the MPI thread's table, rank, size).
        reply: Box<dyn FnOnce(Result<NewComm>) + Send>,
    },
}

struct Job {
    comm: usize,
    seq: u64,
    rank: usize,
    desc: OpDesc,
    action: Action,
}

impl Job {
    fn fail(self, e: CommError) {
        match self.action {
            Action::Collective { complete, .. } => complete(Err(e)),
            Action::Split { reply, .. } => reply(Err(e)),
        }
    }
}

enum Msg {
    Job(Box<Job>),
    Abort(i32),
    Shutdown,
}

impl MpiGroup {
    /// A buffer of `len` elements (contents unspecified: MPI overwrites them), reused if one
    /// of this type and size was given back.
    fn take_scratch<T: Copy + Send + 'static>(&self, len: usize, fill: T) -> Vec<T> {
        let mut pool = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let found = pool.iter().position(|b| {
            b.downcast_ref::<Vec<T>>()
                .is_some_and(|v| v.capacity() >= len)
        });
        match found {
            Some(i) => {
                let mut v = *pool.swap_remove(i).downcast::<Vec<T>>().expect("checked");
                v.truncate(len);
                v.resize(len, fill);
                v
            }
            None => vec![fill; len],
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    pub(crate) fn overlaps(&self) -> bool {
        self.background
    }

    fn aborted(&self, desc: &OpDesc, seq: u64, reason: String) -> CommError {
        CommError::Aborted {
            op: desc.clone(),
            seq,
            rank: self.rank,
            reason,
        }
    }

    fn submit(&self, job: Job) {
        if let Some(reason) = self.engine.failed() {
            let e = self.aborted(&job.desc, job.seq, reason);
            job.fail(e);
            return;
        }
        if let Err(Msg::Job(job)) = self.engine.send(Msg::Job(Box::new(job))) {
            let e = self.aborted(&job.desc, job.seq, "MPI was finalised".into());
            job.fail(e);
        }
    }

    /// Starts collective `desc` (`#seq`) from `input` into `out`, which MPI reads and writes in
    /// place; `finish` makes the result of the output once MPI is done (the average's
    /// division).
    pub(crate) fn start<T, I, O, R: Send + 'static>(
        &self,
        desc: OpDesc,
        seq: u64,
        input: I,
        mut out: O,
        finish: impl FnOnce(O) -> R + Send + 'static,
    ) -> Arc<Completion<R>>
    where
        T: crate::CommElement,
        I: crate::SendBuf<T>,
        O: crate::RecvBuf<T>,
    {
        let done = Completion::new();
        let count = input.as_slice().len();
        let Ok(count) = c_int::try_from(count) else {
            done.set(Err(CommError::Backend(format!(
                "MPI {desc} #{seq} on rank {}: {count} elements is more than MPI's count \
                 (i32) can say",
                self.rank
            ))));
            return done;
        };
        if let OpKind::Broadcast { root } = desc.kind
            && root == self.rank
        {
            // MPI broadcasts in place: the root's output starts as its input.
            out.as_mut_slice().copy_from_slice(input.as_slice());
        }
        // Both buffers move into the closure below with their heap storage in place (boxed,
        // so a `RecvBuf` keeping its elements inline cannot move them either).
        let input = Box::new(input);
        let mut out = Box::new(out);
        // A reduce-scatter is an all-to-all into `scratch` (chunk r of every rank to rank r),
        // then the reduction of the chunks in rank order: 4x faster than Open MPI's
        // `MPI_Ireduce_scatter_block` at 16-64 MiB (PERFORMANCE.md), and the same bits as the
        // thread transport. An all-reduce (of a length the ranks divide) is that, then an
        // all-gather of the reduced chunks: the thread transport's bits again, on every rank.
        let n = self.world_size;
        let len = input.as_slice().len();
        let two_phase =
            matches!(desc.kind, OpKind::AllReduce(_)) && n > 1 && len > 0 && len.is_multiple_of(n);
        let mut scratch: Vec<T> = match input.as_slice().first() {
            Some(&x) if desc.kind == OpKind::ReduceScatter || two_phase => {
                self.take_scratch(len, x)
            }
            _ => Vec::new(),
        };
        let pool = self.scratch.clone();
        let uses_scratch = !scratch.is_empty();
        let (kind, recv) = if uses_scratch {
            (OpKind::ReduceScatter, scratch.as_mut_ptr())
        } else {
            (desc.kind, out.as_mut_slice().as_mut_ptr())
        };
        let call = Call {
            kind,
            dtype: desc.dtype,
            send: Ptr(input.as_slice().as_ptr() as *mut c_void),
            recv: Ptr(recv as *mut c_void),
            count,
        };
        let op = match desc.kind {
            OpKind::AllReduce(op) => op,
            _ => ReduceOp::Sum,
        };
        let chunk = len / n.max(1);
        // Phase 2 of the all-reduce, run by the MPI thread once the all-to-all is in: reduce
        // this rank's chunk into the front of `scratch`, then all-gather it into `out`.
        let (front, out_ptr) = (
            call.recv,
            Ptr(out.as_mut_slice().as_mut_ptr() as *mut c_void),
        );
        let dtype = desc.dtype;
        let then = two_phase.then(|| {
            Box::new(move || {
                // Safety: `scratch` (`len` elements) is owned by `complete`, which the MPI
                // thread keeps until after this runs; nothing else touches it meanwhile.
                let all = unsafe { std::slice::from_raw_parts_mut(front.0 as *mut T, len) };
                let (first, rest) = all.split_at_mut(chunk);
                for part in rest.chunks_exact(chunk) {
                    T::combine(op, first, part);
                }
                Call {
                    kind: OpKind::AllGather,
                    dtype,
                    send: front,
                    recv: out_ptr,
                    count: chunk as c_int,
                }
            }) as Box<dyn FnOnce() -> Call + Send>
        });
        let slot = done.clone();
        let complete = Box::new(move |result: Result<()>| {
            drop(input);
            slot.set(result.map(|()| {
                if uses_scratch && !two_phase {
                    let dst = out.as_mut_slice();
                    dst.copy_from_slice(&scratch[..chunk]);
                    for part in scratch.chunks_exact(chunk.max(1)).skip(1) {
                        T::combine(ReduceOp::Sum, dst, part);
                    }
                }
                if uses_scratch {
                    give_back(&pool, scratch);
                }
                finish(*out)
            }));
        });
        self.submit(Job {
            comm: self.comm,
            seq,
            rank: self.rank,
            desc,
            action: Action::Collective {
                call,
                then,
                complete,
            },
        });
        done
    }

    /// `MPI_Comm_split` (after the descriptor check): this rank's new communicator.
    pub(crate) fn split(
        &self,
        seq: u64,
        color: usize,
        key: usize,
        timeout: Duration,
    ) -> Result<MpiGroup> {
        let desc = OpDesc::new(OpKind::Split, DType::I64, vec![2]);
        let (Ok(color), Ok(key)) = (c_int::try_from(color), c_int::try_from(key)) else {
            return Err(CommError::Backend(format!(
                "MPI split: colour {color} and key {key} must fit an i32"
            )));
        };
        let done = Completion::new();
        let slot = done.clone();
        self.submit(Job {
            comm: self.comm,
            seq,
            rank: self.rank,
            desc: desc.clone(),
            action: Action::Split {
                color,
                key,
                reply: Box::new(move |r| slot.set(r)),
            },
        });
        let (comm, rank, world_size) = self.wait(&done, &desc, seq, timeout)?;
        Ok(MpiGroup {
            engine: self.engine.clone(),
            comm,
            rank,
            world_size,
            background: self.background,
            scratch: Scratch::default(),
        })
    }

    /// Waits at most `timeout` for `done`; a timeout makes the group unusable (see the module).
    pub(crate) fn wait<O>(
        &self,
        done: &Completion<O>,
        desc: &OpDesc,
        seq: u64,
        timeout: Duration,
    ) -> Result<O> {
        match done.with(timeout, |v| v.take().expect("set")) {
            Some(r) => r,
            None => Err(self.timed_out(desc, seq, timeout)),
        }
    }

    /// The error of a wait that ran out of time; later calls fail at once.
    pub(crate) fn timed_out(&self, desc: &OpDesc, seq: u64, timeout: Duration) -> CommError {
        let e = CommError::Timeout {
            op: desc.clone(),
            seq,
            rank: self.rank,
            timeout,
            missing: Vec::new(),
        };
        self.engine.fail(format!(
            "rank {}: {e} (MPI cannot cancel a collective: end the job)",
            self.rank
        ));
        e
    }

    /// Ends the job (`MPI_Abort`), after printing `error`: MPI cannot abort one group.
    pub(crate) fn abort(&self, error: &CommError) -> ! {
        eprintln!(
            "burn-tp: rank {} of an MPI group aborts the job: {error}",
            self.rank
        );
        self.engine.abort(1)
    }
}

// ---------------------------------------------------------------------------------------------
// The MPI thread.

/// A communicator's state on the MPI thread.
struct Comm {
    comm: SimpleCommunicator,
    /// Jobs not yet posted, in issue order.
    queue: VecDeque<Job>,
    /// The head job's descriptor exchange.
    checking: Option<Checking>,
    /// A two-phase job whose first phase runs: later jobs wait for its second phase to be
    /// posted, so every rank posts the same collectives in the same order.
    first_phase: Option<FirstPhase>,
}

/// The first phase's request, the second phase, the job's completion, and what it is.
type FirstPhase = (
    ffi::MPI_Request,
    Box<dyn FnOnce() -> Call + Send>,
    Box<dyn FnOnce(Result<()>) + Send>,
    String,
);

/// A descriptor exchange in flight: the request, this rank's words, every rank's words (both
/// kept alive until MPI is done), and the job waiting on it.
type Checking = (ffi::MPI_Request, Box<[u64; HEADER]>, Box<[u64]>, Job);

/// A data collective MPI is running.
struct Running {
    request: ffi::MPI_Request,
    what: String,
    complete: Box<dyn FnOnce(Result<()>) + Send>,
}

/// What the MPI thread reports once MPI is up: rank, world size, ranks on this node.
type Ready = Result<(usize, usize, usize)>;

fn engine_main(rx: Receiver<Msg>, ready: Sender<Ready>, failed: Failed) {
    let Some((universe, threading)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
    else {
        let _ = ready.send(Err(CommError::Backend(
            "MPI: MPI_Init_thread failed (was MPI initialised elsewhere?)".into(),
        )));
        return;
    };
    if threading < mpi::Threading::Funneled {
        let _ = ready.send(Err(CommError::Backend(format!(
            "MPI: this MPI offers thread level {threading:?}; burn-tp needs Funneled or more"
        ))));
        return;
    }
    let ops = UserOps::new();
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let local = world.split_shared(world.rank()).size() as usize;
    let mut comms = vec![Comm::new(world)];
    let _ = ready.send(Ok((rank, size, local)));
    let mut running: Vec<Running> = Vec::new();
    let mut last_progress = Instant::now();
    'outer: loop {
        let busy = !running.is_empty()
            || comms
                .iter()
                .any(|c| c.checking.is_some() || c.first_phase.is_some());
        // Idle: sleep until a job comes. Busy: spin a little (a collective on shared memory
        // completes in microseconds), then poll every 50 us so compute keeps the cores.
        let first = if !busy {
            rx.recv().ok()
        } else if last_progress.elapsed() < Duration::from_micros(200) {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(Duration::from_micros(50)) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Msg::Shutdown),
            }
        };
        let first = match (first, busy) {
            (None, false) => Some(Msg::Shutdown), // every sender is gone
            (m, _) => m,
        };
        for msg in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match msg {
                Msg::Job(job) => comms[job.comm].queue.push_back(*job),
                Msg::Abort(code) => {
                    // Safety: plain call on a live communicator; does not return.
                    unsafe { ffi::MPI_Abort(comms[0].comm.as_raw(), code) };
                }
                Msg::Shutdown => break 'outer,
            }
        }
        let mut progressed = false;
        for c in 0..comms.len() {
            progressed |= step_comm(&mut comms, c, &ops, &mut running, &failed);
        }
        let mut i = 0;
        while i < running.len() {
            let verdict = match test(&mut running[i].request) {
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            };
            let done = running.swap_remove(i);
            let what = done.what;
            (done.complete)(verdict.map_err(|e| CommError::Backend(format!("MPI {what}: {e}"))));
            progressed = true;
        }
        if progressed {
            last_progress = Instant::now();
        }
    }
    let in_flight = running.len()
        + comms
            .iter()
            .filter(|c| c.checking.is_some() || c.first_phase.is_some())
            .count();
    if in_flight > 0 {
        // Finalising with requests in flight is erroneous (and can hang): end the job.
        eprintln!(
            "burn-tp: MPI shut down on rank {rank} with {in_flight} collective(s) in flight: \
             aborting the job"
        );
        // Safety: plain call on a live communicator; does not return.
        unsafe { ffi::MPI_Abort(comms[0].comm.as_raw(), 1) };
    }
    for c in comms.iter_mut() {
        for job in c.queue.drain(..) {
            let e = CommError::Aborted {
                op: job.desc.clone(),
                seq: job.seq,
                rank: job.rank,
                reason: "MPI was finalised".into(),
            };
            job.fail(e);
        }
    }
    drop(ops);
    drop(comms);
    drop(universe); // MPI_Finalize
}

impl Comm {
    fn new(comm: SimpleCommunicator) -> Self {
        // Errors come back as codes (and so as `CommError`s) instead of aborting the job.
        // Safety: plain call on a live communicator.
        unsafe { ffi::MPI_Comm_set_errhandler(comm.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
        Self {
            comm,
            queue: VecDeque::new(),
            checking: None,
            first_phase: None,
        }
    }
}

/// Advances communicator `c`: checks the head job's descriptors, then posts its collective.
/// Returns whether anything moved.
fn step_comm(
    comms: &mut Vec<Comm>,
    c: usize,
    ops: &UserOps,
    running: &mut Vec<Running>,
    failed: &Failed,
) -> bool {
    let mut progressed = false;
    loop {
        let comm = &mut comms[c];
        if let Some((request, ..)) = comm.first_phase.as_mut() {
            let verdict = test(request);
            if verdict == Ok(false) {
                return progressed;
            }
            let (_, then, complete, what) = comm.first_phase.take().expect("first phase");
            progressed = true;
            match verdict.and_then(|_| post(&comm.comm, &then(), ops)) {
                Ok(request) => running.push(Running {
                    request,
                    what,
                    complete,
                }),
                Err(e) => complete(Err(CommError::Backend(format!("MPI {what}: {e}")))),
            }
            continue;
        }
        if comm.checking.is_none() {
            let Some(job) = comm.queue.pop_front() else {
                return progressed;
            };
            let mine = Box::new(encode(job.seq, &job.desc));
            let mut all = vec![0u64; HEADER * comm.comm.size() as usize].into_boxed_slice();
            let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // Safety: both buffers live in `checking` until the request completes.
            let rc = unsafe {
                ffi::MPI_Iallgather(
                    mine.as_ptr() as *const c_void,
                    HEADER as c_int,
                    ffi::RSMPI_UINT64_T,
                    all.as_mut_ptr() as *mut c_void,
                    HEADER as c_int,
                    ffi::RSMPI_UINT64_T,
                    comm.comm.as_raw(),
                    &mut request,
                )
            };
            if rc != 0 {
                let e = mpi_error(&job, "posting the descriptor check", rc);
                job.fail(e);
                progressed = true;
                continue;
            }
            comm.checking = Some((request, mine, all, job));
            progressed = true;
        }
        let (request, _, _, _) = comm.checking.as_mut().expect("checking");
        match test(request) {
            Ok(false) => return progressed,
            Ok(true) => {}
            Err(e) => {
                let (_, _, _, job) = comm.checking.take().expect("checking");
                let e = CommError::Backend(format!(
                    "MPI descriptor check of {} #{} on rank {}: {e}",
                    job.desc, job.seq, job.rank
                ));
                job.fail(e);
                return true;
            }
        }
        let (_, _, all, job) = comm.checking.take().expect("checking");
        progressed = true;
        if let Some(e) = mismatch(&all, &job) {
            // Ranks disagree on the sequence: nothing later on this process can be matched.
            fail(failed, format!("rank {}: {e}", job.rank));
            job.fail(e);
            for later in comm.queue.drain(..).collect::<Vec<_>>() {
                let e = CommError::Aborted {
                    op: later.desc.clone(),
                    seq: later.seq,
                    rank: later.rank,
                    reason: "an earlier collective did not match across ranks".into(),
                };
                later.fail(e);
            }
            continue;
        }
        match job.action {
            Action::Split { color, key, reply } => {
                let parent = &comms[c].comm;
                let result = parent
                    .split_by_color_with_key(Color::with_value(color), key)
                    .map(|new| {
                        let (rank, size) = (new.rank() as usize, new.size() as usize);
                        comms.push(Comm::new(new));
                        (comms.len() - 1, rank, size)
                    })
                    .ok_or_else(|| {
                        CommError::Backend(format!(
                            "MPI split on rank {}: colour {color} gave no communicator",
                            job.rank
                        ))
                    });
                reply(result);
            }
            Action::Collective {
                call,
                then,
                complete,
            } => {
                let what = format!("{} #{} on rank {}", job.desc, job.seq, job.rank);
                match (post(&comms[c].comm, &call, ops), then) {
                    (Ok(request), None) => running.push(Running {
                        request,
                        what,
                        complete,
                    }),
                    (Ok(request), Some(then)) => {
                        comms[c].first_phase = Some((request, then, complete, what));
                    }
                    (Err(e), _) => complete(Err(CommError::Backend(format!("MPI {what}: {e}")))),
                }
            }
        }
    }
}

/// Posts the non-blocking MPI collective of `call`.
fn post(
    comm: &SimpleCommunicator,
    call: &Call,
    ops: &UserOps,
) -> std::result::Result<ffi::MPI_Request, String> {
    let comm = comm.as_raw();
    let dtype = datatype(call.dtype);
    let (send, recv, n) = (call.send.0 as *const c_void, call.recv.0, call.count);
    let size = {
        let mut s = 0;
        // Safety: plain query on a live communicator.
        unsafe { ffi::MPI_Comm_size(comm, &mut s) };
        s
    };
    let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
    // Safety: the buffers stay valid (owned by the job's completion) until the request is done;
    // their lengths were checked by the caller against `n` and the world size.
    let rc = unsafe {
        match call.kind {
            OpKind::AllGather | OpKind::Split => {
                ffi::MPI_Iallgather(send, n, dtype, recv, n, dtype, comm, &mut request)
            }
            // Reduced by the job once every chunk is in (see `MpiGroup::start`).
            OpKind::ReduceScatter => ffi::MPI_Ialltoall(
                send,
                n / size,
                dtype,
                recv,
                n / size,
                dtype,
                comm,
                &mut request,
            ),
            OpKind::AllReduce(op) => ffi::MPI_Iallreduce(
                send,
                recv,
                n,
                dtype,
                ops.get(call.dtype, op),
                comm,
                &mut request,
            ),
            OpKind::Broadcast { root } => {
                ffi::MPI_Ibcast(recv, n, dtype, root as c_int, comm, &mut request)
            }
            OpKind::Barrier => ffi::MPI_Ibarrier(comm, &mut request),
        }
    };
    if rc != 0 {
        return Err(error_string(rc));
    }
    Ok(request)
}

/// `MPI_Test`: whether the request is done (it is freed then).
fn test(request: &mut ffi::MPI_Request) -> std::result::Result<bool, String> {
    let mut flag: c_int = 0;
    // Safety: a live request; the status is ignored.
    let rc = unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    if rc != 0 {
        return Err(error_string(rc));
    }
    Ok(flag != 0)
}

fn error_string(code: c_int) -> String {
    let mut buf = vec![0 as std::ffi::c_char; 512];
    let mut len: c_int = 0;
    // Safety: the buffer has MPI_MAX_ERROR_STRING (256 in Open MPI) room and more.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    let bytes: Vec<u8> = buf[..len.max(0) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    format!("MPI error {code}: {}", String::from_utf8_lossy(&bytes))
}

fn mpi_error(job: &Job, what: &str, code: c_int) -> CommError {
    CommError::Backend(format!(
        "MPI {} #{} on rank {}: {what}: {}",
        job.desc,
        job.seq,
        job.rank,
        error_string(code)
    ))
}

fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // Safety: reads of constants rsmpi's C shim exports.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::I64 => ffi::RSMPI_INT64_T,
            // Moved as raw 16-bit words; reduced by `UserOps` as floats.
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Call descriptors.

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Avg => 3,
    }
}

fn encode(seq: u64, desc: &OpDesc) -> [u64; HEADER] {
    let (kind, arg) = match desc.kind {
        OpKind::AllGather => (0, 0),
        OpKind::ReduceScatter => (1, 0),
        OpKind::AllReduce(op) => (2, op_code(op)),
        OpKind::Broadcast { root } => (3, root as u64),
        OpKind::Barrier => (4, 0),
        OpKind::Split => (5, 0),
    };
    let mut h = [0u64; HEADER];
    h[0] = seq;
    h[1] = kind;
    h[2] = arg;
    h[3] = dtype_code(desc.dtype);
    h[4] = desc.shape.len() as u64;
    for (i, &d) in desc.shape.iter().enumerate() {
        let slot = 5 + i.min(MAX_DIMS - 1);
        h[slot] = if i < MAX_DIMS {
            d as u64
        } else {
            h[slot] * d as u64
        };
    }
    h
}

fn decode(h: &[u64]) -> (u64, OpDesc) {
    let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg];
    let kind = match h[1] {
        0 => OpKind::AllGather,
        1 => OpKind::ReduceScatter,
        2 => OpKind::AllReduce(op[(h[2] as usize).min(3)]),
        3 => OpKind::Broadcast {
            root: h[2] as usize,
        },
        4 => OpKind::Barrier,
        _ => OpKind::Split,
    };
    let dtype =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64][(h[3] as usize).min(4)];
    let dims = (h[4] as usize).min(MAX_DIMS);
    let shape = h[5..5 + dims].iter().map(|&d| d as usize).collect();
    (h[0], OpDesc::new(kind, dtype, shape))
}

/// The first rank whose descriptor differs from this rank's, as [`CommError::Mismatch`].
fn mismatch(all: &[u64], job: &Job) -> Option<CommError> {
    let mine = &all[HEADER * job.rank..HEADER * (job.rank + 1)];
    let (r, theirs) = all
        .chunks_exact(HEADER)
        .enumerate()
        .find(|(_, h)| *h != mine)?;
    let (their_seq, theirs) = decode(theirs);
    if their_seq != job.seq {
        return Some(CommError::Backend(format!(
            "collective #{} mismatch: rank {} called {} as its call #{} but rank {r} called {theirs} \
             as its call #{their_seq} (the ranks issued different collectives before)",
            job.seq, job.rank, job.desc, job.seq
        )));
    }
    Some(CommError::Mismatch {
        seq: job.seq,
        rank: job.rank,
        ours: job.desc.clone(),
        other_rank: r,
        theirs,
    })
}

// ---------------------------------------------------------------------------------------------
// Reductions of 16-bit floats: MPI has no bf16 / f16 types, so they travel as `uint16_t` and are
// reduced by user operations that do the arithmetic in the element's own type (as the thread
// transport does), never as integers.

struct UserOps {
    /// `[f16, bf16] x [sum, max, min]`.
    half: [[ffi::MPI_Op; 3]; 2],
}

/// `inout = inout op input` over `*len` elements of `T`, with the element's own arithmetic
/// ([`CommElement::combine`](crate::CommElement::combine), as the thread transport reduces).
/// `OP` is the index of [`REDUCTIONS`] (a `ReduceOp` cannot be a const parameter).
unsafe extern "C" fn half_op<T: crate::CommElement, const OP: usize>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _: *mut ffi::MPI_Datatype,
) {
    // Safety: MPI passes two buffers of `*len` elements of the type the op was registered for
    // (uint16_t words holding `T`s, which have the same layout).
    unsafe {
        let n = *len as usize;
        let other = std::slice::from_raw_parts(input as *const T, n);
        let acc = std::slice::from_raw_parts_mut(inout as *mut T, n);
        T::combine(REDUCTIONS[OP], acc, other);
    }
}

/// The reductions MPI does for us, by index (the average is a sum, divided afterwards).
const REDUCTIONS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

impl UserOps {
    fn new() -> Self {
        let make = |f: UserFn| {
            let mut op = unsafe { ffi::RSMPI_SUM };
            // Safety: registers a commutative function with MPI's signature.
            unsafe { ffi::MPI_Op_create(Some(f), 1, &mut op) };
            op
        };
        Self {
            half: [
                [
                    make(half_op::<f16, 0>),
                    make(half_op::<f16, 1>),
                    make(half_op::<f16, 2>),
                ],
                [
                    make(half_op::<bf16, 0>),
                    make(half_op::<bf16, 1>),
                    make(half_op::<bf16, 2>),
                ],
            ],
        }
    }

    /// The MPI operation of `op` on `dtype` (the average is a sum, divided afterwards).
    fn get(&self, dtype: DType, op: ReduceOp) -> ffi::MPI_Op {
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        };
        match dtype {
            DType::F16 => self.half[0][i],
            DType::BF16 => self.half[1][i],
            // Safety: reads of constants rsmpi's C shim exports.
            _ => unsafe { [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][i] },
        }
    }
}

impl Drop for UserOps {
    fn drop(&mut self) {
        for op in self.half.iter_mut().flatten() {
            // Safety: ops made by `MPI_Op_create`, freed once, before MPI_Finalize.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}
