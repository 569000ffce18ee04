//! Section 10: the pipeline's bubble. A Llama (d 256, 8 blocks, seq 128, 2 sequences per
//! micro-batch) cut into `pp` stages (ranks as threads, over a simulated link of 25 GB/s and
//! 5 us: an inter-node link), one step of `m` micro-batches after a warm-up: the fraction of the
//! step each stage spent waiting for an activation or a gradient (`PipelineStep::idle_s /
//! step_s`, each stage's median of 5 steps), against the schedule's theory. The floor is that theory: the idle the schedule
//! cannot avoid with free transfers and one device per stage.
//!
//! The theory: each stage computes `m (f + b)` per step; the fill and drain leave it idle
//! `(p - 1) (f + b) / v` (v = 1 for GPipe and 1F1B, the virtual stages for the interleaved
//! schedule, whose chunks are 1 / v of a stage's work). Megatron writes the bubble against the
//! ideal time, `(p - 1) / (v m)`; as a fraction of the step it is
//! `((p - 1) / v) / (m + (p - 1) / v) = (p - 1) / (v m + p - 1)`, which for v = 1 is the
//! issue's `(p - 1) / (m + p - 1)`. (Dividing that by v, as the first table did, is not the
//! step's fraction for v > 1: it undercounts the interleaved bubble, most at small m.) Both
//! forms are printed: idle / step against the step fraction, idle / busy against Megatron's.
//!
//! The stages share this machine's cores (Flex's rayon pool): a stage computing alone runs
//! faster than one of two computing together, which the theory (one device per stage) does
//! not see; the figures are this machine's, not a cluster's.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_ranks;
use burn_tp::model::LanguageModel;
use burn_tp::pipeline::{Pipeline, PipelineSchedule, loss_and_grads, virtual_stage_layers};
use burn_tp::reshard::Reshard;
use burn_tp_comm::{LinkModel, LocalGroup, LocalGroupOptions};

pub(crate) fn bench_pipeline(quick: bool) {
    let (seq, micro, layers) = if quick { (32, 2, 4) } else { (128, 2, 8) };
    println!(
        "\n## 10. Pipeline bubble: Llama d 256, {layers} blocks, seq {seq}, {micro} sequences per \
         micro-batch, ranks as threads over a link of 25 GB/s, 5 us\n"
    );
    println!(
        "| pp | schedule | micro-batches | step ms | idle / step per stage | theory (p-1)/(vm+p-1) \
         | mean / theory | idle / busy, mean | Megatron (p-1)/(vm) | mean / theory |"
    );
    println!("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|");
    let device = Device::flex().autodiff();
    device.seed(1);
    let solo = LocalGroup::new(1).unwrap().remove(0);
    let full = LlamaConfig::new(64, seq, 256, 4, 2, layers, 688)
        .init(&solo, &device)
        .unwrap();
    let pps: &[usize] = if quick { &[2] } else { &[2, 4] };
    let ms: &[usize] = if quick { &[2] } else { &[1, 2, 4, 8] };
    for &pp in pps {
        for schedule in [
            PipelineSchedule::GPipe,
            PipelineSchedule::OneFOneB,
            PipelineSchedule::Interleaved { virtual_stages: 2 },
        ] {
            for &m in ms {
                let v = schedule.virtual_stages();
                if v > 1 && (m % pp != 0 || pp * v > layers) {
                    continue;
                }
                let (full, device) = (full.clone(), device.clone());
                let link = LocalGroupOptions {
                    link: Some(LinkModel::new(25.0, 5.0)),
                    ..Default::default()
                };
                let groups = LocalGroup::with_options(pp, link).unwrap();
                let out = run_ranks(groups, move |g| {
                    let solo = LocalGroup::new(1).unwrap().remove(0);
                    let chunks = virtual_stage_layers(layers, pp, schedule, g.rank()).unwrap();
                    let held: Vec<usize> = chunks.into_iter().flatten().collect();
                    let model = burn_tp::llama::Llama::shard_module(&full, &solo)
                        .unwrap()
                        .keep_layers(&held);
                    let pipe = Pipeline::new(&g).unwrap();
                    let ids = |i: usize| {
                        let v: Vec<i64> = (0..seq * micro).map(|j| ((i + j) % 64) as i64).collect();
                        Tensor::<2, Int>::from_data(TensorData::new(v, [seq, micro]), &device)
                    };
                    let batches: Vec<_> = (0..m).map(|i| (ids(i), ids(i + 1))).collect();
                    // One warm-up step, then the median of 5 (of 1 when quick): 4 stage
                    // threads on a 2-core machine make single steps noisy.
                    let runs = if quick { 1 } else { 5 };
                    let mut steps: Vec<(f64, f64)> = (0..=runs)
                        .map(|_| {
                            let s =
                                loss_and_grads(&model, &pipe, &batches, schedule, None).unwrap();
                            (s.idle_s, s.step_s)
                        })
                        .skip(1)
                        .collect();
                    steps.sort_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)));
                    steps[steps.len() / 2]
                })
                .unwrap();
                let theory = (pp - 1) as f64 / (v * m + pp - 1) as f64;
                let megatron = (pp - 1) as f64 / (v * m) as f64;
                let fractions: Vec<f64> = out.iter().map(|(i, s)| i / s).collect();
                let step_ms = out.iter().map(|x| x.1).fold(0.0, f64::max) * 1e3;
                let mean = fractions.iter().sum::<f64>() / pp as f64;
                let per_busy = out.iter().map(|(i, s)| i / (s - i)).sum::<f64>() / pp as f64;
                println!(
                    "| {pp} | {schedule:?} | {m} | {step_ms:.0} | {} | {theory:.2} | {:.2} | \
                     {per_busy:.2} | {megatron:.2} | {:.2} |",
                    fractions
                        .iter()
                        .map(|f| format!("{f:.2}"))
                        .collect::<Vec<_>>()
                        .join(" / "),
                    mean / theory,
                    per_busy / megatron
                );
            }
        }
    }
}
