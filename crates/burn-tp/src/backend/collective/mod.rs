//! The host transport of the collectives: one dtype switch, dim-first moves, slicing
//! (`host.rs`), and the pooled output buffers that become the output tensors' storage
//! (`pool.rs`).

pub(crate) mod host;
pub(crate) mod pool;
