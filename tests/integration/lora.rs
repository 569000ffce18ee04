//! LoRA at tensor parallelism (`burn_tp::lora`): a fine-tune at tp 2 and 4, in both modes and
//! with dp, gives the tp 1 run's losses and adapters, the base untouched; bad input names the
//! values.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::lora::{LoraConfig, apply_lora};
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::reshard::Reshard;

use super::common::{assert_close, device, f64s, param_values, rng_lock, token_ids};

/// A Llama whose key / value heads (2) are replicated at tp 4.
fn llama(mode: TpMode) -> LlamaConfig {
    LlamaConfig::new(40, 16, 16, 4, 2, 2, 32)
        .with_settings(TpSettings::new().with_mode(mode).with_attention_tile(4))
}

fn lora() -> LoraConfig {
    LoraConfig::new(4, 8.0).with_targets(
        ["q", "k", "v", "o", "gate", "up", "down"]
            .map(String::from)
            .to_vec(),
    )
}

/// A model's frozen parameters (the base) and trainable ones (the adapters), in visiting order.
type Split = (Vec<Vec<f64>>, Vec<Vec<f64>>);

fn split<M: Module>(m: &M) -> Split {
    use burn::module::{ModuleVisitor, Param};
    struct Both(Split);
    impl ModuleVisitor for Both {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            // A QLoRA base's packed values: none.
            let v = match p.val().dtype().is_float() {
                true => f64s(p.val()),
                false => Vec::new(),
            };
            match p.val().is_require_grad() {
                true => self.0.1.push(v),
                false => self.0.0.push(v),
            }
        }
    }
    let mut both = Both((Vec::new(), Vec::new()));
    m.visit(&mut both);
    both.0
}

/// Three AdamW steps of the LoRA fine-tune of `full` (a tp 1 model with its adapters) at tp x
/// dp, each dp rank on its own batches: dp rank 0's losses and the whole model after
/// (gathered to tp 1), its base and its adapters.
fn fine_tune(full: &Llama, tp: usize, dp: usize) -> (Vec<f64>, Split) {
    let full = full.clone();
    let out = run_local(tp * dp, move |world| {
        let mesh = DeviceMesh::new(world.clone(), tp).unwrap();
        let mut model = Llama::shard_module(&full, mesh.tp_group()).unwrap();
        // A large epsilon makes the step follow the gradient's size, not only its sign (which
        // rounding decides for a gradient near zero).
        let mut optim = AdamWConfig::new().with_epsilon(1.0).init();
        let d = mesh.dp_rank() as i64;
        let mut losses = Vec::new();
        for step in 0..3i64 {
            let ids = |add: i64| {
                let v = token_ids(16, 40, 5 + step, add + 7 * d);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device())
            };
            let loss = LanguageModel::loss(&model, ids(0), ids(1), None).unwrap();
            losses.push(f64s(loss.clone())[0]);
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            burn_tp::dp::average_gradients(&model, &mut grads, mesh.dp_group()).unwrap();
            model = optim.step(0.5, model, grads);
        }
        let whole = split(&model.to_full_module().unwrap());
        (losses, whole)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn a_lora_fine_tune_at_tp_2_and_4_gives_the_tp_1_runs_losses_and_adapters() {
    let _lock = rng_lock();
    let solo = burn_tp::comm::LocalGroup::new(1).unwrap().remove(0);
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        device().seed(21);
        let base = llama(mode).init(&solo, &device()).unwrap();
        let before = param_values(&base);
        let full = apply_lora(base, &lora()).unwrap();
        // Only the adapters train: 2 blocks x (q, k, v, o, gate, up, down) x (A, B).
        let (frozen, adapters) = split(&full);
        assert_eq!(frozen, before, "{mode:?}: the base, frozen");
        assert_eq!(adapters.len(), 2 * 7 * 2, "{mode:?}: adapters");
        for dp in [1, 2] {
            let (want_losses, (want_base, want)) = fine_tune(&full, 1, dp);
            assert_eq!(
                want_base, before,
                "{mode:?} dp {dp}: the base after the fine-tune"
            );
            // B moved from zero: the fine-tune trained the adapters.
            let b_moved = want.iter().skip(1).step_by(2).flatten().any(|&v| v != 0.0);
            assert!(b_moved, "{mode:?} dp {dp}");
            for tp in [2, 4] {
                let at = format!("{mode:?} tp {tp} x dp {dp}");
                let (losses, (base, got)) = fine_tune(&full, tp, dp);
                assert_eq!(base, before, "{at}: the base after the fine-tune");
                assert_close(&losses, &want_losses, 1e-5, &format!("{at}: losses"));
                assert_eq!(got.len(), want.len(), "{at}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(g, w, 1e-5, &format!("{at}: adapter factor {i}"));
                }
            }
        }
    }
}

#[test]
fn lora_errors_name_the_values() {
    let _lock = rng_lock();
    let solo = burn_tp::comm::LocalGroup::new(1).unwrap().remove(0);
    let model = || llama(TpMode::AllReduce).init(&solo, &device()).unwrap();
    let e = apply_lora(model(), &LoraConfig::new(0, 8.0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0"), "{e}");
    let bad = LoraConfig::new(4, 8.0).with_targets(vec!["q".into(), "wq".into()]);
    let e = apply_lora(model(), &bad).unwrap_err().to_string();
    assert!(e.contains("`wq`"), "{e}");
    let e = apply_lora(model(), &LoraConfig::new(4, 8.0).with_targets(Vec::new()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no target"), "{e}");
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf")
        .join(name)
}

/// The last position's logits over the real vocabulary of `model` on `prompt` (every rank).
fn last_logits(
    model: &Llama,
    prompt: &[i64],
    vocab: usize,
    g: &burn_tp::comm::ProcessGroup,
) -> Vec<f64> {
    let s = prompt.len();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(prompt.to_vec(), [s, 1]), &device());
    let logits = model.logits(ids).unwrap();
    let logits = burn_tp::ops::gather_from_tp_region(logits, 2, g).unwrap();
    f64s(
        logits
            .narrow(0, s - 1, 1)
            .narrow(2, 0, vocab)
            .reshape([vocab]),
    )
}

/// A PEFT adapter made by `peft` for the `llama_tied` fixture (`make_peft_fixture.py`: every
/// projection, r 4, B drawn) gives peft's logits at tp 1, 2 and 4 (the key / value heads
/// replicated at 4); saved back as a PEFT folder from tp 2 and read again, its factors are bit
/// for bit the same; an adapter whose shapes do not fit the base is an error naming the tensor.
#[test]
fn a_peft_adapter_gives_peft_logits_at_every_tp_and_round_trips() {
    use burn_tp::hf::{init_llama, load_peft, save_peft};
    let _lock = rng_lock();
    let (base, adapter) = (fixture("llama_tied"), fixture("llama_tied_lora"));
    let text = std::fs::read_to_string(adapter.join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let floats = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let prompt: Vec<i64> = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect();
    let (want, want_base) = (floats("last_logits"), floats("base_last_logits"));
    let out = std::env::temp_dir().join(format!("burn-tp-peft-{}", std::process::id()));
    for tp in [1usize, 2, 4] {
        let (base, adapter, prompt, out) =
            (base.clone(), adapter.clone(), prompt.clone(), out.clone());
        let got = run_local(tp, move |g| {
            let (model, hf) = init_llama(&base, TpSettings::new(), &g, &device()).unwrap();
            let plain = last_logits(&model, &prompt, hf.vocab_size, &g);
            let model = load_peft(model, &adapter, &hf).unwrap();
            let tuned = last_logits(&model, &prompt, hf.vocab_size, &g);
            let full = model.to_full_module().unwrap();
            if tp == 2 && g.rank() == 0 {
                save_peft(&full, &out, &hf, Some("llama_tied")).unwrap();
            }
            (plain, tuned, split(&full).1)
        })
        .unwrap();
        for (rank, (plain, tuned, _)) in got.iter().enumerate() {
            let at = format!("tp {tp} rank {rank}");
            assert_close(plain, &want_base, 1e-4, &format!("{at}: the base's logits"));
            assert_close(tuned, &want, 1e-4, &format!("{at}: with the adapter"));
        }
        // The adapter changes the logits well beyond the tolerance.
        assert!(
            want.iter()
                .zip(&want_base)
                .any(|(a, b)| (a - b).abs() > 0.1)
        );
    }
    // Export -> import: the same factors, bit for bit.
    let (base2, adapter2, out2) = (base.clone(), adapter.clone(), out.clone());
    let both = run_local(1, move |g| {
        let (model, hf) = init_llama(&base2, TpSettings::new(), &g, &device()).unwrap();
        let first = split(&load_peft(model.clone(), &adapter2, &hf).unwrap()).1;
        let again = split(&load_peft(model, &out2, &hf).unwrap()).1;
        (first, again)
    })
    .unwrap()
    .remove(0);
    assert_eq!(both.0.len(), 2 * 7 * 2);
    assert_eq!(both.0, both.1, "export -> import");
    let config = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
    assert!(
        config.contains("\"lora_alpha\": 8.0") && config.contains("\"r\": 4"),
        "{config}"
    );
    // An adapter of another rank than its tensors': the first tensor named, both shapes.
    let bad = out.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(
        adapter.join("adapter_model.safetensors"),
        bad.join("adapter_model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap();
    std::fs::write(
        bad.join("adapter_config.json"),
        text.replace("\"r\": 4", "\"r\": 3"),
    )
    .unwrap();
    let (base3, bad2) = (base.clone(), bad.clone());
    let e = run_local(1, move |g| {
        let (model, hf) = init_llama(&base3, TpSettings::new(), &g, &device()).unwrap();
        load_peft(model, &bad2, &hf).unwrap_err().to_string()
    })
    .unwrap()
    .remove(0);
    assert!(
        e.contains("lora_A.weight") && e.contains("[4, 32]") && e.contains("[3, 32]"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// QLoRA (`apply_qlora`, 8-bit): every adapted projection's frozen weight is held quantized on
/// every rank (its own shard over its own range), the adapters train, and the losses stay
/// within the quantization's error of the unquantized LoRA run's, at tp 1 and 2.
#[test]
fn a_qlora_fine_tune_holds_the_base_quantized_and_follows_lora() {
    use burn::tensor::quantization::QuantValue;
    use burn_tp::lora::apply_qlora;
    let _lock = rng_lock();
    let run = |tp: usize, quantized: bool| {
        device().seed(23);
        run_local(tp, move |g| {
            let base = llama(TpMode::ReduceScatter).init(&g, &device()).unwrap();
            let model = match quantized {
                true => apply_qlora(base, &lora(), QuantValue::Q8S).unwrap(),
                false => apply_lora(base, &lora()).unwrap(),
            };
            let packed = model.blocks.iter().all(|b| {
                let attn = &b.attn;
                let mlp = b.mlp.as_ref().unwrap();
                [
                    attn.qkv[0].weight.val().dtype(),
                    attn.out.weight.val().dtype(),
                    mlp.gate_up.weight.val().dtype(),
                    mlp.down.weight.val().dtype(),
                ]
                .iter()
                .all(|d| !d.is_float())
            });
            let mut model = model;
            let mut optim = AdamWConfig::new().with_epsilon(1.0).init();
            let mut losses = Vec::new();
            // One batch, again and again: the adapters fit it.
            for _ in 0..4 {
                let ids = |add: i64| {
                    let v = token_ids(16, 40, 5, add);
                    Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device())
                };
                let loss = LanguageModel::loss(&model, ids(0), ids(1), None).unwrap();
                losses.push(f64s(loss.clone())[0]);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(0.5, model, grads);
            }
            (packed, losses)
        })
        .unwrap()
        .remove(0)
    };
    let (_, plain) = run(1, false);
    for tp in [1, 2] {
        let (packed, losses) = run(tp, true);
        assert!(packed, "tp {tp}: the base is held quantized");
        assert_close(&losses, &plain, 2e-2, &format!("QLoRA tp {tp} vs LoRA"));
        assert!(losses.last() < losses.first(), "tp {tp}: {losses:?}");
        assert!(losses != plain, "tp {tp}: the quantized base computes");
    }
}

/// A LoRA model's checkpoint (`CheckpointInfo::with_frozen_base`) holds the adapters and their
/// AdamW moments alone: saved at tp 2 after one step, its index names exactly the trainable
/// parameters; loaded at tp 1 and 4 into the same base with freshly drawn adapters, the adapters
/// are the saved ones and the base the model's own, and one more step gives the uninterrupted
/// run's loss; a QLoRA model takes it with its base still packed. A model that trains its base
/// is refused, naming the missing tensor.
#[test]
fn a_lora_checkpoint_holds_the_adapters_alone_and_resumes_at_another_tp() {
    use burn::tensor::quantization::QuantValue;
    use burn_tp::checkpoint::{self, CheckpointInfo, INDEX};
    use burn_tp::lora::apply_qlora;
    let _lock = rng_lock();
    let dir = std::env::temp_dir().join(format!("burn-tp-lora-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let solo = burn_tp::comm::LocalGroup::new(1).unwrap().remove(0);
    let config = llama(TpMode::ReduceScatter);
    device().seed(31);
    let base = config.init(&solo, &device()).unwrap();
    device().seed(32);
    let full = apply_lora(base.clone(), &lora()).unwrap();
    fn step(model: Llama, optim: &mut burn::optim::ModuleOptimizer, s: i64) -> (Llama, f64) {
        let ids = |add: i64| {
            let v = token_ids(16, 40, 5 + s, add);
            Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device())
        };
        let loss = LanguageModel::loss(&model, ids(0), ids(1), None).unwrap();
        let value = f64s(loss.clone())[0];
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (optim.step(0.5, model, grads), value)
    }
    let (f, d, c) = (full.clone(), dir.clone(), config.clone());
    let (saved, next_loss) = run_local(2, move |g| {
        let model = Llama::shard_module(&f, &g).unwrap();
        let mut optim = AdamWConfig::new().with_epsilon(1.0).init();
        let (model, _) = step(model, &mut optim, 0);
        let info = CheckpointInfo::new(1, 2, 1, &c).with_frozen_base("the seed-31 draw");
        checkpoint::save(&model, Some(&optim), &d, &info, &g, 0).unwrap();
        let saved = split(&model.to_full_module().unwrap());
        let (_, next) = step(model, &mut optim, 1);
        (saved, next)
    })
    .unwrap()
    .remove(0);
    let (saved_base, saved_adapters) = saved;
    assert_eq!(saved_base, split(&full).0, "one step keeps the base");

    // The index: parameter k and its two moments for the 28 trainable k, nothing else.
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).unwrap()).unwrap();
    let names: std::collections::BTreeSet<String> = index["tensors"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let trainable: Vec<usize> = {
        use burn::module::{ModuleVisitor, Param};
        struct Flags(Vec<bool>);
        impl ModuleVisitor for Flags {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0.push(p.val().is_require_grad());
            }
        }
        let mut flags = Flags(Vec::new());
        full.visit(&mut flags);
        (0..flags.0.len()).filter(|&k| flags.0[k]).collect()
    };
    assert_eq!(trainable.len(), 2 * 7 * 2);
    let want: std::collections::BTreeSet<String> = trainable
        .iter()
        .flat_map(|k| ["", ".momentum.moment_1", ".momentum.moment_2"].map(|f| format!("p{k}{f}")))
        .collect();
    assert_eq!(names, want, "the checkpoint's tensors");
    assert_eq!(index["info"]["frozen_base"], "the seed-31 draw");

    for tp in [1usize, 4] {
        let (b, d, c) = (base.clone(), dir.clone(), config.clone());
        // The same base, other adapters: the load must replace the adapters only.
        device().seed(99);
        let other = apply_lora(b, &lora()).unwrap();
        let out = run_local(tp, move |g| {
            let fresh = Llama::shard_module(&other, &g).unwrap();
            let (model, info) = checkpoint::load(fresh, &d, Some(&c), &g).unwrap();
            let optim = AdamWConfig::new().with_epsilon(1.0).init();
            let mut optim = checkpoint::load_optimizer(optim, &model, &d, &g).unwrap();
            let loaded = split(&model.to_full_module().unwrap());
            let (_, next) = step(model, &mut optim, info.step as i64);
            (loaded, next)
        })
        .unwrap()
        .remove(0);
        let ((loaded_base, loaded_adapters), next) = out;
        assert_eq!(loaded_base, saved_base, "tp {tp}: the model's own base");
        assert_eq!(
            loaded_adapters, saved_adapters,
            "tp {tp}: the saved adapters"
        );
        assert_close(
            &[next],
            &[next_loss],
            1e-5,
            &format!("tp {tp}: the next loss"),
        );
    }

    // QLoRA: the base stays packed; the adapters are the saved ones.
    let (b, d, c) = (base.clone(), dir.clone(), config.clone());
    let (packed, adapters) = run_local(1, move |g| {
        let model = apply_qlora(b.clone(), &lora(), QuantValue::Q8S).unwrap();
        let (model, _) = checkpoint::load(model, &d, Some(&c), &g).unwrap();
        let packed = !model.blocks[0].attn.out.weight.val().dtype().is_float();
        (packed, split(&model).1)
    })
    .unwrap()
    .remove(0);
    assert!(packed, "the QLoRA base after the load");
    assert_eq!(adapters, saved_adapters, "QLoRA: the saved adapters");

    // A model that trains its base finds no base in the checkpoint.
    let (f, d) = (full.clone(), dir.clone());
    let e = run_local(1, move |g| {
        struct Thaw;
        impl burn::module::ModuleMapper for Thaw {
            fn map_float<const D: usize>(
                &mut self,
                p: burn::module::Param<Tensor<D>>,
            ) -> burn::module::Param<Tensor<D>> {
                p.set_require_grad(true)
            }
        }
        let thawed = Llama::shard_module(&f, &g).unwrap().map(&mut Thaw);
        checkpoint::load(thawed, &d, Some(&config), &g).map(|_| ())
    })
    .unwrap()
    .remove(0)
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("p0 is missing") && e.contains("the seed-31 draw"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Adapters with `B` set away from zero (a fresh adapter's is zero, which hides the scale), held
/// to PEFT's forward written out in f64 loops, `base(x) + (alpha / r) * (x A) B`, at tp 1 and 2:
/// the column layer's output columns and the row layer's reduced output. `alpha / r` = 1.5
/// here, so a scale of `alpha` (6) or of 1 is seen.
#[test]
fn an_adapted_linear_gives_the_base_plus_alpha_over_r_times_x_a_b() {
    use burn::module::Param;
    use burn_tp::linear::{ColumnParallelLinearConfig, RowParallelLinearConfig};
    let _rng = rng_lock();
    let (d_in, d_out, r, alpha) = (8usize, 12usize, 4usize, 6.0f64);
    let scale = alpha / r as f64;
    let n = 4 * 2; // rows x batch
    let x_col = crate::common::uniform(n * d_in, 41);
    let x_row = crate::common::uniform(n * d_out, 44);
    let b_col = crate::common::uniform(r * d_out, 42);
    let b_row = crate::common::uniform(r * d_in, 43);
    for tp in [1usize, 2] {
        device().seed(5);
        let (xc, xr, bc, br) = (x_col.clone(), x_row.clone(), b_col.clone(), b_row.clone());
        let out = run_local(tp, move |g| {
            let (rank, c) = (g.rank(), d_out / tp);
            let t3 =
                |v: Vec<f32>, d| Tensor::<3>::from_data(TensorData::new(v, [4, 2, d]), &device());
            // Column: d_in -> d_out, this rank's columns of B.
            let col = ColumnParallelLinearConfig::new(d_in, d_out)
                .init(&g, &device())
                .unwrap();
            let base_col = col.to_full().unwrap();
            let mut col = col.with_lora(&[0], r, alpha).unwrap();
            let b_full = Tensor::<2>::from_data(TensorData::new(bc.clone(), [r, d_out]), &device());
            let lora = col.lora.as_mut().unwrap();
            lora.b[0] = Param::from_tensor(b_full.narrow(1, rank * c, c));
            let a_col = f64s(lora.a[0].val());
            let y_col = f64s(col.forward(t3(xc.clone(), d_in)));
            // Row: d_out -> d_in, this rank's rows of A and input columns.
            let row = RowParallelLinearConfig::new(d_out, d_in)
                .init(&g, &device())
                .unwrap();
            let base_row = row.to_full().unwrap();
            let mut row = row.with_lora(r, alpha).unwrap();
            let lora = row.lora.as_mut().unwrap();
            lora.b = Param::from_tensor(Tensor::from_data(
                TensorData::new(br.clone(), [r, d_in]),
                &device(),
            ));
            let a_row = f64s(lora.a.val());
            let x = t3(xr.clone(), d_out).narrow(2, rank * c, c);
            let y_row = f64s(row.forward(x));
            let w =
                |l: &burn::nn::Linear| (f64s(l.weight.val()), f64s(l.bias.clone().unwrap().val()));
            (y_col, a_col, w(&base_col), y_row, a_row, w(&base_row))
        })
        .unwrap();
        // The row layer's whole A: each rank's rows in rank order.
        let a_row: Vec<f64> = out.iter().flat_map(|o| o.4.clone()).collect();
        let linear =
            |x: &[f32], w: &[f64], bias: &[f64], a: &[f64], b: &[f32], [k, m]: [usize; 2]| {
                let mut y = vec![0.0f64; n * m];
                for i in 0..n {
                    let u: Vec<f64> = (0..r)
                        .map(|j| (0..k).map(|q| x[i * k + q] as f64 * a[q * r + j]).sum())
                        .collect();
                    for col in 0..m {
                        let base: f64 = (0..k).map(|q| x[i * k + q] as f64 * w[q * m + col]).sum();
                        let lora: f64 = (0..r).map(|j| u[j] * b[j * m + col] as f64).sum();
                        y[i * m + col] = base + bias[col] + scale * lora;
                    }
                }
                y
            };
        for (rank, (y_col, a_col, (w_col, bias_col), y_row, _, (w_row, bias_row))) in
            out.iter().enumerate()
        {
            let want = linear(&x_col, w_col, bias_col, a_col, &b_col, [d_in, d_out]);
            let c = d_out / tp;
            let mine: Vec<f64> = (0..n)
                .flat_map(|i| want[i * d_out + rank * c..i * d_out + (rank + 1) * c].to_vec())
                .collect();
            assert_close(y_col, &mine, 1e-5, &format!("tp {tp} rank {rank}: column"));
            let want = linear(&x_row, w_row, bias_row, &a_row, &b_row, [d_out, d_in]);
            assert_close(y_row, &want, 1e-5, &format!("tp {tp} rank {rank}: row"));
        }
    }
}
