//! The host transport of the collectives: one dtype switch, dim-first moves, slicing
//! (`host.rs`), and the pooled output buffers that become the output tensors' storage
//! (`pool.rs`), the all-to-all with per-rank counts (`all_to_all.rs`), and the ring shift of
//! ring attention (`shift.rs`).

pub(crate) mod all_to_all;
pub(crate) mod host;
pub(crate) mod pool;
pub(crate) mod shift;
