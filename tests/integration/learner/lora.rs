//! A LoRA fine-tune through the Learner.

use burn_tp::train::TensorParallel;

use super::{against_plain, config, fixture, values};
use crate::common::device;

/// A LoRA fine-tune through the Learner (`lora::apply_lora` on the model it starts from): at
/// tp 2 x dp 2, the dp average after the backward, in buckets or fully sharded, the logged losses and the
/// trained model are the plain loop's (whose base is frozen).
#[test]
fn the_learner_trains_lora_adapters_at_tp_and_dp() {
    use burn_tp::lora::{LoraConfig, apply_lora};
    let (_rng, solo, root) = fixture("lora");
    type Sync = fn(TensorParallel) -> TensorParallel;
    let runs: [(&str, Sync); 3] = [
        ("", |t| t),
        ("buckets", |t| t.with_overlapped_grad_reduce(2048)),
        // The frozen base split over dp too, only the adapters' gradients reduce-scattered.
        ("fsdp", |t| t.with_fsdp()),
    ];
    for (how, sync) in runs {
        device().seed(3);
        let base = config().init(&solo, &device()).unwrap();
        let before = values(&base);
        let targets = ["q", "v", "o", "down"].map(String::from).to_vec();
        let full = apply_lora(base, &LoraConfig::new(4, 8.0).with_targets(targets)).unwrap();
        let dir = root.join(format!("lora-{how}"));
        let tag = format!("LoRA tp 2 dp 2 {how}");
        let got_model = against_plain(&full, (2, 2), &dir, sync, &tag);
        // The trained model is the plain loop's, whose base is frozen: merged, the adapters
        // moved its weights.
        let trained = values(&burn_tp::lora::merge_lora(got_model));
        assert_eq!(trained.len(), before.len(), "{tag}");
        assert!(
            trained != before,
            "{tag}: the adapters changed the merged weights"
        );
    }
    std::fs::remove_dir_all(&root).ok();
}
