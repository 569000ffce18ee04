//! Character-level data: a built-in deterministic corpus or any UTF-8 text file.

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

    /// The model's vocabulary size: [`len`](Self::len) rounded up to [`VOCAB_MULTIPLE`].
    pub fn padded_len(&self) -> usize {
        self.len().div_ceil(VOCAB_MULTIPLE) * VOCAB_MULTIPLE
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

/// Entropy (nats) of the character frequencies: the loss of the best model that ignores context.
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
