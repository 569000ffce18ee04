//! The Llama as the shared code sees it: its block ([`DecoderBlock`]) and its parts of
//! [`LanguageModel`] (the forward, the loss, decoding and stages are written once, in
//! `crate::model`).

use burn::tensor::{Int, Tensor};

use super::{Llama, LlamaBlock, LlamaConfig};
use crate::Result as TpResult;
use crate::attention::{DecodeCache, ParallelAttention};
use crate::decoder::DecoderBlock;
use crate::dropout::{DropoutKey, DropoutStep};
use crate::linear::TpMode;
use crate::model::{LanguageModel, count_params};
use crate::moe::RouterStats;

impl DecoderBlock for LlamaBlock {
    fn attention(&self) -> &ParallelAttention {
        &self.attn
    }

    fn attention_mut(&mut self) -> &mut ParallelAttention {
        &mut self.attn
    }

    fn attn_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.attn_norm.forward(x)
    }

    fn mlp_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.mlp_norm.forward(x)
    }

    fn mlp(&self, x: Tensor<3>) -> TpResult<Tensor<3>> {
        self.ffn(x)
    }
}

impl LanguageModel for Llama {
    crate::model::family_parts!("Llama", LlamaConfig, LlamaBlock);

    fn expert_params(&self) -> Vec<burn::module::ParamId> {
        let moe = self.blocks.iter().filter_map(|b| b.moe.as_ref());
        moe.flat_map(|m| crate::model::param_ids(&m.experts))
            .collect()
    }

    fn router_loss_experts(&self) -> usize {
        let on = self.options.router_loss != (0.0, 0.0);
        if on { self.options.routed_experts } else { 0 }
    }

    fn router_loss(&self, stats: &[RouterStats]) -> Option<Tensor<1>> {
        let (aux, z) = self.options.router_loss;
        crate::moe::router_loss(stats, aux, z)
    }

    fn final_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.norm.forward(x)
    }

    fn with_mode(self, mode: TpMode) -> Self {
        Llama::with_mode(self, mode)
    }

    fn embed(&self, ids: Tensor<2, Int>) -> TpResult<Tensor<3>> {
        let table = self.blocks.first().and_then(|b| b.attn.max_positions());
        crate::model::check_positions(Self::NAME, &ids, table)?;
        self.tok.try_forward(ids)
    }

    fn embed_new(&self, ids: Tensor<2, Int>, _cache: &DecodeCache) -> TpResult<Tensor<3>> {
        // Rotary positions are the attention's: the tokens alone here.
        self.tok.try_forward(ids)
    }

    fn layer(&self, index: usize, x: Tensor<3>, step: Option<DropoutStep>) -> TpResult<Tensor<3>> {
        let o = self.options;
        let key = step.map(|at| DropoutKey {
            seed: o.dropout_seed,
            at,
        });
        let block = crate::model::block_at(self, index)?;
        block.try_forward(x, key, o.dropout, index, &self.group, o.settings.mode)
    }

    fn logits_loss(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> TpResult<Tensor<1>> {
        Ok(self.loss_of_logits(logits, targets, None)?.mean)
    }

    fn param_sections(&self) -> [usize; 3] {
        [
            count_params(&self.tok),
            self.blocks.first().map_or(0, count_params),
            count_params(&self.norm) + self.head.as_ref().map_or(0, count_params),
        ]
    }

    fn block_params(&self, layer: usize) -> usize {
        self.block_params[layer]
    }
}
