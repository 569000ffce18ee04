//! Scalar math the CPU kernels inline into their loops, written so that the loops vectorize
//! (libm's `expf` is a call per element).

/// `e^x`, vectorizable (Cephes' `expf`: `2^n e^r` with `|r| <= ln 2 / 2`, a degree-5
/// polynomial; relative error ~1e-7); 0 for `x` below -87.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    // Round to nearest through the 1.5 * 2^23 trick (no SSE4.1 `round` needed).
    let n = (xc * LOG2E + 12_582_912.0) - 12_582_912.0;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_66;
    let p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scaled = e * f32::from_bits(((n as i32 + 127) << 23) as u32);
    if x < -87.0 { 0.0 } else { scaled }
}
