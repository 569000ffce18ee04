//! `TensorParallel::with_shards`: each rank builds its own shard through the Learner.

use burn::optim::AdamWConfig;
use burn_tp::checkpoint;
use burn_tp::llama::LlamaConfig;
use burn_tp::train::TensorParallel;
use burn_tp_examples::learner::{LmLearner, Windows};
use burn_train::checkpoint::KeepLastNCheckpoints;

use super::{SEQ, config, fixture, launch, plain_loop, step_losses, text, values};
use crate::common::{assert_close, device};

/// `with_shards`: each rank builds its own shard (the Learner's model only a tiny placeholder of
/// the same type), at tp 2 x dp 2: the plain loop's losses (1e-5) and trained model. Without the
/// gathered model, `result.model` is the placeholder and the last checkpoint, read whole at
/// tp 1, is the plain loop's trained model. A builder of another model type is an error naming
/// both types.
#[test]
fn the_ranks_build_their_own_shards() {
    use burn::tensor::Device;
    use burn_tp::comm::ProcessGroup;
    let (_rng, solo, root) = fixture("build");
    let _ = std::fs::remove_dir_all(&root);
    // The plain loop's model and the ranks' from the same stream (this thread's, which the
    // rank threads start from).
    burn_tp::local::set_init_seed(6);
    let full = config().init(&solo, &device()).unwrap();
    let (want, want_model) = plain_loop(&full, 2);
    let placeholder = LlamaConfig::new(23, SEQ, 4, 1, 1, 1, 4)
        .init(&solo, &device())
        .unwrap();
    let build = |g: &ProcessGroup, d: &Device| config().init(g, d).map(LmLearner::new);
    let train = || Windows::new(text(), SEQ, SEQ);

    burn_tp::local::set_init_seed(6);
    let strategy = TensorParallel::new(2, 2, || AdamWConfig::new().init()).with_shards(build);
    let dir = root.join("gathered");
    let result = launch(&placeholder, strategy, &dir, train(), |t| t.num_epochs(1));
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_close(&step_losses(&dir, 1), &want, 1e-5, "built shards: losses");
    let trained = values(&result.model.model);
    assert_close(
        &trained,
        &values(&want_model),
        1e-5,
        "built shards: the model",
    );

    burn_tp::local::set_init_seed(6);
    let ckpt = root.join("checkpoints");
    let strategy = TensorParallel::new(2, 2, || AdamWConfig::new().init())
        .with_shards(build)
        .without_gathered_model()
        .with_checkpoints(&ckpt, KeepLastNCheckpoints::new(1));
    let result = launch(
        &placeholder,
        strategy,
        &root.join("sharded"),
        train(),
        |t| t.num_epochs(1),
    );
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(values(&result.model.model), values(&placeholder));
    let dir = TensorParallel::checkpoint_dir(&ckpt, 1);
    let (loaded, _) = checkpoint::load(full.clone(), &dir, None::<&()>, &solo).unwrap();
    assert_close(
        &values(&loaded),
        &values(&want_model),
        1e-5,
        "the checkpoint",
    );

    let strategy = TensorParallel::new(2, 1, || AdamWConfig::new().init())
        .with_shards(|g: &ProcessGroup, d: &Device| config().init(g, d));
    let result = launch(&placeholder, strategy, &root.join("bad"), train(), |t| {
        t.num_epochs(1)
    });
    let e = result.error.expect("a builder of another type").to_string();
    assert!(
        e.contains("with_shards builds burn_tp::llama::Llama") && e.contains("LmLearner"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).ok();
    burn_tp::local::clear_init_seed();
}
