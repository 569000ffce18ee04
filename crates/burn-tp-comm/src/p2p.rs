//! Point-to-point transfers between neighbouring ranks of a ring: what pipeline stages send each
//! other (activations forward, their gradients back; the last stage to the first for interleaved
//! schedules).
//!
//! Each direction between neighbours gets a group of two ranks (made once, by
//! [`ProcessGroup::ring_links`]), and a transfer is a broadcast in it from the sender: the way
//! DeepSpeed's pipeline engine moves tensors over NCCL without send / recv. So a transfer is
//! async on every transport (threads, MPI, NCCL), and fails as the collectives do: both sides
//! give the same length (a different one is [`CommError::Mismatch`] on both), and a peer that
//! leaves or never comes is an error on both within the timeout, never a hang.
//!
//! ```text
//!   rank r's four links, each its own two-rank group (indices: sender 0, receiver 1)
//!   send_next: r -> r+1   recv_prev: r-1 -> r   (the forward direction, activations)
//!   send_prev: r -> r-1   recv_next: r+1 -> r   (the backward direction, gradients)
//! ```
//!
//! Transfers in one direction between two ranks are matched in the order they are issued (as
//! NCCL's send / recv); the two directions are independent, so a 1F1B schedule, whose stages
//! interleave sends forward with receives backward differently, never mismatches. A ring of one
//! rank has no links.

use crate::{CommElement, CommError, ProcessGroup, Result, Work};

/// One direction's group: this rank sends (index 0) or receives (index 1) in it.
#[derive(Clone, Debug)]
struct Link {
    group: ProcessGroup,
    /// The neighbour's rank in the ring.
    peer: usize,
}

/// One of a rank's two neighbours in a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Neighbour {
    /// Rank `rank + 1` (the next stage: activations go there, gradients come from there).
    Next,
    /// Rank `rank - 1` (the previous stage).
    Prev,
}

/// This rank's links to its two neighbours in a ring of ranks (pipeline stages), each direction
/// its own.
#[derive(Clone, Debug)]
pub struct RingLinks {
    rank: usize,
    size: usize,
    /// send_next, recv_prev, send_prev, recv_next.
    links: Option<[Link; 4]>,
}

/// A transfer in flight: [`wait`](Self::wait) completes it.
#[must_use = "a transfer completes only when it is waited on"]
#[derive(Debug)]
pub struct Transfer<T> {
    work: Work<Vec<T>>,
    what: String,
}

impl<T> Transfer<T> {
    /// Waits for the transfer (the group's timeout) and returns what arrived (a receive) or the
    /// buffer sent (a send).
    ///
    /// # Errors
    /// As [`Work::wait`], the message naming the transfer (`send 1 -> 2 of 64 f32`).
    pub fn wait(self) -> Result<Vec<T>> {
        let what = self.what;
        self.work
            .wait()
            .map_err(|e| CommError::Backend(format!("{what}: {e}")))
    }

    /// Whether [`wait`](Self::wait) would return without blocking.
    pub fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
}

impl ProcessGroup {
    /// This rank's links to ranks `rank - 1` and `rank + 1` (mod the world size), one two-rank
    /// group per direction, made with four [`split`](Self::split)s (six for an odd ring).
    /// Collective over this group.
    ///
    /// # Errors
    /// As [`split`](Self::split).
    pub fn ring_links(&self) -> Result<RingLinks> {
        let (n, r) = (self.world_size(), self.rank());
        if n == 1 {
            return Ok(RingLinks {
                rank: r,
                size: n,
                links: None,
            });
        }
        let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
        // Hop k: k -> k + 1 (forward) or k + 1 -> k (backward), a group with the sender first.
        // A split takes even hops, another odd ones (and an odd ring's closing hop a third), so
        // no rank is in two groups of one split.
        let splits = if n % 2 == 1 { 3 } else { 2 };
        let split_of = |k: usize| if n % 2 == 1 && k == n - 1 { 2 } else { k % 2 };
        // This rank is in hop r (as its lower end) and hop r - 1 (its upper end).
        let (hop_up, hop_down) = (r, prev);
        let mut groups: [Option<ProcessGroup>; 4] = [None, None, None, None];
        for forward in [true, false] {
            for s in 0..splits {
                // (colour, key = index in the group, which link it is)
                let (color, key, slot) = if split_of(hop_up) == s {
                    // Forward: r sends to r + 1 (index 0); backward: r receives (index 1).
                    (hop_up, usize::from(!forward), if forward { 0 } else { 3 })
                } else if split_of(hop_down) == s {
                    // Forward: r receives from r - 1; backward: r sends to r - 1.
                    (hop_down, usize::from(forward), if forward { 1 } else { 2 })
                } else {
                    (n + r, 0, usize::MAX)
                };
                let group = self.split(color, key)?;
                if slot != usize::MAX {
                    groups[slot] = Some(group);
                }
            }
        }
        let link = |i: usize, peer: usize| Link {
            group: groups[i].clone().expect("every link's split ran"),
            peer,
        };
        Ok(RingLinks {
            rank: r,
            size: n,
            links: Some([link(0, next), link(1, prev), link(2, prev), link(3, next)]),
        })
    }
}

impl RingLinks {
    /// This rank's index in the ring.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the ring.
    pub fn size(&self) -> usize {
        self.size
    }

    fn link(&self, which: usize) -> Result<&Link> {
        self.links.as_ref().map(|l| &l[which]).ok_or_else(|| {
            CommError::Backend(format!(
                "rank {} of a ring of {}: no neighbour to transfer with",
                self.rank, self.size
            ))
        })
    }

    fn send<T: CommElement>(&self, which: usize, data: Vec<T>) -> Result<Transfer<T>> {
        let link = self.link(which)?;
        let what = format!(
            "send {} -> {} of {} {:?}",
            self.rank,
            link.peer,
            data.len(),
            T::DTYPE
        );
        let out = data.clone();
        let work = link.group.broadcast_async(data, 0, out)?;
        Ok(Transfer { work, what })
    }

    fn recv<T: CommElement + Default>(&self, which: usize, len: usize) -> Result<Transfer<T>> {
        let link = self.link(which)?;
        let what = format!(
            "recv {} <- {} of {len} {:?}",
            self.rank,
            link.peer,
            T::DTYPE
        );
        // The input's contents are never read (not the root); its length is what the sender's
        // is checked against.
        let work =
            link.group
                .broadcast_async(vec![T::default(); len], 0, vec![T::default(); len])?;
        Ok(Transfer { work, what })
    }

    /// Starts sending `data` to rank `rank + 1`.
    ///
    /// # Errors
    /// A ring of one rank; as [`ProcessGroup::broadcast_async`].
    pub fn send_next<T: CommElement>(&self, data: Vec<T>) -> Result<Transfer<T>> {
        self.send(0, data)
    }

    /// Starts sending `data` to rank `rank - 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn send_prev<T: CommElement>(&self, data: Vec<T>) -> Result<Transfer<T>> {
        self.send(2, data)
    }

    /// Starts receiving `len` elements from rank `rank - 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn recv_prev<T: CommElement + Default>(&self, len: usize) -> Result<Transfer<T>> {
        self.recv(1, len)
    }

    /// Starts receiving `len` elements from rank `rank + 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn recv_next<T: CommElement + Default>(&self, len: usize) -> Result<Transfer<T>> {
        self.recv(3, len)
    }

    /// Starts sending `data` to neighbour `to` and receiving `len` elements from neighbour
    /// `from` together: the paired transfer of Megatron's `send_forward_recv_backward` (1F1B's
    /// steady state: this stage's activation out, the next stage's gradient in) and its
    /// mirror images. Both are posted before either is waited on, so two neighbours exchanging
    /// never wait on each other. Returns (the send, the receive).
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next); nothing is posted if the ring has one rank.
    pub fn send_recv<T: CommElement + Default>(
        &self,
        (to, data): (Neighbour, Vec<T>),
        (from, len): (Neighbour, usize),
    ) -> Result<(Transfer<T>, Transfer<T>)> {
        self.link(0)?;
        let send = match to {
            Neighbour::Next => self.send_next(data)?,
            Neighbour::Prev => self.send_prev(data)?,
        };
        let recv = match from {
            Neighbour::Next => self.recv_next(len)?,
            Neighbour::Prev => self.recv_prev(len)?,
        };
        Ok((send, recv))
    }
}
