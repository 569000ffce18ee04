//! The Llama's mixtures of experts split over an expert-parallel group and gathered back
//! ([`crate::moe`]).

use burn_tp_comm::ProcessGroup;

use super::{Llama, LlamaBlock};
use crate::Result as TpResult;
use crate::moe::MoeLayer;

impl Llama {
    /// The model with each MoE layer's experts split over `ep` ([`MoeLayer::keep_experts`]):
    /// from a model built or loaded at ep = 1, identical on the ep ranks. No communication.
    ///
    /// # Errors
    /// As [`MoeLayer::keep_experts`].
    pub fn expert_parallel(mut self, ep: &ProcessGroup) -> TpResult<Self> {
        self.blocks = self
            .blocks
            .into_iter()
            .map(|b| {
                Ok(LlamaBlock {
                    moe: b.moe.map(|m| m.keep_experts(ep)).transpose()?,
                    ..b
                })
            })
            .collect::<TpResult<_>>()?;
        Ok(self)
    }

    /// The model with every MoE layer's experts on every ep rank again
    /// ([`MoeLayer::gather_experts`]). Collective over ep.
    ///
    /// # Errors
    /// A communication error.
    pub fn gather_experts(mut self) -> TpResult<Self> {
        self.blocks = self
            .blocks
            .into_iter()
            .map(|b| {
                Ok(LlamaBlock {
                    moe: b.moe.map(MoeLayer::gather_experts).transpose()?,
                    ..b
                })
            })
            .collect::<TpResult<_>>()?;
        Ok(self)
    }
}
