//! A simulated network link for [`LocalGroup`](crate::LocalGroup), so overlap can be measured
//! on one machine.

use std::time::Duration;

/// A simulated network link for [`LocalGroup`](crate::LocalGroup): a delivery is delayed by
/// `latency + bytes_received / bandwidth`, counted from the last peer's post. The delay is a
/// timed sleep, not a busy loop, so it costs no CPU and compute can overlap it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Per-message latency.
    pub latency: Duration,
    /// Bandwidth in bytes per second.
    pub bandwidth: f64,
}

impl LinkModel {
    /// A link of `gb_per_s` GB/s (10^9 bytes) and `latency_us` microseconds.
    pub fn new(gb_per_s: f64, latency_us: f64) -> Self {
        Self {
            latency: Duration::from_secs_f64(latency_us * 1e-6),
            bandwidth: gb_per_s * 1e9,
        }
    }

    pub(crate) fn delay(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth)
    }
}
