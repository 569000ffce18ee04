//! Rotary positions: Burn's `RotaryEncoding`, and Llama 3's scaling of its frequencies.

use burn::config::Config;
use burn::nn::{RotaryEncoding, RotaryEncodingConfig};
use burn::tensor::{Device, Tensor};

/// Llama 3's scaling of the rotary frequencies (Hugging Face's `rope_scaling` / `rope_parameters`
/// of type `llama3`; Llama 3.1 - 3.3): wavelengths shorter than
/// `original_max_position_embeddings / high_freq_factor` are kept, those longer than
/// `original_max_position_embeddings / low_freq_factor` divided by `factor`, and those between
/// interpolated smoothly between the two.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// How much longer the context is than the one trained at first.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context the model was first trained at.
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// The scaled inverse frequencies of `freqs` (`[head_dim / 2]`), as transformers'
    /// `_compute_llama3_parameters`.
    pub fn apply(&self, freqs: Tensor<1>) -> Tensor<1> {
        let device = freqs.device();
        let values: Vec<f64> = freqs
            .into_data()
            .convert::<f64>()
            .try_to_vec::<f64>()
            .expect("f64 values");
        let old = self.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (old / self.low_freq_factor, old / self.high_freq_factor);
        let scaled: Vec<f32> = values
            .iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let f = if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / self.factor
                } else {
                    let smooth = (old / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * f / self.factor + smooth * f
                };
                f as f32
            })
            .collect();
        let n = scaled.len();
        Tensor::from_data(burn::tensor::TensorData::new(scaled, [n]), &device)
    }
}

/// The rotary encoding of `max_seq` positions of heads of `head_dim` at base `theta`, its
/// frequencies scaled by `scaling` (Llama 3.1 - 3.3) if given.
pub(super) fn rotary(
    max_seq: usize,
    head_dim: usize,
    theta: f32,
    scaling: Option<Llama3RopeScaling>,
    device: &Device,
) -> RotaryEncoding {
    let config = RotaryEncodingConfig::new(max_seq, head_dim).with_theta(theta);
    match scaling {
        Some(scaling) => config.init_with_frequency_scaling(|f| scaling.apply(f), device),
        None => config.init(device),
    }
}
