//! Sections 3 and 4: a MoE model's rank at ep 1, 2, 4 and a LoRA fine-tune's beside the full
//! one, each rank a thread whose allocations carry its own tag (`main.rs`'s counting allocator).

use std::sync::atomic::Ordering;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::comm::LocalGroup;
use burn_tp::llama::LlamaConfig;
use burn_tp::local::{RunOptions, run_ranks_with};
use burn_tp::model::LanguageModel;

use super::{TAG, TAGGED, TAGGED_PEAK, mb, start_peak};

/// Section 3: a MoE Llama's rank at dp = ep = 1, 2, 4 (each rank a thread with its own tag):
/// its parameters' bytes beside what the split promises (the dense parameters whole, the
/// experts' `1 / ep`); the bytes its allocations hold once built, and after one AdamW step (the
/// parameters, their two moments, and what the step left: the collectives' buffer pool keeps
/// freed blocks for reuse, whose free bytes are the last column).
pub(super) fn moe_memory(quick: bool) {
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn_tp::dp::{DpOptimizer, Experts};
    use burn_tp::mesh::DeviceMesh;
    use burn_tp::moe::ExpertsConfig;
    let (d, ff, experts, layers, seq) = if quick {
        (64, 128, 8, 2, 16)
    } else {
        (256, 512, 8, 4, 64)
    };
    let vocab = 1024;
    let config = LlamaConfig::new(vocab, seq, d, 4, 2, layers, ff)
        .with_experts(Some(ExpertsConfig::new(experts, 2, ff)));
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let whole = config.init(&solo, &Device::flex()).unwrap();
    let expert_ids: std::collections::HashSet<_> = whole.expert_params().into_iter().collect();
    let (mut dense, mut expert) = (0usize, 0usize);
    param_sizes(&whole)
        .into_iter()
        .for_each(|(id, n)| match expert_ids.contains(&id) {
            true => expert += n * 4,
            false => dense += n * 4,
        });
    println!(
        "
## Mixture of experts: bytes per rank after one AdamW step (MB; Llama d {d}, {layers}          MoE blocks of {experts} experts of width {ff}, f32; dp = ep ranks as threads)
"
    );
    println!(
        "unsplit: dense parameters {} MB, experts {} MB; with AdamW's two moments, x 3
",
        mb(dense as f64),
        mb(expert as f64)
    );
    println!(
        "| ep | parameters | dense + experts / ep | ratio | held after building | held after \
         the step | collectives' pool (free, per rank) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for ep in [1usize, 2, 4] {
        let config = config.clone();
        let options = RunOptions {
            threads_per_rank: Some(1),
            keep_freed_memory: Some(false),
        };
        let out = run_ranks_with(LocalGroup::new(ep).unwrap(), options, move |world| {
            let rank = world.rank();
            TAG.set(rank);
            let before = TAGGED[rank].load(Ordering::SeqCst);
            let device = Device::flex().autodiff();
            let mesh = DeviceMesh::new(world.clone(), 1).unwrap();
            let (ep_group, expert_dp) = mesh.expert_groups(ep).unwrap();
            let tp = world.split(rank, 0).unwrap();
            let all: Vec<usize> = (0..layers).collect();
            let model = config
                .init_expert_parallel(&tp, &ep_group, &device, &all)
                .unwrap();
            let built = TAGGED[rank].load(Ordering::SeqCst) - before;
            let mut optim = DpOptimizer::new(AdamWConfig::new().init()).with_experts(Experts {
                params: model.expert_params().into_iter().collect(),
                group: expert_dp,
            });
            let v: Vec<i64> = (0..seq * 2)
                .map(|j| ((rank * 31 + j * 7) % vocab) as i64)
                .collect();
            let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, 2]), &device);
            let loss = LanguageModel::loss(&model, ids.clone(), ids, None).unwrap();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let working = model.clone();
            let model = optim
                .step(1e-3, model, &working, grads, mesh.dp_group())
                .unwrap();
            drop(working);
            let held = TAGGED[rank].load(Ordering::SeqCst) - before;
            let params: usize = param_sizes(&model).iter().map(|p| p.1 * 4).sum();
            drop((model, optim));
            TAG.set(usize::MAX);
            (params as f64, built as f64, held as f64)
        })
        .unwrap();
        // The largest rank's (they hold the same shapes).
        let most = |f: fn(&(f64, f64, f64)) -> f64| out.iter().map(f).fold(0.0, f64::max);
        let (params, built, held) = (most(|o| o.0), most(|o| o.1), most(|o| o.2));
        let want = dense as f64 + expert as f64 / ep as f64;
        let pool = burn_tp::backend::pool_free_bytes() as f64 / ep as f64;
        println!(
            "| {ep} | {} | {} | {:.3} | {} | {} | {} |",
            mb(params),
            mb(want),
            params / want,
            mb(built),
            mb(held),
            mb(pool)
        );
    }
}

/// Section 4: a Llama's rank fine-tuned in full, with LoRA (r 16 on every projection) and with
/// QLoRA (that, the adapted projections' base in 8 bits), at
/// tp 1 and 2 (each rank a thread with its own tag): the bytes its allocations hold after one
/// AdamW step (the parameters, and the moments of the trainable ones), and the most they held
/// during the step above what they held before it (activations, gradients, temporaries).
pub(super) fn lora_memory(quick: bool) {
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::quantization::QuantValue;
    use burn_tp::lora::{LoraConfig, apply_lora, quantize_base};
    let (d, ff, layers, seq, batch) = if quick {
        (64, 128, 2, 32, 2)
    } else {
        (512, 1408, 4, 256, 4)
    };
    let vocab = 4096;
    let config = LlamaConfig::new(vocab, seq, d, 8, 2, layers, ff);
    let targets = ["q", "k", "v", "o", "gate", "up", "down"]
        .map(String::from)
        .to_vec();
    let lora = LoraConfig::new(16, 32.0).with_targets(targets);
    println!(
        "\n## LoRA against the full fine-tune: bytes per rank (MB; Llama vocab {vocab}, d {d}, \
         {layers} blocks, d_ff {ff}, seq {seq}, batch {batch}, f32; LoRA r 16 on every \
         projection; ranks as threads)\n"
    );
    println!(
        "| tp | fine-tune | parameters | trainable | held after one AdamW step | step peak above \
         what it held before |"
    );
    println!("|---:|---|---:|---:|---:|---:|");
    for tp in [1usize, 2] {
        for kind in ["full", "LoRA", "QLoRA"] {
            let (config, lora) = (config.clone(), lora.clone());
            let options = RunOptions {
                threads_per_rank: Some(1),
                keep_freed_memory: Some(false),
            };
            let out = run_ranks_with(LocalGroup::new(tp).unwrap(), options, move |g| {
                let rank = g.rank();
                TAG.set(rank);
                let before = TAGGED[rank].load(Ordering::SeqCst);
                let device = Device::flex().autodiff();
                let model = config.init(&g, &device).unwrap();
                let model = match kind {
                    "full" => model,
                    "LoRA" => apply_lora(model, &lora).unwrap(),
                    _ => quantize_base(apply_lora(model, &lora).unwrap(), QuantValue::Q8S).unwrap(),
                };
                // Bytes as held: a QLoRA base one byte a value.
                let params: usize = {
                    struct B(usize);
                    impl burn::module::ModuleVisitor for B {
                        fn visit_float<const D: usize>(
                            &mut self,
                            p: &burn::module::Param<Tensor<D>>,
                        ) {
                            let t = p.val();
                            self.0 += t.shape().num_elements() * t.dtype().size();
                        }
                    }
                    let mut b = B(0);
                    model.visit(&mut b);
                    b.0
                };
                let trainable = {
                    struct T(usize);
                    impl burn::module::ModuleVisitor for T {
                        fn visit_float<const D: usize>(
                            &mut self,
                            p: &burn::module::Param<Tensor<D>>,
                        ) {
                            if p.val().is_require_grad() {
                                self.0 += p.val().shape().num_elements() * 4;
                            }
                        }
                    }
                    let mut t = T(0);
                    model.visit(&mut t);
                    t.0
                };
                let mut optim = AdamWConfig::new().init();
                let v: Vec<i64> = (0..seq * batch)
                    .map(|j| ((j * 7 + 3) % vocab) as i64)
                    .collect();
                let ids = Tensor::<2, Int>::from_data(TensorData::new(v, [seq, batch]), &device);
                g.barrier().unwrap();
                let held_before = start_peak(rank);
                let loss = LanguageModel::loss(&model, ids.clone(), ids, None).unwrap();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                let model = optim.step(1e-3, model, grads);
                let peak = TAGGED_PEAK[rank].load(Ordering::SeqCst) - held_before;
                let held = TAGGED[rank].load(Ordering::SeqCst) - before;
                drop((model, optim));
                TAG.set(usize::MAX);
                (params as f64, trainable as f64, held as f64, peak as f64)
            })
            .unwrap();
            let (params, trainable, held, peak) = out[0];
            println!(
                "| {tp} | {} | {} | {} | {} | {} |",
                kind,
                mb(params),
                mb(trainable),
                mb(held),
                mb(peak)
            );
        }
    }
}

/// Each float parameter's id and elements, in visiting order.
fn param_sizes<M: Module>(m: &M) -> Vec<(burn::module::ParamId, usize)> {
    struct Sizes(Vec<(burn::module::ParamId, usize)>);
    impl burn::module::ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            self.0.push((p.id, p.val().shape().num_elements()));
        }
    }
    let mut s = Sizes(Vec::new());
    m.visit(&mut s);
    s.0
}
