//! [`Work`]: a collective in flight on this rank.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::local::{FinishFn, Payload, Shared, Slot, State, downcast};
use crate::{CommElement, CommError, LinkModel, OpDesc, OpKind, ProcessGroup, RecvBuf, Result};

/// How long a rank waits on ranks no thread ever used, in a group its own thread made, before
/// calling it a group used from one thread (a rank thread starting late arrives well within).
pub(crate) const SAME_THREAD_GRACE: Duration = Duration::from_secs(1);

/// A collective in flight. `wait` completes it; dropping it without waiting releases this rank's
/// part without reading the result.
#[must_use = "a collective completes only when its Work is waited on"]
pub struct Work<T> {
    group: ProcessGroup,
    seq: u64,
    desc: OpDesc,
    state: InFlight<T>,
}

/// Where a call is, by transport.
enum InFlight<T> {
    /// Posted on the thread transport.
    Local(LocalCall<T>),
    /// Completed (or failed) when it was issued (staged through NCCL); taken by the wait.
    #[cfg(feature = "nccl")]
    Done(Option<Result<T>>),
    /// In flight on the MPI thread, which fills the completion.
    #[cfg(feature = "mpi")]
    Mpi(Arc<crate::mpi::Completion<T>>),
}

/// A call on the thread transport: its meeting place, and how its result is made of every
/// rank's posts.
struct LocalCall<T> {
    shared: Arc<Shared>,
    finish: Option<FinishFn<T>>,
    /// With profiling on: the label the call was issued under, and when it was posted.
    profiled: Option<(&'static str, Instant)>,
    consumed: bool,
    /// The bytes this rank receives, where the descriptor cannot say (an all-to-all's counts
    /// differ per rank): what the simulated link delays it by.
    recv_bytes: Option<usize>,
}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Work({} #{} on rank {})",
            self.desc,
            self.seq,
            self.group.rank()
        )
    }
}

enum Ready {
    Yes(Vec<Payload>),
    No {
        missing: Vec<usize>,
        until: Option<Instant>,
    },
}

impl<T> Work<T> {
    /// A call posted on the local transport, completed by `finish` over every rank's posts.
    pub(crate) fn posted(
        group: ProcessGroup,
        shared: Arc<Shared>,
        seq: u64,
        desc: OpDesc,
        finish: FinishFn<T>,
    ) -> Self {
        let profiled = group
            .profile
            .is_some()
            .then(|| (crate::profile::current_scope(), Instant::now()));
        let state = InFlight::Local(LocalCall {
            shared,
            finish: Some(finish),
            profiled,
            consumed: false,
            recv_bytes: None,
        });
        Work {
            group,
            seq,
            desc,
            state,
        }
    }

    /// A call in flight on the MPI thread, which fills the completion `done`.
    #[cfg(feature = "mpi")]
    pub(crate) fn remote(
        group: ProcessGroup,
        seq: u64,
        desc: OpDesc,
        done: Arc<crate::mpi::Completion<T>>,
    ) -> Self {
        Work {
            group,
            seq,
            desc,
            state: InFlight::Mpi(done),
        }
    }

    /// A call that completed (or failed) when it was issued.
    #[cfg(feature = "nccl")]
    pub(crate) fn done(group: ProcessGroup, seq: u64, desc: OpDesc, result: Result<T>) -> Self {
        Work {
            group,
            seq,
            desc,
            state: InFlight::Done(Some(result)),
        }
    }

    /// This local call receives `bytes` (for the simulated link), where the descriptor is the
    /// same on every rank but the bytes are not.
    pub(crate) fn with_recv_bytes(mut self, bytes: usize) -> Self {
        // Without features `mpi` and `nccl` every call is local.
        #[allow(irrefutable_let_patterns)]
        if let InFlight::Local(call) = &mut self.state {
            call.recv_bytes = Some(bytes);
        }
        self
    }

    /// The bytes this rank receives.
    fn recv_bytes(&self) -> usize {
        match &self.state {
            InFlight::Local(LocalCall {
                recv_bytes: Some(b),
                ..
            }) => *b,
            _ => self
                .desc
                .recv_bytes(self.group.rank(), self.group.world_size()),
        }
    }

    /// When the last rank posted this call (for the profile).
    fn last_post(&self) -> Option<Instant> {
        let st = self.shared().lock();
        st.slots
            .get(&self.seq)?
            .posts
            .iter()
            .filter_map(|p| p.as_ref().map(|p| p.at))
            .max()
    }

    fn local(&mut self) -> &mut LocalCall<T> {
        match &mut self.state {
            InFlight::Local(call) => call,
            // Without features `mpi` and `nccl` every call is local.
            #[allow(unreachable_patterns)]
            _ => unreachable!("only calls posted on the local transport are polled"),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        match &self.state {
            InFlight::Local(call) => &call.shared,
            // Without features `mpi` and `nccl` every call is local.
            #[allow(unreachable_patterns)]
            _ => unreachable!("only calls posted on the local transport are polled"),
        }
    }

    /// Per-group sequence number of this call.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether [`wait`](Self::wait) would return without blocking (done, or failed).
    pub fn is_completed(&self) -> bool {
        match &self.state {
            #[cfg(feature = "nccl")]
            InFlight::Done(_) => return true,
            #[cfg(feature = "mpi")]
            InFlight::Mpi(remote) => return remote.is_set(),
            InFlight::Local(_) => {}
        }
        let st = self.shared().lock();
        match self.poll(&st, None) {
            Ok(Ready::Yes(_)) | Err(_) => true,
            Ok(Ready::No { .. }) => false,
        }
    }

    /// Waits with the group's timeout and returns the result.
    ///
    /// # Errors
    /// [`CommError::Mismatch`], [`CommError::PeerGone`], [`CommError::Timeout`] or
    /// [`CommError::Aborted`]; any of them aborts the group, so every rank fails.
    pub fn wait(self) -> Result<T> {
        let timeout = self.group.timeout();
        self.wait_timeout(timeout)
    }

    /// Waits at most `timeout` and returns the result.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(mut self, timeout: Duration) -> Result<T> {
        let profiled = match &mut self.state {
            #[cfg(feature = "nccl")]
            InFlight::Done(done) => return done.take().expect("a Work completes once"),
            #[cfg(feature = "mpi")]
            InFlight::Mpi(remote) => {
                let m = self.group.mpi();
                return m.wait(remote, &self.desc, self.seq, timeout);
            }
            InFlight::Local(call) => call.profiled,
        };
        if profiled.is_none() {
            let payloads = self.wait_ready(timeout, None)?;
            let finish = self.local().finish.take().expect("a Work completes once");
            let out = finish(&payloads);
            drop(payloads);
            self.consume();
            return Ok(out);
        }
        let entered = Instant::now();
        let payloads = self.wait_ready(timeout, None)?;
        let ready = Instant::now();
        // Without blocking, the data was complete when the last rank posted plus the simulated
        // link's delivery time, if any (before this wait began).
        let bytes = self.recv_bytes();
        let completed = if ready - entered > Duration::from_micros(50) {
            ready
        } else {
            let link = self.shared().options.link;
            let delay = link.map_or(Duration::ZERO, |l| l.delay(bytes));
            (self.last_post().unwrap_or(entered) + delay).min(entered)
        };
        let finish = self.local().finish.take().expect("a Work completes once");
        let out = finish(&payloads);
        drop(payloads);
        if let (Some((label, posted)), Some(store)) = (profiled, &self.group.profile) {
            // The copy into the output is communication done by this thread.
            let copy = entered.elapsed() - (ready - entered);
            let comm = completed.saturating_duration_since(posted) + copy;
            store.record(label, self.desc.kind, bytes, comm, entered.elapsed());
        }
        self.consume();
        Ok(out)
    }

    /// Blocks until the call is complete (`part = None`) or rank `part`'s buffer has arrived,
    /// and returns the posted buffers (only `part`'s is meaningful in the second case).
    fn wait_ready(&self, timeout: Duration, part: Option<(usize, f64)>) -> Result<Vec<Payload>> {
        let shared = self.shared().clone();
        let started = Instant::now();
        let deadline = started + timeout;
        let mut st = shared.lock();
        loop {
            let now = Instant::now();
            match self.poll(&st, part) {
                Ok(Ready::Yes(p)) => return Ok(p),
                Err(e) => {
                    shared.abort(&mut st, &e);
                    return Err(e);
                }
                Ok(Ready::No { missing, until }) => {
                    if until.is_none()
                        && let Some(e) = self.same_thread(&shared, &st, &missing, now - started)
                    {
                        shared.abort(&mut st, &e);
                        return Err(e);
                    }
                    if now >= deadline {
                        let e = CommError::Timeout {
                            op: self.desc.clone(),
                            seq: self.seq,
                            rank: self.group.rank(),
                            timeout,
                            missing,
                        };
                        shared.abort(&mut st, &e);
                        return Err(e);
                    }
                    let wake = until
                        .unwrap_or(now + shared.options.poll_interval)
                        .min(deadline);
                    if until.is_some() {
                        // Simulated transfer: sleep without holding the lock.
                        drop(st);
                        std::thread::sleep(wake.saturating_duration_since(now));
                        st = shared.lock();
                    } else {
                        st = shared
                            .cv
                            .wait_timeout(st, wake.saturating_duration_since(now))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
            }
        }
    }

    /// The ranks this wait can never see arrive: every missing rank last posted from this very
    /// thread (now blocked here), or none of them was ever used by any thread and this thread
    /// made the group (after [`SAME_THREAD_GRACE`], so a rank thread that starts late is not
    /// mistaken for one that never will).
    fn same_thread(
        &self,
        shared: &Shared,
        st: &State,
        missing: &[usize],
        waited: Duration,
    ) -> Option<CommError> {
        let me = std::thread::current().id();
        let here = missing.iter().all(|&r| st.threads[r] == Some(me));
        let never = missing.iter().all(|&r| st.threads[r].is_none())
            && shared.creator == Some(me)
            && waited >= SAME_THREAD_GRACE;
        (!missing.is_empty() && (here || never)).then(|| CommError::SameThread {
            op: self.desc.clone(),
            seq: self.seq,
            rank: self.group.rank(),
            missing: missing.to_vec(),
            never: if here {
                String::new()
            } else {
                " (never used by any other thread)".into()
            },
        })
    }

    /// With the link model, when the first `frac` of rank `p`'s all-gather shard reaches this
    /// rank: a ring moves it `k = (rank - p) mod n` hops, each `latency + shard / bandwidth`,
    /// after every rank on its path has posted, pipelined (the last hop delivers the shard
    /// progressively, as a chunked ring does).
    fn ring_arrival(&self, slot: &Slot, link: &LinkModel, p: usize, frac: f64) -> Option<Instant> {
        let n = slot.posts.len();
        let rank = self.group.rank();
        let hops = (rank + n - p) % n;
        if hops == 0 {
            return None;
        }
        let shard = self.desc.len() * self.desc.dtype.size();
        let start = (0..hops)
            .filter_map(|h| slot.posts[(p + h) % n].as_ref().map(|q| q.at))
            .max()?;
        let last = link.delay((shard as f64 * frac).ceil() as usize);
        Some(start + link.delay(shard) * (hops as u32 - 1) + last)
    }

    fn poll(&self, st: &State, part: Option<(usize, f64)>) -> Result<Ready> {
        let rank = self.group.rank();
        let slot = st
            .slots
            .get(&self.seq)
            .expect("a posted slot lives until every rank consumed it");
        let mut missing = Vec::new();
        let mut first: Option<(usize, &OpDesc)> = None;
        for (r, post) in slot.posts.iter().enumerate() {
            match post {
                None => missing.push(r),
                Some(p) => match first {
                    None => first = Some((r, &p.desc)),
                    Some((r0, d0)) if *d0 != p.desc => {
                        return Err(CommError::Mismatch {
                            seq: self.seq,
                            rank: r,
                            ours: p.desc.clone(),
                            other_rank: r0,
                            theirs: d0.clone(),
                        });
                    }
                    Some(_) => {}
                },
            }
        }
        if let Some((p, frac)) = part.filter(|(p, _)| !slot.dead && !missing.contains(p)) {
            if let Some(ready) = self
                .shared()
                .options
                .link
                .and_then(|l| self.ring_arrival(slot, &l, p, frac))
                && Instant::now() < ready
            {
                return Ok(Ready::No {
                    missing,
                    until: Some(ready),
                });
            }
            return Ok(Ready::Yes(
                slot.posts
                    .iter()
                    .map(|q| {
                        q.as_ref()
                            .map_or_else(|| Arc::new(()) as Payload, |q| q.data.clone())
                    })
                    .collect(),
            ));
        }
        if missing.is_empty() && !slot.dead {
            if let Some(link) = self
                .shared()
                .options
                .link
                .filter(|_| self.desc.kind == OpKind::AllGather)
            {
                // Ring all-gather: complete when the farthest shard has arrived.
                let ready = (0..slot.posts.len())
                    .filter_map(|p| self.ring_arrival(slot, &link, p, 1.0))
                    .max();
                if let Some(ready) = ready.filter(|r| Instant::now() < *r) {
                    return Ok(Ready::No {
                        missing,
                        until: Some(ready),
                    });
                }
            } else if let Some(link) = self.shared().options.link {
                let last = slot
                    .posts
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| *r != rank)
                    .filter_map(|(_, p)| p.as_ref().map(|p| p.at))
                    .max();
                if let Some(last) = last {
                    let ready = last + link.delay(self.recv_bytes());
                    if Instant::now() < ready {
                        return Ok(Ready::No {
                            missing,
                            until: Some(ready),
                        });
                    }
                }
            }
            return Ok(Ready::Yes(
                slot.posts
                    .iter()
                    .map(|p| p.as_ref().expect("complete").data.clone())
                    .collect(),
            ));
        }
        let gone: Vec<usize> = missing.iter().copied().filter(|&r| st.gone[r]).collect();
        if !gone.is_empty() {
            return Err(CommError::PeerGone {
                op: self.desc.clone(),
                seq: self.seq,
                rank,
                gone,
            });
        }
        if let Some(reason) = &st.aborted {
            return Err(CommError::Aborted {
                op: self.desc.clone(),
                seq: self.seq,
                rank,
                reason: reason.clone(),
            });
        }
        Ok(Ready::No {
            missing,
            until: None,
        })
    }

    /// This rank is done with a call on the thread transport (the last rank frees its slot).
    fn consume(&mut self) {
        let call = match &mut self.state {
            InFlight::Local(call) => call,
            #[allow(unreachable_patterns)]
            _ => return,
        };
        if call.consumed {
            return;
        }
        call.consumed = true;
        let shared = &call.shared;
        let mut st = shared.lock();
        let world = shared.world;
        if let Some(slot) = st.slots.get_mut(&self.seq) {
            slot.consumed += 1;
            if slot.consumed == world {
                st.slots.remove(&self.seq);
            }
        }
    }
}

impl<O> Work<O> {
    /// For an all-gather: waits (with the group's timeout) until rank `part`'s shard has arrived
    /// and returns a copy of it, without waiting for the others. Shards arrive in ring order
    /// (own, rank - 1, rank - 2, ...): consuming them in that order overlaps compute with the
    /// rest of the gather. The `Work` still completes (or is dropped) as usual afterwards.
    ///
    /// # Errors
    /// As [`Work::wait`]; [`CommError::Backend`] if the call is not an all-gather or `part` is
    /// not a rank.
    pub fn wait_part<T: CommElement>(&self, part: usize) -> Result<Vec<T>>
    where
        O: RecvBuf<T>,
    {
        self.with_part_range(part, 0..self.desc.len(), <[T]>::to_vec)
    }

    /// For an all-gather: waits until elements `range` of rank `part`'s shard have arrived and
    /// lends them to `read` in place (a ring delivers a shard progressively: the first chunks
    /// come first; the caller copies them where it wants, e.g. into a reused buffer).
    ///
    /// # Errors
    /// As [`wait_part`](Self::wait_part); [`CommError::Backend`] for a range past the shard.
    pub fn with_part_range<T: CommElement, R>(
        &self,
        part: usize,
        range: std::ops::Range<usize>,
        read: impl FnOnce(&[T]) -> R,
    ) -> Result<R>
    where
        O: RecvBuf<T>,
    {
        let shard = self.desc.len();
        if self.desc.kind != OpKind::AllGather
            || part >= self.group.world_size()
            || range.end > shard
            || range.start > range.end
        {
            return Err(CommError::Backend(format!(
                "wait_part_range({part}, {range:?}) on {} of a group of {}: only all-gathers \
                 have parts, of {shard} elements",
                self.desc,
                self.group.world_size()
            )));
        }
        #[cfg(feature = "nccl")]
        if let InFlight::Done(Some(done)) = &self.state {
            let all = done.as_ref().map_err(Clone::clone)?.as_slice();
            return Ok(read(&all[part * shard..(part + 1) * shard][range]));
        }
        #[cfg(feature = "mpi")]
        if let InFlight::Mpi(remote) = &self.state {
            // MPI delivers the gather whole: wait for all of it, keep it for the final wait.
            let timeout = self.group.timeout();
            let read = |v: &mut Option<Result<O>>| match v.as_ref().expect("set") {
                Ok(out) => Ok(read(
                    &out.as_slice()[part * shard..(part + 1) * shard][range],
                )),
                Err(e) => Err(e.clone()),
            };
            return match remote.with(timeout, read) {
                Some(r) => r,
                None => Err(self.group.mpi().timed_out(&self.desc, self.seq, timeout)),
            };
        }
        let frac = range.end as f64 / shard.max(1) as f64;
        let payloads = self.wait_ready(self.group.timeout(), Some((part, frac)))?;
        Ok(read(&downcast::<T>(&payloads[part])[range]))
    }
}

impl<T> Drop for Work<T> {
    fn drop(&mut self) {
        self.consume();
    }
}
