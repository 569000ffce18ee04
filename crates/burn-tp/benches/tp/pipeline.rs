//! Section 10: the pipeline's bubble. A Llama (d 256, 8 blocks, seq 128, 2 sequences per
//! micro-batch) cut into `pp` stages (ranks as threads), one step of `m` micro-batches after a
//! warm-up: the fraction of the step each stage spent waiting for an activation or a gradient
//! (`PipelineStep::idle_s / step_s`), against the schedule's theory, `(p - 1) / (m + p - 1)`
//! (the same for GPipe and 1F1B; 1F1B holds fewer micro-batches), divided by the virtual stages
//! `v` for the interleaved schedule. The floor is that theory: the
//! idle the schedule cannot avoid with a backward twice the forward and free transfers.
//!
//! The stages share this machine's cores (Flex's rayon pool): a stage computing alone runs
//! faster than one of two computing together, which the theory (one device per stage) does
//! not see; the figures are this machine's, not a cluster's.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_tp::llama::LlamaConfig;
use burn_tp::local::run_local;
use burn_tp::model::LanguageModel;
use burn_tp::pipeline::{Pipeline, PipelineSchedule, chunk_layers, loss_and_grads};
use burn_tp::reshard::Reshard;
use burn_tp_comm::LocalGroup;

pub(crate) fn bench_pipeline(quick: bool) {
    let (seq, micro, layers) = if quick { (32, 2, 4) } else { (128, 2, 8) };
    println!(
        "\n## 10. Pipeline bubble: Llama d 256, {layers} blocks, seq {seq}, {micro} sequences per \
         micro-batch, ranks as threads\n"
    );
    println!(
        "| pp | schedule | micro-batches | step ms | idle per stage | theory | idle / theory |"
    );
    println!("|---:|---|---:|---:|---|---:|---:|");
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
                let v = schedule.chunks();
                if v > 1 && (m % pp != 0 || pp * v > layers) {
                    continue;
                }
                let (full, device) = (full.clone(), device.clone());
                let out = run_local(pp, move |g| {
                    let solo = LocalGroup::new(1).unwrap().remove(0);
                    let chunks = chunk_layers(layers, pp, schedule, g.rank()).unwrap();
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
                    let mut last = None;
                    for _ in 0..if quick { 1 } else { 3 } {
                        last =
                            Some(loss_and_grads(&model, &pipe, &batches, schedule, None).unwrap());
                    }
                    let s = last.unwrap();
                    (s.idle_s, s.step_s)
                })
                .unwrap();
                let theory = (pp - 1) as f64 / (m + pp - 1) as f64 / v as f64;
                let fractions: Vec<f64> = out.iter().map(|(i, s)| i / s).collect();
                let step_ms = out.iter().map(|x| x.1).fold(0.0, f64::max) * 1e3;
                let mean = fractions.iter().sum::<f64>() / pp as f64;
                println!(
                    "| {pp} | {schedule:?} | {m} | {step_ms:.0} | {} | {theory:.2} | {:.2} |",
                    fractions
                        .iter()
                        .map(|f| format!("{f:.2}"))
                        .collect::<Vec<_>>()
                        .join(" / "),
                    mean / theory
                );
            }
        }
    }
}
