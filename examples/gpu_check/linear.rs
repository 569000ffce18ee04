//! `ColumnParallelLinear` / `RowParallelLinear` against burn's `Linear` at 8192 (check 3).

use super::*;

pub(super) fn linear_8192(f: &mut Figures) -> Result<(), String> {
    const N: usize = 8192;
    // Compared on the first rows only: the whole output is 256 MiB a copy.
    const ROWS: usize = 64;
    let dev = cuda();
    let group = LocalGroup::new(1).map_err(|e| e.to_string())?.remove(0);
    let base32 = linear(values(N * N, 7), values(N, 8), N, N, &dev);
    let x32 = Tensor::<2>::from_data(TensorData::new(values(N * N, 9), [N, N]), &dev);
    let g32 = Tensor::<2>::from_data(TensorData::new(values(N * N, 10), [N, N]), &dev);
    // f32's y rows and dW rows, for bf16 to be compared against.
    let mut f32_outputs: Option<(Vec<f32>, Vec<f32>)> = None;
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        let tag = format!("{dtype:?}").to_lowercase();
        let base = cast_params(base32.clone(), dtype);
        let col =
            ColumnParallelLinear::from_full(&base, &group, &ColumnParallelLinearConfig::new(N, N))
                .map_err(|e| e.to_string())?;
        let row = RowParallelLinear::from_full(&base, &group, &RowParallelLinearConfig::new(N, N))
            .map_err(|e| e.to_string())?;
        let x = x32.clone().cast(dtype).require_grad();
        let g = g32.clone().cast(dtype);
        // Forward + backward with a dense upstream gradient `g` (loss `sum(y * g)`): three GEMMs.
        let step = |forward: &dyn Fn(Tensor<2>) -> Tensor<2>, weight: Tensor<2>| {
            let y = forward(x.clone());
            let grads = (y.clone() * g.clone()).sum().backward();
            let gw = weight.grad(&grads).expect("a weight gradient");
            let gx = x.grad(&grads).expect("an input gradient");
            (y, gw, gx)
        };
        // Timed up to the device's sync: every kernel queued has run (a read of one value
        // measured 0.48 ms for 3.3 TFLOP, 7x the H200's peak: it did not wait for them all).
        let timed = |forward: &dyn Fn(Tensor<2>) -> Tensor<2>, weight: Tensor<2>| {
            time(1, 5, || {
                let out = step(forward, weight.clone());
                dev.sync().expect("device sync");
                drop(out);
            })
        };
        let rows = |t: Tensor<2>| host(t.slice([0..ROWS, 0..N]));
        let t_burn = timed(&|x| base.forward(x), base.weight.val());
        let t_col = timed(&|x| col.forward(x), col.weight.val());
        let t_row = timed(&|x| row.forward(x), row.weight.val());
        let flops = 3.0 * 2.0 * (N as f64).powi(3);
        println!(
            "  {tag}: burn Linear {:.2} ms ({:.1} TFLOP/s), column {:.2} ms (x{:.3}), row {:.2} ms (x{:.3})",
            t_burn * 1e3,
            flops / t_burn / 1e12,
            t_col * 1e3,
            t_col / t_burn,
            t_row * 1e3,
            t_row / t_burn
        );
        f.num(format!("linear_8192.{tag}.burn_linear_ms"), t_burn * 1e3);
        f.num(format!("linear_8192.{tag}.column_ms"), t_col * 1e3);
        f.num(format!("linear_8192.{tag}.row_ms"), t_row * 1e3);
        f.num(
            format!("linear_8192.{tag}.column_over_burn"),
            t_col / t_burn,
        );
        f.num(format!("linear_8192.{tag}.row_over_burn"), t_row / t_burn);
        f.num(
            format!("linear_8192.{tag}.burn_tflops"),
            flops / t_burn / 1e12,
        );
        // No timing may beat the H200's dense bf16 peak (989 TFLOP/s): one that does did not
        // wait for the GPU, and its ratios mean nothing.
        let fastest = t_burn.min(t_col).min(t_row);
        if flops / fastest / 1e12 > 989.0 {
            return Err(format!(
                "{tag}: {:.0} TFLOP/s is above the H200's peak: the timing is not the GPU's",
                flops / fastest / 1e12
            ));
        }

        // Values: the layers against burn's Linear in the same dtype, and bf16 against f32.
        let (y_burn, gw_burn, gx_burn) = step(&|x| base.forward(x), base.weight.val());
        let (y_burn, gw_burn, gx_burn) = (rows(y_burn), rows(gw_burn), rows(gx_burn));
        for (name, (y, gw, gx)) in [
            ("column", step(&|x| col.forward(x), col.weight.val())),
            ("row", step(&|x| row.forward(x), row.weight.val())),
        ] {
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_dx_vs_burn"),
                rel_error(&rows(gx), &gx_burn),
                1e-3,
            )?;
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_y_vs_burn"),
                rel_error(&rows(y), &y_burn),
                1e-3,
            )?;
            expect_close(
                f,
                &format!("linear_8192.{tag}.{name}_dw_vs_burn"),
                rel_error(&rows(gw), &gw_burn),
                1e-3,
            )?;
        }
        match &f32_outputs {
            None => f32_outputs = Some((y_burn, gw_burn)),
            Some((y32, gw32)) => {
                expect_close(
                    f,
                    &format!("linear_8192.{tag}.y_vs_f32"),
                    rel_error(&y_burn, y32),
                    2e-2,
                )?;
                expect_close(
                    f,
                    &format!("linear_8192.{tag}.dw_vs_f32"),
                    rel_error(&gw_burn, gw32),
                    2e-2,
                )?;
            }
        }
    }
    Ok(())
}
