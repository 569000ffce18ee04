//! A communicator seen from the caller threads: jobs posted to the MPI thread, completions
//! waited on, the reduce-scatters' scratch buffers.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::engine::{Action, Call, Engine, Job, Msg, Ptr, VCounts};
use crate::{CommError, DType, OpDesc, OpKind, ReduceOp, Result};

/// A communicator of this process: its index in the MPI thread's table, this rank, its size.
#[derive(Clone)]
pub(crate) struct MpiGroup {
    pub(super) engine: Arc<Engine>,
    pub(super) comm: usize,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    /// See [`MpiRuntime::overlaps`].
    pub(super) background: bool,
    /// The reduce-scatters' receive buffers, reused (`Vec<T>`s of any element type): a fresh
    /// 16 MiB buffer costs more in page faults than the transfer.
    pub(super) scratch: Scratch,
}

pub(super) type Scratch = Arc<Mutex<Vec<Box<dyn std::any::Any + Send>>>>;

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
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            value: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    pub(super) fn set(&self, value: Result<T>) {
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
            counts: None,
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
                    counts: None,
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

    /// Starts `MPI_Ialltoallv` of `input` into `out` with per-peer counts (in elements, checked
    /// by the caller against the buffers and across ranks).
    pub(crate) fn start_all_to_all<T, I, O>(
        &self,
        desc: OpDesc,
        seq: u64,
        input: I,
        (send, recv): (&[usize], &[usize]),
        out: O,
    ) -> Arc<Completion<O>>
    where
        T: crate::CommElement,
        I: crate::SendBuf<T>,
        O: crate::RecvBuf<T>,
    {
        let done = Completion::new();
        let ints = |v: &[usize]| -> Option<(Vec<c_int>, Vec<c_int>)> {
            let counts = v
                .iter()
                .map(|&c| c_int::try_from(c).ok())
                .collect::<Option<_>>()?;
            let at = crate::buffer::displacements(v)
                .into_iter()
                .map(|a| c_int::try_from(a).ok())
                .collect::<Option<_>>()?;
            Some((counts, at))
        };
        let (Some((send, send_at)), Some((recv, recv_at))) = (ints(send), ints(recv)) else {
            done.set(Err(CommError::Backend(format!(
                "MPI {desc} #{seq} on rank {}: more elements than MPI's count (i32) can say",
                self.rank
            ))));
            return done;
        };
        let counts = Arc::new(VCounts {
            send,
            send_at,
            recv,
            recv_at,
        });
        let input = Box::new(input);
        let mut out = Box::new(out);
        let call = Call {
            kind: OpKind::AllToAll,
            dtype: desc.dtype,
            send: Ptr(input.as_slice().as_ptr() as *mut c_void),
            recv: Ptr(out.as_mut_slice().as_mut_ptr() as *mut c_void),
            count: 0,
            counts: Some(counts.clone()),
        };
        let slot = done.clone();
        let complete = Box::new(move |result: Result<()>| {
            drop((input, counts));
            slot.set(result.map(|()| *out));
        });
        self.submit(Job {
            comm: self.comm,
            seq,
            rank: self.rank,
            desc,
            action: Action::Collective {
                call,
                then: None,
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
