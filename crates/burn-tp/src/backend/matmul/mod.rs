//! The parallel linears' GEMMs: the overlapped forward and backward (`overlap.rs`, with the
//! diagram of the shards), a row-major strided product as a BLAS call (`gemm.rs`), the GEMM hook
//! on CUDA (`cublas.rs`, feature `cuda`).

#[cfg(feature = "cuda")]
pub(crate) mod cublas;
pub mod gemm;
pub(crate) mod overlap;
