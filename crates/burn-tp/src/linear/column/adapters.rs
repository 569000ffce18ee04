//! A column layer's LoRA adapters ([`ColumnLora`], `linear/lora.rs`): put on (drawn, or read
//! from a PEFT folder), sharded and gathered with the weight, merged into it, the base held
//! quantized (QLoRA).

use burn::module::Param;
use burn::tensor::Tensor;

use super::{ColumnParallelLinear, gather_columns};
use crate::TpError;
use crate::init::{init_replicated, owned, shard};
use crate::linear::lora::{ColumnLora, dense, merged_param, quantized_param};
use crate::ops::all_gather;

impl ColumnParallelLinear {
    /// The layer with low-rank adapters of rank `rank` on parts `parts` (indices into
    /// [`parts`](Self::parts); `[0]` for an unfused layer), scaled by `alpha / rank`: each `A`
    /// drawn as PEFT draws `lora_A` (Kaiming-uniform over `d_input`), the same at every tp
    /// (drawn on rank 0, broadcast), each `B` zero, so the layer's output is unchanged. The
    /// weight and bias are frozen. Collective over the layer's group.
    ///
    /// # Errors
    /// [`TpError::Config`] naming the values: a rank of 0, a part the layer does not have,
    /// `gather_output`; a communication error.
    pub fn with_lora(self, parts: &[usize], rank: usize, alpha: f64) -> crate::Result<Self> {
        let n_parts = self.parts.len().max(1);
        if rank == 0 || parts.is_empty() || parts.iter().any(|&p| p >= n_parts) {
            return Err(TpError::Config(format!(
                "ColumnParallelLinear LoRA: rank {rank} on parts {parts:?} of a layer of \
                 {n_parts} part(s) (a rank of at least 1, on parts it has)"
            )));
        }
        if self.spec.gather_output {
            return Err(TpError::Config(
                "ColumnParallelLinear LoRA: not on a layer with gather_output".into(),
            ));
        }
        let [d_input, _] = self.weight.dims();
        let device = self.weight.device();
        let dtype = dense(self.weight.val()).dtype();
        let d_output: usize = match self.parts.is_empty() {
            true => self.weight.dims()[1] * self.group.world_size(),
            false => self.parts.iter().map(|c| c.width).sum(),
        };
        let init = crate::linear::lora_init();
        let mut a = Vec::with_capacity(parts.len());
        let mut b = Vec::with_capacity(parts.len());
        for &p in parts {
            let draw = init_replicated(
                &init,
                [d_input, rank],
                Some(d_input),
                Some(rank),
                &self.group,
                &device,
            )?;
            a.push(draw.cast(dtype));
            b.push(Tensor::<2>::zeros(
                [rank, self.part_width(p, d_output)],
                (&device, dtype),
            ));
        }
        let lora = self.shard_lora(a, b, parts.to_vec(), alpha / rank as f64);
        Ok(self.frozen().with_adapters(lora))
    }

    /// The layer with adapters of the given full factors (`A [d_input, r]`, `B [r, part
    /// width]` per adapted part: a PEFT adapter read from disk), this rank keeping its columns
    /// of each B; the weight and bias frozen. No communication.
    ///
    /// # Errors
    /// [`TpError::Config`] naming the shapes: factors that do not fit the layer's parts.
    pub fn with_lora_factors(
        self,
        parts: Vec<usize>,
        a: Vec<Tensor<2>>,
        b: Vec<Tensor<2>>,
        scale: f64,
    ) -> crate::Result<Self> {
        let [d_input, _] = self.weight.dims();
        let d_output: usize = match self.parts.is_empty() {
            true => self.weight.dims()[1] * self.group.world_size(),
            false => self.parts.iter().map(|c| c.width).sum(),
        };
        let n_parts = self.parts.len().max(1);
        let rank = a.first().map_or(0, |a| a.dims()[1]);
        for ((a, b), &p) in a.iter().zip(&b).zip(&parts) {
            let width = self.part_width(p.min(n_parts - 1), d_output);
            if p >= n_parts || a.dims() != [d_input, rank] || b.dims() != [rank, width] {
                return Err(TpError::Config(format!(
                    "ColumnParallelLinear LoRA: factors {:?} and {:?} on part {p} of a layer \
                     whose part is [{d_input} -> {width}] (A [{d_input}, r], B [r, {width}], \
                     r = {rank})",
                    a.dims(),
                    b.dims()
                )));
            }
        }
        if rank == 0 || a.len() != parts.len() || b.len() != parts.len() {
            return Err(TpError::Config(format!(
                "ColumnParallelLinear LoRA: {} A and {} B factors for parts {parts:?}, rank {rank}",
                a.len(),
                b.len()
            )));
        }
        let lora = self.shard_lora(a, b, parts, scale);
        Ok(self.frozen().with_adapters(lora))
    }

    /// This layer's adapters from full factors (`A [d_input, r]`, `B [r, part width]` per
    /// adapter): A whole, this rank's columns of B.
    pub(super) fn shard_lora(
        &self,
        a: Vec<Tensor<2>>,
        b: Vec<Tensor<2>>,
        parts: Vec<usize>,
        scale: f64,
    ) -> ColumnLora {
        let b = b
            .into_iter()
            .zip(&parts)
            .map(|(full, &p)| {
                let local = match self.parts.is_empty() {
                    true => shard(full, 1, &self.group),
                    false => {
                        let piece = &self.placement[p];
                        let start = self.part_start(p);
                        owned(full.narrow(1, piece.full.start - start, piece.full.len()))
                    }
                };
                Param::from_tensor(local)
            })
            .collect();
        ColumnLora {
            a: a.into_iter()
                .map(|t| Param::from_tensor(owned(t)))
                .collect(),
            b,
            parts,
            scale,
        }
    }

    /// The adapters' full factors (A, B's columns gathered over tp, their parts and scale),
    /// detached. Collective.
    #[allow(clippy::type_complexity)]
    pub(super) fn full_lora(
        &self,
    ) -> crate::Result<Option<(Vec<Tensor<2>>, Vec<Tensor<2>>, Vec<usize>, f64)>> {
        let Some(l) = &self.lora else {
            return Ok(None);
        };
        let placements = (!self.parts.is_empty())
            .then(|| self.placements())
            .transpose()?;
        let b = l
            .b
            .iter()
            .zip(&l.parts)
            .map(|(b, &p)| -> crate::Result<_> {
                let b = b.val();
                let full = match &placements {
                    None => owned(all_gather(b, 1, &self.group)?),
                    Some(all) => {
                        // This rank's columns of the part, gathered with every rank's and
                        // placed as the weight's are; then the part's own columns.
                        let [rank, _] = b.dims();
                        let local = self.placement.iter().map(|q| q.local.len()).sum();
                        let cols = self.placement[p].local.clone();
                        let padded = Tensor::<2>::zeros([rank, local], (&b.device(), b.dtype()))
                            .slice_assign([0..rank, cols], b);
                        let whole = gather_columns(padded, 1, &self.group, Some(all))?;
                        let start = self.part_start(p);
                        owned(whole.narrow(1, start, self.parts[p].width))
                    }
                };
                Ok(full)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let a = l.a.iter().map(|a| owned(a.val())).collect();
        Ok(Some((a, b, l.parts.clone(), l.scale)))
    }

    /// The layer with its adapters merged into its weight (`W + scale * A B`, this rank's
    /// columns of each part) and removed: a plain layer, as PEFT's `merge_and_unload` (the
    /// weight frozen as it was). No communication.
    pub fn merge_lora(self) -> Self {
        let Some(lora) = &self.lora else {
            return self;
        };
        let weight = dense(self.weight.val()).detach();
        let mut merged = weight.clone();
        for ((a, b), &p) in lora.a.iter().zip(&lora.b).zip(&lora.parts) {
            let cols = self.placement[p].local.clone();
            let delta = a
                .val()
                .detach()
                .matmul(b.val().detach())
                .mul_scalar(lora.scale);
            let [d_input, _] = weight.dims();
            let part = merged.clone().slice([0..d_input, cols.clone()]) + delta;
            merged = merged.slice_assign([0..d_input, cols], part);
        }
        Self {
            weight: merged_param(&self.weight, merged),
            lora: None,
            ..self
        }
    }

    /// QLoRA: the frozen weight held quantized with `scheme` (this rank's shard over its own
    /// range), dequantized at each use; the adapters stay as they are. No communication.
    pub fn quantize_base(self, scheme: &burn::tensor::quantization::QuantScheme) -> Self {
        Self {
            weight: quantized_param(self.weight, scheme),
            ..self
        }
    }

    /// The layer with its weight and bias frozen (no gradient, no optimizer state).
    pub(super) fn frozen(self) -> Self {
        Self {
            weight: self.weight.set_require_grad(false),
            bias: self.bias.map(|b| b.set_require_grad(false)),
            ..self
        }
    }

    pub(super) fn with_adapters(self, lora: ColumnLora) -> Self {
        Self {
            lora: Some(lora),
            ..self
        }
    }
}
