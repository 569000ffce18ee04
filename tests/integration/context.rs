//! Context parallelism: the ring attention (`burn_tp::context`) at cp 2 and 4, both layouts,
//! against the unsplit kernel over the whole sequence: the output and dq, dk, dv of each rank's
//! chunks, in f64 (the tensor-op tiles) and f32 (Flex's CPU kernel), with grouped-query heads,
//! chunks of odd lengths and several tiles, a sliding window, a soft cap and dropout; the
//! errors; the GPT, the Llama and Gemma trained on split sequences against the unsplit models; and
//! `train_gpt --cp`.

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_tp::attention::LayerType;
use burn_tp::attention::fused_attention;
use burn_tp::backend::{AttentionDropout, AttentionSpec};
use burn_tp::context::{ContextParallel, CpLayout};
use burn_tp::dp::broadcast_parameters;
use burn_tp::dropout::{DropoutKey, DropoutStep};
use burn_tp::gemma::{Gemma, GemmaConfig};
use burn_tp::gpt::{Gpt, GptConfig};
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;

use burn_tp_examples::train_gpt::run;

use crate::common::{
    assert_close, device, f64s, full_grads, param_values, rel_norm, rng_lock, tensor, token_ids,
    uniform,
};
use crate::train_gpt::{temp_dir, tiny_args};

/// One case: sizes `[b, hq, hkv, seq, hd]`, the attention's spec, the dtype.
#[derive(Clone)]
struct Case {
    dims: [usize; 5],
    spec: AttentionSpec,
    dtype: DType,
}

/// q, k, v and the loss weights over the whole sequence (every rank makes the same).
fn inputs(c: &Case) -> [Tensor<4>; 4] {
    let [b, hq, hkv, s, hd] = c.dims;
    let d = c.dtype;
    [
        tensor(uniform(b * hq * s * hd, 11), [b, hq, s, hd], d).require_grad(),
        tensor(uniform(b * hkv * s * hd, 12), [b, hkv, s, hd], d).require_grad(),
        tensor(uniform(b * hkv * s * hd, 13), [b, hkv, s, hd], d).require_grad(),
        tensor(uniform(b * hq * s * hd, 14), [b, hq, s, hd], d),
    ]
}

/// Values of a rank: the output and dq, dk, dv, each `[b, h, s, hd]` flattened.
type Values = [Vec<f64>; 4];

/// The unsplit kernel's output and gradients of `sum(out * w)`, whole sequence.
fn unsplit(c: &Case) -> Values {
    let [q, k, v, w] = inputs(c);
    let out = fused_attention(q.clone(), k.clone(), v.clone(), c.spec.clone()).unwrap();
    let grads = (out.clone() * w).sum().backward();
    let g = |t: &Tensor<4>| f64s(t.grad(&grads).unwrap());
    [f64s(out), g(&q), g(&k), g(&v)]
}

/// Each rank's output and gradients with the sequence split over `cp` ranks in `layout`, and
/// its positions.
fn ring(c: &Case, cp: usize, layout: CpLayout) -> Vec<(Values, Vec<usize>)> {
    let c = c.clone();
    run_local(cp, move |g| {
        let ctx = ContextParallel::new(g, layout).unwrap();
        let [q, k, v, w] = inputs(&c);
        let split = |t: Tensor<4>| ctx.split(t, 2).unwrap().detach().require_grad();
        let (q, k, v) = (split(q), split(k), split(v));
        let w = ctx.split(w, 2).unwrap();
        let out = ctx
            .attention(q.clone(), k.clone(), v.clone(), c.spec.clone())
            .unwrap();
        let grads = (out.clone() * w).sum().backward();
        let g = |t: &Tensor<4>| f64s(t.grad(&grads).unwrap());
        let values = [f64s(out), g(&q), g(&k), g(&v)];
        (values, ctx.positions(c.dims[3]).unwrap())
    })
    .unwrap()
}

/// `x` (`[b, h, seq, hd]` flattened) at `positions` of dim 2.
fn at(x: &[f64], [b, h, seq, hd]: [usize; 4], positions: &[usize]) -> Vec<f64> {
    let mut out = Vec::new();
    for bh in 0..b * h {
        for &p in positions {
            out.extend_from_slice(&x[(bh * seq + p) * hd..][..hd]);
        }
    }
    out
}

/// Every rank's chunks of the output and gradients against the unsplit kernel's.
fn check(tag: &str, c: &Case, cp: usize, layout: CpLayout, tol: f64) {
    let want = unsplit(c);
    let [b, hq, hkv, seq, hd] = c.dims;
    let ranks = ring(c, cp, layout);
    let mut covered = vec![false; seq];
    for (r, (got, positions)) in ranks.iter().enumerate() {
        for &p in positions {
            assert!(!covered[p], "{tag}: position {p} on two ranks");
            covered[p] = true;
        }
        for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let h = if i >= 2 { hkv } else { hq };
            let want = at(&want[i], [b, h, seq, hd], positions);
            let err = rel_norm(&got[i], &want);
            assert!(
                err <= tol,
                "{tag}: cp {cp} {layout:?} rank {r} {name}: {err:.2e}"
            );
            assert!(want.iter().any(|x| x.abs() > 1e-6), "{tag}: {name} is zero");
        }
    }
    assert!(
        covered.iter().all(|&c| c),
        "{tag}: every position on a rank"
    );
}

fn case(dims: [usize; 5], tile: usize, dtype: DType) -> Case {
    Case {
        dims,
        spec: AttentionSpec {
            tile,
            ..AttentionSpec::causal(0)
        },
        dtype,
    }
}

#[test]
fn ring_attention_is_the_unsplit_kernel_in_f64() {
    // GQA (4 query heads over 2), chunks of 3 positions (odd), tiles of 2 (several per chunk).
    for (cp, layout) in [
        (2, CpLayout::LoadBalanced),
        (4, CpLayout::LoadBalanced),
        (2, CpLayout::Contiguous),
        (4, CpLayout::Contiguous),
    ] {
        let seq = 3
            * cp
            * if layout == CpLayout::LoadBalanced {
                2
            } else {
                1
            };
        let c = case([2, 4, 2, seq, 8], 2, DType::F64);
        check("causal", &c, cp, layout, 1e-12);
    }
}

#[test]
fn ring_attention_with_window_softcap_and_dropout() {
    // A window of 5 over chunks of 3: pairs wholly before it are skipped, and a row of a pair
    // sees no key at all (its output 0, weighed 0 in the merge).
    let mut c = case([1, 4, 1, 24, 8], 2, DType::F64);
    c.spec.window = Some(5);
    check("window", &c, 4, CpLayout::LoadBalanced, 1e-12);
    // The contiguous layout's ring stops early: the window reaches one block back.
    check("window", &c, 4, CpLayout::Contiguous, 1e-12);
    let mut c = case([2, 2, 2, 12, 4], 3, DType::F64);
    c.spec.softcap = Some(0.7);
    c.spec.scale = Some(0.8);
    check("softcap", &c, 2, CpLayout::LoadBalanced, 1e-12);
    // Dropout: each pair's mask is its region of the whole sequence's.
    let mut c = case([2, 4, 2, 16, 4], 3, DType::F64);
    c.spec.dropout = Some(AttentionDropout {
        p: 0.3,
        key: DropoutKey {
            seed: 9,
            at: DropoutStep::new(2),
        },
        site: 3,
        batch_total: 2,
        batch: 0..2,
        heads_total: 4,
        heads: 0..4,
        positions: None,
    });
    check("dropout", &c, 2, CpLayout::LoadBalanced, 1e-12);
    check("dropout", &c, 4, CpLayout::Contiguous, 1e-12);
}

#[test]
fn ring_attention_on_the_cpu_kernel_in_f32_and_bf16() {
    let c = case([2, 4, 2, 40, 16], 4, DType::F32);
    check("f32", &c, 2, CpLayout::LoadBalanced, 1e-5);
    check("f32", &c, 4, CpLayout::LoadBalanced, 1e-5);
    let mut c = case([1, 2, 1, 32, 8], 4, DType::F32);
    c.spec.window = Some(6);
    check("f32 window", &c, 4, CpLayout::LoadBalanced, 1e-5);
    // bf16 inputs (computed in f32, the output cast back) against the unsplit bf16 kernel.
    let c = case([1, 2, 2, 16, 8], 4, DType::BF16);
    check("bf16", &c, 2, CpLayout::LoadBalanced, 2e-2);
}

#[test]
fn ring_attention_errors_name_the_values() {
    let out = run_local(2, |g| {
        let ctx = ContextParallel::new(g, CpLayout::LoadBalanced).unwrap();
        let seq = ctx.chunks(10).unwrap_err().to_string();
        let q = tensor(uniform(2 * 3 * 4, 1), [1, 2, 3, 4], DType::F32);
        let odd = ctx
            .attention(q.clone(), q.clone(), q.clone(), AttentionSpec::causal(0))
            .unwrap_err()
            .to_string();
        let q = tensor(uniform(2 * 4 * 4, 1), [1, 2, 4, 4], DType::F32);
        let start = ctx
            .attention(q.clone(), q.clone(), q, AttentionSpec::causal(2))
            .unwrap_err()
            .to_string();
        (seq, odd, start)
    })
    .unwrap();
    let (seq, odd, start) = &out[0];
    assert!(
        seq.contains("10 positions") && seq.contains("4 equal chunks"),
        "{seq}"
    );
    assert!(
        odd.contains("[1, 2, 3, 4]") && odd.contains("2 equal chunks"),
        "{odd}"
    );
    assert!(start.contains("start 2"), "{start}");
}

/// Sizes of the models' cases: vocabulary, sequence, batch.
const V: usize = 32;
const SEQ: usize = 16;
const B: usize = 2;

/// The mean loss over the ranks and the mean of their gradients (gathered to tp 1), of `M`
/// built from `config` at tp x cp (cp carved out of the data-parallel ranks), each rank given
/// its chunks of the ids and targets; `step` turns dropout on.
fn model_run<M: LanguageModel>(
    config: M::Config,
    [tp, cp]: [usize; 2],
    layout: CpLayout,
    step: Option<DropoutStep>,
) -> (f64, Vec<Vec<f64>>) {
    let ids = token_ids(SEQ * B, V, 7, 3);
    let targets = token_ids(SEQ * B, V, 5, 1);
    device().seed(21);
    let out = run_local(tp * cp, move |world| {
        let mesh = DeviceMesh::new(world, tp).unwrap();
        let ctx = (cp > 1).then(|| ContextParallel::new(mesh.context_group(cp).unwrap(), layout));
        let ctx = ctx.transpose().unwrap();
        // The first replica draws the model alone (the Flex RNG is one for every thread), the
        // others theirs after it, then take the first one's.
        let dp = mesh.dp_group();
        if dp.rank() > 0 {
            dp.barrier().unwrap();
        }
        let model = M::init(&config, mesh.tp_group(), &device()).unwrap();
        if dp.rank() == 0 && dp.world_size() > 1 {
            dp.barrier().unwrap();
        }
        let model = broadcast_parameters(model, dp).unwrap();
        let model = model.with_context_parallel(ctx.clone());
        let int = |v: Vec<i64>| {
            let t = Tensor::<2, Int>::from_data(TensorData::new(v, [SEQ, B]), &device());
            match &ctx {
                Some(c) => c.split(t, 0).unwrap(),
                None => t,
            }
        };
        let loss = model
            .loss(int(ids.clone()), int(targets.clone()), step)
            .unwrap();
        let value = f64s(loss.clone())[0];
        let grads = loss.backward();
        (value, param_values(&full_grads(&model, &grads)))
    })
    .unwrap();
    let n = out.len() as f64;
    let loss = out.iter().map(|(l, _)| l).sum::<f64>() / n;
    let mut grads = out[0].1.clone();
    for (_, g) in &out[1..] {
        for (acc, x) in grads.iter_mut().zip(g) {
            for (a, b) in acc.iter_mut().zip(x) {
                *a += b;
            }
        }
    }
    grads.iter_mut().flatten().for_each(|g| *g /= n);
    (loss, grads)
}

/// The losses and every gradient at cp 2 and 4 (x tp 1, 2; both tp modes) equal cp 1's.
fn models_agree<M: LanguageModel>(
    tag: &str,
    config: impl Fn(TpMode) -> M::Config,
    step: Option<DropoutStep>,
    layouts: &[CpLayout],
) {
    let _rng = rng_lock();
    for mode in [TpMode::AllReduce, TpMode::ReduceScatter] {
        let (want_loss, want) = model_run::<M>(config(mode), [1, 1], CpLayout::default(), step);
        for &layout in layouts {
            for [tp, cp] in [[1, 2], [2, 2], [1, 4]] {
                let (loss, grads) = model_run::<M>(config(mode), [tp, cp], layout, step);
                let what = format!("{tag} {mode:?} {layout:?} tp {tp} cp {cp}");
                assert!(
                    (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
                    "{what}: loss {loss} vs {want_loss}"
                );
                for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
                    let err = rel_norm(g, w);
                    assert!(err <= 1e-4, "{what}: parameter {i}'s gradient {err:.2e}");
                }
            }
        }
    }
}

#[test]
fn gpt_at_cp_2_and_4_is_the_unsplit_gpt() {
    // Learned positions: each rank adds its chunks' rows of the table.
    let config =
        |mode| GptConfig::new(V, SEQ, 16, 4, 2).with_settings(TpSettings::new().with_mode(mode));
    let layouts = [CpLayout::LoadBalanced, CpLayout::Contiguous];
    models_agree::<Gpt>("gpt", config, None, &layouts);
}

#[test]
fn llama_at_cp_2_and_4_with_dropout_and_a_window_is_the_unsplit_llama() {
    // Rotary positions at each chunk's place, grouped-query heads, dropout of the attention
    // and of the residual branches as the whole sequence's masks, a sliding window of 5.
    let config = |mode| {
        LlamaConfig::new(V, SEQ, 16, 4, 2, 2, 32)
            .with_sliding_window(Some(5))
            .with_dropout(0.2)
            .with_dropout_seed(7)
            .with_settings(TpSettings::new().with_mode(mode))
    };
    models_agree::<Llama>(
        "llama",
        config,
        Some(DropoutStep::new(3)),
        &[CpLayout::LoadBalanced],
    );
}

/// `train_gpt --cp`: the Llama (dropout on) at dp 2 x cp 2 and tp 2 x dp 4 x cp 2, both modes,
/// with recompute, with pipeline stages (1F1B and interleaved), gives the cp 1 run's losses (one replica's batch split over the ring); a
/// checkpoint written at cp 2 resumes at cp 1 and at cp 4 on the uninterrupted curve; the
/// flags' errors name them.
#[test]
fn train_gpt_at_cp_gives_the_cp_1_losses_and_resumes_at_any_cp() {
    let _rng = rng_lock();
    let args = |extra: &[&str], name: &str| {
        let mut argv = vec!["--arch", "llama"];
        for (flag, value) in [("--seq", "16"), ("--steps", "6")] {
            if !extra.contains(&flag) {
                argv.extend_from_slice(&[flag, value]);
            }
        }
        argv.extend_from_slice(extra);
        tiny_args(&argv, &temp_dir(name))
    };
    let want = run(&args(&["--dp", "1"], "cp-1")).unwrap().losses;
    for extra in [
        &["--dp", "2", "--cp", "2"][..],
        &[
            "--dp",
            "2",
            "--cp",
            "2",
            "--mode",
            "reduce-scatter",
            "--recompute-layers",
        ],
        &["--tp", "2", "--dp", "4", "--cp", "2"],
        &["--dp", "4", "--cp", "4"],
        // Pipeline stages, each stage's attention its own ring.
        &[
            "--dp",
            "2",
            "--cp",
            "2",
            "--pp",
            "2",
            "--micro-batches",
            "2",
        ],
    ] {
        let got = run(&args(extra, "cp")).unwrap().losses;
        assert_close(&got, &want, 1e-5, &format!("{extra:?}"));
    }
    // The interleaved schedule (4 blocks over 2 stages of 2 virtual stages) against its cp 1 run.
    let interleaved = [
        "--pp",
        "2",
        "--micro-batches",
        "2",
        "--pp-schedule",
        "interleaved",
        "--layers",
        "4",
    ];
    let want_4 = run(&args(&interleaved, "cp-1-4")).unwrap().losses;
    let at_cp = [&interleaved[..], &["--dp", "2", "--cp", "2"]].concat();
    let got = run(&args(&at_cp, "cp-4")).unwrap().losses;
    assert_close(&got, &want_4, 1e-5, "interleaved, cp 2");
    // Resumed: 3 steps at cp 2, then 3 at cp 1 or cp 4.
    let first = run(&args(
        &["--dp", "2", "--cp", "2", "--steps", "3"],
        "cp-half",
    ))
    .unwrap();
    let ckpt = first.checkpoint.to_str().unwrap().to_string();
    for extra in [&["--dp", "1"][..], &["--dp", "4", "--cp", "4"]] {
        let mut argv = extra.to_vec();
        argv.extend_from_slice(&["--steps", "3", "--resume", &ckpt]);
        let rest = run(&args(&argv, "cp-rest")).unwrap().losses;
        assert_close(&rest, &want[3..], 1e-5, &format!("resumed at {extra:?}"));
    }
    for (extra, needle) in [
        (&["--dp", "2", "--cp", "3"][..], "--cp 3 must divide --dp 2"),
        (
            &["--dp", "2", "--cp", "2", "--seq", "10"],
            "--seq 10 is not a multiple of 2 x --cp 2",
        ),
        (
            &["--dp", "2", "--cp", "2", "--ep", "2"],
            "--cp 2 does not run with --ep yet",
        ),
    ] {
        let err = run(&args(extra, "cp-err")).unwrap_err().to_string();
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
}

/// A rank that fails mid-ring (it leaves before its attention) ends every other rank's ring
/// attention with an error naming it, not a hang, long before the 60 s timeout.
#[test]
fn a_rank_failing_mid_ring_ends_every_rank_with_an_error() {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    let c = case([1, 2, 1, 16, 4], 4, DType::F32);
    let seen = Arc::new(Mutex::new(Vec::<(usize, String, Duration)>::new()));
    let log = seen.clone();
    let out = burn_tp::local::run_ranks(burn_tp::comm::LocalGroup::new(4).unwrap(), move |g| {
        g.set_timeout(Duration::from_secs(60));
        let ctx = ContextParallel::new(g, CpLayout::LoadBalanced).unwrap();
        if ctx.rank() == 2 {
            std::thread::sleep(Duration::from_millis(200));
            std::panic::resume_unwind(Box::new("rank 2 fails"));
        }
        let [q, k, v, _] = inputs(&c);
        let split = |t: Tensor<4>| ctx.split(t, 2).unwrap();
        let start = Instant::now();
        let result = ctx.attention(split(q), split(k), split(v), c.spec.clone());
        let error = result.map(|_| ()).unwrap_err().to_string();
        log.lock()
            .unwrap()
            .push((ctx.rank(), error, start.elapsed()));
    });
    assert!(out.unwrap_err().contains("rank 2 fails"));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3, "every other rank reports: {seen:?}");
    for (rank, error, elapsed) in seen.iter() {
        eprintln!("rank {rank} heard after {elapsed:?}: {error}");
        // Each names its transfer (`recv 3 <- 2`) and the peer that left its link.
        assert!(
            error.contains("left the group") && (error.contains("<-") || error.contains("->")),
            "rank {rank}: {error}"
        );
        // Event driven, not the timeout: bounded at half of it for a loaded machine.
        assert!(
            *elapsed < Duration::from_secs(30),
            "rank {rank}: {elapsed:?}"
        );
    }
}

#[test]
fn gemma_at_cp_2_and_4_is_the_unsplit_gemma() {
    // Sliding and full layers (each its own rotary base), the scores' soft cap and scale,
    // dropout: the ring with each layer's window.
    let config = |mode| {
        GemmaConfig::new(V, SEQ, 16, 4, 2, 3, 24, 8)
            .with_layer_types(vec![
                LayerType::Sliding,
                LayerType::Full,
                LayerType::Sliding,
            ])
            .with_sliding_window(Some(5))
            .with_rope_local_theta(50.0)
            .with_query_pre_attn_scalar(Some(6.0))
            .with_attn_logit_softcap(Some(1.5))
            .with_dropout(0.1)
            .with_settings(TpSettings::new().with_mode(mode))
    };
    models_agree::<Gemma>(
        "gemma",
        config,
        Some(DropoutStep::new(2)),
        &[CpLayout::LoadBalanced],
    );
}

/// The load-balanced layout, pinned: at cp 2 rank 0 holds chunks 0 and 3 of 4 (positions
/// 0..4 and 12..16 of 16) and rank 1 chunks 1 and 2; at cp 4 rank `r` chunks `r` and `7 - r` of
/// 8. Each rank's causal work (the keys its queries see, `sum(i + 1)`) is the same; the
/// contiguous layout's is not. `split` cuts exactly those positions, in that order.
#[test]
fn the_load_balanced_layout_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r_and_equal_work() {
    let layout = |cp: usize, seq: usize, kind: CpLayout| {
        run_local(cp, move |g| {
            let ctx = ContextParallel::new(g, kind).unwrap();
            let x = Tensor::<2, Int>::from_data(
                TensorData::new((0..seq as i64).collect::<Vec<_>>(), [1, seq]),
                &device(),
            );
            let cut = ctx.split(x, 1).unwrap().into_data().convert::<i64>();
            let cut: Vec<i64> = cut.try_to_vec().unwrap();
            (ctx.chunks(seq).unwrap(), ctx.positions(seq).unwrap(), cut)
        })
        .unwrap()
    };
    let work = |positions: &[usize]| positions.iter().map(|&i| i + 1).sum::<usize>();
    let cp2 = layout(2, 16, CpLayout::LoadBalanced);
    assert_eq!(cp2[0].0, vec![0..4, 12..16]);
    assert_eq!(cp2[1].0, vec![4..8, 8..12]);
    let cp4 = layout(4, 32, CpLayout::LoadBalanced);
    for (r, (chunks, positions, cut)) in cp4.iter().enumerate() {
        assert_eq!(
            chunks,
            &vec![r * 4..(r + 1) * 4, (7 - r) * 4..(8 - r) * 4],
            "cp 4 rank {r}"
        );
        assert_eq!(
            cut,
            &positions.iter().map(|&p| p as i64).collect::<Vec<_>>()
        );
        assert_eq!(
            work(positions),
            work(&cp4[0].1),
            "cp 4 rank {r}'s causal work"
        );
    }
    assert_eq!(work(&cp2[0].1), work(&cp2[1].1));
    let plain = layout(2, 16, CpLayout::Contiguous);
    assert_eq!(plain[0].0, vec![0..8]);
    assert!(
        work(&plain[1].1) > 2 * work(&plain[0].1),
        "contiguous: the last rank does more"
    );
}

/// Ring attention under cp 2 with a soft cap that binds, on the CPU kernel (f32, bf16) and the
/// tensor-op tiles (f64), against the materialized path (not the unsplit kernel, which would
/// share a kernel's mistake): each rank's output and gradients.
#[test]
fn ring_attention_with_a_binding_soft_cap_is_the_materialized_attention() {
    let (gain, cap) = (4.0, 0.5);
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4), (DType::BF16, 4e-2)] {
        let mut c = case([1, 4, 2, 16, 8], 2, dtype);
        let [b, hq, hkv, seq, hd] = c.dims;
        c.spec.scale = Some(gain / (hd as f64).sqrt());
        c.spec.softcap = Some(cap);
        let want = {
            let [q, k, v, w] = inputs(&c);
            let out = crate::attention::materialized(
                q.clone().mul_scalar(gain),
                k.clone(),
                v.clone(),
                0,
                None,
                &[],
                None,
                Some(cap),
            );
            let grads = (out.clone() * w).sum().backward();
            let g = |t: &Tensor<4>| f64s(t.grad(&grads).unwrap());
            [f64s(out), g(&q), g(&k), g(&v)]
        };
        for (r, (got, positions)) in ring(&c, 2, CpLayout::LoadBalanced).iter().enumerate() {
            for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
                let h = if i >= 2 { hkv } else { hq };
                let want = at(&want[i], [b, h, seq, hd], positions);
                let err = rel_norm(&got[i], &want);
                assert!(err <= tol, "{dtype:?} rank {r} {name}: {err:.2e}");
            }
        }
    }
}
