//! Section 6: fully sharded data parallelism's bytes per rank. The 50M-parameter GPT of
//! PERFORMANCE's checkpoint section (d 1024, 8 heads, 4 layers, f32) trained two steps at dp 4
//! (ranks as threads, each its own allocation tag, `main.rs`'s counting allocator): plain dp,
//! the distributed optimizer (ZeRO-1), fsdp with and without resharding after the forward, HSDP
//! and tp 2 x fsdp 2. What a rank holds between steps (parameters and AdamW's moments) against
//! the floor, the unsharded model's bytes x 3 / world, and the second step's peak.

use std::sync::atomic::Ordering;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::comm::{LinkModel, LocalGroup, LocalGroupOptions, ReduceOp};
use burn_tp::dp::{DistributedAdamW, DpOptimizer};
use burn_tp::fsdp::Fsdp;
use burn_tp::gpt::GptConfig;
use burn_tp::local::{RunOptions, run_ranks_with};
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::reshard::move_optimizer_state;

use super::{TAG, TAGGED, TAGGED_PEAK, mb};

/// How the dp ranks hold the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Plain,
    Zero1,
    /// The shard group's size; whether it reshards after the forward.
    Fsdp(usize, bool),
}

/// The most any rank holds between steps (after the second): its parameters' and AdamW
/// moments' bytes, and its allocations (above what it held before building the model: the
/// tensors, and the collectives' pooled receive buffers it allocated); and the second step's
/// peak.
fn measure(config: &GptConfig, [tp, dp]: [usize; 2], layout: Layout, seq: usize) -> [f64; 3] {
    let config = config.clone();
    let vocab = config.n_vocab;
    let options = RunOptions {
        threads_per_rank: Some(1),
        keep_freed_memory: Some(false),
    };
    let out = run_ranks_with(LocalGroup::new(tp * dp).unwrap(), options, move |world| {
        let rank = world.rank();
        TAG.set(rank);
        let before = TAGGED[rank].load(Ordering::SeqCst);
        let device = Device::flex().autodiff();
        let mesh = DeviceMesh::new(world, tp).unwrap();
        let dp_group = mesh.dp_group().clone();
        let mut model = config.init(mesh.tp_group(), &device).unwrap();
        let adamw = AdamWConfig::new().init();
        let (fsdp, mut optim) = match layout {
            Layout::Plain => (None, DpOptimizer::new(adamw)),
            Layout::Zero1 => {
                let zero = DistributedAdamW::new(&AdamWConfig::new(), &model, &dp_group, 4 << 20);
                (
                    None,
                    DpOptimizer::distributed(adamw, zero, AdamWConfig::new()),
                )
            }
            Layout::Fsdp(shard, reshard) => {
                let (shard, replicas) = mesh.fsdp_groups(shard).unwrap();
                let fsdp = Fsdp::new(&model, &shard)
                    .with_replicas(&replicas)
                    .with_reshard_after_forward(reshard);
                model = fsdp.shard(model);
                let optim = DpOptimizer::new(adamw).with_fsdp(fsdp.clone());
                (Some(fsdp), optim)
            }
        };
        let v: Vec<i64> = (0..seq).map(|j| ((j * 7 + rank) % vocab) as i64).collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, 1]), &device);
        let mut peak = 0;
        for _ in 0..2 {
            mesh.world().barrier().unwrap();
            TAGGED_PEAK[rank].store(TAGGED[rank].load(Ordering::SeqCst), Ordering::SeqCst);
            let grads = match &fsdp {
                Some(f) => {
                    f.loss_and_grads(&model, ids.clone(), ids.clone(), None)
                        .unwrap()
                        .1
                }
                None => {
                    let working = optim.attach(model.clone());
                    let loss = LanguageModel::loss(&working, ids.clone(), ids.clone(), None);
                    burn::optim::GradientsParams::from_grads(loss.unwrap().backward(), &working)
                }
            };
            model = optim
                .step(1e-3, model.clone(), &model, grads, &dp_group)
                .unwrap();
            peak = TAGGED_PEAK[rank].load(Ordering::SeqCst) - before;
        }
        let held = TAGGED[rank].load(Ordering::SeqCst) - before;
        // The tensors themselves: the parameters and (but for ZeRO-1, whose state the
        // optimizer would gather to show) AdamW's moments, each state field counted as a model.
        let tensors = match layout {
            Layout::Zero1 => f64::NAN,
            _ => {
                let bytes = std::cell::Cell::new(Fsdp::param_bytes(&model));
                let adamw = optim.module_optimizer(&model).unwrap();
                move_optimizer_state(adamw, &model, &model, |field| {
                    bytes.set(bytes.get() + Fsdp::param_bytes(&field));
                    Ok(field)
                })
                .unwrap();
                bytes.get() as f64
            }
        };
        drop((model, optim));
        TAG.set(usize::MAX);
        [tensors, held as f64, peak as f64]
    })
    .unwrap();
    let most = |i: usize| out.iter().map(|o| o[i]).fold(f64::NAN, f64::max);
    [most(0), most(1), most(2)]
}

pub(super) fn fsdp_memory(quick: bool) {
    let (d, heads, layers, seq) = if quick {
        (128, 4, 2, 16)
    } else {
        (1024, 8, 4, 64)
    };
    let config = GptConfig::new(256, seq, d, heads, layers);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let params = (config.init(&solo, &Device::flex()).unwrap().num_params() * 4) as f64;
    println!(
        "\n## Fully sharded data parallelism: bytes per rank (MB; GPT d {d}, {heads} heads, \
         {layers} layers, f32, batch 1 x seq {seq} per rank; ranks as threads of one core each)\n"
    );
    println!(
        "unsharded parameters: {} MB. Held between steps: the parameters and AdamW's two \
         moments (the tensors; the allocations add the collectives' pooled receive buffers); floor: 3 x the parameters / (tp x the ranks a parameter is split over).\n",
        mb(params)
    );
    println!(
        "| layout | parameters + moments held | floor | / floor | allocations held between \
         steps | step peak | peak / plain dp's |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut plain_peak = 0.0;
    for (tp, dp, layout) in [
        (1usize, 4usize, Layout::Plain),
        (1, 4, Layout::Zero1),
        (1, 4, Layout::Fsdp(4, false)),
        (1, 4, Layout::Fsdp(4, true)),
        (1, 2, Layout::Fsdp(2, true)),
        (1, 4, Layout::Fsdp(2, true)),
        (2, 2, Layout::Fsdp(2, true)),
    ] {
        let [tensors, held, peak] = measure(&config, [tp, dp], layout, seq);
        if layout == Layout::Plain {
            plain_peak = peak;
        }
        let split = match layout {
            Layout::Plain | Layout::Zero1 => 1,
            Layout::Fsdp(n, _) => n,
        };
        let floor = match layout {
            // ZeRO-1: the parameters whole, the moments / dp.
            Layout::Zero1 => params / tp as f64 * (1.0 + 2.0 / dp as f64),
            _ => 3.0 * params / (tp * split) as f64,
        };
        let name = match layout {
            Layout::Plain => format!("tp {tp} x dp {dp}, plain"),
            Layout::Zero1 => format!("tp {tp} x dp {dp}, distributed optimizer"),
            Layout::Fsdp(n, r) if n == dp => format!(
                "tp {tp} x fsdp {dp}{}",
                if r { ", reshard after forward" } else { "" }
            ),
            Layout::Fsdp(n, _) => format!("tp {tp} x dp {dp}, hsdp (shards of {n})"),
        };
        println!(
            "| {name} | {} | {} | {:.3} | {} | {} | {:.3} |",
            if tensors.is_nan() {
                "-".into()
            } else {
                mb(tensors)
            },
            mb(floor),
            tensors / floor,
            mb(held),
            mb(peak),
            peak / plain_peak
        );
    }
}

/// Seconds of a training step (forward, backward, reductions, AdamW; the slowest rank's median
/// of `reps`) at dp `dp` over `link` (none: the threads' shared memory).
fn step_seconds(
    config: &GptConfig,
    dp: usize,
    layout: Layout,
    prefetch: bool,
    link: Option<LinkModel>,
    [seq, batch, reps]: [usize; 3],
) -> f64 {
    let config = config.clone();
    let vocab = config.n_vocab;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = RunOptions {
        threads_per_rank: Some((cores / dp).max(1)),
        keep_freed_memory: Some(true),
    };
    let group = LocalGroup::with_options(
        dp,
        LocalGroupOptions {
            link,
            ..LocalGroupOptions::default()
        },
    )
    .unwrap();
    let out = run_ranks_with(group, options, move |g| {
        let device = Device::flex().autodiff();
        let tp = g.split(g.rank(), 0).unwrap();
        let mut model = config.init(&tp, &device).unwrap();
        let mut optim = DpOptimizer::new(AdamWConfig::new().init());
        let fsdp = match layout {
            Layout::Fsdp(_, reshard) => {
                let fsdp = Fsdp::new(&model, &g)
                    .with_reshard_after_forward(reshard)
                    .with_prefetch(prefetch);
                model = fsdp.shard(model);
                optim = optim.with_fsdp(fsdp.clone());
                Some(fsdp)
            }
            _ => None,
        };
        let v: Vec<i64> = (0..seq * batch)
            .map(|j| ((j * 7 + g.rank()) % vocab) as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, batch]), &device);
        let mut times = Vec::new();
        for rep in 0..=reps {
            g.barrier().unwrap();
            let t = Instant::now();
            let grads = match &fsdp {
                Some(f) => {
                    f.loss_and_grads(&model, ids.clone(), ids.clone(), None)
                        .unwrap()
                        .1
                }
                None => {
                    let loss = LanguageModel::loss(&model, ids.clone(), ids.clone(), None);
                    GradientsParams::from_grads(loss.unwrap().backward(), &model)
                }
            };
            model = optim.step(1e-3, model.clone(), &model, grads, &g).unwrap();
            // The first step builds AdamW's state and warms the pools.
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        g.all_reduce(vec![median], ReduceOp::Max).unwrap()[0]
    })
    .unwrap();
    out[0]
}

/// The step against plain dp's in one run, and what the prefetch hides over a simulated link:
/// `hidden = 1 - (the step over the link - without it) / the link's time for what a rank
/// receives` (each gather brings `(n - 1) / n` of the parameters, each reduce-scatter as much,
/// each collective one latency: one per parameter tensor).
pub(super) fn fsdp_step_time(quick: bool) {
    let (d, heads, layers, seq, batch, reps) = if quick {
        (64, 4, 2, 16, 1, 2)
    } else {
        (512, 8, 4, 128, 4, 7)
    };
    let dp = 2;
    let config = GptConfig::new(256, seq, d, heads, layers);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let whole = config.init(&solo, &Device::flex()).unwrap();
    let params = (whole.num_params() * 4) as f64;
    let tensors = tensor_count(&whole) as f64;
    let (gb_s, latency_us) = (0.25, 20.0);
    println!(
        "\n## Fully sharded data parallelism: the step against plain dp (GPT d {d}, {heads} \
         heads, {layers} layers, f32, batch {batch} x seq {seq} per rank, dp {dp}: ranks as \
         threads sharing the cores; link: {gb_s} GB/s, {latency_us} us, or none)\n"
    );
    println!(
        "| layout | prefetch | step, no link (s) | / plain dp | step over the link (s) | \
         link time of what a rank receives (s) | hidden |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    let shape = [seq, batch, reps];
    let link = Some(LinkModel::new(gb_s, latency_us));
    let plain = step_seconds(&config, dp, Layout::Plain, false, None, shape);
    let plain_linked = step_seconds(&config, dp, Layout::Plain, false, link, shape);
    // Plain dp all-reduces the gradients after the backward: 2 (n - 1) / n of them.
    let share = (dp - 1) as f64 / dp as f64;
    let link_time = |passes: f64, calls: f64| {
        passes * share * params / (gb_s * 1e9) + calls * tensors * latency_us * 1e-6
    };
    println!(
        "| plain dp (all-reduce after the backward) | - | {plain:.3} | 1.000 | {plain_linked:.3} \
         | {:.3} | {:.2} |",
        link_time(2.0, 1.0),
        1.0 - (plain_linked - plain) / link_time(2.0, 1.0)
    );
    for (reshard, passes) in [(false, 2.0), (true, 3.0)] {
        for prefetch in [true, false] {
            let layout = Layout::Fsdp(dp, reshard);
            let t = step_seconds(&config, dp, layout, prefetch, None, shape);
            let linked = step_seconds(&config, dp, layout, prefetch, link, shape);
            let name = match reshard {
                true => format!("fsdp {dp}, reshard after forward"),
                false => format!("fsdp {dp}"),
            };
            println!(
                "| {name} | {} | {t:.3} | {:.3} | {linked:.3} | {:.3} | {:.2} |",
                if prefetch { "on" } else { "off" },
                t / plain,
                link_time(passes, passes),
                1.0 - (linked - t) / link_time(passes, passes)
            );
        }
    }
}

/// The parameter tensors of `model`.
fn tensor_count<M: Module>(model: &M) -> usize {
    struct Count(usize);
    impl burn::module::ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, _: &burn::module::Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

/// Seconds of a pipelined step at pp 2 x fsdp 2 (1F1B, `m` micro-batches; the slowest rank's
/// median of `reps`) over `link` (which the stages' transfers cross too), and the fraction of
/// fsdp's gathers' time (post to completion) the ranks did not wait for (the profile's).
fn pipelined_seconds(
    config: &GptConfig,
    (reshard, prefetch): (bool, bool),
    link: Option<LinkModel>,
    [seq, batch, m, reps]: [usize; 4],
) -> (f64, f64) {
    use burn_tp::pipeline::{
        Pipeline, PipelineSchedule, drop_unused_ends, loss_and_grads_sharded, virtual_stage_layers,
    };
    let (pp, dp) = (2, 2);
    let config = config.clone();
    let vocab = config.n_vocab;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = RunOptions {
        threads_per_rank: Some((cores / (pp * dp)).max(1)),
        keep_freed_memory: Some(true),
    };
    let options_link = LocalGroupOptions {
        link,
        profile: true,
        ..LocalGroupOptions::default()
    };
    let group = LocalGroup::with_options(pp * dp, options_link).unwrap();
    let out = run_ranks_with(group, options, move |world| {
        let device = Device::flex().autodiff();
        let mesh = DeviceMesh::with_pipeline(world.clone(), 1, pp).unwrap();
        let (stage, dp_group) = (mesh.pp_rank(), mesh.dp_group().clone());
        let schedule = PipelineSchedule::OneFOneB;
        let layers: Vec<usize> = virtual_stage_layers(config.n_layers, pp, schedule, stage)
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        let model = config.init(mesh.tp_group(), &device).unwrap();
        let model = drop_unused_ends(model.keep_layers(&layers), stage, pp).unwrap();
        let fsdp = Fsdp::new(&model, &dp_group)
            .with_reshard_after_forward(reshard)
            .with_prefetch(prefetch);
        let mut model = fsdp.shard(model);
        let mut optim = DpOptimizer::new(AdamWConfig::new().init()).with_fsdp(fsdp.clone());
        let pipe = Pipeline::new(mesh.pp_group()).unwrap();
        let v: Vec<i64> = (0..seq * batch)
            .map(|j| ((j * 7 + dp_group.rank()) % vocab) as i64)
            .collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, batch]), &device);
        let micro: Vec<_> = (0..m)
            .map(|i| {
                let cut = ids.clone().narrow(1, i * batch / m, batch / m);
                (cut.clone(), cut)
            })
            .collect();
        let mut times = Vec::new();
        for rep in 0..=reps {
            world.barrier().unwrap();
            let t = Instant::now();
            let out = loss_and_grads_sharded(&model, &pipe, &micro, schedule, None, &fsdp);
            let grads = out.unwrap().grads;
            model = optim
                .step(1e-3, model.clone(), &model, grads, &dp_group)
                .unwrap();
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let profile = world.profile().expect("profiled");
        let gathers = profile
            .rows
            .iter()
            .filter(|r| r.label.starts_with("fsdp gather"));
        let (comm, waited) = gathers.fold((0.0, 0.0), |(c, w), r| {
            (c + r.comm.as_secs_f64(), w + r.waited.as_secs_f64())
        });
        let median = world.all_reduce(vec![median], ReduceOp::Max).unwrap()[0];
        let sums = world.all_reduce(vec![comm, waited], ReduceOp::Sum).unwrap();
        (median, 1.0 - sums[1] / sums[0])
    })
    .unwrap();
    out[0]
}

/// The prefetch under a pipeline (pp 2 x fsdp 2, 1F1B): the step with and without it, over
/// the simulated link and without one; `exposed` = the step over the link - without it (the
/// communication the step did not hide: gathers, reduce-scatters and the stages' transfers);
/// and the fraction of the gathers' time the ranks did not wait for, from the profile.
pub(super) fn fsdp_pipeline_time(quick: bool) {
    let (d, heads, layers, seq, batch, m, reps) = if quick {
        (64, 4, 4, 16, 2, 2, 2)
    } else {
        (512, 8, 4, 128, 8, 4, 5)
    };
    let config = GptConfig::new(256, seq, d, heads, layers);
    let (gb_s, latency_us) = (0.25, 20.0);
    println!(
        "\n## Fully sharded data parallelism under a pipeline: the prefetch (GPT d {d}, {heads} \
         heads, {layers} layers, f32, pp 2 x fsdp 2, 1F1B, {m} micro-batches of {} x seq {seq} \
         per rank; four rank threads sharing the cores; link: {gb_s} GB/s, {latency_us} us, or \
         none)\n",
        batch / m
    );
    println!(
        "| layout | prefetch | step, no link (s) | step over the link (s) | exposed (s) | \
         exposed / without prefetch | gathers hidden, no link | over the link |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let shape = [seq, batch, m, reps];
    let link = Some(LinkModel::new(gb_s, latency_us));
    for reshard in [false, true] {
        let mut off = None;
        for prefetch in [false, true] {
            let (t, hidden) = pipelined_seconds(&config, (reshard, prefetch), None, shape);
            let (linked, hidden_linked) =
                pipelined_seconds(&config, (reshard, prefetch), link, shape);
            let exposed = linked - t;
            let ratio = off.map_or("1.00".into(), |o: f64| format!("{:.2}", exposed / o));
            off.get_or_insert(exposed);
            let name = match reshard {
                true => "pp 2 x fsdp 2, reshard after forward",
                false => "pp 2 x fsdp 2",
            };
            println!(
                "| {name} | {} | {t:.3} | {linked:.3} | {exposed:.3} | {ratio} | {hidden:.2} | \
                 {hidden_linked:.2} |",
                if prefetch { "on" } else { "off" },
            );
        }
    }
}
