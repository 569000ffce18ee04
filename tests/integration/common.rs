//! Shared helpers: devices, seeded random tensors, comparisons.

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_tp::comm::{LinkModel, LocalGroup, LocalGroupOptions, ProcessGroup};
use burn_tp::linear::OverlapSchedule;
use burn_tp::local::run_ranks;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// `run_local` over a group with a (very fast) simulated link: collectives then progress in the
/// background, so the async layers run their real overlap schedules (without a link, ranks as
/// threads move data inside the wait and the schedules fall back to one block).
pub fn run_linked<T: Send + 'static>(
    tp: usize,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, String> {
    let options = LocalGroupOptions {
        link: Some(LinkModel::new(1000.0, 1.0)),
        ..Default::default()
    };
    run_ranks(LocalGroup::with_options(tp, options).unwrap(), f)
}

/// How the ranks of a test run the async layers' overlap schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Ranks as threads without a link: no background progress, so the schedules take one block
    /// (the sync path's work).
    OneBlock,
    /// Over a (very fast) simulated link: the schedule runs block by block, as over NCCL.
    Overlapped(OverlapSchedule),
}

impl Path {
    /// The three paths, which a test rotates through its cases.
    pub const ALL: [Path; 3] = [
        Path::OneBlock,
        Path::Overlapped(OverlapSchedule::Split),
        Path::Overlapped(OverlapSchedule::Ring),
    ];

    /// The paths a model test runs at `tp`: one block only at tp = 1 (nothing to overlap), all
    /// three above.
    pub fn at(tp: usize) -> &'static [Path] {
        if tp == 1 { &Path::ALL[..1] } else { &Path::ALL }
    }

    /// The schedule the layers are configured with (the default, ring, on the one-block path).
    pub fn schedule(self) -> OverlapSchedule {
        match self {
            Path::OneBlock => OverlapSchedule::Ring,
            Path::Overlapped(s) => s,
        }
    }

    /// `f` on `tp` rank threads, linked for the overlapped paths.
    pub fn run<T: Send + 'static>(
        self,
        tp: usize,
        f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>, String> {
        match self {
            Path::OneBlock => burn_tp::local::run_local(tp, f),
            Path::Overlapped(_) => run_linked(tp, f),
        }
    }

    /// `train_gpt`'s flags for this path.
    pub fn args(self) -> Vec<&'static str> {
        match self {
            Path::OneBlock => vec![],
            Path::Overlapped(OverlapSchedule::Split) => {
                vec!["--link-latency-us", "1", "--schedule", "split"]
            }
            Path::Overlapped(OverlapSchedule::Ring) => {
                vec!["--link-latency-us", "1", "--schedule", "ring"]
            }
        }
    }
}

pub fn device() -> Device {
    Device::flex().autodiff()
}

/// Seeded values that are multiples of 1/4 in [-4, 4): sums of a few are exact in every float type.
pub fn quarters(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len)
        .map(|_| rng.random_range(-16i32..16) as f32 * 0.25)
        .collect()
}

/// Seeded uniform values in [-1, 1).
pub fn uniform(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

pub fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D], dtype: DType) -> Tensor<D> {
    Tensor::from_data(
        TensorData::new(values, shape).convert_dtype(dtype),
        (&device(), dtype),
    )
}

pub fn f64s<const D: usize>(t: Tensor<D>) -> Vec<f64> {
    burn_tp::testing::to_f64(t)
}

#[track_caller]
pub fn assert_close(a: &[f64], b: &[f64], rtol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = rtol * (1.0 + x.abs().max(y.abs()));
        assert!(
            (x - y).abs() <= tol,
            "{what}[{i}]: {x} vs {y} (tol {tol:e})"
        );
    }
}

/// `n` token ids `(i * mul + add) % vocab`: a deterministic batch covering the vocabulary.
pub fn token_ids(n: usize, vocab: usize, mul: i64, add: i64) -> Vec<i64> {
    (0..n as i64)
        .map(|i| (i * mul + add) % vocab as i64)
        .collect()
}

/// Flex has one device, so one RNG for every test thread: tests that draw from it (layer `init`)
/// hold this lock, so a seeded test sees exactly its own draws.
pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Replaces every parameter of a module by its gradient (then `to_full_module` gathers the
/// gradients of a sharded model into the full layout).
pub struct ToGrads<'a>(pub &'a burn::tensor::Gradients);

impl burn::module::ModuleMapper for ToGrads<'_> {
    fn map_float<const R: usize>(
        &mut self,
        param: burn::module::Param<Tensor<R>>,
    ) -> burn::module::Param<Tensor<R>> {
        let grads = self.0;
        param.map(|t| t.grad(grads).expect("every parameter has a gradient"))
    }
}

/// The gradients of a sharded `model`, gathered into its tp = 1 layout (each parameter replaced
/// by its gradient).
pub fn full_grads<M: burn::module::Module + burn_tp::reshard::Reshard>(
    model: &M,
    grads: &burn::tensor::Gradients,
) -> M {
    model
        .clone()
        .map(&mut ToGrads(grads))
        .to_full_module()
        .expect("the gradients gather")
}

/// `||a - b|| / ||b||`.
pub fn rel_norm(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n.max(1e-30)).sqrt()
}

/// Rank `r`'s part of `t` cut in `n` along `dim` (`t` itself at `n = 1`).
pub(crate) fn chunk<const D: usize>(t: Tensor<D>, n: usize, dim: usize, r: usize) -> Tensor<D> {
    if n == 1 {
        t
    } else {
        t.chunk(n, dim).swap_remove(r)
    }
}

/// Every float parameter's values of `module`, in visiting order.
pub(crate) fn param_values<M: burn::module::Module>(module: &M) -> Vec<Vec<f64>> {
    use burn::module::{ModuleVisitor, Param};
    struct Collect(Vec<Vec<f64>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(f64s(p.val()));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}
