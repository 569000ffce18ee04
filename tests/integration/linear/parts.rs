//! Contiguous parts (a fused QKV, a SwiGLU's gate / up): each part sharded on its own, the
//! replicas' gradients summed.

use super::*;

/// A fused column layer with contiguous parts (q: 4 heads, k and v: 2 heads each, heads of 2):
/// every rank holds its piece of each part (tp 1, 2) or, at tp 4, the k / v head its q heads
/// use, replicated on 2 ranks. Outputs equal the full `Linear`'s columns of that placement; the
/// weight gradient of each rank's columns equals the full gradient's (replicas: summed over the
/// ranks holding the block); `to_full` gives the original back; both modes, async and sync.
#[test]
fn fused_parts_shard_each_part_and_sum_replica_gradients() {
    use burn_tp::linear::FusedPart;
    let (d_in, n) = (4usize, 8usize);
    let parts = vec![
        FusedPart::new(8).with_blocks(Some(4)),
        FusedPart::new(4).with_blocks(Some(2)),
        FusedPart::new(4).with_blocks(Some(2)),
    ];
    let d_out = 16;
    let w_vals = uniform(d_in * d_out, 71);
    let b_vals = uniform(d_out, 72);
    let x_vals = uniform(n * d_in, 73);
    let v_vals = uniform(n * d_out, 74);
    // The full columns of each part rank r holds, as the layout says: q heads r*4/tp.., and the
    // k / v heads r*2/tp.. (tp <= 2) or head r / 2 (tp = 4).
    let columns = |tp: usize, r: usize| -> Vec<usize> {
        let q = (r * 8 / tp..(r + 1) * 8 / tp).collect::<Vec<_>>();
        let kv = |at: usize| -> Vec<usize> {
            if tp <= 2 {
                (at + r * 4 / tp..at + (r + 1) * 4 / tp).collect()
            } else {
                (at + (r / 2) * 2..at + (r / 2) * 2 + 2).collect()
            }
        };
        [q, kv(8), kv(12)].concat()
    };
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        for asynch in [true, false] {
            for tp in [1usize, 2, 4] {
                let (wv, bv, xv, vv, ch) = (
                    w_vals.clone(),
                    b_vals.clone(),
                    x_vals.clone(),
                    v_vals.clone(),
                    parts.clone(),
                );
                let out = run_local(tp, move |g| {
                    let (r, tp) = (g.rank(), g.world_size());
                    let full = Linear {
                        weight: burn::module::Param::from_tensor(tensor(
                            wv.clone(),
                            [d_in, d_out],
                            DType::F32,
                        )),
                        bias: Some(burn::module::Param::from_tensor(tensor(
                            bv.clone(),
                            [d_out],
                            DType::F32,
                        ))),
                    };
                    let config = ColumnParallelLinearConfig::new(d_in, d_out)
                        .with_settings(
                            TpSettings::new()
                                .with_mode(mode)
                                .with_async_communication(asynch),
                        )
                        .with_parts(ch.clone());
                    let layer = ColumnParallelLinear::from_full(&full, &g, &config).unwrap();
                    let x_full = tensor(xv.clone(), [n, d_in], DType::F32);
                    let x = if mode == TpMode::ReduceScatter {
                        chunk(x_full.clone(), tp, 0, r)
                    } else {
                        x_full.clone()
                    };
                    let y = layer.forward(x);
                    // This rank's share of the logical loss sum(y_full * v): replicated columns
                    // count 1 / (ranks holding them) on each.
                    let cols = columns(tp, r);
                    let share: Vec<f32> = cols
                        .iter()
                        .map(|&c| if c >= 8 && tp == 4 { 0.5 } else { 1.0 })
                        .collect();
                    let idx = Tensor::<1, burn::tensor::Int>::from_data(
                        TensorData::new(
                            cols.iter().map(|&c| c as i64).collect::<Vec<_>>(),
                            [cols.len()],
                        ),
                        &device(),
                    );
                    let v = tensor(vv.clone(), [n, d_out], DType::F32).select(1, idx.clone());
                    let scale = tensor(share, [cols.len()], DType::F32).unsqueeze::<2>();
                    let grads = (y.clone() * v * scale).sum().backward();
                    let gw = layer.weight.val().grad(&grads).unwrap();
                    let back = layer.to_full().unwrap();
                    let y_want = full.forward(x_full).select(1, idx.clone());
                    (
                        f64s(y),
                        f64s(y_want),
                        f64s(gw),
                        cols,
                        f64s(back.weight.val()),
                        f64s(back.bias.unwrap().val()),
                    )
                })
                .unwrap();
                // The full weight gradient of sum(y * v): x^T v.
                let gw_full = tensor(x_vals.clone(), [n, d_in], DType::F32)
                    .transpose()
                    .matmul(tensor(v_vals.clone(), [n, d_out], DType::F32));
                let gw_full = f64s(gw_full);
                for (r, (y, y_want, gw, cols, w_back, b_back)) in out.into_iter().enumerate() {
                    let tag = format!("{mode:?} async {asynch} tp {tp} rank {r}");
                    assert_close(&y, &y_want, 1e-6, &format!("{tag}: output"));
                    let want: Vec<f64> = (0..d_in)
                        .flat_map(|i| cols.iter().map(move |&c| (i, c)))
                        .map(|(i, c)| gw_full[i * d_out + c])
                        .collect();
                    assert_close(&gw, &want, 1e-5, &format!("{tag}: weight gradient"));
                    let w_orig: Vec<f64> = w_vals.iter().map(|&v| v as f64).collect();
                    let b_orig: Vec<f64> = b_vals.iter().map(|&v| v as f64).collect();
                    assert_eq!(w_back, w_orig, "{tag}: to_full weight");
                    assert_eq!(b_back, b_orig, "{tag}: to_full bias");
                }
            }
        }
    }
}
