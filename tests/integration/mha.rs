//! `ParallelAttention` against burn-nn's `MultiHeadAttention` sharded into it (`from_full`):
//! self-attention with a key padding mask and cross-attention over a memory of another length,
//! at tp 1, 2 and 4, both modes, the fused kernel (in tiles of 2, so the padding cuts tiles)
//! and the materialized path: the outputs, the input and memory gradients, and the query and
//! key weights' gradients; `to_full` gives burn-nn's module back.

use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use burn::tensor::{Bool, Tensor, TensorData};
use burn_tp::attention::{AttentionInput, ParallelAttention, ParallelAttentionConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::reshard::{Twin, TwinContext};

use crate::common::{
    assert_close, chunk, device, f64s, full_grads, param_values, rng_lock, uniform,
};

const D: usize = 16;
const H: usize = 4;
const B: usize = 3;
const S: usize = 8;
const T: usize = 4;

/// `[B, len]`, `true` past each row's real keys.
fn mask(lengths: [usize; B], len: usize) -> Tensor<2, Bool> {
    let v: Vec<bool> = lengths
        .iter()
        .flat_map(|&l| (0..len).map(move |j| j >= l))
        .collect();
    Tensor::from_data(TensorData::new(v, [B, len]), &device())
}

/// The key padding of a case: right padding (lengths 8, 5, 2 of S; 4, 2, 1 of T), or, with
/// `general`, padding anywhere (left padding, holes, none).
fn masks(cross: bool, general: bool) -> Tensor<2, Bool> {
    match (cross, general) {
        (false, false) => mask([8, 5, 2], S),
        (true, false) => mask([4, 2, 1], T),
        (false, true) => rows([
            [true, true, false, false, false, false, false, false],
            [false, true, false, true, false, false, true, false],
            [false; S],
        ]),
        (true, true) => rows([
            [true, false, false, false],
            [false, true, false, true],
            [false; T],
        ]),
    }
}

fn rows<const L: usize>(rows: [[bool; L]; B]) -> Tensor<2, Bool> {
    Tensor::from_data(TensorData::new(rows.concat(), [B, L]), &device())
}

/// What one side gives: output, dx, dmemory (cross only), the q and k weights' gradients,
/// all batch first and whole.
type Out = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// burn-nn's attention of `x` (`[B, S, D]`) over itself or `memory` (`[B, T, D]`), the loss
/// `sum(y * g)`.
fn reference(mha: &MultiHeadAttention, cross: bool, g: &Tensor<3>, general: bool) -> Out {
    let x = Tensor::<3>::from_data(TensorData::new(uniform(B * S * D, 1), [B, S, D]), &device())
        .require_grad();
    let m = Tensor::<3>::from_data(TensorData::new(uniform(B * T * D, 2), [B, T, D]), &device())
        .require_grad();
    let input = if cross {
        MhaInput::new(x.clone(), m.clone(), m.clone()).mask_pad(masks(cross, general))
    } else {
        MhaInput::self_attn(x.clone()).mask_pad(masks(cross, general))
    };
    let y = mha.forward(input).context;
    let grads = (y.clone() * g.clone()).sum().backward();
    (
        f64s(y),
        f64s(x.grad(&grads).unwrap()),
        if cross {
            f64s(m.grad(&grads).unwrap())
        } else {
            Vec::new()
        },
        f64s(mha.query.weight.val().grad(&grads).unwrap()),
        f64s(mha.key.weight.val().grad(&grads).unwrap()),
    )
}

#[allow(clippy::too_many_arguments)]
fn parallel(
    mha: &MultiHeadAttention,
    cross: bool,
    g: &Tensor<3>,
    tp: usize,
    mode: TpMode,
    fused: bool,
    general: bool,
) -> Vec<Out> {
    let (mha, g) = (mha.clone(), g.clone());
    run_local(tp, move |group| {
        let (r, n) = (group.rank(), group.world_size());
        let settings = TpSettings::new()
            .with_mode(mode)
            .with_fused_attention(fused)
            .with_attention_tile(2);
        let config = ParallelAttentionConfig::new(D, H)
            .with_causal(false)
            .with_settings(settings);
        let attn = ParallelAttention::from_full(&mha, &group, &config).unwrap();
        // Sequence first, this rank's rows in REDUCE_SCATTER mode.
        let rows = |t: Tensor<3>| match mode {
            TpMode::AllReduce => t,
            TpMode::ReduceScatter => chunk(t, n, 0, r),
        };
        let x =
            Tensor::<3>::from_data(TensorData::new(uniform(B * S * D, 1), [B, S, D]), &device());
        let m =
            Tensor::<3>::from_data(TensorData::new(uniform(B * T * D, 2), [B, T, D]), &device());
        let (x, m) = (
            rows(x.swap_dims(0, 1)).require_grad(),
            rows(m.swap_dims(0, 1)).require_grad(),
        );
        let input = if cross {
            AttentionInput::cross_attn(x.clone(), m.clone()).mask_pad(masks(cross, general))
        } else {
            AttentionInput::self_attn(x.clone()).mask_pad(masks(cross, general))
        };
        let y = attn.forward_input(input);
        let grads = (y.clone() * rows(g.clone().swap_dims(0, 1)))
            .sum()
            .backward();
        let full = full_grads(&attn, &grads);
        let dm = if cross {
            f64s(m.grad(&grads).unwrap().swap_dims(0, 1))
        } else {
            Vec::new()
        };
        (
            f64s(y.swap_dims(0, 1)),
            f64s(x.grad(&grads).unwrap().swap_dims(0, 1)),
            dm,
            f64s(full.qkv[0].to_full().unwrap().weight.val()),
            f64s(full.qkv[1].to_full().unwrap().weight.val()),
        )
    })
    .unwrap()
}

/// This rank's part of a whole batch-first tensor's values (its rows of dim 1 in REDUCE_SCATTER
/// mode).
fn part(whole: &[f64], len: usize, mode: TpMode, tp: usize, r: usize) -> Vec<f64> {
    if mode == TpMode::AllReduce {
        return whole.to_vec();
    }
    let t = Tensor::<3>::from_data(
        TensorData::new(
            whole.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            [B, len, whole.len() / (B * len)],
        ),
        &device(),
    );
    f64s(chunk(t, tp, 1, r))
}

#[test]
fn padded_self_and_cross_attention_equal_burn_nns_multi_head_attention_at_every_tp() {
    let _rng = rng_lock();
    device().seed(17);
    let mha = MultiHeadAttentionConfig::new(D, H)
        .with_dropout(0.0)
        .init(&device());
    let g = Tensor::<3>::from_data(TensorData::new(uniform(B * S * D, 3), [B, S, D]), &device());
    for (cross, general) in [(false, false), (true, false), (false, true), (true, true)] {
        let want = reference(&mha, cross, &g, general);
        for tp in [1usize, 2, 4] {
            for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
                for fused in [true, false] {
                    let out = parallel(&mha, cross, &g, tp, mode, fused, general);
                    for (r, (y, dx, dm, dq, dk)) in out.iter().enumerate() {
                        let tag = format!(
                            "cross {cross} general {general} tp {tp} {mode:?} fused {fused} rank {r}"
                        );
                        assert_close(
                            y,
                            &part(&want.0, S, mode, tp, r),
                            1e-5,
                            &format!("{tag}: y"),
                        );
                        assert_close(
                            dx,
                            &part(&want.1, S, mode, tp, r),
                            1e-5,
                            &format!("{tag}: dx"),
                        );
                        if cross {
                            assert_close(
                                dm,
                                &part(&want.2, T, mode, tp, r),
                                1e-5,
                                &format!("{tag}: dmemory"),
                            );
                        }
                        assert_close(dq, &want.3, 1e-4, &format!("{tag}: dW_q"));
                        assert_close(dk, &want.4, 1e-4, &format!("{tag}: dW_k"));
                    }
                }
            }
        }
    }
    // The masked keys matter: without the mask the output differs.
    let unmasked = mha.forward(MhaInput::self_attn(Tensor::<3>::from_data(
        TensorData::new(uniform(B * S * D, 1), [B, S, D]),
        &device(),
    )));
    assert!(
        f64s(unmasked.context)
            .iter()
            .zip(&reference(&mha, false, &g, false).0)
            .any(|(a, b)| (a - b).abs() > 1e-3)
    );
}

/// `to_full` gives burn-nn's module back (at tp 2, gathered), the same outputs; what does not
/// carry over is an error naming it.
#[test]
fn to_full_gives_burn_nns_attention_back_and_unsupported_settings_are_named() {
    let _rng = rng_lock();
    device().seed(18);
    let mha = MultiHeadAttentionConfig::new(D, H)
        .with_dropout(0.0)
        .init(&device());
    let m2 = mha.clone();
    let out = run_local(2, move |group| {
        let config = ParallelAttentionConfig::new(D, H).with_causal(false);
        let attn = ParallelAttention::from_full(&m2, &group, &config).unwrap();
        // The Twin impl: the same shards (its context non-causal by default, as burn-nn's).
        let twin = <ParallelAttention as Twin<MultiHeadAttention>>::from_twin(
            &m2,
            &TwinContext::new(&group),
        )
        .unwrap();
        assert_eq!(param_values(&twin), param_values(&attn));
        let back = attn.to_full().unwrap();
        let rope = ParallelAttention::from_full(
            &m2,
            &group,
            &config.clone().with_rope_theta(Some(1e4)).with_max_seq(8),
        )
        .unwrap_err()
        .to_string();
        let sizes = ParallelAttention::from_full(&m2, &group, &ParallelAttentionConfig::new(D, 2))
            .unwrap_err()
            .to_string();
        let gqa = ParallelAttentionConfig::new(D, H)
            .with_n_kv_heads(Some(2))
            .init(&group, &device())
            .unwrap()
            .to_full()
            .unwrap_err()
            .to_string();
        let bad_mask = attn
            .try_forward_input(
                AttentionInput::self_attn(Tensor::zeros([S, B, D], &device()))
                    .mask_pad(rows([[false; S], [true; S], [false; S]])),
                None,
                0,
            )
            .unwrap_err()
            .to_string();
        (back, rope, sizes, gqa, bad_mask)
    })
    .unwrap();
    let x = Tensor::<3>::from_data(TensorData::new(uniform(B * S * D, 5), [B, S, D]), &device());
    for (back, rope, sizes, gqa, bad_mask) in out {
        let (a, b) = (
            mha.forward(MhaInput::self_attn(x.clone())).context,
            back.forward(MhaInput::self_attn(x.clone())).context,
        );
        assert_close(&f64s(b), &f64s(a), 1e-6, "to_full's outputs");
        assert!(rope.contains("rope_theta"), "{rope}");
        assert!(
            sizes.contains("n_heads 2") && sizes.contains("/ 4"),
            "{sizes}"
        );
        assert!(gqa.contains("fewer key / value heads"), "{gqa}");
        assert!(
            bad_mask.contains("row 1") && bad_mask.contains("all padding"),
            "{bad_mask}"
        );
    }
}
