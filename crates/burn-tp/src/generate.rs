//! Text generation with a KV cache: the prompt runs once, then each new token costs one
//! position's compute ([`LanguageModel::logits_cached`]). Greedy or sampled (temperature, top-k,
//! top-p), seeded: every rank gathers the same logits and draws with the same generator, so all
//! ranks pick the same tokens without communicating them.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp_comm::ProcessGroup;

use crate::attention::DecodeCache;
use crate::model::LanguageModel;
use crate::ops::gather_from_tp_region;
use crate::rng::SplitMix64;
use crate::{Result, TpError};

/// How [`generate`] picks tokens and when it stops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Sampling temperature; 0: greedy (the most likely token).
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities add up to `p` (nucleus).
    pub top_p: Option<f64>,
    /// Seed of the draws.
    pub seed: u64,
    /// Stop after generating this id.
    pub eos: Option<i64>,
    /// Reuse the keys and values of earlier positions (true); false recomputes the whole
    /// sequence for every new token (to compare against).
    pub kv_cache: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 16,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            eos: None,
            kv_cache: true,
        }
    }
}

/// The next token from the full vocabulary's `logits` under `options` (greedy at temperature 0;
/// else softmax at the temperature over the `top_k` most likely, cut to the `top_p` nucleus, one
/// draw of `rng`): the one sampler of burn-tp and its examples. Every rank draws the same token
/// from the same logits and stream.
pub fn sample_token(logits: &[f64], options: &GenerateOptions, rng: &mut SplitMix64) -> usize {
    let argmax = || {
        (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap_or(0)
    };
    if options.temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if let Some(k) = options.top_k {
        order.truncate(k.max(1));
    }
    let top = logits[order[0]];
    let mut probs: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] - top) / options.temperature).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(p) = options.top_p {
        let mut acc = 0.0;
        let keep = probs
            .iter()
            .position(|q| {
                acc += q;
                acc >= p
            })
            .map_or(probs.len(), |i| i + 1);
        order.truncate(keep);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u = rng.next_f64();
    for (i, p) in order.iter().zip(&probs) {
        if u < *p {
            return *i;
        }
        u -= p;
    }
    *order.last().unwrap_or(&0)
}

/// Generates up to `options.max_new_tokens` ids after `prompt` (one sequence) with `model`'s KV
/// cache; every rank of `group` (the model's) returns the same ids. Collective.
///
/// # Errors
/// [`TpError::Config`] for an empty prompt; as [`LanguageModel::logits_cached`] (the model in
/// ALL_REDUCE mode; positions past its context).
pub fn generate<M: LanguageModel>(
    model: &M,
    prompt: &[i64],
    options: &GenerateOptions,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Vec<i64>> {
    let mut rows = generate_batch(model, &[prompt.to_vec()], options, group, device)?;
    Ok(rows.remove(0))
}

/// Generates after each of `prompts` (of any lengths) at once, one batch: the prompts are
/// left-padded to the longest, each sequence's learned positions count from its first token
/// (rotary scores depend on position differences only) and no query sees its padding ([`DecodeCache::with_padding`]), so each row is what [`generate`] gives
/// for that prompt alone (sampled rows too: each row draws from its own generator of
/// `options.seed`). Each row stops at its own `options.eos` (its ids end there); the batch stops
/// when every row has. Collective; every rank returns the same ids.
///
/// # Errors
/// [`TpError::Config`] for no prompt or an empty one; as [`LanguageModel::logits_cached`].
pub fn generate_batch<M: LanguageModel>(
    model: &M,
    prompts: &[Vec<i64>],
    options: &GenerateOptions,
    group: &ProcessGroup,
    device: &Device,
) -> Result<Vec<Vec<i64>>> {
    generate_batch_with(model, prompts, options, group, device, &mut |_, _| {})
}

/// [`generate_batch`], calling `on_token(row, id)` for each new id as soon as it is picked (on
/// every rank: a caller streams from one), e.g. to print the text as it comes.
///
/// # Errors
/// As [`generate_batch`].
pub fn generate_batch_with<M: LanguageModel>(
    model: &M,
    prompts: &[Vec<i64>],
    options: &GenerateOptions,
    group: &ProcessGroup,
    device: &Device,
    on_token: &mut dyn FnMut(usize, i64),
) -> Result<Vec<Vec<i64>>> {
    if prompts.is_empty() {
        return Err(TpError::Config("generate: no prompt".into()));
    }
    if let Some(r) = prompts.iter().position(Vec::is_empty) {
        return Err(TpError::Config(format!(
            "generate: prompt {r} of {} is empty",
            prompts.len()
        )));
    }
    // Off autodiff: on an autodiff device a forward keeps its graph until a backward that never
    // comes (burn-tp's ops whose backward communicates are always tracked), every step's, for
    // the whole generation.
    let model = model.valid();
    let device = &device.clone().without_autodiff();
    let vocab = model.n_vocab();
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let padding: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    // Sequence-major `[s, b]` ids; the padding's ids are never seen (any id does).
    let padded: Vec<Vec<i64>> = prompts
        .iter()
        .zip(&padding)
        .map(|(p, &pad)| {
            std::iter::repeat_n(0, pad)
                .chain(p.iter().copied())
                .collect()
        })
        .collect();
    let columns = |rows: &[Vec<i64>], from: usize| -> Tensor<2, Int> {
        let s = rows[0].len() - from;
        let ids: Vec<i64> = (from..rows[0].len())
            .flat_map(|i| rows.iter().map(move |r| r[i]))
            .collect();
        Tensor::from_data(TensorData::new(ids, [s, rows.len()]), device)
    };
    let mut cache = DecodeCache::with_padding(padding.clone());
    let mut rngs: Vec<SplitMix64> = (0..b).map(|_| SplitMix64::new(options.seed)).collect();
    // Each row's sequence so far (a finished row repeats its last id: never read).
    let mut seqs = padded.clone();
    let mut out: Vec<Vec<i64>> = vec![Vec::new(); b];
    let mut done = vec![false; b];
    let mut fed = 0;
    for _ in 0..options.max_new_tokens {
        if !options.kv_cache {
            cache = DecodeCache::with_padding(padding.clone());
            fed = 0;
        }
        let ids = columns(&seqs, fed);
        fed = seqs[0].len();
        let logits = model.last_logits_cached(ids, &mut cache)?; // [1, b, V_p / tp]
        let last = gather_from_tp_region(logits, 2, group)?;
        let last: Vec<f64> = last
            .narrow(2, 0, vocab)
            .into_data()
            .convert::<f64>()
            .try_to_vec::<f64>()
            .map_err(|e| TpError::Config(format!("generate: reading the logits: {e:?}")))?;
        for (r, seq) in seqs.iter_mut().enumerate() {
            let mut id = *seq.last().expect("a prompt is not empty");
            if !done[r] {
                id = sample_token(&last[r * vocab..(r + 1) * vocab], options, &mut rngs[r]) as i64;
                out[r].push(id);
                on_token(r, id);
                done[r] = options.eos == Some(id);
            }
            seq.push(id);
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_follow_temperature_top_k_and_top_p() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let greedy = GenerateOptions::default();
        assert_eq!(sample_token(&logits, &greedy, &mut SplitMix64::new(1)), 1);
        // top-k 1 is greedy at any temperature.
        let k1 = GenerateOptions {
            temperature: 5.0,
            top_k: Some(1),
            ..greedy
        };
        for seed in 0..20 {
            assert_eq!(sample_token(&logits, &k1, &mut SplitMix64::new(seed)), 1);
        }
        // top-k 2 draws only the two best, both over many seeds.
        let k2 = GenerateOptions {
            temperature: 1.0,
            top_k: Some(2),
            ..greedy
        };
        let drawn: std::collections::BTreeSet<usize> = (0..200)
            .map(|s| sample_token(&logits, &k2, &mut SplitMix64::new(s)))
            .collect();
        assert_eq!(drawn, [1, 3].into());
        // A small nucleus keeps the best token only (its probability alone passes p).
        let p = GenerateOptions {
            temperature: 0.1,
            top_p: Some(0.5),
            ..greedy
        };
        for seed in 0..20 {
            assert_eq!(sample_token(&logits, &p, &mut SplitMix64::new(seed)), 1);
        }
        // Seeded: the same seed, the same draws.
        let t = GenerateOptions {
            temperature: 2.0,
            ..greedy
        };
        let draws = |seed| -> Vec<usize> {
            let mut rng = SplitMix64::new(seed);
            (0..10)
                .map(|_| sample_token(&logits, &t, &mut rng))
                .collect()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
    }
}
