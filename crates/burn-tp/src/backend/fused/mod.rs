//! The fused elementwise ops whose backward keeps only their input: layer norm and RMSNorm
//! (`norm.rs`), `act(gate) * up` (`swiglu.rs`: SwiGLU, GeGLU), dropout (`dropout.rs`: the masks of the
//! counter-based RNG, regenerated in the backward).

pub(crate) mod dropout;
pub(crate) mod norm;
pub(crate) mod swiglu;
