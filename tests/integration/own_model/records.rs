//! Burn record files in and out of a model of one's own (`load_burn_record`,
//! `save_burn_record`), and a padded Llama's record at any tp.

use burn::module::Module;
use burn::nn::LinearConfig;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Tensor;
use burn_tp::comm::{LocalGroup, ProcessGroup};
use burn_tp::linear::TpMode;
use burn_tp::local::run_ranks;

use super::{D, MyMlp, PlainMlp, batch, held_out_loss, loss_of, rows};
use crate::common::{assert_close, device, rng_lock};

/// A plain burn-nn model's record file loaded into the parallel model at tp 2 (each rank its
/// slices), trained there, written back as a Burn record, loaded by burn-nn's own
/// `Module::load_file` with the parallel model's held-out loss, and read again at tp 1; a
/// record of another model is refused, naming the tensor.
#[test]
fn a_burn_nn_record_loads_into_the_parallel_model_and_is_written_back_as_one() {
    use burn_tp::checkpoint::{load_burn_record, save_burn_record};
    let _rng = rng_lock();
    let dir = std::env::temp_dir().join(format!("burn-tp-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plain_file, trained_file) = (dir.join("plain.bpk"), dir.join("trained.bpk"));
    device().seed(21);
    let plain = PlainMlp::new();
    let held_out = |y: Tensor<3>| loss_of(y).into_scalar::<f64>();
    let plain_loss = held_out(plain.forward(batch(9, 0, 1)));
    plain.clone().save_file(&plain_file).unwrap();
    let mode = TpMode::ReduceScatter;
    let eval = move |m: &MyMlp, g: &ProcessGroup| held_out_loss(m, mode, g);
    device().seed(22);
    let (pf, tf) = (plain_file.clone(), trained_file.clone());
    let tp2 = run_ranks(LocalGroup::new(2).unwrap(), move |g| {
        let fresh = MyMlp::new(mode, &g);
        let before = eval(&fresh, &g);
        let mut model = load_burn_record(fresh, &pf, &g).unwrap();
        let loaded = eval(&model, &g);
        let mut optim = AdamWConfig::new().init();
        for step in 0..2 {
            let loss = loss_of(model.forward(rows(batch(step, 0, 1), mode, &g)));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        save_burn_record(&model, &tf, &g).unwrap();
        (before, loaded, eval(&model, &g))
    })
    .unwrap();
    for (r, (before, loaded, _)) in tp2.iter().enumerate() {
        assert!(
            (before - plain_loss).abs() > 1e-4,
            "rank {r}: a fresh model is another"
        );
        assert_close(
            &[*loaded],
            &[plain_loss],
            1e-5,
            &format!("rank {r}: loaded"),
        );
    }
    let trained_loss = tp2[0].2;
    assert!(
        (trained_loss - plain_loss).abs() > 1e-5,
        "the steps moved it"
    );
    // burn-nn reads what the parallel model wrote.
    let back = PlainMlp::new().load_file(&trained_file);
    let back_loss = held_out(back.forward(batch(9, 0, 1)));
    assert_close(
        &[back_loss],
        &[trained_loss],
        1e-5,
        "burn-nn's load of the written record",
    );
    // And at tp 1.
    let tf = trained_file.clone();
    let tp1 = run_ranks(LocalGroup::new(1).unwrap(), move |g| {
        let model = load_burn_record(MyMlp::new(mode, &g), &tf, &g).unwrap();
        eval(&model, &g)
    })
    .unwrap();
    assert_close(&tp1, &[trained_loss], 1e-5, "the written record at tp 1");
    // A record of another model: its fc1 is 16 -> 32, not 16 -> 64.
    let other_file = dir.join("other.bpk");
    let mut other = PlainMlp::new();
    other.fc1 = LinearConfig::new(D, 2 * D).init(&device());
    other.save_file(&other_file).unwrap();
    let err = run_ranks(LocalGroup::new(1).unwrap(), move |g| {
        load_burn_record(MyMlp::new(mode, &g), &other_file, &g)
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(
        err[0].contains("fc1.weight") && err[0].contains("[16, 32]") && err[0].contains("[16, 64]"),
        "{}",
        err[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Llama of 23 ids (padded at tp 2, key / value heads split) written as a Burn record at tp 1
/// and read at tp 2 and 4 (replicated key / value heads at 4): the tp 1 loss at every tp.
#[test]
fn a_burn_record_of_a_padded_llama_reads_at_any_tp() {
    use burn::tensor::{Int, TensorData};
    use burn_tp::checkpoint::{load_burn_record, save_burn_record};
    use burn_tp::llama::LlamaConfig;
    let _rng = rng_lock();
    let file = std::env::temp_dir().join(format!("burn-tp-llama-{}.bpk", std::process::id()));
    let config = LlamaConfig::new(23, 8, 16, 4, 2, 2, 32);
    let ids = |seed: i64| -> Vec<i64> { (0..16).map(|i| (i * 7 + seed) % 23).collect() };
    let loss = move |m: &burn_tp::llama::Llama| {
        let t = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device());
        m.loss(t(ids(3)), t(ids(5))).into_scalar::<f64>()
    };
    device().seed(31);
    let (c, f) = (config.clone(), file.clone());
    let want = run_ranks(LocalGroup::new(1).unwrap(), move |g| {
        let model = c.init(&g, &device()).unwrap();
        save_burn_record(&model, &f, &g).unwrap();
        loss(&model)
    })
    .unwrap()[0];
    for tp in [2usize, 4] {
        device().seed(32);
        let (c, f) = (config.clone(), file.clone());
        let got = run_ranks(LocalGroup::new(tp).unwrap(), move |g| {
            let fresh = c.init(&g, &device()).unwrap();
            let before = loss(&fresh);
            (before, loss(&load_burn_record(fresh, &f, &g).unwrap()))
        })
        .unwrap();
        for (r, (before, after)) in got.into_iter().enumerate() {
            assert!(
                (before - want).abs() > 1e-4,
                "tp {tp} rank {r}: a fresh model is another"
            );
            assert_close(&[after], &[want], 1e-5, &format!("tp {tp} rank {r}"));
        }
    }
    let _ = std::fs::remove_file(&file);
}
