//! NCCL on CUDA devices, through cudarc (feature `nccl`). One process per GPU, started by
//! `burn-tp-launch` (or torchrun-style by hand) and met at the [`store`](crate::store).
//!
//! Every collective runs on a dedicated communication stream. It first waits for an event
//! recorded on the compute stream (so it sees the inputs), and records a completion event the
//! [`NcclWork`] handle gives back: [`NcclWork::wait`] makes the compute stream wait for it (no host
//! block), so an all-gather issued before a matmul really runs beside it.
//!
//! cudarc loads `libcuda` and `libnccl` at run time and panics if they are missing, so
//! [`probe`] checks first and returns errors instead. NCCL installs as `libnccl.so.2`, a name
//! cudarc does not try: [`probe`] reports it, and `burn-tp-launch` puts a `libnccl.so` link on
//! its children's `LD_LIBRARY_PATH`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DeviceRepr};
use cudarc::nccl::{Comm, Id, NcclType};

use crate::store::{LaunchEnv, StoreClient};
use crate::{CommError, ReduceOp, Result};

/// The libraries NCCL needs, found or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `libcuda` loads.
    pub cuda: bool,
    /// `libnccl` loads under a name cudarc tries.
    pub nccl: bool,
    /// `libnccl.so.2` loads (NCCL's real soname).
    pub nccl_soname: bool,
}

/// Checks for libcuda and libnccl without panicking.
///
/// # Errors
/// What is missing, and what to do about it.
pub fn probe() -> Result<Probe> {
    // Safety: only dlopen; no symbol is called.
    let p = unsafe {
        Probe {
            cuda: cudarc::driver::sys::is_culib_present(),
            nccl: cudarc::nccl::sys::is_culib_present(),
            nccl_soname: libloading::Library::new("libnccl.so.2").is_ok(),
        }
    };
    if !p.cuda {
        return Err(CommError::Backend(
            "NCCL: libcuda was not found (no NVIDIA driver on this machine?)".into(),
        ));
    }
    if !p.nccl {
        return Err(CommError::Backend(if p.nccl_soname {
            "NCCL: libnccl.so.2 is installed but cudarc loads `libnccl.so`: add a link \
             `libnccl.so -> libnccl.so.2` in a directory on LD_LIBRARY_PATH (burn-tp-launch does)"
                .into()
        } else {
            "NCCL: libnccl was not found (install NCCL, or add its directory to LD_LIBRARY_PATH)"
                .into()
        }));
    }
    Ok(p)
}

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

/// One rank's NCCL communicator on its GPU (`LOCAL_RANK`).
pub struct NcclGroup {
    comm: Comm,
    compute: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    seq: AtomicU64,
    timeout: Duration,
}

/// A collective in flight on the communication stream.
#[must_use = "a collective is ordered before later compute only once waited on"]
pub struct NcclWork {
    done: CudaEvent,
    compute: Arc<CudaStream>,
    what: String,
    timeout: Duration,
}

impl NcclWork {
    /// Orders the compute stream after the collective (the host does not block).
    ///
    /// # Errors
    /// A CUDA error.
    pub fn wait(self) -> Result<()> {
        self.compute
            .wait(&self.done)
            .map_err(|e| CommError::Backend(format!("{}: {e:?}", self.what)))
    }

    /// Whether the collective has finished on the device.
    pub fn is_completed(&self) -> bool {
        // Safety: a live event of this context.
        unsafe { cudarc::driver::result::event::query(self.done.cu_event()).is_ok() }
    }

    /// Blocks the host until the collective finished, at most the group's timeout.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the call on timeout or a CUDA error.
    pub fn wait_host(self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        while !self.is_completed() {
            if Instant::now() >= deadline {
                return Err(CommError::Backend(format!(
                    "{} timed out after {:?}",
                    self.what, self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.wait()
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
        let comm = Comm::from_rank(comm_stream, rank, world_size, id)
            .map_err(|e| nccl_err("comm_init_rank", 0, rank, e))?;
        Ok(Self {
            comm,
            compute: ctx.default_stream(),
            rank,
            world_size,
            seq: AtomicU64::new(0),
            timeout,
        })
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

    /// Runs `launch` on the communication stream after the compute stream's current work.
    fn issue(
        &self,
        op: &str,
        launch: impl FnOnce(&Comm) -> std::result::Result<(), CommError>,
    ) -> Result<NcclWork> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let cuda = |e| nccl_err(op, seq, self.rank, e);
        let ready = self.compute.record_event(None).map_err(cuda)?;
        self.comm.stream().wait(&ready).map_err(cuda)?;
        launch(&self.comm)?;
        let done = self.comm.stream().record_event(None).map_err(cuda)?;
        let what = format!("NCCL {op} #{seq} on rank {}", self.rank);
        Ok(NcclWork {
            done,
            compute: self.compute.clone(),
            what,
            timeout: self.timeout,
        })
    }

    /// Rank-order concatenation of every rank's `input` into `out` (`world_size * input.len()`).
    ///
    /// # Errors
    /// [`CommError::BufferSize`] for a wrong `out`; an NCCL error.
    pub fn all_gather_async<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
    ) -> Result<NcclWork> {
        let want = input.len() * self.world_size;
        if out.len() != want {
            return Err(CommError::BufferSize {
                op: "all_gather",
                expected: want,
                got: out.len(),
            });
        }
        let (rank, seq) = (self.rank, self.seq.load(Ordering::SeqCst));
        self.issue("all_gather", |c| {
            c.all_gather(input, out)
                .map(|_| ())
                .map_err(|e| nccl_err("all_gather", seq, rank, e))
        })
    }

    /// Sum over ranks, chunk `r` of `input` to rank `r` (`out.len() = input.len() / world_size`).
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] / [`CommError::BufferSize`]; an NCCL error.
    pub fn reduce_scatter_async<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
    ) -> Result<NcclWork> {
        if !input.len().is_multiple_of(self.world_size) {
            return Err(CommError::NotDivisible {
                op: "reduce_scatter",
                len: input.len(),
                world_size: self.world_size,
            });
        }
        if out.len() != input.len() / self.world_size {
            return Err(CommError::BufferSize {
                op: "reduce_scatter",
                expected: input.len() / self.world_size,
                got: out.len(),
            });
        }
        let (rank, seq) = (self.rank, self.seq.load(Ordering::SeqCst));
        let op = nccl_op(ReduceOp::Sum);
        self.issue("reduce_scatter", |c| {
            c.reduce_scatter(input, out, &op)
                .map(|_| ())
                .map_err(|e| nccl_err("reduce_scatter", seq, rank, e))
        })
    }

    /// Element-wise reduction of every rank's `input` into `out` (same length).
    ///
    /// # Errors
    /// [`CommError::BufferSize`]; an NCCL error.
    pub fn all_reduce_async<T: NcclType + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<NcclWork> {
        if out.len() != input.len() {
            return Err(CommError::BufferSize {
                op: "all_reduce",
                expected: input.len(),
                got: out.len(),
            });
        }
        let (rank, seq) = (self.rank, self.seq.load(Ordering::SeqCst));
        let op = nccl_op(op);
        self.issue("all_reduce", |c| {
            c.all_reduce(input, out, &op)
                .map(|_| ())
                .map_err(|e| nccl_err("all_reduce", seq, rank, e))
        })
    }

    /// `root`'s `buf` to every rank, in place.
    ///
    /// # Errors
    /// [`CommError::InvalidRoot`]; an NCCL error.
    pub fn broadcast_async<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<NcclWork> {
        if root >= self.world_size {
            return Err(CommError::InvalidRoot {
                op: "broadcast",
                root,
                world_size: self.world_size,
            });
        }
        let (rank, seq) = (self.rank, self.seq.load(Ordering::SeqCst));
        self.issue("broadcast", |c| {
            c.broadcast_in_place(buf, root as i32)
                .map(|_| ())
                .map_err(|e| nccl_err("broadcast", seq, rank, e))
        })
    }

    /// Blocks the host until every rank reached this point (an all-reduce of one value).
    ///
    /// # Errors
    /// A timeout or an NCCL error.
    pub fn barrier(&self) -> Result<()> {
        let stream = self.compute.clone();
        let cuda = |e| nccl_err("barrier", 0, self.rank, e);
        let one = stream.clone_htod(&[1.0f32]).map_err(cuda)?;
        let mut out = stream.alloc_zeros::<f32>(1).map_err(cuda)?;
        self.all_reduce_async(&one, &mut out, ReduceOp::Sum)?
            .wait_host()
    }
}
