//! The parallel linears as functions on tensors: shape checks, then the overlapped backend op
//! (`async_communication`) or the differentiable collectives composed with Burn's `linear`.

use burn::backend::Dispatch;
use burn::tensor::Tensor;
use burn::tensor::module::linear;
use burn_tp_comm::ProcessGroup;
use burn_tp_comm::profile::scope;

use crate::backend::{LinearSpec, TpBackend, TpMode};
use crate::error::check_divisible;
use crate::ops::{
    all_gather, copy_to_tp_region, gather_from_tp_region, into_tensor, reduce_from_tp_region,
    reduce_scatter,
};
use crate::{Result, TpError};

fn check_last(op: &'static str, dims: &[usize], want: usize) -> Result<()> {
    if dims.last() != Some(&want) {
        return Err(TpError::Shape {
            op,
            expected: format!("[.., {want}]"),
            got: dims.to_vec(),
        });
    }
    Ok(())
}

fn check_bias(op: &'static str, bias: Option<&Tensor<1>>, want: usize) -> Result<()> {
    match bias.map(|b| b.dims()[0]) {
        Some(d) if d != want => Err(TpError::Shape {
            op,
            expected: format!("bias [{want}]"),
            got: vec![d],
        }),
        _ => Ok(()),
    }
}

fn sequence_sharded(op: &'static str, dims: &[usize], expected: &str) -> Result<()> {
    if dims.len() < 2 {
        return Err(TpError::Shape {
            op,
            expected: expected.into(),
            got: dims.to_vec(),
        });
    }
    Ok(())
}

/// Column-parallel linear on this rank's shard: `weight [d_in, d_out/tp]`, `bias [d_out/tp]`.
///
/// # Shapes
/// - ALL_REDUCE: `[.., d_in] -> [.., d_out / tp]` (`[.., d_out]` with `gather_output`)
/// - REDUCE_SCATTER: `[s / tp, .., d_in] -> [s, .., d_out / tp]`
///
/// # Errors
/// [`TpError::Shape`] if the last dim is not `d_in`, the bias is not `[d_out / tp]`, or `D < 2` in
/// REDUCE_SCATTER mode; [`TpError::Config`] for `gather_output` in REDUCE_SCATTER mode; a
/// communication error.
pub fn column_parallel_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    const OP: &str = "ColumnParallelLinear";
    let [d_in, d_out_local] = weight.dims();
    check_last(OP, &x.dims(), d_in)?;
    check_bias(OP, bias.as_ref(), d_out_local)?;
    if spec.settings.mode == TpMode::ReduceScatter {
        sequence_sharded(OP, &x.dims(), "[s / tp, .., d_input]")?;
        if spec.gather_output {
            return Err(TpError::Config(format!(
                "{OP}: gather_output needs TpMode::AllReduce"
            )));
        }
    }
    let y = if spec.settings.async_communication {
        let out = <Dispatch as TpBackend>::tp_column_linear(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.map(Tensor::into_dispatch).into(),
            spec,
            group.clone(),
        );
        into_tensor(out)?
    } else {
        let _scope = scope("ColumnParallelLinear.forward (sync)");
        let x = match spec.settings.mode {
            TpMode::AllReduce => copy_to_tp_region(x, group),
            TpMode::ReduceScatter => all_gather(x, 0, group)?,
        };
        linear(x, weight, bias)
    };
    if spec.gather_output && group.world_size() > 1 {
        return gather_from_tp_region(y, D - 1, group);
    }
    Ok(y)
}

/// Row-parallel linear on this rank's shard: `weight [d_in/tp, d_out]`, `bias [d_out]`
/// (replicated, added once after the reduction).
///
/// # Shapes
/// - ALL_REDUCE: `[.., d_in / tp] -> [.., d_out]`
/// - REDUCE_SCATTER: `[s, .., d_in / tp] -> [s / tp, .., d_out]`
///
/// # Errors
/// [`TpError::Shape`] if the last dim is not `d_in / tp`, the bias is not `[d_out]`, or `D < 2` in
/// REDUCE_SCATTER mode; [`TpError::NotDivisible`] if `s % tp != 0` in REDUCE_SCATTER mode; a
/// communication error.
pub fn row_parallel_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    spec: LinearSpec,
    group: &ProcessGroup,
) -> Result<Tensor<D>> {
    const OP: &str = "RowParallelLinear";
    let tp = group.world_size();
    let dims = x.dims();
    let [d_in_local, d_out] = weight.dims();
    check_last(OP, &dims, d_in_local)?;
    check_bias(OP, bias.as_ref(), d_out)?;
    if spec.settings.mode == TpMode::ReduceScatter {
        sequence_sharded(OP, &dims, "[s, .., d_input / tp]")?;
        check_divisible(format!("{OP}: dim 0 (sequence) of the input"), dims[0], tp)?;
    }
    if spec.settings.async_communication {
        let out = <Dispatch as TpBackend>::tp_row_linear(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.map(Tensor::into_dispatch).into(),
            spec,
            group.clone(),
        );
        return into_tensor(out);
    }
    let _scope = scope("RowParallelLinear.forward (sync)");
    let partial = linear(x, weight, None);
    let y = match spec.settings.mode {
        TpMode::AllReduce => reduce_from_tp_region(partial, group)?,
        TpMode::ReduceScatter => reduce_scatter(partial, 0, group)?,
    };
    Ok(match bias {
        None => y,
        // In RS mode each rank adds the bias to its own sequence shard; copy_to_tp_region
        // sums the shards' bias gradients so the replicated bias stays identical.
        Some(b) if spec.settings.mode == TpMode::ReduceScatter => {
            y + copy_to_tp_region(b, group).unsqueeze::<D>()
        }
        Some(b) => y + b.unsqueeze::<D>(),
    })
}
