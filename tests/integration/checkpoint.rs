//! Sharded checkpoints: where each rank's shards lie in the full parameters (the layout a
//! sharded checkpoint writes), checked against the gathered full model.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_tp::gpt::GptConfig;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::reshard::{ParamLayout, Reshard};

use crate::common::{device, f64s, rng_lock};

/// `(shape, values)` of every float parameter, in visiting order.
fn params<M: Module>(module: &M) -> Vec<(Vec<usize>, Vec<f64>)> {
    struct Collect(Vec<(Vec<usize>, Vec<f64>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.0.push((t.dims().to_vec(), f64s(t)));
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// The values of `values` (row-major `shape`) at `range` along `dim`.
fn slice(shape: &[usize], values: &[f64], dim: usize, range: std::ops::Range<usize>) -> Vec<f64> {
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    let mut out = Vec::new();
    for o in 0..outer {
        let base = o * shape[dim] * inner;
        out.extend_from_slice(&values[base + range.start * inner..base + range.end * inner]);
    }
    out
}

/// Every rank's layout of `model` (built at `tp` by `build`) against the gathered full model:
/// one layout per parameter; each piece is that slice of the full parameter; the written pieces
/// tile every full parameter exactly once.
fn check_layouts<M: Module + Reshard + 'static>(
    tp: usize,
    tag: &str,
    build: impl Fn(&burn_tp::comm::ProcessGroup) -> M + Send + Sync + 'static,
) {
    type RankOut = (
        Vec<ParamLayout>,
        Vec<(Vec<usize>, Vec<f64>)>,
        Vec<(Vec<usize>, Vec<f64>)>,
    );
    let out: Vec<RankOut> = run_local(tp, move |g| {
        let model = build(&g);
        let full = model.to_full_module().unwrap();
        (model.layout(g.rank()), params(&model), params(&full))
    })
    .unwrap();
    let full = &out[0].2;
    for (r, (layouts, local, _)) in out.iter().enumerate() {
        assert_eq!(
            layouts.len(),
            local.len(),
            "{tag} rank {r}: a layout per parameter"
        );
        for (k, (layout, (shape, values))) in layouts.iter().zip(local).enumerate() {
            let (full_shape, full_values) = &full[k];
            assert_eq!(
                &layout.global_shape, full_shape,
                "{tag} rank {r} parameter {k}"
            );
            for (d, (&n, &g)) in shape.iter().zip(full_shape).enumerate() {
                if d != layout.dim {
                    assert_eq!(n, g, "{tag} rank {r} parameter {k}: dim {d} is whole");
                }
            }
            for p in &layout.pieces {
                assert_eq!(
                    slice(shape, values, layout.dim, p.local.clone()),
                    slice(full_shape, full_values, layout.dim, p.global.clone()),
                    "{tag} rank {r} parameter {k}: piece {p:?}"
                );
            }
        }
    }
    for (k, (full_shape, _)) in full.iter().enumerate() {
        let dim = out[0].0[k].dim;
        let mut written: Vec<_> = out
            .iter()
            .flat_map(|(layouts, _, _)| layouts[k].pieces.iter().filter(|p| p.writes))
            .map(|p| p.global.clone())
            .collect();
        written.sort_by_key(|r| r.start);
        let mut next = 0;
        for range in written {
            assert_eq!(
                range.start, next,
                "{tag} parameter {k}: written {:?}",
                range
            );
            next = range.end;
        }
        assert_eq!(
            next, full_shape[dim],
            "{tag} parameter {k}: the written pieces end early"
        );
    }
}

#[test]
fn every_rank_knows_where_its_shards_lie_in_the_full_parameters() {
    let _rng = rng_lock();
    // A vocabulary of 13: padded to 14 at tp 2 and 16 at tp 4, rank 3's rows partly padding.
    for tp in [1usize, 2, 4] {
        for (tied, fused) in [(false, true), (true, false)] {
            for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
                device().seed(5);
                check_layouts(
                    tp,
                    &format!("gpt tp {tp} tied {tied} fused {fused} {mode:?}"),
                    move |g| {
                        GptConfig::new(13, 8, 16, 4, 2)
                            .with_settings(TpSettings::new().with_mode(mode))
                            .with_tie_embeddings(tied)
                            .with_fused_qkv(fused)
                            .init(g, &device())
                            .unwrap()
                    },
                );
            }
        }
        // Key / value heads sharded (4), replicated on pairs of ranks (2 at tp 4) and on every
        // rank (1): replicas are written by the lowest rank holding them.
        for n_kv in [1usize, 2, 4] {
            device().seed(6);
            check_layouts(tp, &format!("llama tp {tp} kv {n_kv}"), move |g| {
                LlamaConfig::new(13, 8, 16, 4, n_kv, 2, 32)
                    .init(g, &device())
                    .unwrap()
            });
        }
    }
}

mod sharded {
    use std::path::PathBuf;

    use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
    use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
    use burn_tp::TpError;
    use burn_tp::checkpoint::{self, CheckpointInfo, INDEX};
    use burn_tp::gpt::{Gpt, GptConfig};
    use burn_tp::linear::{TpMode, TpSettings};
    use burn_tp::llama::LlamaConfig;
    use burn_tp::local::run_local;
    use burn_tp::precision::cast_params;
    use burn_tp::reshard::Reshard;

    use super::params;
    use crate::common::{assert_close, device, rng_lock, token_ids};

    const V: usize = 13;
    const LR: f64 = 1e-2;

    fn config() -> GptConfig {
        GptConfig::new(V, 8, 16, 4, 2)
            .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("burn-tp-ckpt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn batch(step: usize) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let ids = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device());
        let s = step as i64;
        (ids(token_ids(16, V, 7, s)), ids(token_ids(16, V, 5, s + 1)))
    }

    /// Steps `steps` (numbered from `first`) of AdamW; the losses.
    fn train(
        mut model: Gpt,
        optim: &mut ModuleOptimizer,
        first: usize,
        steps: usize,
    ) -> (Gpt, Vec<f64>) {
        let mut losses = Vec::new();
        for step in first..first + steps {
            let (x, y) = batch(step);
            let loss = model.loss(x, y);
            losses.push(f64::from(loss.clone().into_scalar::<f32>()));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(LR, model, grads);
        }
        (model, losses)
    }

    /// A tp = 4 run saves after 2 steps (model and AdamW state); loaded at tp 1, 2 and 4 the
    /// model is the saved one bit for bit, and 3 more steps from there give the losses of the
    /// uninterrupted run. The files hold about one copy of the model (each rank its own slices),
    /// not tp copies.
    #[test]
    fn a_tp_4_checkpoint_resumes_at_tp_1_2_4_into_the_same_curve() {
        let _rng = rng_lock();
        let ckpt = dir("resume");
        device().seed(17);
        let c = ckpt.clone();
        let out = run_local(4, move |g| {
            let model = config().init(&g, &device()).unwrap();
            let mut optim = AdamWConfig::new().init();
            let (model, _) = train(model, &mut optim, 0, 2);
            let info = CheckpointInfo::new(2, 4, 1, &config());
            checkpoint::save(&model, Some(&optim), &c, &info, &g, 0).unwrap();
            let saved = params(&model.to_full_module().unwrap());
            let (_, rest) = train(model, &mut optim, 2, 3);
            (saved, rest)
        })
        .unwrap();
        let (saved, uninterrupted) = out[0].clone();
        assert!(ckpt.join(INDEX).exists());

        // What the ranks wrote: each its own slices, one model in all. A safetensors file is an
        // 8-byte header length, the header, then the tensors' bytes.
        let payload: u64 = std::fs::read_dir(ckpt.join("step-2"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .map(|p| {
                let bytes = std::fs::read(&p).unwrap();
                let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                bytes.len() as u64 - 8 - header
            })
            .sum();
        let model_bytes = saved.iter().map(|(_, v)| 4 * v.len() as u64).sum::<u64>();
        // Parameters and AdamW's two moments, each once; at tp 4 the vocabulary of 13 is padded
        // to 16: 3 rows of the embedding and 3 columns of the head (d 16, f32) more, 3 times.
        let padding = 3 * 2 * (3 * 16 * 4);
        assert_eq!(
            payload,
            3 * model_bytes + padding,
            "bytes of tensors written"
        );

        for tp in [1usize, 2, 4] {
            device().seed(99); // other initial values: the load must replace every one
            let c = ckpt.clone();
            let out = run_local(tp, move |g| {
                let fresh = config().init(&g, &device()).unwrap();
                let (model, info) = checkpoint::load(fresh, &c, Some(&config()), &g).unwrap();
                let optim = AdamWConfig::new().init();
                let mut optim = checkpoint::load_optimizer(optim, &model, &c, &g).unwrap();
                let loaded = params(&model.to_full_module().unwrap());
                let (_, rest) = train(model, &mut optim, info.step as usize, 3);
                (info.step, loaded, rest)
            })
            .unwrap();
            for (r, (step, loaded, rest)) in out.into_iter().enumerate() {
                let tag = format!("loaded at tp {tp} rank {r}");
                assert_eq!(step, 2, "{tag}");
                assert_eq!(loaded, saved, "{tag}: the parameters");
                assert_close(&rest, &uninterrupted, 1e-5, &format!("{tag}: steps 2..5"));
            }
        }
        std::fs::remove_dir_all(&ckpt).unwrap();
    }

    /// What a save holds beside the model, counted by the saving thread's allocations: AdamW's
    /// record once (burn-optim 0.22 hands its state out whole), written to a scratch file, then
    /// one tensor at a time; not a copy of every parameter and two of the moments (the save
    /// before 2026-12-07 (c): the parameters, the record and its encoding at once). The
    /// checkpoint still reads back bit for bit, its scratch file gone.
    #[test]
    fn a_save_holds_the_optimizer_record_once_then_one_tensor_at_a_time() {
        let _rng = rng_lock();
        let ckpt = dir("held");
        device().seed(5);
        // 16 blocks of d 64: many tensors, none large beside the whole.
        let config = GptConfig::new(V, 8, 64, 4, 16);
        let g = burn_tp::comm::LocalGroup::new(1).unwrap().remove(0);
        let model = config.init(&g, &device()).unwrap();
        let mut optim = AdamWConfig::new().init();
        let (model, _) = train(model, &mut optim, 0, 1);
        let sizes: Vec<usize> = params(&model).iter().map(|(_, v)| 4 * v.len()).collect();
        let (model_bytes, largest) = (sizes.iter().sum::<usize>(), *sizes.iter().max().unwrap());
        let info = CheckpointInfo::new(1, 1, 1, &config);
        let ((), held) = crate::counting::peak_of(|| {
            checkpoint::save(&model, Some(&optim), &ckpt, &info, &g, 0).unwrap()
        });
        // The record: the two moments (2 x the model's bytes); a tensor made, cut and encoded:
        // a few copies of the largest; the writers' buffers (safetensors' is 1 MiB), headers
        // and names: 2 MiB. Measured: 7.1 MB against this bound's 8.8 MB; the save before
        // held 16.6 MB.
        let bound = 2 * model_bytes + 4 * largest + (2 << 20);
        assert!(
            held <= bound,
            "the save held {held} bytes at once; the moments are {} bytes, the largest \
             tensor {largest}: at most {bound}",
            2 * model_bytes
        );
        assert!(held >= 2 * model_bytes, "the record itself: {held} bytes");
        let files: Vec<String> = std::fs::read_dir(ckpt.join("step-1"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(files, ["rank-00000.safetensors"], "no scratch file left");
        device().seed(6);
        let fresh = config.init(&g, &device()).unwrap();
        let (loaded, _) = checkpoint::load(fresh, &ckpt, Some(&config), &g).unwrap();
        assert_eq!(params(&loaded), params(&model));
        // AdamW's state read back: the next step from it is the saved optimizer's (to
        // rounding: the loaded weights' layout may take another GEMM path; a fresh state's
        // step is 1.7e-2 off). Its record's encoding is not compared: its padding follows the
        // entries' order, which varies.
        let mut reread =
            checkpoint::load_optimizer(AdamWConfig::new().init(), &loaded, &ckpt, &g).unwrap();
        let (next, _) = train(loaded, &mut reread, 1, 1);
        let (want, _) = train(model, &mut optim, 1, 1);
        let off = params(&next)
            .iter()
            .zip(&params(&want))
            .flat_map(|((_, a), (_, b))| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
            .fold(0.0, f64::max);
        assert!(
            off < 1e-5,
            "the step after AdamW's state read back is {off} off"
        );
        std::fs::remove_dir_all(&ckpt).unwrap();
    }

    /// A save that dies half way (its shard folder written, no index yet) leaves the previous
    /// checkpoint loading as it was; a completed save replaces it and removes the old shards.
    #[test]
    fn a_save_interrupted_before_its_index_leaves_the_previous_checkpoint() {
        let _rng = rng_lock();
        let ckpt = dir("atomic");
        device().seed(21);
        let c = ckpt.clone();
        run_local(2, move |g| {
            let model = config().init(&g, &device()).unwrap();
            let info = CheckpointInfo::new(1, 2, 1, &config());
            checkpoint::save(&model, None, &c, &info, &g, 0).unwrap();
        })
        .unwrap();
        // The crash: the next save's shards, renamed into place, but no new index.
        std::fs::create_dir_all(ckpt.join("step-2.tmp")).unwrap();
        std::fs::write(
            ckpt.join("step-2.tmp/rank-00000.safetensors"),
            b"half a file",
        )
        .unwrap();
        let c = ckpt.clone();
        let steps = run_local(2, move |g| {
            let fresh = config().init(&g, &device()).unwrap();
            checkpoint::load(fresh, &c, Some(&config()), &g)
                .unwrap()
                .1
                .step
        })
        .unwrap();
        assert_eq!(steps, vec![1, 1]);
        // A completed save: the index points at the new shards, the old ones are gone.
        let c = ckpt.clone();
        run_local(2, move |g| {
            let model = config().init(&g, &device()).unwrap();
            let info = CheckpointInfo::new(3, 2, 1, &config());
            checkpoint::save(&model, None, &c, &info, &g, 0).unwrap();
        })
        .unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [INDEX, "step-3"]);
        std::fs::remove_dir_all(&ckpt).unwrap();
    }

    /// Every way a checkpoint can be wrong is a `TpError::Checkpoint` naming the file and, where
    /// there is one, the tensor: no index, a missing shard, a truncated shard, another dtype,
    /// another shape, another configuration, another model.
    #[test]
    fn a_bad_checkpoint_is_an_error_naming_the_file_and_tensor() {
        let _rng = rng_lock();
        let ckpt = dir("errors");
        device().seed(23);
        let c = ckpt.clone();
        run_local(2, move |g| {
            let model = config().init(&g, &device()).unwrap();
            checkpoint::save(
                &model,
                None,
                &c,
                &CheckpointInfo::new(1, 2, 1, &config()),
                &g,
                0,
            )
            .unwrap();
        })
        .unwrap();
        let shard = ckpt.join("step-1/rank-00001.safetensors");
        let good = std::fs::read(&shard).unwrap();
        let index = ckpt.join(INDEX);

        // Loads `build`'s model at tp 2 with `config` and returns rank 1's error.
        let load_err = |build: fn(&burn_tp::comm::ProcessGroup) -> Gpt, config: GptConfig| {
            let c = ckpt.clone();
            let out = run_local(2, move |g| {
                checkpoint::load(build(&g), &c, Some(&config), &g).map(|_| ())
            })
            .unwrap();
            match out[1].clone() {
                Err(TpError::Checkpoint { path, what }) => format!("{path}: {what}"),
                other => panic!("expected a checkpoint error, got {other:?}"),
            }
        };
        let plain = |g: &burn_tp::comm::ProcessGroup| config().init(g, &device()).unwrap();

        // A truncated shard.
        std::fs::write(&shard, &good[..good.len() / 2]).unwrap();
        let e = load_err(plain, config());
        assert!(
            e.contains("rank-00001.safetensors") && e.contains("truncated"),
            "{e}"
        );
        // A missing shard.
        std::fs::remove_file(&shard).unwrap();
        let e = load_err(plain, config());
        assert!(
            e.contains("rank-00001.safetensors") && e.contains("opening"),
            "{e}"
        );
        std::fs::write(&shard, &good).unwrap();
        // Another dtype: the model in bf16.
        let e = load_err(
            |g| cast_params(config().init(g, &device()).unwrap(), FloatDType::BF16),
            config(),
        );
        assert!(
            e.contains(INDEX) && e.contains("p0") && e.contains("F32") && e.contains("BF16"),
            "{e}"
        );
        // Another shape (d_model 32): named with both shapes.
        let wider = || {
            GptConfig::new(V, 8, 32, 4, 2)
                .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
        };
        let e = load_err(
            |g| {
                GptConfig::new(V, 8, 32, 4, 2)
                    .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter))
                    .init(g, &device())
                    .unwrap()
            },
            config(),
        );
        assert!(
            e.contains("p0") && e.contains("[13, 16]") && e.contains("[13, 32]"),
            "{e}"
        );
        // Another configuration.
        let e = load_err(plain, wider());
        assert!(e.contains("another configuration"), "{e}");
        // Another model: a Llama's checkpoint into the GPT.
        let llama = dir("errors-llama");
        let l = llama.clone();
        run_local(2, move |g| {
            let cfg = LlamaConfig::new(V, 8, 16, 4, 2, 2, 32);
            let model = cfg.init(&g, &device()).unwrap();
            checkpoint::save(&model, None, &l, &CheckpointInfo::new(1, 2, 1, &cfg), &g, 0).unwrap();
        })
        .unwrap();
        let l = llama.clone();
        let out = run_local(2, move |g| {
            checkpoint::load(
                config().init(&g, &device()).unwrap(),
                &l,
                None::<&GptConfig>,
                &g,
            )
            .map(|_| ())
        })
        .unwrap();
        let e = format!("{:?}", out[0]);
        assert!(
            e.contains("another model") && e.contains("parameters"),
            "{e}"
        );
        // No index: an incomplete save.
        std::fs::remove_file(&index).unwrap();
        let e = load_err(plain, config());
        assert!(e.contains(INDEX) && e.contains("did not complete"), "{e}");
        for d in [ckpt, llama] {
            std::fs::remove_dir_all(d).unwrap();
        }
        let _ = DType::F32;
    }
}
