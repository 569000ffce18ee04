//! The all-to-all with per-rank counts (MPI's `Alltoallv`, PyTorch's `all_to_all_single` with
//! split sizes): what expert parallelism sends each token to the ranks holding its experts with.
//!
//! ```text
//!  rank 0 input: [ to 0 | to 1  | to 2 ]        rank 0 output: [ from 0 | from 1 | from 2 ]
//!  rank 1 input: [ to 0  | to 1 | to 2 ]        (rank 0's "to 0" slices, in source order)
//! ```
//!
//! Each rank says how many elements it sends to each peer and how many it expects from each;
//! the two sides of every pair must agree. The counts are checked first, by an all-gather of
//! every rank's `[send | recv]` counts, so a disagreement is the same [`CommError::Counts`] on
//! every rank (never a truncated message or a hang); then the data moves in one call.

#[cfg(any(feature = "mpi", feature = "nccl"))]
use std::sync::atomic::Ordering;

use crate::buffer::{RecvBuf, SendBuf, displacements};
use crate::group::Transport;
use crate::local::{downcast, payload};
use crate::{CommElement, CommError, OpDesc, OpKind, ProcessGroup, Result, Work};

impl ProcessGroup {
    /// Starts an all-to-all: this rank sends `send_counts[p]` consecutive elements of `input`
    /// (peers in rank order) to each peer `p`, and receives `recv_counts[p]` elements from each
    /// peer `p` into `out`, in source-rank order. `[sum(send_counts)] -> [sum(recv_counts)]`.
    ///
    /// Exchanges the counts first (a small all-gather, waited here), so it returns once every
    /// rank has started the call; the data then moves in the background.
    ///
    /// # Errors
    /// [`CommError::BufferSize`] if `send_counts` / `recv_counts` do not have one entry per rank
    /// or do not add up to `input` / `out` (before any communication); [`CommError::Counts`], on
    /// every rank, if some rank's count to a peer differs from what that peer expects.
    pub fn all_to_all_async<T: CommElement, I: SendBuf<T>, O: RecvBuf<T>>(
        &self,
        input: I,
        send_counts: &[usize],
        recv_counts: &[usize],
        mut out: O,
    ) -> Result<Work<O>> {
        let n = self.world_size();
        Self::check_out("all_to_all (send counts)", n, send_counts.len())?;
        Self::check_out("all_to_all (recv counts)", n, recv_counts.len())?;
        Self::check_out(
            "all_to_all (input)",
            send_counts.iter().sum(),
            input.as_slice().len(),
        )?;
        Self::check_out(
            "all_to_all (output)",
            recv_counts.iter().sum(),
            out.as_mut_slice().len(),
        )?;
        let mine: Vec<i64> = send_counts
            .iter()
            .chain(recv_counts)
            .map(|&c| c as i64)
            .collect();
        let all = self.all_gather(mine)?;
        let matrix = |s: usize, r: usize, recv: bool| all[s * 2 * n + usize::from(recv) * n + r];
        for s in 0..n {
            for r in 0..n {
                let (sent, expected) = (matrix(s, r, false), matrix(r, s, true));
                if sent != expected {
                    return Err(CommError::Counts {
                        rank: self.rank(),
                        sender: s,
                        receiver: r,
                        sent: sent as usize,
                        expected: expected as usize,
                    });
                }
            }
        }
        // Every rank calls with its own counts: the descriptor carries only what all agree on.
        let desc = OpDesc::new(OpKind::AllToAll, T::DTYPE, vec![n]);
        let rank = self.rank();
        // Where this rank's slice starts in each peer's input: the counts peers send before it.
        let from: Vec<usize> = (0..n)
            .map(|p| (0..rank).map(|q| matrix(p, q, false) as usize).sum())
            .collect();
        match &self.transport {
            Transport::Local(_) => {}
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => {
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let counts = (send_counts, recv_counts);
                let done = m.start_all_to_all(desc.clone(), seq, input, counts, out);
                return Ok(Work::remote(self.clone(), seq, desc, done));
            }
            #[cfg(feature = "nccl")]
            Transport::Nccl(n) => {
                let seq = self.seq.fetch_add(1, Ordering::SeqCst);
                let mut out = out;
                let result = n
                    .host_all_to_all(input.as_slice(), send_counts, recv_counts)
                    .map(|v| {
                        out.as_mut_slice().copy_from_slice(&v);
                        out
                    });
                return Ok(Work::done(self.clone(), seq, desc, result));
            }
        }
        let recv = recv_counts.to_vec();
        // A simulated link delays it by what comes from the peers.
        let from_peers: usize = (0..n).filter(|&p| p != rank).map(|p| recv[p]).sum();
        let bytes = from_peers * T::DTYPE.size();
        let work = self.post(desc, payload(input), move |posts| {
            let mut out = out;
            let dst = out.as_mut_slice();
            let at = displacements(&recv);
            for (p, post) in posts.iter().enumerate() {
                let src = &downcast::<T>(post)[from[p]..from[p] + recv[p]];
                dst[at[p]..at[p] + recv[p]].copy_from_slice(src);
            }
            out
        });
        Ok(work.with_recv_bytes(bytes))
    }

    /// Blocking all-to-all into a new buffer; see [`all_to_all_async`](Self::all_to_all_async).
    ///
    /// # Errors
    /// See [`all_to_all_async`](Self::all_to_all_async) and [`Work::wait`].
    pub fn all_to_all<T: CommElement + Default>(
        &self,
        input: Vec<T>,
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<T>> {
        let out = vec![T::default(); recv_counts.iter().sum()];
        self.all_to_all_async(input, send_counts, recv_counts, out)?
            .wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalGroup;

    fn on_ranks<R: Send + 'static>(
        n: usize,
        f: impl Fn(ProcessGroup) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let hs: Vec<_> = LocalGroup::new(n)
            .unwrap()
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn uneven_counts_arrive_in_source_order() {
        // Rank s sends (s + r) % 3 elements to rank r, each element 100 s + 10 r + i; a rank
        // that sends nothing to a peer (count 0) is part of it.
        let count = |s: usize, r: usize| (s + r) % 3;
        let got = on_ranks(3, move |g| {
            let s = g.rank();
            let send: Vec<usize> = (0..3).map(|r| count(s, r)).collect();
            let recv: Vec<usize> = (0..3).map(|p| count(p, s)).collect();
            let input: Vec<f32> = (0..3)
                .flat_map(|r| (0..count(s, r)).map(move |i| (100 * s + 10 * r + i) as f32))
                .collect();
            g.all_to_all(input, &send, &recv).unwrap()
        });
        for (r, out) in got.iter().enumerate() {
            let want: Vec<f32> = (0..3)
                .flat_map(|s| (0..count(s, r)).map(move |i| (100 * s + 10 * r + i) as f32))
                .collect();
            assert_eq!(out, &want, "rank {r}");
        }
    }

    /// Counts that differ between the two directions of a pair (rank 0 sends rank 1 one
    /// element, rank 1 sends rank 0 three), so a sender's offsets swapped with a receiver's
    /// land the wrong elements (a symmetric pattern hides that), with empty slices between.
    #[test]
    fn asymmetric_counts_arrive_from_each_sender_at_its_offset() {
        let count =
            |s: usize, r: usize| [[2, 1, 0, 4], [3, 0, 2, 1], [0, 5, 1, 0], [1, 0, 3, 2]][s][r];
        assert_ne!(count(0, 1), count(1, 0));
        let got = on_ranks(4, move |g| {
            let s = g.rank();
            let send: Vec<usize> = (0..4).map(|r| count(s, r)).collect();
            let recv: Vec<usize> = (0..4).map(|p| count(p, s)).collect();
            let input: Vec<i64> = (0..4)
                .flat_map(|r| (0..count(s, r)).map(move |i| (100 * s + 10 * r + i) as i64))
                .collect();
            g.all_to_all(input, &send, &recv).unwrap()
        });
        for (r, out) in got.iter().enumerate() {
            let want: Vec<i64> = (0..4)
                .flat_map(|s| (0..count(s, r)).map(move |i| (100 * s + 10 * r + i) as i64))
                .collect();
            assert_eq!(out, &want, "rank {r}");
        }
        // Written out for rank 1: 1 from rank 0, none from itself, 5 from rank 2, none from 3.
        assert_eq!(got[1], vec![10, 210, 211, 212, 213, 214]);
    }

    #[test]
    fn a_count_mismatch_is_the_same_error_on_every_rank() {
        let got = on_ranks(2, |g| {
            // Rank 1 expects 3 elements from rank 0, which sends 2.
            let recv = if g.rank() == 1 { [3, 1] } else { [1, 1] };
            let sent = [1, 2];
            let send = if g.rank() == 0 { sent } else { [1, 1] };
            g.all_to_all(vec![0.0f32; send.iter().sum()], &send, &recv)
                .unwrap_err()
        });
        for e in &got {
            assert!(
                matches!(
                    e,
                    CommError::Counts {
                        sender: 0,
                        receiver: 1,
                        sent: 2,
                        expected: 3,
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("rank 0 sends 2"), "{e}");
        }
    }

    #[test]
    fn counts_that_do_not_add_up_fail_before_communicating() {
        let g = LocalGroup::new(1).unwrap().remove(0);
        let e = g.all_to_all(vec![1.0f32; 3], &[2], &[2]).unwrap_err();
        assert!(
            matches!(
                e,
                CommError::BufferSize {
                    expected: 2,
                    got: 3,
                    ..
                }
            ),
            "{e}"
        );
    }
}
