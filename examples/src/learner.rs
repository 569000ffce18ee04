//! What a Burn user writes to train a burn-tp language model through Burn's Learner: the
//! model's `TrainStep` / `InferenceStep` (as without tensor parallelism), its batches and their
//! batcher, its output and metrics. `learner_llama` and the tests use them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::{Module, ModuleDisplay};
use burn::tensor::TensorReadError;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::comm::ReduceOp;
use burn_tp::dropout::DropoutStep;
use burn_tp::model::LanguageModel;
use burn_tp::reshard::{ParamLayout, Reshard};
use burn_tp::train::{DpItem, ProcessBatch, mean_over};
use burn_train::metric::state::{FormatOptions, NumericMetricState};
use burn_train::metric::{
    Adaptor, ItemLazy, LossInput, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn_train::{InferenceStep, TrainOutput, TrainStep};

/// A burn-tp language model as a Learner model: the loss of a batch of next-token targets.
/// Dropout, if the model has it, takes each step's own masks (every rank counts its steps, so
/// a replica's tp ranks agree).
#[derive(Module, Debug)]
pub struct LmLearner<M: LanguageModel + ModuleDisplay> {
    /// The model (this rank's shard).
    pub model: M,
    /// Training steps run (the dropout masks' step).
    #[module(skip)]
    steps: Arc<AtomicU64>,
}

impl<M: LanguageModel + ModuleDisplay> LmLearner<M> {
    /// `model` to train.
    pub fn new(model: M) -> Self {
        Self {
            model,
            steps: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl<M: LanguageModel + ModuleDisplay> Reshard for LmLearner<M> {
    fn to_full_module(&self) -> burn_tp::Result<Self> {
        Ok(Self::new(self.model.to_full_module()?))
    }
    fn shard_module(full: &Self, group: &burn_tp::comm::ProcessGroup) -> burn_tp::Result<Self> {
        Ok(Self::new(M::shard_module(&full.model, group)?))
    }
    fn layout(&self, rank: usize) -> Vec<ParamLayout> {
        self.model.layout(rank)
    }
}

/// A batch: ids and their next tokens, `[seq, batch]` each.
#[derive(Clone, Debug)]
pub struct LmBatch {
    /// Input ids.
    pub ids: Tensor<2, Int>,
    /// Next-token targets.
    pub targets: Tensor<2, Int>,
}

/// A batch's tensors, for ranks as processes: the leader sends them to its tp peers.
impl ProcessBatch for LmBatch {
    fn to_data(&self) -> Vec<TensorData> {
        vec![self.ids.to_data(), self.targets.to_data()]
    }
    fn from_data(data: Vec<TensorData>, device: &Device) -> Self {
        let [ids, targets] = <[TensorData; 2]>::try_from(data)
            .unwrap_or_else(|d| panic!("an LmBatch is 2 tensors, not {}", d.len()));
        Self {
            ids: Tensor::from_data(ids, device),
            targets: Tensor::from_data(targets, device),
        }
    }
}

/// A step's output: the batch's mean loss, and its tokens.
#[derive(Debug)]
pub struct LmOutput {
    /// The mean next-token loss, `[1]`.
    pub loss: Tensor<1>,
    /// Tokens in the batch.
    pub tokens: usize,
}

/// The step's item over every replica: the mean of the replicas' losses (as the gradients
/// are averaged), the tokens summed.
impl DpItem for LmOutput {
    fn dp_merge(self, dp_group: &burn_tp::comm::ProcessGroup) -> burn_tp::Result<Self> {
        if dp_group.world_size() == 1 {
            return Ok(self);
        }
        let tokens = dp_group.all_reduce(vec![self.tokens as i64], ReduceOp::Sum)?[0];
        Ok(Self {
            loss: mean_over(self.loss, dp_group)?,
            tokens: tokens as usize,
        })
    }
}

impl ItemLazy for LmOutput {
    fn sync(self) -> Result<Self, burn_std::ExecutionError> {
        Ok(Self {
            loss: self.loss.without_autodiff(),
            tokens: self.tokens,
        })
    }
}

impl Adaptor<LossInput> for LmOutput {
    fn adapt(&self) -> LossInput {
        LossInput::new(self.loss.clone())
    }
}

impl<M: LanguageModel + ModuleDisplay> TrainStep for LmLearner<M> {
    type Input = LmBatch;
    type Output = LmOutput;

    fn step(&self, batch: LmBatch) -> TrainOutput<LmOutput> {
        let step = self.steps.fetch_add(1, Ordering::SeqCst);
        let tokens = batch.ids.shape().num_elements();
        let loss = self
            .model
            .loss(batch.ids, batch.targets, Some(DropoutStep::new(step)))
            .unwrap_or_else(|e| panic!("{e}"));
        let grads = loss.backward();
        TrainOutput::new(self, grads, LmOutput { loss, tokens })
    }
}

impl<M: LanguageModel + ModuleDisplay> InferenceStep for LmLearner<M> {
    type Input = LmBatch;
    type Output = LmOutput;

    fn step(&self, batch: LmBatch) -> LmOutput {
        let tokens = batch.ids.shape().num_elements();
        let loss = self
            .model
            .loss(batch.ids, batch.targets, None)
            .unwrap_or_else(|e| panic!("{e}"));
        LmOutput { loss, tokens }
    }
}

/// Windows of `seq + 1` tokens of a text: a sequence and its next tokens.
#[derive(Clone, Debug)]
pub struct Windows {
    tokens: Arc<Vec<i64>>,
    seq: usize,
    stride: usize,
}

impl Windows {
    /// The windows of `tokens`, `stride` tokens apart.
    pub fn new(tokens: Vec<i64>, seq: usize, stride: usize) -> Self {
        Self {
            tokens: Arc::new(tokens),
            seq,
            stride: stride.max(1),
        }
    }
}

impl Dataset<Vec<i64>> for Windows {
    fn get(&self, index: usize) -> Result<Vec<i64>, DatasetError> {
        let start = index * self.stride;
        self.tokens
            .get(start..start + self.seq + 1)
            .map(<[i64]>::to_vec)
            .ok_or_else(|| {
                DatasetError::new(std::io::Error::other(format!(
                    "window {index} of {} is past the text",
                    self.len()
                )))
            })
    }

    fn len(&self) -> usize {
        match self.tokens.len() {
            n if n > self.seq => (n - self.seq - 1) / self.stride + 1,
            _ => 0,
        }
    }
}

/// Windows into [`LmBatch`]es (`[seq, batch]`).
#[derive(Clone, Debug, Default)]
pub struct LmBatcher;

impl Batcher<Vec<i64>, LmBatch> for LmBatcher {
    fn batch(&self, windows: Vec<Vec<i64>>, device: &Device) -> LmBatch {
        let (b, s) = (windows.len(), windows[0].len() - 1);
        let mut ids = vec![0i64; s * b];
        let mut targets = vec![0i64; s * b];
        for (j, w) in windows.iter().enumerate() {
            for t in 0..s {
                ids[t * b + j] = w[t];
                targets[t * b + j] = w[t + 1];
            }
        }
        LmBatch {
            ids: Tensor::from_data(TensorData::new(ids, [s, b]), device),
            targets: Tensor::from_data(TensorData::new(targets, [s, b]), device),
        }
    }
}

/// A step's mean loss and its tokens, for [`PerplexityMetric`] and [`TokensPerSecond`].
#[derive(Clone, Debug)]
pub struct LmStats {
    /// The mean next-token loss.
    pub loss: f64,
    /// Tokens in the batch.
    pub tokens: usize,
}

impl Adaptor<LmStats> for LmOutput {
    fn adapt(&self) -> LmStats {
        LmStats {
            loss: self.loss.clone().into_scalar::<f32>() as f64,
            tokens: self.tokens,
        }
    }
}

/// Perplexity, `exp` of the mean loss per token (the epoch's: weighted by the batches' tokens).
#[derive(Clone)]
pub struct PerplexityMetric {
    name: MetricName,
    state: NumericMetricState,
}

impl Default for PerplexityMetric {
    fn default() -> Self {
        Self {
            name: Arc::new("Perplexity".to_string()),
            state: NumericMetricState::new(),
        }
    }
}

impl Metric for PerplexityMetric {
    type Input = LmStats;

    fn update(
        &mut self,
        item: &LmStats,
        _: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        self.state.update(item.loss.exp(), item.tokens);
        Ok(self
            .state
            .compute_update(FormatOptions::new(self.name()).precision(2)))
    }
    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self
            .state
            .compute_final(FormatOptions::new(self.name()).precision(2)))
    }
    fn clear(&mut self) {
        self.state.reset()
    }
    fn name(&self) -> MetricName {
        self.name.clone()
    }
    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }
}

impl Numeric for PerplexityMetric {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }
    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }
    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}

/// Tokens per second of the items reported (a replica's: with dp, each replica's rate).
#[derive(Clone)]
pub struct TokensPerSecond {
    name: MetricName,
    state: NumericMetricState,
    last: Option<std::time::Instant>,
}

impl Default for TokensPerSecond {
    fn default() -> Self {
        Self {
            name: Arc::new("Tokens per second".to_string()),
            state: NumericMetricState::new(),
            last: None,
        }
    }
}

impl Metric for TokensPerSecond {
    type Input = LmStats;

    fn update(
        &mut self,
        item: &LmStats,
        _: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let now = std::time::Instant::now();
        // The first item of a split has no interval before it.
        let rate = match self.last.replace(now) {
            Some(last) => item.tokens as f64 / (now - last).as_secs_f64().max(1e-9),
            None => 0.0,
        };
        self.state.update(rate, 1);
        Ok(self
            .state
            .compute_update(FormatOptions::new(self.name()).unit("tok/s").precision(0)))
    }
    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        Ok(self
            .state
            .compute_final(FormatOptions::new(self.name()).unit("tok/s").precision(0)))
    }
    fn clear(&mut self) {
        self.state.reset();
        self.last = None;
    }
    fn name(&self) -> MetricName {
        self.name.clone()
    }
    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: Some("tok/s".to_string()),
            higher_is_better: true,
        }
        .into()
    }
}

impl Numeric for TokensPerSecond {
    fn value(&self) -> Option<NumericEntry> {
        Some(self.state.current_value())
    }
    fn running_value(&self) -> Option<NumericEntry> {
        Some(self.state.running_value())
    }
    fn final_value(&self) -> NumericEntry {
        self.state.final_value()
    }
}
