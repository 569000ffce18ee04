//! What `gpu_check` (the GPU check `.ci/gpu-check run` bundles) measures with, apart from the
//! CUDA binary so that the CPU tests cover it: errors that fail on NaN, and a figures file
//! written after every check so that a run killed by its time bound still reports what it did.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `||a - b|| / ||b||` in f64; NaN if either side holds a NaN, infinite if the lengths differ
/// (a wrong shape is never close).
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// Whether `err` is within `tol`: false for NaN (`err > tol` would let a NaN pass).
pub fn within(err: f64, tol: f64) -> bool {
    err <= tol
}

/// The worst of several errors, where a NaN is the worst of all (`f64::max` would drop it).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Worst(f64);

impl Worst {
    /// Takes `err` into account.
    pub fn add(&mut self, err: f64) {
        if !self.0.is_nan() && (err.is_nan() || err > self.0) {
            self.0 = err;
        }
    }

    /// The worst error so far (0 if none).
    pub fn get(self) -> f64 {
        self.0
    }
}

/// The figures of a check run, as a flat JSON object written to `path` after every change.
#[derive(Debug)]
pub struct Figures {
    path: PathBuf,
    values: BTreeMap<String, String>,
}

impl Figures {
    /// Figures written to `path` (nothing is written until the first value).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            values: BTreeMap::new(),
        }
    }

    /// A number (non-finite values are written as strings, which JSON can hold).
    pub fn num(&mut self, key: impl Into<String>, value: f64) {
        let v = if value.is_finite() {
            format!("{value}")
        } else {
            json_string(&format!("{value}"))
        };
        self.set(key.into(), v);
    }

    /// A text.
    pub fn text(&mut self, key: impl Into<String>, value: &str) {
        self.set(key.into(), json_string(value));
    }

    /// The value of `key` as written in the JSON.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    fn set(&mut self, key: String, json: String) {
        self.values.insert(key, json);
        if let Err(e) = self.save() {
            eprintln!("gpu_check: writing {}: {e}", self.path.display());
        }
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        let mut s = String::from("{\n");
        for (i, (k, v)) in self.values.iter().enumerate() {
            let comma = if i + 1 < self.values.len() { "," } else { "" };
            let _ = writeln!(s, "  {}: {v}{comma}", json_string(k));
        }
        s.push('}');
        s.push('\n');
        s
    }

    /// Writes the file: to a temporary beside it, then renamed over it, so a run killed while
    /// writing leaves the previous figures whole.
    ///
    /// # Errors
    /// The file system's.
    pub fn save(&self) -> std::io::Result<()> {
        let tmp = tmp_path(&self.path);
        std::fs::write(&tmp, self.to_json())?;
        std::fs::rename(&tmp, &self.path)
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// `s` as a JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_fails_every_check() {
        let good = [1.0f32, 2.0, 3.0];
        let nan = [1.0f32, f32::NAN, 3.0];
        assert_eq!(rel_error(&good, &good), 0.0);
        assert!(rel_error(&nan, &good).is_nan());
        assert!(rel_error(&good, &nan).is_nan());
        assert!(!within(rel_error(&nan, &good), 1e-2));
        assert!(within(rel_error(&[1.0, 2.0, 3.01], &good), 1e-2));
        assert!(!within(rel_error(&[1.0, 2.0, 3.5], &good), 1e-2));
        // A wrong length is never close.
        assert!(!within(rel_error(&good[..2], &good), 1e30));

        let mut w = Worst::default();
        w.add(1e-4);
        w.add(f64::NAN);
        w.add(0.5);
        assert!(w.get().is_nan(), "{w:?}");
        let mut w = Worst::default();
        w.add(1e-4);
        w.add(3e-3);
        w.add(1e-5);
        assert_eq!(w.get(), 3e-3);
    }

    #[test]
    fn figures_are_on_disk_after_every_value_and_stay_valid_json() {
        let dir = std::env::temp_dir().join(format!("burn-tp-figures-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("figures.json");
        let mut f = Figures::new(&path);
        f.text("a.status", "FAILED: \"quoted\"\nnext line");
        assert!(std::fs::read_to_string(&path).unwrap().contains("a.status"));
        f.num("b.ms", 1.5);
        f.num("c.err", f64::NAN);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\n  \"a.status\": \"FAILED: \\\"quoted\\\"\\nnext line\",\n  \"b.ms\": 1.5,\n  \
             \"c.err\": \"NaN\"\n}\n"
        );
        assert_eq!(f.get("b.ms"), Some("1.5"));
        // Only the figures file is left: the temporary was renamed over it.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("figures.json")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// What [`llama_steps_on_threads`] measured: rank 0's loss of each step, and the mean seconds
/// of the steps after the first (a warm-up).
#[derive(Clone, Debug)]
pub struct StepTimes {
    /// The loss of each step.
    pub losses: Vec<f64>,
    /// Mean seconds per step, the first left out (its own when there is one step).
    pub step_s: f64,
}

/// `steps` training steps of the Llama of `config` at `tp`, ranks as threads sharing `device`
/// (one GPU: the collectives go through the host), each step a batch of `batch` sequences of
/// the config's context drawn from a fixed seed: its forward and backward with the parameters
/// in `dtype` (f32 master weights, as `train_gpt --dtype`), AdamW. The GPU check's tp = 2 step;
/// on the CPU the tests check it gives the tp = 1 losses.
///
/// # Errors
/// A rank's error, as text.
pub fn llama_steps_on_threads(
    config: &burn_tp::llama::LlamaConfig,
    tp: usize,
    device: &burn::tensor::Device,
    (batch, steps): (usize, usize),
    dtype: burn::tensor::FloatDType,
) -> Result<StepTimes, String> {
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_tp::model::LanguageModel;
    use burn_tp::precision::{cast_grads, cast_params};
    let device = device.clone().inner().autodiff();
    device.seed(0);
    let (config, seq, vocab) = (config.clone(), config.max_seq, config.n_vocab);
    let groups = burn_tp::comm::LocalGroup::new(tp).map_err(|e| e.to_string())?;
    let results = burn_tp::local::run_ranks(groups, move |group| {
        let run = || -> burn_tp::Result<StepTimes> {
            let mut model = config.init(&group, &device)?;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut times) = (Vec::new(), Vec::new());
            for step in 0..steps {
                // A fixed text per step (the same on every rank): ids and next ids.
                let ids: Vec<i64> = (0..(seq + 1) * batch)
                    .map(|i| ((i * 7919 + step * 104_729) % vocab) as i64)
                    .collect();
                let window = |from: usize| {
                    let v: Vec<i64> = (0..seq * batch)
                        .map(|i| ids[(i % batch) * (seq + 1) + i / batch + from])
                        .collect();
                    Tensor::<2, Int>::from_data(TensorData::new(v, [seq, batch]), &device)
                };
                let started = std::time::Instant::now();
                let working = cast_params(model.clone(), dtype);
                let loss = LanguageModel::loss(&working, window(0), window(1), None)?;
                let value: f32 = loss.clone().into_scalar();
                let mut grads = GradientsParams::from_grads(loss.backward(), &working);
                cast_grads(&working, &mut grads, burn::tensor::FloatDType::F32);
                model = optim.step(1e-4, model, grads);
                // The step's end: its last value read back.
                let _ = model.embedding_weight().val().sum().into_scalar::<f32>();
                times.push(started.elapsed().as_secs_f64());
                losses.push(f64::from(value));
            }
            let warm = if times.len() > 1 {
                &times[1..]
            } else {
                &times[..]
            };
            Ok(StepTimes {
                losses,
                step_s: warm.iter().sum::<f64>() / warm.len() as f64,
            })
        };
        run().map_err(|e| e.to_string())
    })?;
    results.into_iter().next().ok_or("no rank")?
}
