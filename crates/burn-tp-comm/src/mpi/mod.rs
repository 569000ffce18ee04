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
//!
//! | file            | what                                                                      |
//! |-----------------|---------------------------------------------------------------------------|
//! | `mod.rs`        | [`MpiRuntime`]: MPI started on its own thread, the world, abort, overlap   |
//! | `group.rs`      | a communicator seen from the callers: posting jobs, waiting, scratch buffers |
//! | `engine.rs`     | the MPI thread: the job queue per communicator, posting and polling requests |
//! | `../descriptor.rs` | the 11-word call descriptor every rank exchanges (transport-free: tested without MPI) |
//! | `ops.rs`        | bf16 / f16 reductions as MPI user operations, in the element's own arithmetic |

mod engine;
mod group;
mod ops;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use crate::{CommError, Result};

pub(crate) use engine::Engine;
use engine::{Msg, engine_main};
use group::Scratch;
pub(crate) use group::{Completion, MpiGroup};

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
