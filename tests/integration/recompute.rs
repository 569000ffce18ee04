//! Full activation recompute (`burn_tp::recompute::loss_and_grads`: the forward keeps one tensor
//! per block, the backward recomputes each block) against the plain forward and backward: the
//! same loss and the same gradient of every parameter, for the GPT (tied and untied) and the
//! Llama (with dropout, whose masks the recomputation must regenerate), at tp 1 and at tp 2 in
//! both modes.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::dropout::DropoutStep;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;
use burn_tp::recompute::loss_and_grads;

use crate::common::{assert_close, device, f64s, rng_lock};

/// A run's loss and every parameter's gradient (`None`: no gradient).
type Run = (f64, Vec<Option<Vec<f64>>>);

/// Every parameter's gradient in `grads`, in the model's visiting order (`None`: no gradient).
fn grads_of<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Option<Vec<f64>>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Option<Vec<f64>>>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(self.0.get::<D>(param.id).map(f64s));
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

fn ids(seq: usize, batch: usize, seed: i64) -> Tensor<2, Int> {
    let v: Vec<i64> = (0..(seq * batch) as i64)
        .map(|i| (i * 7 + seed) % 23)
        .collect();
    Tensor::from_data(TensorData::new(v, [seq, batch]), &device())
}

/// The plain backward's and the recomputed backward's loss and gradients on every rank.
fn both<M: LanguageModel>(model: M) -> [Run; 2] {
    let (x, y) = (ids(8, 2, 1), ids(8, 2, 5));
    let step = Some(DropoutStep::new(3));
    let loss = model.loss(x.clone(), y.clone(), step).unwrap();
    let plain = GradientsParams::from_grads(loss.backward(), &model);
    let (loss_r, recomputed) = loss_and_grads(&model, x, y, step).unwrap();
    [
        (f64s(loss)[0], grads_of(&model, &plain)),
        (f64s(loss_r)[0], grads_of(&model, &recomputed)),
    ]
}

fn check(what: &str, per_rank: Vec<[Run; 2]>) {
    for (rank, [(loss, plain), (loss_r, recomputed)]) in per_rank.into_iter().enumerate() {
        assert_close(
            &[loss_r],
            &[loss],
            1e-6,
            &format!("{what} rank {rank} loss"),
        );
        assert_eq!(plain.len(), recomputed.len());
        let mut compared = 0;
        for (i, (p, r)) in plain.iter().zip(&recomputed).enumerate() {
            match (p, r) {
                (Some(p), Some(r)) => {
                    assert_close(r, p, 1e-5, &format!("{what} rank {rank} param {i}"));
                    compared += 1;
                }
                (None, None) => {}
                _ => panic!("{what} rank {rank} param {i}: a gradient on one side only"),
            }
        }
        assert!(compared > 10, "{what}: only {compared} gradients");
    }
}

#[test]
fn recomputed_blocks_give_the_plain_backwards_loss_and_gradients() {
    let _rng = rng_lock();
    for (tp, mode) in [
        (1, TpMode::AllReduce),
        (2, TpMode::AllReduce),
        (2, TpMode::ReduceScatter),
    ] {
        let settings = TpSettings::new().with_mode(mode);
        for tied in [false, true] {
            let out = run_local(tp, move |g| {
                let config = GptConfig::new(23, 8, 16, 4, 3)
                    .with_tie_embeddings(tied)
                    .with_settings(settings);
                both(config.init(&g, &device()).unwrap())
            })
            .unwrap();
            check(&format!("gpt tp {tp} {mode:?} tied {tied}"), out);
        }
        let out = run_local(tp, move |g| {
            let config = LlamaConfig::new(23, 8, 16, 4, 2, 3, 32)
                .with_dropout(0.2)
                .with_settings(settings);
            both(config.init(&g, &device()).unwrap())
        })
        .unwrap();
        check(&format!("llama tp {tp} {mode:?} dropout"), out);
    }
}
