//! The error type of burn-tp.

use burn_tp_comm::CommError;

/// Why a tensor-parallel operation could not run. Shape errors are found before any
/// communication, so every rank reports them without waiting on the others.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TpError {
    /// The communication failed (mismatch, timeout, a rank gone); every rank of the group fails.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A size that must be a multiple of the tensor-parallel world size is not.
    #[error("{what} = {size} is not divisible by the tensor-parallel size {tp}")]
    NotDivisible {
        /// What was split (for example `"d_output"` or `"dim 0 of the input"`).
        what: String,
        /// Its size.
        size: usize,
        /// The tensor-parallel world size.
        tp: usize,
    },
    /// A dimension index out of range for the tensor.
    #[error("{op}: dim {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
    },
    /// An input whose shape does not fit the layer.
    #[error("{op}: expected {expected}, got shape {got:?}")]
    Shape {
        /// The layer or operation.
        op: &'static str,
        /// What was expected, in words.
        expected: String,
        /// The shape received.
        got: Vec<usize>,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary 0..{vocab}")]
    OutOfRange {
        /// The offending id.
        id: i64,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A configuration that cannot work.
    #[error("{0}")]
    Config(String),
    /// Data-parallel replicas that must hold the same parameter hold different values: the
    /// gradient average would train a blend of different models.
    #[error(
        "{what}: the {ranks} data-parallel replicas hold different values of `{param}`; start \
         them from one model (burn_tp::dp::broadcast_parameters, or dp::sync_replicas with \
         ReplicaPolicy::Broadcast), or build it the same way on every replica (burn-tp's layers \
         draw alike on every rank thread of burn_tp::local::run_ranks; a parameter of one's \
         own: burn_tp::init::init_replicated_param)"
    )]
    ReplicasDiffer {
        /// What checked (a helper's name).
        what: String,
        /// The first parameter that differs (its module path).
        param: String,
        /// The ranks compared.
        ranks: usize,
    },
    /// A checkpoint that cannot be written or read: a missing or truncated file, a tensor whose
    /// dtype or shape does not fit the model, an index of another model.
    #[error("checkpoint {path}: {what}")]
    Checkpoint {
        /// The file (or folder) concerned.
        path: String,
        /// What is wrong, naming the tensor where there is one.
        what: String,
    },
}

/// Result alias of burn-tp.
pub type Result<T> = std::result::Result<T, TpError>;

/// `Err(NotDivisible)` unless `size` is a multiple of `tp`.
pub(crate) fn check_divisible(what: impl Into<String>, size: usize, tp: usize) -> Result<()> {
    if !size.is_multiple_of(tp) {
        return Err(TpError::NotDivisible {
            what: what.into(),
            size,
            tp,
        });
    }
    Ok(())
}

/// [`TpError::Checkpoint`] naming the file (or folder) `path` and what is wrong with it: every
/// file format's error (the sharded checkpoints, Hugging Face's).
pub(crate) fn file_error(path: &std::path::Path, what: impl Into<String>) -> TpError {
    TpError::Checkpoint {
        path: path.display().to_string(),
        what: what.into(),
    }
}
