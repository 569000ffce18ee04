//! SplitMix64 (Steele, Lea and Flood, 2014): the one counter-based generator of burn-tp and its
//! examples. Dropout hashes `(seed, site, step, element)` through [`splitmix64`], so every rank
//! computes any part of a logical mask alone; sampling and the examples' batches draw from a
//! seeded [`SplitMix64`], so every rank draws the same values without communicating.
//!
//! The lowest floor of the crate: it imports nothing of it.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output for the state `z`: `z` advanced by the golden gamma, then mixed. A hash
/// of `z` good enough that `splitmix64(a ^ b)` keys a stream.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `z`'s top 53 bits as a uniform draw in `[0, 1)`.
pub fn unit_f64(z: u64) -> f64 {
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// A seeded SplitMix64 stream: the same draws on every rank from the same seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let z = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN);
        z
    }

    /// The next uniform draw in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference values of SplitMix64 from seed 1234567 (the generator's published test
    /// vector, as in Vigna's `splitmix64.c`), and the stream equal to the hash of its states.
    #[test]
    fn matches_the_reference_sequence() {
        let mut rng = SplitMix64::new(1_234_567);
        let want = [
            6_457_827_717_110_365_317u64,
            3_203_168_211_198_807_973,
            9_817_491_932_198_370_423,
            4_593_380_528_125_082_431,
            16_408_922_859_458_223_821,
        ];
        for w in want {
            assert_eq!(rng.next_u64(), w);
        }
        let mut rng = SplitMix64::new(99);
        assert_eq!(rng.next_u64(), splitmix64(99));
        assert_eq!(rng.next_u64(), splitmix64(99u64.wrapping_add(GOLDEN)));
        let u = SplitMix64::new(5).next_f64();
        assert!((0.0..1.0).contains(&u));
    }
}
