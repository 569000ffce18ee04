//! The fused elementwise ops whose backward keeps only their input: layer norm and RMSNorm
//! (`norm.rs`), `act(gate) * up` (`swiglu.rs`: SwiGLU, GeGLU), dropout (`dropout.rs`: the masks of the
//! counter-based RNG, regenerated in the backward), the exact GELU's backward (`gelu.rs`); on
//! Flex, `activation_cpu.rs` runs the gate, the GELU and their backwards as one pass each and
//! `norm_cpu.rs` the norms and their backward (`cpu_math.rs`: the vectorized exponential and
//! loops; `flex_rows.rs`: the f32 views and parallel row writes the CPU kernels share).

pub(crate) mod activation_cpu;
pub(crate) mod cpu_math;
pub(crate) mod dropout;
pub(crate) mod flex_rows;
pub(crate) mod gelu;
pub(crate) mod norm;
pub(crate) mod norm_cpu;
pub(crate) mod swiglu;
