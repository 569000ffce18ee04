//! The collectives of a [`ProcessGroup`], each in an async form returning a [`Work`] and a
//! blocking one; the `_into` forms read the input in place ([`SendBuf`]) and write straight into
//! the caller's output buffer ([`RecvBuf`]).

use std::sync::Arc;

use crate::buffer::{RecvBuf, SendBuf};
use crate::group::Transport;
use crate::local::{
    Payload, SharedReduce, downcast, fold_rest_in_rank_order, payload, reduce_in_rank_order,
    take_chunk,
};
use crate::{CommElement, CommError, DType, OpDesc, OpKind, ProcessGroup, ReduceOp, Result, Work};

impl ProcessGroup {
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

    pub(crate) fn gather_kind<T: CommElement>(
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
        let rank = self.rank();
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
        let rank = self.rank();
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
        let data: Payload = if root == self.rank() {
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
                let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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
}
