//! Point-to-point transfers between neighbouring ranks of a ring: what pipeline stages send each
//! other (activations forward, their gradients back; the last stage to the first for interleaved
//! schedules).
//!
//! Each pair of neighbours `{r, r + 1 mod n}` gets a group of two ranks (made once, by
//! [`ProcessGroup::ring_links`]), and a transfer is a broadcast in it from the sender: the way
//! DeepSpeed's pipeline engine moves tensors over NCCL without send / recv. So a transfer is
//! async on every transport (threads, MPI, NCCL), and fails as the collectives do: both sides
//! give the same length (a different one is [`CommError::Mismatch`] on both), and a peer that
//! leaves or never comes is an error on both within the timeout, never a hang. Both ranks of a
//! pair issue their transfers between them in the same order (as with NCCL's send / recv).
//!
//! ```text
//!   pair groups of a ring of 4        rank r's links
//!   {0,1} {1,2} {2,3} {3,0}           prev: the pair {r-1, r}   next: the pair {r, r+1}
//! ```
//!
//! With two ranks the two links are two groups of the same pair (`{0, 1}` carries rank 0's sends
//! to its next and rank 1's to its previous, `{1, 0}` the others), so each direction of a ring
//! keeps its own order; with one rank there is none.

use crate::{CommElement, CommError, ProcessGroup, Result, Work};

/// One pair group and this rank's side of it.
#[derive(Clone, Debug)]
struct Link {
    group: ProcessGroup,
    /// This rank's index in the pair.
    me: usize,
    /// The neighbour's rank in the ring.
    peer: usize,
}

/// This rank's links to its two neighbours in a ring of ranks (pipeline stages).
#[derive(Clone, Debug)]
pub struct RingLinks {
    rank: usize,
    size: usize,
    prev: Option<Link>,
    next: Option<Link>,
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
    /// This rank's links to ranks `rank - 1` and `rank + 1` (mod the world size): the pair
    /// groups of the ring, made with two [`split`](Self::split)s (three for an odd ring).
    /// Collective over this group.
    ///
    /// # Errors
    /// As [`split`](Self::split).
    pub fn ring_links(&self) -> Result<RingLinks> {
        let (n, r) = (self.world_size(), self.rank());
        let mut links = RingLinks {
            rank: r,
            size: n,
            prev: None,
            next: None,
        };
        if n == 1 {
            return Ok(links);
        }
        // Pair k = {k, k + 1 mod n}: even pairs in split 0, odd in split 1, and with an odd
        // ring the closing pair {n - 1, 0} in split 2, so no rank is in two pairs of a split.
        let split_of = |k: usize| if n % 2 == 1 && k == n - 1 { 2 } else { k % 2 };
        let (as_first, as_second) = (r, (r + n - 1) % n);
        for s in 0..if n % 2 == 1 { 3 } else { 2 } {
            // This rank's pair in split s (colour = the pair), or a group of its own.
            let (color, key) = if split_of(as_first) == s {
                (as_first, 0)
            } else if split_of(as_second) == s {
                (as_second, 1)
            } else {
                (n + r, 0)
            };
            let group = self.split(color, key)?;
            if color == as_first {
                links.next = Some(Link {
                    group,
                    me: 0,
                    peer: (r + 1) % n,
                });
            } else if color == as_second {
                links.prev = Some(Link {
                    group,
                    me: 1,
                    peer: as_second,
                });
            }
        }
        Ok(links)
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

    fn link(&self, next: bool) -> Result<&Link> {
        let link = if next { &self.next } else { &self.prev };
        link.as_ref().ok_or_else(|| {
            CommError::Backend(format!(
                "rank {} of a ring of {}: no neighbour to transfer with",
                self.rank, self.size
            ))
        })
    }

    fn send<T: CommElement>(&self, next: bool, data: Vec<T>) -> Result<Transfer<T>> {
        let link = self.link(next)?;
        let what = format!(
            "send {} -> {} of {} {:?}",
            self.rank,
            link.peer,
            data.len(),
            T::DTYPE
        );
        let out = data.clone();
        let work = link.group.broadcast_async(data, link.me, out)?;
        Ok(Transfer { work, what })
    }

    fn recv<T: CommElement + Default>(&self, next: bool, len: usize) -> Result<Transfer<T>> {
        let link = self.link(next)?;
        let what = format!(
            "recv {} <- {} of {len} {:?}",
            self.rank,
            link.peer,
            T::DTYPE
        );
        // The input's contents are never read (not the root); its length is what the sender's
        // is checked against.
        let work = link.group.broadcast_async(
            vec![T::default(); len],
            1 - link.me,
            vec![T::default(); len],
        )?;
        Ok(Transfer { work, what })
    }

    /// Starts sending `data` to rank `rank + 1`.
    ///
    /// # Errors
    /// A ring of one rank; as [`ProcessGroup::broadcast_async`].
    pub fn send_next<T: CommElement>(&self, data: Vec<T>) -> Result<Transfer<T>> {
        self.send(true, data)
    }

    /// Starts sending `data` to rank `rank - 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn send_prev<T: CommElement>(&self, data: Vec<T>) -> Result<Transfer<T>> {
        self.send(false, data)
    }

    /// Starts receiving `len` elements from rank `rank - 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn recv_prev<T: CommElement + Default>(&self, len: usize) -> Result<Transfer<T>> {
        self.recv(false, len)
    }

    /// Starts receiving `len` elements from rank `rank + 1`.
    ///
    /// # Errors
    /// As [`send_next`](Self::send_next).
    pub fn recv_next<T: CommElement + Default>(&self, len: usize) -> Result<Transfer<T>> {
        self.recv(true, len)
    }
}
