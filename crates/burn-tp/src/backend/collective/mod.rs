//! The host transport of the collectives: one dtype switch, dim-first moves, slicing
//! (`host.rs`), and the pooled output buffers that become the output tensors' storage
//! (`pool.rs`), and the all-to-all with per-rank counts (`all_to_all.rs`).

pub(crate) mod all_to_all;
pub(crate) mod host;
pub(crate) mod pool;
