//! The types the backend ops take and return: which collective, the one pending collective, its
//! output, and the settings of a parallel linear.

use std::fmt;
use std::sync::Arc;

use burn::backend::{Backend, ExtensionType, tensor::FloatTensor};
use burn::config::Config;
use burn::tensor::TensorData;
use burn_tp_comm::{CommError, ProcessGroup, ReduceOp};

/// Which collective a [`PendingCollective`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Rank-order concatenation along `dim`: `[.., n_d, ..] -> [.., tp * n_d, ..]`.
    AllGather {
        /// The concatenated dimension.
        dim: usize,
    },
    /// Sum over ranks, then chunk `r` of `dim` to rank `r`: `[.., n_d, ..] -> [.., n_d / tp, ..]`.
    ReduceScatter {
        /// The scattered dimension.
        dim: usize,
    },
    /// Element-wise reduction to every rank; its backward is the true per-rank adjoint (an
    /// all-reduce), as data parallelism wants. Tensor parallel code uses the two below.
    AllReduce(ReduceOp),
    /// Megatron's `f`: identity forward, all-reduce (sum) backward.
    CopyToRegion,
    /// Megatron's `g`: all-reduce (sum) forward, identity backward.
    ReduceFromRegion,
    /// All-gather forward, split (keep this rank's chunk) backward: for a gathered output that
    /// feeds replicated compute (`gather_output`), where every rank holds the full gradient.
    GatherFromRegion {
        /// The concatenated dimension.
        dim: usize,
    },
    /// Split forward (keep this rank's chunk, no communication), all-gather backward.
    ScatterToRegion {
        /// The split dimension.
        dim: usize,
    },
}

impl Collective {
    /// The dimension the collective moves, or 0 for element-wise ones.
    pub(crate) fn dim(self) -> usize {
        match self {
            Collective::AllGather { dim }
            | Collective::ReduceScatter { dim }
            | Collective::GatherFromRegion { dim }
            | Collective::ScatterToRegion { dim } => dim,
            _ => 0,
        }
    }

    /// Whether the forward communicates at all (all but the identity and split forwards).
    pub(crate) fn communicates(self) -> bool {
        !matches!(
            self,
            Collective::CopyToRegion | Collective::ScatterToRegion { .. }
        )
    }

    /// Whether the forward runs without communication on this group (identity or split forwards,
    /// or a group of one).
    pub(crate) fn is_local(self, group: &ProcessGroup) -> bool {
        group.world_size() == 1 || !self.communicates()
    }
}

/// A transport's [`Work`](burn_tp_comm::Work) as a [`PendingCollective`] holds it, its element
/// type erased: the host transport's `HostWork`, the CUDA backend's `NcclWork` (a
/// `burn_tp_comm::nccl::DeviceWork` with the buffers it keeps alive). `Any`: a device
/// backend finds its own work again. The vocabulary of work in flight, one stem per layer: a
/// transport's `*Work`, the backend's [`PendingCollective`], the tensor's
/// [`Pending`](crate::ops::Pending).
pub(crate) trait TransportWork: std::any::Any + Send + Sync {
    /// Waits for the whole result (once), collective dim first.
    fn finish(&self) -> Result<TensorData, CommError>;
    /// For an all-gather: waits for rows `rows` (dim 0) of rank `part`'s shard only.
    fn part(&self, part: usize, rows: std::ops::Range<usize>) -> Result<TensorData, CommError>;
}

/// A started collective: the input it was started from and the communication in flight.
/// [`TpBackend::tp_resolve`](super::TpBackend::tp_resolve) completes it.
#[derive(ExtensionType)]
pub struct PendingCollective<B: Backend> {
    /// The tensor the collective was started from: it routes the resolve to its backend and is
    /// the autodiff parent of the result.
    pub(crate) input: FloatTensor<B>,
    /// The collective.
    pub(crate) op: Collective,
    /// The group it runs on.
    pub(crate) group: ProcessGroup,
    /// What the start posted: `Ok(None)` nothing to communicate ([`Collective::is_local`]),
    /// `Ok(Some(..))` communication in flight (shared so the handle crosses the dispatch
    /// boundary by clone), `Err(..)` a failure before any communication, which the resolve
    /// returns.
    pub(crate) posted: Result<Option<Arc<dyn TransportWork>>, CommError>,
}

impl<B: Backend> Clone for PendingCollective<B> {
    fn clone(&self) -> Self {
        Self {
            input: self.input.clone(),
            op: self.op,
            group: self.group.clone(),
            posted: self.posted.clone(),
        }
    }
}

impl<B: Backend> fmt::Debug for PendingCollective<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PendingCollective({:?} on rank {})",
            self.op,
            self.group.rank()
        )
    }
}

impl<B: Backend> PendingCollective<B> {
    pub(crate) fn new(
        input: FloatTensor<B>,
        op: Collective,
        group: ProcessGroup,
        posted: Result<Option<Arc<dyn TransportWork>>, CommError>,
    ) -> Self {
        Self {
            input,
            op,
            group,
            posted,
        }
    }

    /// The same collective, with `input` in place of this one's (another backend's view of it).
    pub(crate) fn with_input<B2: Backend>(self, input: FloatTensor<B2>) -> PendingCollective<B2> {
        PendingCollective::new(input, self.op, self.group, self.posted)
    }
}

/// The result of a resolved collective at the backend level: a `Result` that can cross the
/// dispatch boundary. [`into_result`](Self::into_result) and `From<Result<..>>` convert.
///
/// Why not `Result`: burn 0.22.1's `#[backend_extension]` takes as an op's output tensors,
/// `Option`s, `Vec`s, tuples and `#[extension_type]`s, and refuses any other named type holding
/// `Self` ("named outputs containing `Self` aren't supported").
#[derive(ExtensionType)]
pub enum CollectiveOutput<B: Backend> {
    /// The collective completed.
    Done(FloatTensor<B>),
    /// It failed on this rank (and, by the group's abort, on every rank).
    Failed(CommError),
}

impl<B: Backend> CollectiveOutput<B> {
    /// As a `Result`.
    pub fn into_result(self) -> Result<FloatTensor<B>, CommError> {
        match self {
            CollectiveOutput::Done(t) => Ok(t),
            CollectiveOutput::Failed(e) => Err(e),
        }
    }
}

impl<B: Backend> From<Result<FloatTensor<B>, CommError>> for CollectiveOutput<B> {
    fn from(result: Result<FloatTensor<B>, CommError>) -> Self {
        match result {
            Ok(t) => CollectiveOutput::Done(t),
            Err(e) => CollectiveOutput::Failed(e),
        }
    }
}

/// Inputs of a parallel-linear op as they cross the dispatch boundary: an optional bias.
///
/// Why not `Option<FloatTensor<Self>>`: burn 0.22.1's `#[backend_extension]` accepts that input
/// type but passes the `Option<DispatchTensor>` on unconverted to the backend's op (tried: it
/// fails to compile, "expected `Option<FlexTensor>`, found `Option<DispatchTensor>`"); an
/// `#[extension_type]` is unwrapped per backend.
#[derive(ExtensionType)]
pub enum Bias<B: Backend> {
    /// No bias.
    None,
    /// The bias: `[d_out / n]` for the column layer, `[d_out]` (replicated) for the row layer.
    Some(FloatTensor<B>),
}

impl<B: Backend> Bias<B> {
    /// As an `Option`.
    pub fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Bias::None => None,
            Bias::Some(b) => Some(b),
        }
    }
}

impl<B: Backend> From<Option<FloatTensor<B>>> for Bias<B> {
    fn from(bias: Option<FloatTensor<B>>) -> Self {
        bias.map_or(Bias::None, Bias::Some)
    }
}

/// Activation layout of the tensor-parallel region.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum TpMode {
    /// Activations replicated on every rank; row-parallel all-reduces its partial outputs.
    AllReduce,
    /// Sequence parallel: activations sharded on dim 0; column-parallel all-gathers its input,
    /// row-parallel reduce-scatters its output.
    ReduceScatter,
}

/// The overlap schedule for a gather feeding a matmul (`backend/matmul/overlap.rs`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum OverlapSchedule {
    /// Own shard during the communication, the rest after it (nanotron).
    Split,
    /// Chunked ring: each rank's shard is consumed as it arrives (own, r-1, r-2, ...), in chunks
    /// as a ring delivers them; the row backward also accumulates its weight and bias gradients
    /// block by block, so nearly all of its compute overlaps the gather.
    Ring,
}

/// How the tensor-parallel layers of a model run: the one settings type. Every config (the
/// parallel linears, the embedding, attention, MLPs, the GPT and the Llama) holds it whole as
/// `settings`, and a model passes its own down once.
///
/// ```
/// use burn_tp::linear::{OverlapSchedule, TpMode, TpSettings};
/// let settings = TpSettings::new()
///     .with_mode(TpMode::ReduceScatter)
///     .with_schedule(OverlapSchedule::Split);
/// assert!(settings.async_communication);
/// ```
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct TpSettings {
    /// Activation layout.
    #[config(default = "TpMode::AllReduce")]
    pub mode: TpMode,
    /// Overlap the communication with compute (the backend's fused ops with their own backward
    /// nodes); otherwise compose the differentiable collectives with Burn's linear.
    #[config(default = true)]
    pub async_communication: bool,
    /// How the async path overlaps a gather with the matmul that consumes it (measured:
    /// docs/PERFORMANCE.md).
    #[config(default = "OverlapSchedule::Ring")]
    pub schedule: OverlapSchedule,
    /// Column layers in REDUCE_SCATTER mode: save only the local shard of the input and re-gather
    /// it in backward (less memory, one more all-gather, hidden behind the dgrad matmul).
    #[config(default = true)]
    pub recompute_all_gather: bool,
    /// Attention by blocks, never materializing the `[s, t]` scores (FlashAttention-2: the
    /// backward recomputes each block's probabilities); otherwise the scores, mask, softmax and
    /// probabilities as separate tracked ops, each kept for the backward.
    #[config(default = true)]
    pub fused_attention: bool,
    /// Query rows (and key columns) of one tile of the fused attention: its scores are
    /// `[tile, tile]` per head at a time, the online softmax rescaling across a row's tiles.
    /// 256 by default; tests take smaller ones to run the rescale on short sequences.
    #[config(default = 256)]
    pub attention_tile: usize,
}

/// What one parallel linear runs with: the model's [`TpSettings`] and its own output layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearSpec {
    /// The model's settings.
    pub settings: TpSettings,
    /// Column layer, ALL_REDUCE mode: all-gather the output along the last dim.
    pub gather_output: bool,
}

impl LinearSpec {
    /// `settings`, without a gathered output.
    pub fn new(settings: TpSettings) -> Self {
        Self {
            settings,
            gather_output: false,
        }
    }
}
