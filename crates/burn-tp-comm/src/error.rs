//! The one error type of the communication layer.

use std::time::Duration;

use crate::OpDesc;

/// Why a collective could not complete. Every rank of the group gets an error for the same call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// The ranks did not call the same collective with the same arguments at this sequence number.
    #[error(
        "collective #{seq} mismatch: rank {rank} called {ours} but rank {other_rank} called {theirs}"
    )]
    Mismatch {
        /// Per-group sequence number of the call.
        seq: u64,
        /// A rank whose call differs from `other_rank`'s.
        rank: usize,
        /// What `rank` called.
        ours: OpDesc,
        /// The rank it was compared with.
        other_rank: usize,
        /// What `other_rank` called.
        theirs: OpDesc,
    },
    /// A rank the call needed dropped its group handle (or its thread panicked) before arriving.
    #[error("{op} #{seq} on rank {rank}: rank(s) {gone:?} left the group before arriving")]
    PeerGone {
        /// The call that failed.
        op: OpDesc,
        /// Per-group sequence number of the call.
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// Ranks that are gone.
        gone: Vec<usize>,
    },
    /// A rank waits for ranks of its group that its own thread serves (they last posted from
    /// it), or that no thread was ever given (the group used from the thread that made it):
    /// they can never arrive, so the call fails at once instead of at the timeout.
    #[error(
        "{op} #{seq} on rank {rank}: rank(s) {missing:?} of this group are served by the thread \
         that now waits for them{never}, so they can never arrive: each rank needs its own thread \
         (run the ranks with burn_tp::local::run_local or run_ranks, or one thread per handle of \
         LocalGroup::new)"
    )]
    SameThread {
        /// The call that failed.
        op: OpDesc,
        /// Per-group sequence number of the call.
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// The ranks that cannot arrive.
        missing: Vec<usize>,
        /// `" (never used by any other thread)"` where they never posted, else empty.
        never: String,
    },
    /// Not every rank arrived within the timeout.
    #[error(
        "{op} #{seq} on rank {rank} timed out after {timeout:?}: rank(s) {missing:?} had not arrived"
    )]
    Timeout {
        /// The call that failed.
        op: OpDesc,
        /// Per-group sequence number of the call.
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// How long it waited.
        timeout: Duration,
        /// Ranks that had not posted this call.
        missing: Vec<usize>,
    },
    /// An earlier failure on some rank aborted the group; no further collective can run on it.
    #[error("{op} #{seq} on rank {rank}: the group was aborted earlier: {reason}")]
    Aborted {
        /// The call that failed.
        op: OpDesc,
        /// Per-group sequence number of the call.
        seq: u64,
        /// The rank reporting.
        rank: usize,
        /// The error that aborted the group.
        reason: String,
    },
    /// A buffer that must be split evenly over the ranks cannot be.
    #[error("{op}: {len} elements cannot be split evenly over world size {world_size}")]
    NotDivisible {
        /// The operation name.
        op: &'static str,
        /// Number of elements (or size of the split dimension).
        len: usize,
        /// The group's world size.
        world_size: usize,
    },
    /// A caller-provided output buffer of the wrong length.
    #[error("{op}: the output buffer has {got} elements, expected {expected}")]
    BufferSize {
        /// The operation name.
        op: &'static str,
        /// The length needed.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A root rank outside the group.
    #[error("{op}: root {root} is not a rank of a group of world size {world_size}")]
    InvalidRoot {
        /// The operation name.
        op: &'static str,
        /// The root asked for.
        root: usize,
        /// The group's world size.
        world_size: usize,
    },
    /// An all-to-all whose sender and receiver disagree on how many elements go between them.
    #[error(
        "all_to_all on rank {rank}: rank {sender} sends {sent} elements to rank {receiver}, \
         which expects {expected} from it"
    )]
    Counts {
        /// The rank reporting (every rank reports the same pair).
        rank: usize,
        /// The sending rank of the first pair that disagrees.
        sender: usize,
        /// The receiving rank.
        receiver: usize,
        /// What `sender` says it sends.
        sent: usize,
        /// What `receiver` says it receives.
        expected: usize,
    },
    /// A world size of zero.
    #[error("a process group needs at least one rank, got world size {0}")]
    InvalidWorldSize(usize),
    /// An error from another transport (NCCL, the rendezvous store).
    #[error("{0}")]
    Backend(String),
}

/// Result alias of the communication layer.
pub type Result<T> = std::result::Result<T, CommError>;
