//! Column/RowParallelLinear: the layers against Burn's `Linear`, their autodiff, errors and the
//! fused layouts (parts of one column layer).
//!
//! | file           | what                                                                  |
//! |----------------|-----------------------------------------------------------------------|
//! | `burn_linear.rs` | the full grid, gathered outputs, init, async vs sync, odd inputs, against Burn's `Linear` |
//! | `autodiff.rs`  | gradcheck of the functional ops, ranks that differ in requires_grad, a trained Megatron MLP |
//! | `errors.rs`    | size errors naming the sizes                                          |
//! | `parts.rs`    | fused parts (QKV, gate / up)                              |

mod autodiff;
mod burn_linear;
mod errors;
mod parts;

use crate::common::{
    assert_close, chunk, device, f64s, quarters, rng_lock, run_linked, tensor, uniform,
};
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Device, Tensor, TensorData, activation::gelu};
use burn_tp::TpError;
use burn_tp::comm::{LocalGroup, ProcessGroup, ReduceOp};
use burn_tp::linear::{
    ColumnParallelLinear, ColumnParallelLinearConfig, LinearSpec, OverlapSchedule,
    RowParallelLinear, RowParallelLinearConfig, TpMode, TpSettings, column_parallel_linear,
    row_parallel_linear,
};
use burn_tp::local::run_local;
use burn_tp::ops::all_reduce;
use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};

pub(crate) const D_IN: usize = 12;

pub(crate) const D_OUT: usize = 12;

pub(crate) fn int_linear(seed: u64) -> Linear {
    Linear {
        weight: Param::from_tensor(tensor(
            quarters(D_IN * D_OUT, seed),
            [D_IN, D_OUT],
            DType::F32,
        )),
        bias: Some(Param::from_tensor(tensor(
            quarters(D_OUT, seed + 1),
            [D_OUT],
            DType::F32,
        ))),
    }
}

pub(crate) fn f64_tensor<const D: usize>(v: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    Tensor::from_data(
        TensorData::new(v, shape).convert::<f64>(),
        (&device(), DType::F64),
    )
}
