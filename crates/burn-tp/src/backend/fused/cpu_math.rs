//! Scalar math the CPU kernels inline into their loops, written so that the loops vectorize
//! (libm's `expf` is a call per element).

/// `e^x`, vectorizable (Cephes' `expf`: `2^n e^r` with `|r| <= ln 2 / 2`, a degree-5
/// polynomial; relative error ~1e-7); 0 for `x` below -87.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `max` / `min`, not `clamp` (whose NaN and order checks keep the loop scalar).
    #[allow(clippy::manual_clamp)]
    let xc = x.max(-87.0).min(88.0);
    // Round to nearest through the 1.5 * 2^23 trick (no SSE4.1 `round` needed): `t`'s low
    // mantissa bits hold n, so 2^n is integer arithmetic on its bits (no float-to-int
    // conversion, whose saturating semantics keep the loop scalar).
    let t = xc.mul_add(LOG2E, 12_582_912.0);
    let n = t - 12_582_912.0;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let p = 1.987_569_1e-4f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 0.166_666_66);
    let p = p.mul_add(r, 0.5);
    let e = (p * r).mul_add(r, r) + 1.0;
    let scaled = e * f32::from_bits((t.to_bits().wrapping_sub(0x4B40_0000 - 127)) << 23);
    if x < -87.0 { 0.0 } else { scaled }
}

/// Runs `f` compiled for the widest vector unit this CPU has (AVX-512, else AVX2 with FMA, else
/// the build's baseline, SSE2 on x86-64): the kernels' loops, inlined into it, vectorize to that
/// width without building for one CPU (`-C target-cpu`), as gemm and Flex pick their kernels at
/// run time. The results do not depend on the width: Rust neither contracts `a * b + c` into
/// an FMA nor reassociates float sums, so each element's arithmetic is the same; the kernels'
/// explicit `mul_add`s are one rounding in the FMA unit and in libm's `fmaf` alike (the
/// baseline's, slow, on a CPU with neither AVX2 nor AVX-512).
///
/// Only what LLVM inlines into the target-feature function gets the width: pass `f` as
/// `#[inline(always)] || ..`, and mark what it calls per element `#[inline(always)]` too.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // Safety: the CPU has the features the function is compiled for (checked above).
            return unsafe { avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // Safety: as above.
            return unsafe { avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`exp`] against f64's over [-100, 100] (relative 2e-7; 0 below -87), and bit for bit the
    /// same whether the loop runs at the build's width or through [`simd`].
    #[test]
    fn exp_is_accurate_and_the_same_at_every_width() {
        let x: Vec<f32> = (0..20_001).map(|i| -100.0 + i as f32 * 0.01).collect();
        let plain: Vec<f32> = x.iter().map(|&v| exp(v)).collect();
        let mut wide = vec![0.0f32; x.len()];
        simd(|| {
            for (o, &v) in wide.iter_mut().zip(&x) {
                *o = exp(v);
            }
        });
        for ((&v, &p), &w) in x.iter().zip(&plain).zip(&wide) {
            assert_eq!(p.to_bits(), w.to_bits(), "exp({v}): {p} vs {w}");
            let want = (v as f64).exp();
            if v < -87.0 {
                assert_eq!(p, 0.0, "exp({v})");
            } else if v <= 88.0 {
                assert!(
                    ((p as f64) - want).abs() <= 2e-7 * want,
                    "exp({v}): {p} vs {want}"
                );
            }
        }
    }
}
