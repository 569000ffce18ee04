//! NCCL on CUDA devices, through cudarc (feature `nccl`). One process per GPU, started by
//! `burn-tp-launch` (or torchrun-style by hand) and met at the [`store`](crate::store).
//!
//! Every collective runs on a dedicated communication stream. It first waits for an event
//! recorded on the compute stream (the context's default stream, which is what cudarc buffers
//! use), and records a completion event the [`DeviceWork`] handle gives back: [`DeviceWork::wait`]
//! makes that compute stream wait for it (no host block), so an all-gather issued before a matmul
//! on cudarc buffers really runs beside it. Burn's CUDA tensors live on cubecl's own streams,
//! which this event ordering cannot see: burn-tp's CUDA backend (`backend/cuda.rs` in burn-tp)
//! syncs cubecl's stream before a post and blocks the host on [`DeviceWork::wait_host`] instead.
//!
//! cudarc loads `libcuda` and `libnccl` at run time and panics if they are missing, so
//! [`probe`] checks first and returns errors instead. NCCL installs as `libnccl.so.2`, a name
//! cudarc does not try: [`probe`] reports it, and `burn-tp-launch` puts a `libnccl.so` link on
//! its children's `LD_LIBRARY_PATH`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::{Comm, Id, NcclType};

mod host;
mod probe;
mod work;

pub use probe::{Probe, probe};

pub(crate) use work::RawDeviceBuffer;
pub use work::{DeviceWork, RawOp};

use crate::communicator::Communicator;
use crate::store::{LaunchEnv, StoreClient};
use crate::{CommElement, CommError, DType, OpKind, ReduceOp, Result};

fn nccl_err(op: &str, seq: u64, rank: usize, e: impl std::fmt::Debug) -> CommError {
    CommError::Backend(format!("NCCL {op} #{seq} on rank {rank}: {e:?}"))
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
    }
}

/// cudarc's `Comm` holds a raw `ncclComm_t` and so is neither `Send` nor `Sync`. NCCL allows a
/// communicator to be used from any thread as long as calls on it do not run concurrently: the
/// mutex serialises them, so the group can live in a `ProcessGroup` that ranks move into threads
/// and autodiff nodes share.
struct CommCell(std::sync::Mutex<Comm>);

// Safety: see `CommCell`; every use goes through the mutex.
unsafe impl Send for CommCell {}
// Safety: as above.
unsafe impl Sync for CommCell {}

impl CommCell {
    fn lock(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `ncclCommInitRank` blocks until every rank of the group has called it, with no timeout of
/// its own: it runs on a helper thread here, so a peer that never comes is an error after
/// `timeout` instead of a hang. On timeout that thread stays blocked inside NCCL (nothing can
/// cancel it); the caller is expected to fail the run.
fn init_comm(
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    id: Id,
    timeout: Duration,
    what: &str,
) -> Result<Comm> {
    struct SendComm(Comm);
    // Safety: the communicator is created on the helper thread and only used after it was
    // handed over; NCCL allows a communicator to move between threads.
    unsafe impl Send for SendComm {}
    let (tx, rx) = std::sync::mpsc::channel();
    let ctx = stream.context().clone();
    std::thread::Builder::new()
        .name(format!("nccl-init-{rank}"))
        .spawn(move || {
            // ncclCommInitRank uses the calling thread's current device.
            let made = ctx
                .bind_to_thread()
                .map_err(|e| format!("{e:?}"))
                .and_then(|()| {
                    Comm::from_rank(stream, rank, world_size, id).map_err(|e| format!("{e:?}"))
                });
            let _ = tx.send(made.map(SendComm));
        })
        .map_err(|e| nccl_err(what, 0, rank, e))?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(SendComm(comm))) => Ok(comm),
        Ok(Err(e)) => Err(nccl_err(what, 0, rank, e)),
        Err(_) => Err(CommError::Backend(format!(
            "NCCL {what} on rank {rank}: not every one of the {world_size} ranks joined within \
             {timeout:?}"
        ))),
    }
}

/// One rank's NCCL communicator on its GPU (`LOCAL_RANK`).
pub struct NcclGroup {
    comm: CommCell,
    comm_stream: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    seq: AtomicU64,
    timeout: Duration,
    posts_at_world_one: bool,
}

impl TryFrom<OpKind> for RawOp {
    type Error = CommError;

    fn try_from(kind: OpKind) -> Result<Self> {
        Ok(match kind {
            OpKind::AllGather => RawOp::AllGather,
            OpKind::ReduceScatter => RawOp::ReduceScatter,
            OpKind::AllReduce(op) => RawOp::AllReduce(op),
            OpKind::Broadcast { root } => RawOp::Broadcast { root },
            OpKind::Barrier | OpKind::Split | OpKind::AllToAll => {
                return Err(CommError::Backend(format!(
                    "{kind:?} has no NCCL buffer call"
                )));
            }
        })
    }
}

impl NcclGroup {
    /// Joins the NCCL group of the launch: checks the libraries and the GPU of `LOCAL_RANK`,
    /// checks that no two ranks share a GPU, takes the NCCL unique id from rank 0 through the
    /// store, and creates the communicator on a new communication stream.
    ///
    /// # Errors
    /// Missing libraries, fewer GPUs than local ranks, two ranks on one GPU, a store timeout, or
    /// an NCCL error, each naming the rank.
    pub fn new(env: &LaunchEnv, store: &StoreClient, timeout: Duration) -> Result<Self> {
        probe()?;
        let (rank, world_size) = (env.rank, env.world_size);
        let count =
            CudaContext::device_count().map_err(|e| nccl_err("device_count", 0, rank, e))? as usize;
        if env.local_rank >= count {
            return Err(CommError::Backend(format!(
                "NCCL: rank {rank} has LOCAL_RANK {} but this machine has {count} GPU(s)",
                env.local_rank
            )));
        }
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let me = format!("{host}/gpu{}", env.local_rank);
        store.set(&format!("nccl/device/{rank}"), me.as_bytes())?;
        for r in 0..world_size {
            let other =
                String::from_utf8_lossy(&store.get(&format!("nccl/device/{r}"))?).into_owned();
            if r != rank && other == me {
                return Err(CommError::Backend(format!(
                    "NCCL: ranks {rank} and {r} are both on {me}"
                )));
            }
        }
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("get_unique_id", 0, rank, e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set("nccl/id", &bytes)?;
            id
        } else {
            let bytes = store.get("nccl/id")?;
            let mut internal = [0 as std::ffi::c_char; 128];
            internal
                .iter_mut()
                .zip(&bytes)
                .for_each(|(d, &b)| *d = b as std::ffi::c_char);
            Id::uninit(internal)
        };
        let ctx = CudaContext::new(env.local_rank).map_err(|e| nccl_err("context", 0, rank, e))?;
        let comm_stream = ctx
            .new_stream()
            .map_err(|e| nccl_err("new_stream", 0, rank, e))?;
        let comm = init_comm(
            comm_stream.clone(),
            rank,
            world_size,
            id,
            timeout,
            "comm_init_rank",
        )?;
        Ok(Self {
            comm: CommCell(std::sync::Mutex::new(comm)),
            comm_stream,
            compute: ctx.default_stream(),
            rank,
            world_size,
            seq: AtomicU64::new(0),
            timeout,
            posts_at_world_one: false,
        })
    }

    /// With `true`, device backends post every communicating collective to NCCL even when the
    /// group has one rank (where they otherwise return the input without a call): what a
    /// single-GPU machine needs to run the device path (output allocation, stream ordering,
    /// pointer hand-off) for real. Off by default; kept by [`split`](Self::split).
    pub fn with_posts_at_world_one(mut self, posts: bool) -> Self {
        self.posts_at_world_one = posts;
        self
    }

    /// Whether a device collective posts to NCCL on this group: always at world size > 1, and at
    /// world size 1 only when asked ([`with_posts_at_world_one`](Self::with_posts_at_world_one)).
    pub fn posts(&self) -> bool {
        self.world_size > 1 || self.posts_at_world_one
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The compute stream the collectives are ordered against (the context's default stream).
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The group's timeout (every host wait).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `launch` on the communication stream after the compute stream's current work.
    fn issue(
        &self,
        op: &str,
        launch: impl FnOnce(&Comm, u64) -> std::result::Result<(), CommError>,
    ) -> Result<DeviceWork> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let cuda = |e| nccl_err(op, seq, self.rank, e);
        let comm = self.comm.lock();
        let ready = self.compute.record_event(None).map_err(cuda)?;
        self.comm_stream.wait(&ready).map_err(cuda)?;
        launch(&comm, seq)?;
        let done = self.comm_stream.record_event(None).map_err(cuda)?;
        let what = format!("NCCL {op} #{seq} on rank {}", self.rank);
        Ok(DeviceWork {
            done,
            compute: self.compute.clone(),
            what,
            timeout: self.timeout,
            output: (),
            _input: None,
        })
    }

    fn check_len(&self, op: RawOp, name: &'static str, input: usize, out: usize) -> Result<()> {
        let world = self.world_size;
        let want = match op {
            RawOp::AllGather => input * world,
            RawOp::ReduceScatter => {
                if !input.is_multiple_of(world) {
                    return Err(CommError::NotDivisible {
                        op: name,
                        len: input,
                        world_size: world,
                    });
                }
                input / world
            }
            RawOp::AllReduce(_) => input,
            RawOp::Broadcast { root } => {
                if root >= world {
                    return Err(CommError::InvalidRoot {
                        op: name,
                        root,
                        world_size: world,
                    });
                }
                input
            }
        };
        if out != want {
            return Err(CommError::BufferSize {
                op: name,
                expected: want,
                got: out,
            });
        }
        Ok(())
    }

    /// Posts `op` from `input` into `out` (any device buffers of this GPU) on the
    /// communication stream, after the compute stream's current work.
    ///
    /// # Errors
    /// [`CommError::BufferSize`], [`CommError::NotDivisible`] or [`CommError::InvalidRoot`]
    /// before any communication; an NCCL error naming the op, sequence number and rank.
    pub fn post_into<T, S, R>(&self, op: RawOp, input: &S, out: &mut R) -> Result<DeviceWork>
    where
        T: NcclType + DeviceRepr,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let name = match op {
            RawOp::AllGather => "all_gather",
            RawOp::ReduceScatter => "reduce_scatter",
            RawOp::AllReduce(_) => "all_reduce",
            RawOp::Broadcast { .. } => "broadcast",
        };
        self.check_len(op, name, input.len(), out.len())?;
        let rank = self.rank;
        self.issue(name, |c, seq| {
            let r = match op {
                RawOp::AllGather => c.all_gather(input, out),
                RawOp::ReduceScatter => c.reduce_scatter(input, out, &nccl_op(ReduceOp::Sum)),
                RawOp::AllReduce(r) => c.all_reduce(input, out, &nccl_op(r)),
                RawOp::Broadcast { root } => c.broadcast(Some(input), out, root as i32),
            };
            r.map(|_| ()).map_err(|e| nccl_err(name, seq, rank, e))
        })
    }

    /// [`post_into`](Self::post_into) on raw device pointers, the element type chosen at run
    /// time (how burn's device tensors, typed by a `DType` value, reach NCCL).
    ///
    /// # Errors
    /// As [`post_into`](Self::post_into).
    ///
    /// # Safety
    /// `input` and `out` are device allocations of this group's GPU holding `input_len` and
    /// `out_len` elements of `dtype`, live and not written by others until the work completes.
    pub unsafe fn post_raw(
        &self,
        op: RawOp,
        dtype: DType,
        (input, input_len): (CUdeviceptr, usize),
        (out, out_len): (CUdeviceptr, usize),
    ) -> Result<DeviceWork> {
        let stream = &self.comm_stream;
        macro_rules! typed {
            ($t:ty) => {{
                // Safety: the caller's contract.
                let (i, mut o) = unsafe {
                    (
                        RawDeviceBuffer::<$t>::new(input, input_len, stream.clone()),
                        RawDeviceBuffer::<$t>::new(out, out_len, stream.clone()),
                    )
                };
                self.post_into(op, &i, &mut o)
            }};
        }
        match dtype {
            DType::F32 => typed!(f32),
            DType::F64 => typed!(f64),
            DType::F16 => typed!(half::f16),
            DType::BF16 => typed!(half::bf16),
            DType::I64 => typed!(i64),
        }
    }

    /// The sub-group of the ranks that pass the same `color`, ranked by `(key, rank)`: a new
    /// NCCL communicator on this rank's GPU, with its own communication stream. Collective over
    /// this group (every rank calls it, in the same order as its other collectives).
    ///
    /// `ncclCommSplit` is not reachable through cudarc's `Comm` (it keeps the raw handle
    /// private), so the sub-group is made as NCCL makes any group: each sub-group's first member
    /// draws a unique id, every rank gets its own sub-group's id by an all-gather over this
    /// group (with the colours and keys), and the members call `ncclCommInitRank` together.
    ///
    /// # Errors
    /// An NCCL or CUDA error, or a timeout.
    pub fn split(&self, color: usize, key: usize) -> Result<NcclGroup> {
        let all = self.host_collective(RawOp::AllGather, &[color as i64, key as i64])?;
        let (members, new_rank) = crate::op::split_members(&all, color, self.rank);
        let leader = members[0];
        // A unique id is 128 bytes: 16 i64s per rank, zeros but from each sub-group's leader.
        const WORDS: usize = 16;
        let mut mine = [0i64; WORDS];
        if self.rank == leader {
            let id = Id::new().map_err(|e| nccl_err("get_unique_id (split)", 0, self.rank, e))?;
            for (w, chunk) in mine.iter_mut().zip(id.internal().chunks(8)) {
                let mut b = [0u8; 8];
                for (d, &c) in b.iter_mut().zip(chunk) {
                    *d = c as u8;
                }
                *w = i64::from_le_bytes(b);
            }
        }
        let ids = self.host_collective(RawOp::AllGather, &mine)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (k, w) in ids[leader * WORDS..(leader + 1) * WORDS].iter().enumerate() {
            for (j, b) in w.to_le_bytes().into_iter().enumerate() {
                internal[8 * k + j] = b as std::ffi::c_char;
            }
        }
        let comm_stream = self
            .comm_stream
            .context()
            .new_stream()
            .map_err(|e| nccl_err("new_stream (split)", 0, self.rank, e))?;
        let comm = init_comm(
            comm_stream.clone(),
            new_rank,
            members.len(),
            Id::uninit(internal),
            self.timeout,
            "comm_init_rank (split)",
        )?;
        Ok(NcclGroup {
            comm: CommCell(std::sync::Mutex::new(comm)),
            comm_stream,
            compute: self.compute.clone(),
            rank: new_rank,
            world_size: members.len(),
            seq: AtomicU64::new(0),
            timeout: self.timeout,
            posts_at_world_one: self.posts_at_world_one,
        })
    }

    /// Blocks the host until every rank reached this point (an all-reduce of one value).
    ///
    /// # Errors
    /// A timeout or an NCCL error.
    pub fn barrier(&self) -> Result<()> {
        self.host_collective(RawOp::AllReduce(ReduceOp::Sum), &[1.0f32])
            .map(|_| ())
    }

    fn post_owned<T: NcclType + DeviceRepr + 'static>(
        &self,
        op: RawOp,
        input: CudaSlice<T>,
        out_len: usize,
    ) -> Result<DeviceWork<CudaSlice<T>>> {
        let cuda = |e| nccl_err("alloc", 0, self.rank, e);
        // Safety: every element is written by the collective before the output is read.
        let mut out = unsafe { self.compute.alloc::<T>(out_len) }.map_err(cuda)?;
        let work = self.post_into(op, &input, &mut out)?;
        Ok(work.with_buffers(out, Box::new(input)))
    }
}

impl<T> Communicator<T> for NcclGroup
where
    T: CommElement + NcclType + DeviceRepr,
{
    type Buffer = CudaSlice<T>;
    type Work = DeviceWork<CudaSlice<T>>;

    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn all_gather_async(&self, input: CudaSlice<T>) -> Result<Self::Work> {
        let n = input.len() * self.world_size;
        self.post_owned(RawOp::AllGather, input, n)
    }
    fn reduce_scatter_async(&self, input: CudaSlice<T>) -> Result<Self::Work> {
        let n = input.len() / self.world_size;
        self.post_owned(RawOp::ReduceScatter, input, n)
    }
    fn all_reduce_async(&self, input: CudaSlice<T>, op: ReduceOp) -> Result<Self::Work> {
        let n = input.len();
        self.post_owned(RawOp::AllReduce(op), input, n)
    }
    fn broadcast_async(&self, input: CudaSlice<T>, root: usize) -> Result<Self::Work> {
        let n = input.len();
        self.post_owned(RawOp::Broadcast { root }, input, n)
    }
    fn barrier(&self) -> Result<()> {
        NcclGroup::barrier(self)
    }
    fn wait(&self, work: Self::Work, timeout: Option<Duration>) -> Result<CudaSlice<T>> {
        match timeout {
            Some(t) => work.wait_host_timeout(t),
            None => work.wait(),
        }
    }
    fn is_completed(&self, work: &Self::Work) -> bool {
        work.is_completed()
    }
}
