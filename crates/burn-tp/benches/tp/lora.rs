//! Section 12: a LoRA fine-tune's step (r 16 on every projection) beside the full fine-tune's
//! of the same Llama and batch, one rank on all cores and tp 2 (ranks as threads sharing them):
//! forward, backward and AdamW, timed side by side in one run. PEFT's side of the same step is
//! `benches/pytorch_lora/run.sh`.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Int, Tensor, TensorData};
use burn_tp::comm::LocalGroupOptions;
use burn_tp::llama::LlamaConfig;
use burn_tp::lora::{LoraConfig, apply_lora};
use burn_tp::model::LanguageModel;

use super::{device, ranks, timed};

/// Vocabulary, width, heads, key / value heads, blocks, MLP width, sequence, batch, rounds.
pub(crate) fn lora_shape(quick: bool) -> [usize; 9] {
    if quick {
        [512, 64, 4, 2, 2, 128, 32, 2, 3]
    } else {
        [4096, 512, 8, 2, 4, 1408, 256, 4, 5]
    }
}

pub(crate) fn bench_lora(quick: bool) {
    let [vocab, d, heads, kv, layers, ff, seq, batch, reps] = lora_shape(quick);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    println!(
        "\n## 12. LoRA against the full fine-tune: one AdamW step (Llama vocab {vocab}, d {d}, \
         {heads} heads / {kv} kv, {layers} blocks, d_ff {ff}; seq {seq} x batch {batch}; f32; \
         LoRA r 16, alpha 32 on q, k, v, o, gate, up, down), medians of {reps}, ranks as threads \
         sharing {cores} cores\n"
    );
    println!("| tp | full ms | LoRA ms | full / LoRA | LoRA tokens/s |");
    println!("|---:|---:|---:|---:|---:|");
    for tp in [1usize, 2] {
        let threads = (cores / tp).max(1);
        let time = |lora: bool| {
            ranks(tp, LocalGroupOptions::default(), threads, move |g| {
                let dev = device();
                let config = LlamaConfig::new(vocab, seq, d, heads, kv, layers, ff);
                let model = config.init(&g, &dev).unwrap();
                let mut model = match lora {
                    true => {
                        let targets = ["q", "k", "v", "o", "gate", "up", "down"];
                        let c = LoraConfig::new(16, 32.0)
                            .with_targets(targets.map(String::from).to_vec());
                        apply_lora(model, &c).unwrap()
                    }
                    false => model,
                };
                let mut optim = AdamWConfig::new().init();
                let v: Vec<i64> = (0..seq * batch)
                    .map(|j| ((j * 7 + 3) % vocab) as i64)
                    .collect();
                let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, batch]), &dev);
                timed(&g, reps, || {
                    let loss = LanguageModel::loss(&model, ids.clone(), ids.clone(), None).unwrap();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = optim.step(1e-4, model.clone(), grads);
                })
            })[0]
        };
        let (full, lora) = (time(false), time(true));
        println!(
            "| {tp} | {:.1} | {:.1} | {:.2} | {:.0} |",
            full * 1e3,
            lora * 1e3,
            full / lora,
            (seq * batch) as f64 / lora
        );
    }
}
