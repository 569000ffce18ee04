//! The attention kernels: causal attention by tiles without the `[s, t]` scores on the backend's
//! ops (`flash.rs`, with the diagram), the same tiles as one CPU kernel on Flex's storage
//! (`flash_cpu.rs`), which keys a query sees (`mask.rs`: the one visibility rule), and the
//! kernel over a ring of context-parallel ranks (`ring.rs`, with its diagram).

pub(crate) mod flash;
pub(crate) mod flash_cpu;
pub(crate) mod mask;
pub(crate) mod ring;
