//! A fully sharded checkpoint (`checkpoint::save_sharded` with `Fsdp::sharding`): each rank
//! writes its own rows of the model and of AdamW's moments, and any layout, fully sharded or
//! not, reads back exactly what a plain checkpoint of the same model holds.

use std::path::Path;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::checkpoint::{self, CheckpointInfo, StageMap};
use burn_tp::fsdp::Fsdp;
use burn_tp::llama::{Llama, LlamaConfig};
use burn_tp::local::run_local;
use burn_tp::mesh::DeviceMesh;
use burn_tp::model::LanguageModel;
use burn_tp::reshard::move_optimizer_state;

use super::{replicated, solo};
use crate::common::{device, param_values, rng_lock, token_ids};
use crate::train_gpt::temp_dir;

/// Rows that do not divide: the MLP's 18 rows of a tp shard over 4 ranks (5, 5, 5, 3), a
/// vocabulary shard's 15 over 2; tp 2 cuts some weights on dim 1, some on dim 0.
fn config() -> LlamaConfig {
    LlamaConfig::new(30, 8, 24, 4, 2, 2, 36)
}

/// Every parameter's values, then every AdamW moment's.
type Values = (Vec<Vec<f64>>, Vec<Vec<f64>>);

fn values<M: Module>(model: &M, optim: &ModuleOptimizer) -> Values {
    let moments = std::cell::RefCell::new(Vec::new());
    move_optimizer_state(optim, model, model, |field| {
        moments.borrow_mut().extend(param_values(&field));
        Ok(field)
    })
    .unwrap();
    (param_values(model), moments.into_inner())
}

/// `model` after one AdamW step on the same batch at every rank (the replicas stay equal).
fn stepped(model: Llama) -> (Llama, ModuleOptimizer) {
    let ids = token_ids(16, 30, 7, 3);
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [8, 2]), &device());
    let loss = LanguageModel::loss(&model, ids.clone(), ids, None).unwrap();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut optim = AdamWConfig::new().init();
    let model = optim.step(1e-2, model, grads);
    (model, optim)
}

/// Saves the stepped model at tp 2 x dp 4 into `dir`: plain (dp replica 0 writes its tp
/// shards), or fully sharded over HSDP groups of 2 (the first group's 4 ranks write their
/// rows, the other group nothing).
fn write(dir: &Path, fsdp: bool) {
    device().seed(7);
    let dir = dir.to_path_buf();
    run_local(8, move |world| {
        let mesh = DeviceMesh::new(world.clone(), 2).unwrap();
        let (model, optim) = stepped(replicated::<Llama>(&config(), &mesh));
        let info = CheckpointInfo::new(1, 2, 4, &config());
        let tp = mesh.tp_group();
        if !fsdp {
            return checkpoint::save(&model, Some(&optim), &dir, &info, tp, mesh.dp_rank())
                .unwrap();
        }
        let (shard, replicas) = mesh.fsdp_groups(2).unwrap();
        let split = Fsdp::new(&model, &shard).with_replicas(&replicas);
        let map = StageMap::whole(param_values(&model).len());
        let sharding = split.sharding(&model, tp.rank(), map);
        let shards = split.shard(model.clone());
        let moved = move_optimizer_state(&optim, &model, &shards, |m| Ok(split.shard(m))).unwrap();
        let optim = AdamWConfig::new().init().load_record(moved);
        let writes = replicas.rank() == 0;
        checkpoint::save_sharded(
            &shards,
            Some(&optim),
            &dir,
            &info,
            &sharding,
            &world,
            writes,
        )
        .unwrap();
    })
    .unwrap();
}

/// The checkpoint in `dir` read at tp 1, whole.
fn read_whole(dir: &Path) -> (Llama, ModuleOptimizer) {
    let group = solo();
    let model = Llama::init(&config(), &group, &device()).unwrap();
    let (model, _) = checkpoint::load(model, dir, Some(&config()), &group).unwrap();
    let optim = AdamWConfig::new().init();
    let optim = checkpoint::load_optimizer(optim, &model, dir, &group).unwrap();
    (model, optim)
}

/// The checkpoint in `dir` read straight into each rank's shards at tp 1 x fsdp 4, against
/// the whole read at tp 1 and cut by the same sharding.
fn read_sharded(dir: &Path) -> Vec<(Values, Values)> {
    let dir = dir.to_path_buf();
    run_local(4, move |world| {
        let (whole, whole_optim) = read_whole(&dir);
        let split = Fsdp::new(&whole, &world);
        let expected_model = split.shard(whole.clone());
        let moved =
            move_optimizer_state(
                &whole_optim,
                &whole,
                &expected_model,
                |m| Ok(split.shard(m)),
            )
            .unwrap();
        let expected = values(
            &expected_model,
            &AdamWConfig::new().init().load_record(moved),
        );

        // A model of the same shapes but other values, cut, then filled from the files.
        let other = Llama::init(&config(), &solo(), &device()).unwrap();
        let split = Fsdp::new(&other, &world);
        let map = StageMap::whole(param_values(&other).len());
        let sharding = split.sharding(&other, 0, map);
        let shards = split.shard(other);
        let (shards, _) =
            checkpoint::load_sharded(shards, &dir, Some(&config()), &sharding).unwrap();
        let optim = AdamWConfig::new().init();
        let optim = checkpoint::load_optimizer_sharded(optim, &shards, &dir, &sharding).unwrap();
        (values(&shards, &optim), expected)
    })
    .unwrap()
}

/// `got` is `want` bit for bit; else a panic naming the first tensor and element that differ.
fn same(got: &Values, want: &Values, what: &str) {
    for (kind, g, w) in [("parameter", &got.0, &want.0), ("moment", &got.1, &want.1)] {
        assert_eq!(g.len(), w.len(), "{what}: {kind}s");
        for (k, (g, w)) in g.iter().zip(w).enumerate() {
            assert_eq!(g.len(), w.len(), "{what}: {kind} {k}'s elements");
            if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
                panic!("{what}: {kind} {k} element {i}: {} against {}", g[i], w[i]);
            }
        }
    }
}

fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

#[test]
fn a_fully_sharded_checkpoint_is_each_ranks_rows_and_reads_back_at_any_layout() {
    let _rng = rng_lock();
    let (plain, sharded) = (temp_dir("fsdp-ckpt-plain"), temp_dir("fsdp-ckpt-sharded"));
    write(&plain, false);
    write(&sharded, true);

    // Whole at tp 1: the same values from both, the parameters and both moments, bit for bit.
    let (model, optim) = read_whole(&plain);
    let want = values(&model, &optim);
    let (model, optim) = read_whole(&sharded);
    let got = values(&model, &optim);
    same(
        &got,
        &want,
        "the fully sharded checkpoint against the plain one, at tp 1",
    );
    assert!(
        want.1.iter().flatten().any(|&m| m != 0.0),
        "a step was taken"
    );

    // Straight into the shards at fsdp 4, from either checkpoint.
    for dir in [&plain, &sharded] {
        for (rank, (got, expected)) in read_sharded(dir).into_iter().enumerate() {
            same(
                &got,
                &expected,
                &format!("{}: fsdp 4 rank {rank}", dir.display()),
            );
        }
    }

    // Each writer its own rows: the first HSDP group's 4 ranks (tp 2 x fsdp 2), a quarter
    // of the plain checkpoint's bytes each (but the replicated norms, on the first); the
    // second group writes nothing.
    let step = |dir: &Path, r: usize| dir.join(format!("step-1/rank-{r:05}.safetensors"));
    let plain_bytes = file_bytes(&step(&plain, 0)) + file_bytes(&step(&plain, 1));
    for r in 0..8 {
        let bytes = file_bytes(&step(&sharded, r));
        match r {
            0..4 => {
                let share = bytes as f64 / plain_bytes as f64;
                assert!(
                    (0.2..0.3).contains(&share),
                    "rank {r}: {bytes} of {plain_bytes} bytes"
                );
            }
            _ => assert_eq!(bytes, 0, "rank {r} is a replica: it writes nothing"),
        }
    }
    let index = std::fs::read_to_string(sharded.join("index.json")).unwrap();
    assert!(index.contains("burn-tp-sharded/2"), "{}", &index[..200]);
}
