//! The collectives of a [`ProcessGroup`], each in two forms: async, reading the input in place
//! ([`SendBuf`]) and writing straight into the caller's output buffer ([`RecvBuf`]), returning a
//! [`Work`]; and blocking, from a `Vec` into a new `Vec`.

use std::sync::Arc;

use crate::buffer::{RecvBuf, SendBuf};
use crate::group::Transport;
use crate::local::{
    Payload, SharedReduce, downcast, fold_rest_in_rank_order, payload, reduce_in_rank_order,
    take_chunk,
};
use crate::{CommElement, CommError, DType, OpDesc, OpKind, ProcessGroup, ReduceOp, Result, Work};

impl ProcessGroup {
    /// Starts an all-gather: `input` (read in place until every rank has read it) gathered in
    /// rank order straight into `out` (`world_size` times its length; say one reused across
    /// calls, as NCCL's `recvbuff`), which the wait returns filled: each byte is copied once,
    /// and a warm buffer takes no page faults. `[len] -> [world_size * len]`.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] (before any communication) if `out` has the wrong length.
    pub fn all_gather_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        Self::check_out(
            "all_gather",
            len * self.world_size(),
            out.as_mut_slice().len(),
        )?;
        let desc = OpDesc::new(OpKind::AllGather, T::DTYPE, input.shape());
        let (input, out) = match self.remote(&desc, input, out) {
            Ok(work) => return Ok(work),
            Err(buffers) => buffers,
        };
        Ok(self.post(desc, payload(input), move |posts| {
            let mut out = out;
            for (chunk, post) in out.as_mut_slice().chunks_exact_mut(len.max(1)).zip(posts) {
                chunk.copy_from_slice(downcast::<T>(post));
            }
            out
        }))
    }

    /// Blocking all-gather into a new buffer: every rank receives the rank-order concatenation
    /// of all inputs (`[len] -> [world_size * len]`).
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn all_gather<T: CommElement>(&self, input: Vec<T>) -> Result<Vec<T>> {
        self.all_gather_owned(input).wait()
    }

    /// The all-gather of an owned buffer into a new one (the blocking form, and the
    /// [`Communicator`](crate::Communicator) impl).
    pub(crate) fn all_gather_owned<T: CommElement>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let shape = vec![input.len()];
        self.gather_kind(OpKind::AllGather, input, shape)
    }

    /// An all-gather of kind `kind` into a new buffer (the blocking all-gather, and the
    /// exchanges of `split`).
    pub(crate) fn gather_kind<T: CommElement>(
        &self,
        kind: OpKind,
        input: Vec<T>,
        shape: Vec<usize>,
    ) -> Work<Vec<T>> {
        let desc = OpDesc::new(kind, T::DTYPE, shape);
        let input = if self.is_local() {
            input
        } else {
            let out = input.repeat(self.world_size());
            match self.remote(&desc, input, out) {
                Ok(work) => return work,
                Err((input, _)) => input,
            }
        };
        self.post(desc, payload(input), |posts| {
            let parts: Vec<&[T]> = posts.iter().map(downcast::<T>).collect();
            let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
            parts.iter().for_each(|p| out.extend_from_slice(p));
            out
        })
    }

    /// Starts a reduce-scatter (sum): every rank's `input` is split into `world_size` equal
    /// chunks, read in place, and rank `r` receives the rank-order sum of every rank's chunk `r`
    /// straight into `out` (`[len] -> [len / world_size]`).
    ///
    /// # Errors
    /// [`CommError::NotDivisible`] if `len % world_size != 0`, [`CommError::BufferSize`] if `out`
    /// has the wrong length (both before any communication).
    pub fn reduce_scatter_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        self.check_divisible("reduce_scatter", len)?;
        let chunk = len / self.world_size();
        Self::check_out("reduce_scatter", chunk, out.as_mut_slice().len())?;
        let desc = OpDesc::new(OpKind::ReduceScatter, T::DTYPE, input.shape());
        let (input, out) = match self.remote(&desc, input, out) {
            Ok(work) => return Ok(work),
            Err(buffers) => buffers,
        };
        let rank = self.rank();
        Ok(self.post(desc, payload(input), move |posts| {
            let mut out = out;
            let range = rank * chunk..(rank + 1) * chunk;
            reduce_in_rank_order(ReduceOp::Sum, posts, range, out.as_mut_slice());
            out
        }))
    }

    /// Blocking reduce-scatter (sum) into a new buffer (`[len] -> [len / world_size]`).
    ///
    /// # Errors
    /// See [`reduce_scatter_async`](Self::reduce_scatter_async) and [`Work::wait`].
    pub fn reduce_scatter<T: CommElement>(&self, input: Vec<T>) -> Result<Vec<T>> {
        self.reduce_scatter_owned(input)?.wait()
    }

    pub(crate) fn reduce_scatter_owned<T: CommElement>(
        &self,
        input: Vec<T>,
    ) -> Result<Work<Vec<T>>> {
        self.check_divisible("reduce_scatter", input.len())?;
        let out = input[..input.len() / self.world_size()].to_vec();
        self.reduce_scatter_async(input, out)
    }

    /// Starts an all-reduce: every rank receives the element-wise `op` of all inputs straight
    /// into `out` (as long as `input`), bit-identical on every rank. Done as a reduce-scatter
    /// then an all-gather (the ring algorithm's data movement): each of `world_size` chunks is
    /// reduced once, in rank order, from every rank's input read in place, and every rank copies
    /// the reduced chunks into `out`. A rank reduces its own chunk (and any a slower peer has not
    /// reached yet), so it reads about `world_size` times less than a full reduction.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] (before any communication) if `out` is not as long as `input`.
    pub fn all_reduce_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        op: ReduceOp,
        mut out: O,
    ) -> Result<Work<O>> {
        let len = input.as_slice().len();
        Self::check_out("all_reduce", len, out.as_mut_slice().len())?;
        let desc = OpDesc::new(OpKind::AllReduce(op), T::DTYPE, input.shape());
        let (input, out) = match self.remote(&desc, input, out) {
            Ok(work) => return Ok(work),
            Err(buffers) => buffers,
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

    /// Blocking all-reduce into a new buffer.
    ///
    /// # Errors
    /// See [`Work::wait`].
    pub fn all_reduce<T: CommElement>(&self, input: Vec<T>, op: ReduceOp) -> Result<Vec<T>> {
        self.all_reduce_owned(input, op)?.wait()
    }

    pub(crate) fn all_reduce_owned<T: CommElement>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        let out = input.clone();
        self.all_reduce_async(input, op, out)
    }

    /// Starts a broadcast: every rank receives `root`'s `input` straight into `out` (as long as
    /// `input`). Every rank passes an input of the same length; only the root's is read.
    ///
    /// # Errors
    /// [`CommError::InvalidRoot`] if `root >= world_size`, [`CommError::BufferSize`] if `out` is
    /// not as long as `input` (both before any communication).
    pub fn broadcast_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        root: usize,
        mut out: O,
    ) -> Result<Work<O>> {
        if root >= self.world_size() {
            return Err(CommError::InvalidRoot {
                op: "broadcast",
                root,
                world_size: self.world_size(),
            });
        }
        let len = input.as_slice().len();
        Self::check_out("broadcast", len, out.as_mut_slice().len())?;
        let desc = OpDesc::new(OpKind::Broadcast { root }, T::DTYPE, input.shape());
        let (input, out) = match self.remote(&desc, input, out) {
            Ok(work) => return Ok(work),
            Err(buffers) => buffers,
        };
        // Non-roots post nothing: their contents are never read.
        let data: Payload = if root == self.rank() {
            payload(input)
        } else {
            payload(Vec::<T>::new())
        };
        Ok(self.post(desc, data, move |posts| {
            let mut out = out;
            out.as_mut_slice()
                .copy_from_slice(downcast::<T>(&posts[root]));
            out
        }))
    }

    /// Blocking broadcast of `root`'s buffer into a new buffer.
    ///
    /// # Errors
    /// See [`broadcast_async`](Self::broadcast_async) and [`Work::wait`].
    pub fn broadcast<T: CommElement>(&self, input: Vec<T>, root: usize) -> Result<Vec<T>> {
        self.broadcast_owned(input, root)?.wait()
    }

    pub(crate) fn broadcast_owned<T: CommElement>(
        &self,
        input: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        let out = input.clone();
        self.broadcast_async(input, root, out)
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
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (empty, out) = (Vec::<i64>::new(), Vec::<i64>::new());
                let done = m.start(desc.clone(), seq, empty, out, |_| ());
                Work::remote(self.clone(), seq, desc, done)
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
