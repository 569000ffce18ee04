//! Clipping by the global norm at any layout ([`GradClip::sharded`]: each element counted by the
//! rank that writes it to the checkpoint): the norm of a pipeline's stages with a tied table is
//! the whole model's, and `train_gpt --clip-grad`'s clipped curve does not move with tp, pp,
//! ep, fsdp x ep, HSDP x ep or the distributed optimizer.

use burn::optim::GradientsParams;
use burn_tp::checkpoint::Sharding;
use burn_tp::dp::{GradClip, average_gradients};
use burn_tp::gpt::{Gpt as GptShard, GptConfig};
use burn_tp::local::run_local;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::pipeline::{
    Pipeline, PipelineSchedule, drop_unused_ends, loss_and_grads, stage_layers, stage_map,
};
use burn_tp::reshard::Reshard;
use burn_tp_comm::LocalGroup;
use burn_tp_examples::train_gpt::run;

use crate::common::{assert_close, device, rng_lock};
use crate::pipeline::{MICRO, ids, micro_batches};
use crate::train_gpt::{temp_dir, tiny_args};

/// A GPT whose head is its embedding table (held by the first and the last stage, its
/// gradient summed over both) at tp 2 x pp 2 x dp 2: on every rank, the clip's norm is the
/// whole model's on one thread (the table counted once, the tp-replicated norms once, dp
/// replica 0's alone).
#[test]
fn the_clips_norm_over_stages_with_a_tied_table_is_the_whole_models() {
    let _rng = rng_lock();
    let (tp, dp, pp, m) = (2, 2, 2, 2);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    device().seed(3);
    let full = GptConfig::new(23, crate::pipeline::SEQ, 16, 4, 4)
        .with_tie_embeddings(true)
        .init(&solo, &device())
        .unwrap();
    assert!(full.tied_head());
    let (x, y) = (ids(dp * m * MICRO, 1), ids(dp * m * MICRO, 5));
    let n = dp * m;
    let loss = micro_batches(&x, &y, 0, n)
        .into_iter()
        .map(|(a, b)| {
            LanguageModel::loss(&full, a, b, None)
                .unwrap()
                .div_scalar(n as f64)
        })
        .reduce(|a, b| a + b)
        .unwrap();
    let mut grads = GradientsParams::from_grads(loss.backward(), &full);
    let want = GradClip::new(&full, &solo, 1e9)
        .clip(&full, &mut grads)
        .unwrap();
    let layers = full.num_layers();
    let norms = run_local(tp * dp * pp, move |world| {
        let mesh = DeviceMesh::with_pipeline(world.clone(), tp, pp).unwrap();
        let stage = mesh.pp_rank();
        let held: Vec<usize> = stage_layers(layers, pp, None).unwrap()[stage]
            .clone()
            .collect();
        let model = GptShard::shard_module(&full, mesh.tp_group()).unwrap();
        let model = model.keep_layers(&held);
        let model = drop_unused_ends(model, stage, pp).unwrap();
        let map = stage_map(&model, layers, stage, pp).unwrap();
        let sharding = Sharding::of(&model, mesh.tp_rank(), map);
        let pipe = Pipeline::new(mesh.pp_group()).unwrap();
        let micro = micro_batches(&x, &y, mesh.dp_rank() * m * MICRO, m);
        let schedule = PipelineSchedule::OneFOneB;
        let mut out = loss_and_grads(&model, &pipe, &micro, schedule, None).unwrap();
        average_gradients(&model, &mut out.grads, mesh.dp_group()).unwrap();
        let clip = GradClip::sharded(&model, &sharding, mesh.dp_rank() == 0, &world, 1e9);
        clip.clip(&model, &mut out.grads).unwrap()
    })
    .unwrap();
    for (rank, norm) in norms.into_iter().enumerate() {
        assert_close(&[norm], &[want], 1e-5, &format!("rank {rank}'s norm"));
    }
}

/// `reference`'s clipped losses (checked to differ from its unclipped ones: the clip binds)
/// and each layout's, which must equal them to 1e-5.
fn clipped_curve_holds(base: &[&str], reference: &[&str], layouts: &[&[&str]]) {
    let clip = ["--clip-grad", "0.05", "--steps", "4"];
    let losses = |extra: &[&str], clipped: bool| {
        let mut argv = base.to_vec();
        argv.extend_from_slice(extra);
        if clipped {
            argv.extend_from_slice(&clip);
        } else {
            argv.extend_from_slice(&clip[2..]);
        }
        run(&tiny_args(&argv, &temp_dir("clip"))).unwrap().losses
    };
    let want = losses(reference, true);
    let free = losses(reference, false);
    let moved = want.iter().zip(&free).any(|(c, f)| (c - f).abs() > 1e-4);
    assert!(moved, "{reference:?}: the clip binds: {want:?} vs {free:?}");
    for layout in layouts {
        let got = losses(layout, true);
        assert_close(
            &got,
            &want,
            1e-5,
            &format!("{layout:?} against {reference:?}"),
        );
    }
}

/// `train_gpt`'s GPT clipped at tp 2, pp 2 (1F1B and interleaved) and tp 2 x pp 2 x dp 2,
/// with or without the distributed optimizer, gives the one-rank curve.
#[test]
fn a_clipped_gpt_keeps_its_curve_under_a_pipeline() {
    let _rng = rng_lock();
    let pp = ["--pp", "2", "--micro-batches", "2"];
    let tp_pp_dp = [&["--tp", "2", "--dp", "2"][..], &pp].concat();
    // The distributed optimizer: each rank its chunks, tp-replicated elements once.
    let zero = ["--distributed-optimizer"];
    let tp_dp_zero = [&["--tp", "2", "--dp", "2"][..], &zero].concat();
    let tp_pp_dp_zero = [&tp_pp_dp[..], &zero].concat();
    let interleaved = [
        &pp[..],
        &["--pp-schedule", "interleaved", "--virtual-stages", "2"],
    ]
    .concat();
    clipped_curve_holds(
        &["--arch", "gpt"],
        &["--tp", "1", "--dp", "1"],
        &[
            &["--tp", "2"],
            &[&["--tp", "1"][..], &pp].concat(),
            &tp_pp_dp,
            &tp_dp_zero,
            &tp_pp_dp_zero,
        ],
    );
    clipped_curve_holds(
        &["--arch", "gpt", "--tp", "1", "--layers", "4"],
        &[],
        &[&interleaved],
    );
}

/// A mixture of experts clipped at ep 2 (plain, fsdp, HSDP, the distributed optimizer) and
/// under a pipeline gives the ep 1 curve: the experts' elements counted on the rank holding
/// them, the rest once.
#[test]
fn a_clipped_mixture_of_experts_keeps_its_curve_at_every_ep_layout() {
    let _rng = rng_lock();
    let moe = [
        "--arch",
        "moe",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--tp",
        "1",
    ];
    clipped_curve_holds(
        &moe,
        &["--dp", "4", "--ep", "1"],
        &[
            &["--dp", "4", "--ep", "2"],
            &["--dp", "4", "--ep", "4"],
            &["--dp", "4", "--ep", "2", "--fsdp"],
            &["--dp", "4", "--ep", "2", "--hsdp", "2"],
            &["--dp", "4", "--ep", "2", "--distributed-optimizer"],
        ],
    );
    let pp = [
        &moe[..],
        &["--pp", "2", "--micro-batches", "2", "--dp", "2"],
    ]
    .concat();
    clipped_curve_holds(
        &pp,
        &["--ep", "1"],
        &[
            &["--ep", "2"],
            &["--ep", "2", "--fsdp"],
            &["--ep", "2", "--distributed-optimizer"],
        ],
    );
}

/// The distributed optimizer's chunks are summed over the world: a clip made for the whole
/// gradients over tp ([`GradClip::new`]) is refused at the step, naming the constructor to use,
/// not a norm silently short of the other ranks' chunks.
#[test]
fn the_distributed_optimizer_refuses_a_clip_that_sums_over_tp_alone() {
    use burn::optim::AdamWConfig;
    use burn_tp::dp::{DistributedAdamW, DpOptimizer};
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let model = GptConfig::new(23, crate::pipeline::SEQ, 16, 4, 2)
        .init(&solo, &device())
        .unwrap();
    let config = AdamWConfig::new();
    let zero = DistributedAdamW::new(&config, &model, &solo, 1 << 20);
    let mut optim = DpOptimizer::distributed(config.init(), zero, config)
        .with_clip(GradClip::new(&model, &solo, 1.0));
    let (x, y) = (ids(MICRO, 1), ids(MICRO, 5));
    let loss = LanguageModel::loss(&optim.attach(model.clone()), x, y, None).unwrap();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let err = optim
        .step(1e-2, model.clone(), &model, grads, &solo)
        .unwrap_err();
    assert!(err.to_string().contains("GradClip::sharded"), "{err}");
}

/// A Llama with one key / value head (replicated over tp 2) and its RMSNorms (tp-replicated),
/// in sequence parallel: the global gradient norm at tp 2 (plain `GradClip::new`) and at tp 2 x
/// dp 2 with the distributed optimizer (`GradClip::sharded`, every rank counting its chunks) is
/// the unsplit model's on one thread, on every rank; a norm that counted the replicated
/// parameters on every tp rank would be larger.
#[test]
fn the_global_norm_at_tp_2_with_replicated_heads_and_norms_is_the_unsplit_models() {
    use burn::optim::AdamWConfig;
    use burn_tp::checkpoint::StageMap;
    use burn_tp::dp::DistributedAdamW;
    use burn_tp::linear::{TpMode, TpSettings};
    use burn_tp::llama::{Llama, LlamaConfig};
    let _rng = rng_lock();
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let config = LlamaConfig::new(24, 8, 16, 4, 1, 2, 32)
        .with_settings(TpSettings::new().with_mode(TpMode::ReduceScatter));
    device().seed(8);
    let full = config.init(&solo, &device()).unwrap();
    // Two replicas' batches of [8, 2]; the whole model's loss is their mean.
    let batch = move |r: usize, seed: i64| {
        let v: Vec<i64> = (0..16)
            .map(|i| (i * 5 + seed + 3 * r as i64) % 24)
            .collect();
        burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(v, [8, 2]),
            &device(),
        )
    };
    let whole = move |m: &Llama, replicas: &[usize]| {
        replicas
            .iter()
            .map(|&r| LanguageModel::loss(m, batch(r, 1), batch(r, 2), None).unwrap())
            .reduce(|a, b| a + b)
            .unwrap()
            .div_scalar(replicas.len() as f64)
    };
    let norm_of = |replicas: &[usize]| {
        let mut grads = GradientsParams::from_grads(whole(&full, replicas).backward(), &full);
        GradClip::new(&full, &solo, 1e9)
            .clip(&full, &mut grads)
            .unwrap()
    };
    let (want_one, want_two) = (norm_of(&[0]), norm_of(&[0, 1]));
    let f = full.clone();
    let plain = run_local(2, move |tp| {
        let model = Llama::shard_module(&f, &tp).unwrap();
        let mut grads = GradientsParams::from_grads(whole(&model, &[0]).backward(), &model);
        GradClip::new(&model, &tp, 1e9)
            .clip(&model, &mut grads)
            .unwrap()
    })
    .unwrap();
    for (rank, norm) in plain.iter().enumerate() {
        assert_close(&[*norm], &[want_one], 1e-5, &format!("tp 2 rank {rank}"));
    }
    let f = full.clone();
    let zero = run_local(4, move |world| {
        let mesh = DeviceMesh::new(world.clone(), 2).unwrap();
        let model = Llama::shard_module(&f, mesh.tp_group()).unwrap();
        let n = burn_tp::reshard::Reshard::layout(&model, 0).len();
        let sharding = Sharding::of(&model, mesh.tp_rank(), StageMap::whole(n));
        let clip = GradClip::sharded(&model, &sharding, true, &world, 1e9);
        let mut optim =
            DistributedAdamW::new(&AdamWConfig::new(), &model, mesh.dp_group(), 1 << 12);
        let tapped = optim.attach(model.clone(), true);
        let loss = whole(&tapped, &[mesh.dp_rank()]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let (_, norm) = optim.step_clipped(1e-3, model, grads, Some(&clip)).unwrap();
        norm.unwrap()
    })
    .unwrap();
    for (rank, norm) in zero.iter().enumerate() {
        assert_close(
            &[*norm],
            &[want_two],
            1e-5,
            &format!("tp 2 x dp 2 zero rank {rank}"),
        );
    }
}
