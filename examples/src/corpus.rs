//! Text and token ids: a built-in deterministic corpus or any UTF-8 text file, read through a
//! character vocabulary or through a Hugging Face model's own `tokenizer.json`.

use std::path::Path;

/// Sentences from a tiny grammar, chosen by a fixed-seed generator: nothing to download, the
/// same text on every machine, and structure (spelling, word order) a small model learns fast.
pub fn builtin(n_chars: usize) -> String {
    const SUBJECTS: [&str; 8] = [
        "the cat",
        "a dog",
        "the old man",
        "my sister",
        "a small bird",
        "the teacher",
        "our neighbour",
        "the fox",
    ];
    const VERBS: [&str; 8] = [
        "sees", "likes", "chases", "finds", "paints", "helps", "follows", "feeds",
    ];
    const OBJECTS: [&str; 8] = [
        "the ball",
        "a red apple",
        "the river",
        "some bread",
        "a green hat",
        "the garden",
        "two fish",
        "the moon",
    ];
    const ENDINGS: [&str; 4] = [".", " today.", " again.", " at night."];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        // xorshift64*: deterministic everywhere, no dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    };
    let mut text = String::with_capacity(n_chars + 64);
    while text.len() < n_chars {
        text.push_str(SUBJECTS[next(8)]);
        text.push(' ');
        text.push_str(VERBS[next(8)]);
        text.push(' ');
        text.push_str(OBJECTS[next(8)]);
        text.push_str(ENDINGS[next(4)]);
        text.push('\n');
    }
    text
}

/// A character vocabulary; the model's size is padded to a multiple of 24 (divisible by every
/// tp from 1 to 4, 6, 8 and 12), so one checkpoint fits each of them.
#[derive(Clone, Debug)]
pub struct Vocab {
    chars: Vec<char>,
}

/// The multiple the model vocabulary is padded to.
pub const VOCAB_MULTIPLE: usize = 24;

impl Vocab {
    /// The sorted distinct characters of `text`.
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self { chars }
    }

    /// Distinct characters.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The text of token ids (ids outside the vocabulary, such as the padding, are skipped).
    pub fn decode(&self, ids: &[i64]) -> String {
        ids.iter()
            .filter_map(|&i| usize::try_from(i).ok().and_then(|i| self.chars.get(i)))
            .collect()
    }

    /// Token ids of `text` (characters outside the vocabulary are skipped).
    pub fn encode(&self, text: &str) -> Vec<i64> {
        text.chars()
            .filter_map(|c| self.chars.binary_search(&c).ok().map(|i| i as i64))
            .collect()
    }
}

/// The file a Hugging Face model folder keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The files of a Hugging Face model folder that describe its tokenizer and generation (what an
/// export copies beside the weights so that `transformers` reads the same text).
pub const TOKENIZER_FILES: [&str; 5] = [
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
];

/// Copies the [`TOKENIZER_FILES`] that `from` has into `to`.
///
/// # Errors
/// A copy that fails, naming both paths.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<(), String> {
    for name in TOKENIZER_FILES {
        let (src, dst) = (from.join(name), to.join(name));
        if src.is_file() {
            std::fs::copy(&src, &dst)
                .map_err(|e| format!("copying {} to {}: {e}", src.display(), dst.display()))?;
        }
    }
    Ok(())
}

/// How text becomes token ids and back.
#[derive(Clone, Debug)]
pub enum Codec {
    /// Each distinct character of the text one id ([`Vocab`]).
    Chars(Vocab),
    /// A model's `tokenizer.json` (the `tokenizers` crate).
    Hf(Box<tokenizers::Tokenizer>),
}

impl Codec {
    /// The tokenizer of the Hugging Face model folder `dir` (its [`TOKENIZER_FILE`]), or `None`
    /// when it has none.
    ///
    /// # Errors
    /// A `tokenizer.json` that does not parse, naming its path.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, String> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        tokenizers::Tokenizer::from_file(&path)
            .map(|t| Some(Codec::Hf(Box::new(t))))
            .map_err(|e| format!("reading the tokenizer {}: {e}", path.display()))
    }

    /// Ids in use: every id is below this (a tokenizer's added tokens included).
    pub fn len(&self) -> usize {
        match self {
            Codec::Chars(v) => v.len(),
            Codec::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// The vocabulary of a model made for these ids: [`len`](Self::len) rounded up to
    /// [`VOCAB_MULTIPLE`].
    pub fn padded_len(&self) -> usize {
        self.len().div_ceil(VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token ids of `text`; `special` adds the tokenizer's own (such as Llama's `<s>`, as
    /// `transformers` does by default; characters have none).
    ///
    /// # Errors
    /// The tokenizer's error.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<i64>, String> {
        match self {
            Codec::Chars(v) => Ok(v.encode(text)),
            Codec::Hf(t) => t
                .encode(text, special)
                .map(|e| e.get_ids().iter().map(|&i| i64::from(i)).collect())
                .map_err(|e| format!("tokenizing {text:?}: {e}")),
        }
    }

    /// The text of `ids`; special tokens and ids the vocabulary lacks (such as the model's
    /// padding) are skipped.
    ///
    /// # Errors
    /// The tokenizer's error.
    pub fn decode(&self, ids: &[i64]) -> Result<String, String> {
        match self {
            Codec::Chars(v) => Ok(v.decode(ids)),
            Codec::Hf(t) => {
                let ids: Vec<u32> = ids
                    .iter()
                    .filter_map(|&i| u32::try_from(i).ok())
                    .filter(|&i| (i as usize) < self.len())
                    .collect();
                t.decode(&ids, true)
                    .map_err(|e| format!("decoding {ids:?}: {e}"))
            }
        }
    }
}

/// Entropy (nats) of the token frequencies: the loss of the best model that ignores context.
pub fn unigram_entropy(tokens: &[i64], vocab: usize) -> f64 {
    let mut counts = vec![0usize; vocab];
    tokens.iter().for_each(|&t| counts[t as usize] += 1);
    let n = tokens.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| c as f64 / n)
        .map(|p| -p * p.ln())
        .sum()
}

/// The text `train_gpt` and `learner_llama` train on (`data`, or the built-in corpus) as tokens:
/// through the imported model's `tokenizer.json` when `init_from` has one, else its characters
/// (in sorted order). Returns the codec (to decode samples) and the tokens.
///
/// # Errors
/// An unreadable file or tokenizer, as text.
pub fn load_tokens(
    data: Option<&Path>,
    init_from: Option<&Path>,
) -> Result<(Codec, Vec<i64>), String> {
    let text = match data {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?
        }
        None => builtin(200_000),
    };
    let hf_codec = match init_from {
        Some(dir) => Codec::from_model_dir(dir)?,
        None => None,
    };
    let codec = hf_codec.unwrap_or_else(|| Codec::Chars(Vocab::new(&text)));
    let tokens = codec.encode(&text, false)?;
    Ok((codec, tokens))
}

/// Whether `codec`'s tokens fit the vocabulary (`vocab_size`) of the model imported from `dir`:
/// an error naming both where they do not (the text's characters, or its tokenizer's size).
///
/// # Errors
/// As said.
pub fn check_fits(codec: &Codec, dir: &Path, vocab_size: usize) -> Result<(), String> {
    if codec.len() <= vocab_size {
        return Ok(());
    }
    let what = match codec {
        Codec::Chars(_) => format!("the text has {} distinct characters", codec.len()),
        Codec::Hf(_) => format!(
            "{} has {} tokens",
            dir.join(TOKENIZER_FILE).display(),
            codec.len()
        ),
    };
    Err(format!(
        "--init-from {}: {what}, more than the model's vocabulary of {vocab_size}",
        dir.display()
    ))
}
