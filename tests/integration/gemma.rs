//! Gemma's training path: the loss and every gradient at tp 1, 2 and 4, both modes, the CPU
//! attention kernel on tiles shorter than the sequence, against the same model at tp 1 with the
//! materialized attention (Burn's own ops, differentiated by Burn's autodiff: independent of the
//! kernel's backward). Dropout on, soft caps on the scores and the logits (Gemma 2's), a score
//! scale of its own, sliding and full layers, two key / value heads (sharded at tp 2, replicated at tp 4). Its forward is held
//! to transformers' values by the fixtures of `hf::import`.

use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::dropout::DropoutStep;
use burn_tp::gemma::{GemmaConfig, LayerType};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;

use crate::common::{assert_close, device, f64s, full_grads, param_values, rng_lock, token_ids};

const V: usize = 13;
const S: usize = 8;
const B: usize = 2;

fn config(settings: TpSettings) -> GemmaConfig {
    // 4 heads of 8 over a width of 16, GeGLU width 24.
    GemmaConfig::new(V, S, 16, 4, 2, 3, 24, 8)
        .with_layer_types(vec![
            LayerType::Sliding,
            LayerType::Full,
            LayerType::Sliding,
        ])
        .with_sliding_window(Some(3))
        .with_rope_theta(500.0)
        .with_rope_local_theta(50.0)
        .with_query_pre_attn_scalar(Some(6.0))
        .with_final_logit_softcap(Some(4.0))
        .with_attn_logit_softcap(Some(1.5))
        .with_dropout(0.1)
        .with_settings(settings)
}

/// `(loss, every full gradient)` of the model `config(settings)` at `tp` on rank 0 (the model
/// drawn from seed 5, so the same at every tp).
fn loss_and_grads(tp: usize, settings: TpSettings) -> (Vec<f64>, Vec<Vec<f64>>) {
    device().seed(5);
    let out = run_local(tp, move |g| {
        let model = config(settings).init(&g, &device()).unwrap();
        let ids = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [S, B]), &device());
        let x = token_ids(S * B, V, 5, 1);
        let y = token_ids(S * B, V, 7, 3);
        let loss = LanguageModel::loss(&model, ids(x), ids(y), Some(DropoutStep::new(2))).unwrap();
        let grads = loss.backward();
        (f64s(loss), param_values(&full_grads(&model, &grads)))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn gemma_gradients_are_the_same_at_every_tp_mode_and_kernel() {
    let _rng = rng_lock();
    let (want_loss, want) = loss_and_grads(1, TpSettings::new().with_fused_attention(false));
    for (i, g) in want.iter().enumerate() {
        assert!(g.iter().any(|v| v.abs() > 1e-7), "gradient {i} is zero");
    }
    for tp in [1usize, 2, 4] {
        for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
            let settings = TpSettings::new().with_mode(mode).with_attention_tile(2);
            let (loss, grads) = loss_and_grads(tp, settings);
            let tag = format!("tp {tp} {mode:?}");
            assert_close(&loss, &want_loss, 1e-5, &format!("{tag}: loss"));
            assert_eq!(grads.len(), want.len(), "{tag}");
            for (i, (got, w)) in grads.iter().zip(&want).enumerate() {
                assert_close(got, w, 1e-4, &format!("{tag}: gradient {i}"));
            }
        }
    }
}

/// The soft-capped head and its cross-entropy (Gemma's final norm, the tied vocabulary-parallel
/// logits, `cap * tanh(logits / cap)`, the sharded cross-entropy) pass a finite-difference
/// gradcheck in f64 at tp 2, through the last block's output.
#[test]
fn gemmas_capped_head_and_loss_pass_a_finite_difference_gradcheck() {
    use burn::tensor::{DType, FloatDType};
    use burn_tp::precision::cast_params;
    use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};

    use crate::common::{tensor, uniform};

    let _rng = rng_lock();
    device().seed(6);
    let reports = run_local(2, |g| {
        let model = config(TpSettings::new()).init(&g, &device()).unwrap();
        let model = cast_params(model, FloatDType::F64);
        let x = tensor(uniform(S * B * 16, 8), [S, B, 16], DType::F64).mul_scalar(4.0);
        let y = Tensor::<2, Int>::from_data(
            TensorData::new(token_ids(S * B, V, 7, 3), [S, B]),
            &device(),
        );
        let options = GradcheckOptions {
            replicated_inputs: true,
            ..GradcheckOptions::default()
        };
        gradcheck(&g, &[x], LossKind::Replicated, options, |xs| {
            model.head_loss(xs[0].clone(), y.clone()).unwrap()
        })
    })
    .unwrap();
    for (r, report) in reports.into_iter().enumerate() {
        let report = report.unwrap();
        assert!(report.checked > 0, "rank {r}: {report:?}");
    }
}

/// A config whose layer types do not fit its layers, or a soft cap that is not a positive
/// number, is an error naming the values, before any communication.
#[test]
fn bad_gemma_configs_are_errors_naming_the_values() {
    let _rng = rng_lock();
    let cases: [(GemmaConfig, &str); 4] = [
        (
            config(TpSettings::new()).with_layer_types(vec![LayerType::Full]),
            "1 layer_types for n_layers = 3",
        ),
        (
            config(TpSettings::new()).with_attn_logit_softcap(Some(0.0)),
            "attn_logit_softcap = 0",
        ),
        (
            config(TpSettings::new()).with_final_logit_softcap(Some(f64::NAN)),
            "final_logit_softcap = NaN",
        ),
        (
            config(TpSettings::new()).with_query_pre_attn_scalar(Some(-1.0)),
            "query_pre_attn_scalar = -1",
        ),
    ];
    for (c, named) in cases {
        let e = run_local(2, move |g| {
            c.init(&g, &device()).map(|_| ()).unwrap_err().to_string()
        })
        .unwrap();
        assert!(e.iter().all(|e| e.contains(named)), "{named}: {e:?}");
    }
}
