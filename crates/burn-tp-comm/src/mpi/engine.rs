//! The MPI thread: it makes every MPI call. Per communicator it keeps the jobs in issue order,
//! checks each one's descriptor against every rank's, posts the collective, and polls the
//! requests in flight (Open MPI advances a collective only inside an MPI call).

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};

use super::ops::UserOps;
use crate::descriptor::{HEADER, encode, mismatch};
use crate::{CommError, DType, OpDesc, OpKind, Result};

/// The handle every group of the process shares on the MPI thread.
pub(crate) struct Engine {
    /// `None` once MPI is finalised.
    pub(super) tx: Mutex<Option<Sender<Msg>>>,
    /// Why the groups of this process can no longer communicate (a timeout, a mismatch).
    pub(super) failed: Failed,
    pub(super) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Engine {
    pub(super) fn send(&self, msg: Msg) -> std::result::Result<(), Msg> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match tx.as_ref() {
            Some(tx) => tx.send(msg).map_err(|e| e.0),
            None => Err(msg),
        }
    }

    pub(super) fn fail(&self, why: String) {
        fail(&self.failed, why);
    }

    pub(super) fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn abort(&self, code: i32) -> ! {
        let _ = self.send(Msg::Abort(code));
        // MPI_Abort does not return; if the MPI thread is gone, end the process ourselves.
        std::thread::sleep(Duration::from_secs(5));
        std::process::exit(code.max(1));
    }

    pub(super) fn shutdown(&self) {
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
pub(super) type Failed = Arc<Mutex<Option<String>>>;

pub(super) fn fail(failed: &Failed, why: String) {
    failed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert(why);
}

/// A raw pointer the job's owner keeps valid until the job completes.
#[derive(Clone, Copy)]
pub(super) struct Ptr(pub(super) *mut c_void);
// Safety: the pointed-to buffers are owned by the job's `complete` closure, which moves with the
// job to the MPI thread and is only dropped after MPI is done with them.
unsafe impl Send for Ptr {}

/// One data collective: MPI's view of the buffers.
pub(super) struct Call {
    pub(super) kind: OpKind,
    pub(super) dtype: DType,
    pub(super) send: Ptr,
    pub(super) recv: Ptr,
    /// Elements of this rank's input (the broadcast's buffer).
    pub(super) count: c_int,
    /// The all-to-all's counts and displacements (kept alive by the job's completion too).
    pub(super) counts: Option<Arc<VCounts>>,
}

/// `MPI_Alltoallv`'s per-peer counts and displacements, in elements.
pub(super) struct VCounts {
    pub(super) send: Vec<c_int>,
    pub(super) send_at: Vec<c_int>,
    pub(super) recv: Vec<c_int>,
    pub(super) recv_at: Vec<c_int>,
}

pub(super) type NewComm = (usize, usize, usize);

pub(super) enum Action {
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

pub(super) struct Job {
    pub(super) comm: usize,
    pub(super) seq: u64,
    pub(super) rank: usize,
    pub(super) desc: OpDesc,
    pub(super) action: Action,
}

impl Job {
    pub(super) fn fail(self, e: CommError) {
        match self.action {
            Action::Collective { complete, .. } => complete(Err(e)),
            Action::Split { reply, .. } => reply(Err(e)),
        }
    }
}

pub(super) enum Msg {
    Job(Box<Job>),
    Abort(i32),
    Shutdown,
}

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
pub(super) type Ready = Result<(usize, usize, usize)>;

pub(super) fn engine_main(rx: Receiver<Msg>, ready: Sender<Ready>, failed: Failed) {
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
        if let Some(e) = mismatch(&all, job.rank, job.seq, &job.desc) {
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
            OpKind::AllToAll => {
                let Some(v) = call.counts.as_deref() else {
                    return Err("all_to_all posted without its counts".into());
                };
                ffi::MPI_Ialltoallv(
                    send,
                    v.send.as_ptr(),
                    v.send_at.as_ptr(),
                    dtype,
                    recv,
                    v.recv.as_ptr(),
                    v.recv_at.as_ptr(),
                    dtype,
                    comm,
                    &mut request,
                )
            }
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
