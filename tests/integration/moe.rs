//! The mixture-of-experts layer (`burn_tp::moe`) at tp x ep, in both tp modes: its output and
//! auxiliary loss against an f64 reference computed here from the same full weights, its
//! gradients against the tp 1 x ep 1 layer, the finite-difference check, and its errors.

use burn::tensor::{DType, Tensor};
use burn_tp::comm::ProcessGroup;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::moe::{MoeConfig, MoeLayer, MoeWeights, aux_loss};

use super::common::{assert_close, f64s, tensor, uniform};

const D: usize = 8;
const E: usize = 4;
const F: usize = 8;
const K: usize = 2;
/// Sequence and batch of each ep rank's (each data-parallel replica's) tokens.
const S: usize = 4;
const B: usize = 3;

/// How the layer under test routes.
#[derive(Clone, Copy, Debug)]
struct Routing {
    /// `norm_topk_prob`.
    norm: bool,
    /// The experts' capacity factor (`None`: dropless).
    capacity: Option<f64>,
}

/// Renormalized top-k, or not; dropless.
fn norm(norm: bool) -> Routing {
    Routing {
        norm,
        capacity: None,
    }
}

fn config(mode: TpMode, routing: Routing) -> MoeConfig {
    MoeConfig::new(D, E, K, F)
        .with_norm_topk_prob(routing.norm)
        .with_capacity_factor(routing.capacity)
        .with_settings(TpSettings::new().with_mode(mode))
}

/// The full weights, `[in, out]`: router `[D, E]`, gate / up `[E, D, 2F]`, down `[E, F, D]`.
fn full_weights() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    (
        uniform(D * E, 1),
        uniform(E * D * 2 * F, 2).iter().map(|v| v * 0.5).collect(),
        uniform(E * F * D, 3).iter().map(|v| v * 0.5).collect(),
    )
}

/// Replica `q`'s tokens `[S, B, D]` and the loss's cotangent for its output.
fn tokens(q: usize) -> (Vec<f32>, Vec<f32>) {
    (
        uniform(S * B * D, 10 + q as u64),
        uniform(S * B * D, 20 + q as u64),
    )
}

/// The layer on `tp` x `ep` ranks from the full weights.
fn layer(cfg: &MoeConfig, tp: &ProcessGroup, ep: &ProcessGroup) -> MoeLayer {
    let (r, g, d) = full_weights();
    let full = MoeWeights {
        router: tensor(r, [D, E], DType::F32),
        gate_up: tensor(g, [E, D, 2 * F], DType::F32),
        down: tensor(d, [E, F, D], DType::F32),
    };
    cfg.init_with(full, None, tp, ep).unwrap()
}

/// What one rank saw: its output, its input's gradient, its router / expert gradients, the
/// aux loss and the expert counts.
struct Seen {
    q: usize,
    r: usize,
    y: Vec<f64>,
    dx: Vec<f64>,
    d_router: Vec<f64>,
    d_gate_up: Vec<f64>,
    d_down: Vec<f64>,
    aux: f64,
    counts: Vec<usize>,
    dropped: usize,
}

/// The layer at `tp` x `ep` (world rank `q tp + r`: replica `q`, tp rank `r`), each replica on
/// its own tokens (the whole sequence, or its tp shard in sequence-parallel mode); loss
/// `sum(y * c) + 0.1 aux`.
fn run(n_tp: usize, n_ep: usize, mode: TpMode, routing: Routing) -> Vec<Seen> {
    run_from(0, n_tp, n_ep, mode, routing)
}

/// [`run`] with replicas `first..first + n_ep`.
fn run_from(first: usize, n_tp: usize, n_ep: usize, mode: TpMode, routing: Routing) -> Vec<Seen> {
    let mut seen = run_local(n_tp * n_ep, move |world| {
        let (q, r) = (first + world.rank() / n_tp, world.rank() % n_tp);
        let tp = world.split(q, r).unwrap();
        let ep = world.split(first + n_ep + r, q).unwrap();
        let cfg = config(mode, routing);
        let layer = layer(&cfg, &tp, &ep);
        let (x, c) = tokens(q);
        let shard = |v: Vec<f32>| -> Tensor<3> {
            let t = tensor(v, [S, B, D], DType::F32);
            if mode == TpMode::ReduceScatter {
                t.narrow(0, r * S / n_tp, S / n_tp)
            } else {
                t
            }
        };
        let x = shard(x).require_grad();
        let (y, stats) = layer.forward(x.clone());
        let aux = aux_loss(std::slice::from_ref(&stats)).unwrap();
        let loss = (y.clone() * shard(c)).sum() + aux.clone().mul_scalar(0.1);
        let grads = loss.backward();
        let grad = |t: Tensor<3>| f64s(t.grad(&grads).unwrap());
        Seen {
            q,
            r,
            y: f64s(y),
            dx: grad(x),
            d_router: f64s(layer.router.val().grad(&grads).unwrap()),
            d_gate_up: expert_grads(&layer, &grads, |e| e.gate_up.weight.val()),
            d_down: expert_grads(&layer, &grads, |e| e.down.weight.val()),
            aux: f64s(aux)[0],
            counts: stats.counts,
            dropped: stats.dropped,
        }
    })
    .unwrap();
    seen.sort_by_key(|s| (s.q, s.r));
    seen
}

/// The gradients of one weight of each of the rank's experts, one after the other.
fn expert_grads(
    layer: &MoeLayer,
    grads: &burn::tensor::Gradients,
    pick: impl Fn(&burn_tp::transformer::ParallelSwiGlu) -> Tensor<2>,
) -> Vec<f64> {
    layer
        .experts
        .iter()
        .flat_map(|e| f64s(pick(e).grad(grads).unwrap()))
        .collect()
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// The layer in f64 on replica `q`'s tokens, from the full weights: `[S B D]`, the aux loss,
/// the counts (before the capacity) and the assignments dropped (each expert keeps its first
/// `ceil(capacity * S B K / E)` in token order).
fn reference(q: usize, routing: Routing) -> (Vec<f64>, f64, Vec<usize>, usize) {
    let norm = routing.norm;
    let capacity = routing
        .capacity
        .map(|c| (c * (S * B * K) as f64 / E as f64).ceil() as usize);
    let (mut kept, mut dropped) = (vec![0usize; E], 0);
    let (router, gate_up, down) = full_weights();
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let (router, gate_up, down) = (f(&router), f(&gate_up), f(&down));
    let x = f(&tokens(q).0);
    let mut y = vec![0.0; S * B * D];
    let (mut counts, mut probs_sum) = (vec![0usize; E], vec![0.0; E]);
    for t in 0..S * B {
        let xt = &x[t * D..(t + 1) * D];
        let logits: Vec<f64> = (0..E)
            .map(|e| (0..D).map(|i| xt[i] * router[i * E + e]).sum())
            .collect();
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|l| (l - max).exp() / z).collect();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let chosen = &order[..K];
        let total: f64 = chosen.iter().map(|&e| p[e]).sum();
        for &e in chosen {
            counts[e] += 1;
            if capacity.is_some_and(|c| kept[e] == c) {
                dropped += 1;
                continue;
            }
            kept[e] += 1;
            let w = if norm { p[e] / total } else { p[e] };
            let g = &gate_up[e * D * 2 * F..(e + 1) * D * 2 * F];
            let h: Vec<f64> = (0..F)
                .map(|j| {
                    let gate: f64 = (0..D).map(|i| xt[i] * g[i * 2 * F + j]).sum();
                    let up: f64 = (0..D).map(|i| xt[i] * g[i * 2 * F + F + j]).sum();
                    silu(gate) * up
                })
                .collect();
            let dn = &down[e * F * D..(e + 1) * F * D];
            for o in 0..D {
                y[t * D + o] += w * (0..F).map(|j| h[j] * dn[j * D + o]).sum::<f64>();
            }
        }
        probs_sum.iter_mut().zip(&p).for_each(|(s, v)| *s += v);
    }
    let n = (S * B) as f64;
    let aux = E as f64
        * counts
            .iter()
            .zip(&probs_sum)
            .map(|(&c, &p)| c as f64 / n * (p / n))
            .sum::<f64>();
    (y, aux, counts, dropped)
}

/// Rows `range` of dim 0 of a `[S, B, D]` buffer, as the sequence-parallel shard holds them.
fn seq_shard(v: &[f64], r: usize, n_tp: usize) -> Vec<f64> {
    let rows = S / n_tp * B * D;
    v[r * rows..(r + 1) * rows].to_vec()
}

/// Rank `(q, r)`'s experts and tp columns of a full `[E, D, 2F]` gate / up gradient: its
/// columns of the gate, then of the up, as the layer splits them.
fn gate_up_slice(full: &[f64], q: usize, r: usize, n_ep: usize, n_tp: usize) -> Vec<f64> {
    let (per, w) = (E / n_ep, F / n_tp);
    let mut out = Vec::new();
    for e in q * per..(q + 1) * per {
        for i in 0..D {
            for part in 0..2 {
                let at = e * D * 2 * F + i * 2 * F + part * F + r * w;
                out.extend_from_slice(&full[at..at + w]);
            }
        }
    }
    out
}

#[test]
fn moe_layer_matches_the_f64_reference_and_the_unsplit_gradients_at_every_tp_x_ep() {
    let _lock = super::common::rng_lock();
    // A capacity factor of 1 drops some of the 24 assignments (each expert keeps 6).
    let capped = Routing {
        norm: true,
        capacity: Some(1.0),
    };
    for routing in [norm(true), norm(false), capped] {
        for (n_tp, n_ep, mode) in [
            (1, 1, TpMode::AllReduce),
            (1, 2, TpMode::AllReduce),
            (1, 4, TpMode::AllReduce),
            (2, 1, TpMode::AllReduce),
            (2, 2, TpMode::AllReduce),
            (2, 2, TpMode::ReduceScatter),
            (4, 1, TpMode::ReduceScatter),
        ] {
            let what = format!("tp {n_tp} x ep {n_ep} {mode:?} {routing:?}");
            let seen = run(n_tp, n_ep, mode, routing);
            // The unsplit layer's expert gradients: the sum over the replicas' tokens.
            let replicas: Vec<Seen> = (0..n_ep).map(|q| replica_alone(q, routing)).collect();
            let summed = |pick: fn(&Seen) -> &Vec<f64>| -> Vec<f64> {
                let mut acc = vec![0.0; pick(&replicas[0]).len()];
                for s in &replicas {
                    acc.iter_mut().zip(pick(s)).for_each(|(a, b)| *a += b);
                }
                acc
            };
            let (dg, dd) = (summed(|s| &s.d_gate_up), summed(|s| &s.d_down));
            for s in &seen {
                let (y, aux, counts, dropped) = reference(s.q, routing);
                let alone = &replicas[s.q];
                let (want_y, want_dx) = if mode == TpMode::ReduceScatter {
                    (seq_shard(&y, s.r, n_tp), seq_shard(&alone.dx, s.r, n_tp))
                } else {
                    (y, alone.dx.clone())
                };
                let at = format!("{what}, replica {} tp rank {}", s.q, s.r);
                assert_close(&s.y, &want_y, 1e-5, &format!("{at}: y"));
                assert_close(&[s.aux], &[aux], 1e-5, &format!("{at}: aux"));
                assert_eq!(s.counts, counts, "{at}: counts");
                assert_eq!(s.dropped, dropped, "{at}: dropped");
                assert_eq!(dropped > 0, routing.capacity.is_some(), "{at}: dropped");
                assert_close(&s.dx, &want_dx, 1e-5, &format!("{at}: dx"));
                assert_close(
                    &s.d_router,
                    &alone.d_router,
                    1e-5,
                    &format!("{at}: d router"),
                );
                assert_close(
                    &s.d_gate_up,
                    &gate_up_slice(&dg, s.q, s.r, n_ep, n_tp),
                    1e-5,
                    &format!("{at}: d gate_up"),
                );
                // down `[E, F, D]` is split over tp by rows.
                let per = E / n_ep;
                let w = F / n_tp;
                let down: Vec<f64> = (s.q * per..(s.q + 1) * per)
                    .flat_map(|e| {
                        let at = e * F * D + s.r * w * D;
                        dd[at..at + w * D].to_vec()
                    })
                    .collect();
                assert_close(&s.d_down, &down, 1e-5, &format!("{at}: d down"));
            }
        }
    }
}

/// The tp 1 x ep 1 layer on replica `q`'s tokens alone.
fn replica_alone(q: usize, routing: Routing) -> Seen {
    run_from(q, 1, 1, TpMode::AllReduce, routing).remove(0)
}

#[test]
fn moe_config_errors_name_the_values() {
    let e = MoeConfig::new(D, 6, 2, F)
        .validate(1, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("6 experts") && e.contains("ep = 4"), "{e}");
    let e = MoeConfig::new(D, 4, 5, F)
        .validate(1, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("top_k = 5") && e.contains("4 experts"), "{e}");
    let e = MoeConfig::new(D, 4, 2, 6)
        .validate(4, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("width 6") && e.contains("tp = 4"), "{e}");
    for bad in [0.0, -1.0, f64::NAN] {
        let e = MoeConfig::new(D, 4, 2, F)
            .with_capacity_factor(Some(bad))
            .validate(1, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("capacity_factor = {bad}")), "{e}");
    }
}

#[test]
fn moe_layer_passes_a_finite_difference_gradcheck_over_ep() {
    use burn_tp::testing::{GradcheckOptions, LossKind, gradcheck};
    let _lock = super::common::rng_lock();
    for n_ep in [1usize, 2] {
        run_local(n_ep, move |ep| {
            let solo = ep.split(ep.rank(), 0).unwrap();
            let (r, g, d) = full_weights();
            let full = MoeWeights {
                router: tensor(r, [D, E], DType::F64),
                gate_up: tensor(g, [E, D, 2 * F], DType::F64),
                down: tensor(d, [E, F, D], DType::F64),
            };
            let layer = config(TpMode::AllReduce, norm(true))
                .init_with(full, None, &solo, &ep)
                .unwrap();
            let (x, c) = tokens(ep.rank());
            let x = tensor(x, [S, B, D], DType::F64);
            let c = tensor(c, [S, B, D], DType::F64);
            let opts = GradcheckOptions {
                atol: 1e-6,
                ..GradcheckOptions::default()
            };
            gradcheck(&ep, &[x], LossKind::Sharded, opts, |xs| {
                let (y, stats) = layer.forward(xs[0].clone());
                let aux = aux_loss(std::slice::from_ref(&stats)).unwrap();
                (y * c.clone()).sum() + aux.mul_scalar(0.1)
            })
            .unwrap();
        })
        .unwrap();
    }
}

/// A Llama whose second block is a mixture of experts (Qwen2-MoE's shape: a shared expert
/// behind its gate; the first block dense, `mlp_only_layers`), the aux and z-losses on.
fn moe_llama(mode: TpMode) -> burn_tp::llama::LlamaConfig {
    use burn_tp::moe::ExpertsConfig;
    burn_tp::llama::LlamaConfig::new(40, 16, 16, 4, 2, 2, 32)
        .with_experts(Some(
            ExpertsConfig::new(4, 2, 16)
                .with_shared_expert(Some(16))
                .with_mlp_only_layers(vec![0])
                .with_aux_loss_coef(0.05)
                .with_z_loss_coef(0.01),
        ))
        .with_settings(TpSettings::new().with_mode(mode).with_attention_tile(4))
}

#[test]
fn a_moe_llama_gives_the_unsplit_losses_and_gradients_at_every_tp_x_ep() {
    use super::common::{full_grads, param_values, token_ids};
    use burn::module::Module;
    use burn::tensor::{Int, TensorData};
    use burn_tp::llama::Llama;
    use burn_tp::model::LanguageModel;
    use burn_tp::reshard::Reshard;
    let _lock = super::common::rng_lock();
    for (n_tp, n_ep, mode) in [
        (1, 2, TpMode::AllReduce),
        (2, 2, TpMode::AllReduce),
        (2, 2, TpMode::ReduceScatter),
        (1, 4, TpMode::AllReduce),
    ] {
        super::common::device().seed(7);
        run_local(n_tp * n_ep, move |world| {
            let (q, r) = (world.rank() / n_tp, world.rank() % n_tp);
            let tp = world.split(q, r).unwrap();
            let ep = world.split(n_ep + r, q).unwrap();
            let solo = world.split(world.rank(), 0).unwrap();
            let device = super::common::device();
            // The unsplit model, the same on every rank (world rank 0's draws).
            let full = moe_llama(mode).init(&solo, &device).unwrap();
            let full = burn_tp::dp::broadcast_parameters(full, &world).unwrap();
            // Replica q's batch: [seq 8, batch 2].
            let ids = |add: i64| {
                let v = token_ids(16, 40, 7, add + 3 * q as i64);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let (x, y) = (ids(0), ids(1));
            let loss_of = |m: &Llama| {
                let loss = LanguageModel::loss(m, x.clone(), y.clone(), None).unwrap();
                let value = f64s(loss.clone())[0];
                (value, loss.backward())
            };
            let (want, g_full) = loss_of(&full);
            let want_grads = full.clone().map(&mut super::common::ToGrads(&g_full));
            let model = Llama::shard_module(&full, &tp)
                .unwrap()
                .expert_parallel(&ep)
                .unwrap();
            let (got, g) = loss_of(&model);
            let got_grads = full_grads(&model, &g);
            let at = format!("tp {n_tp} x ep {n_ep} {mode:?}, replica {q} tp rank {r}");
            assert_close(&[got], &[want], 1e-5, &format!("{at}: loss"));
            // The experts' parameters divide by ep (and by tp within each expert).
            let count = |m: &Llama| -> usize {
                m.blocks
                    .iter()
                    .filter_map(|b| b.moe.as_ref())
                    .flat_map(|m| param_values(&m.experts))
                    .map(|v| v.len())
                    .sum()
            };
            assert_eq!(
                count(&model) * n_ep * n_tp,
                count(&full),
                "{at}: expert parameters"
            );
            let same = |a: Vec<Vec<f64>>, b: Vec<Vec<f64>>, what: &str| {
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    assert_close(a, b, 1e-4, &format!("{at}: {what} {i}"));
                }
            };
            same(
                param_values(&got_grads.tok),
                param_values(&want_grads.tok),
                "tok",
            );
            same(
                param_values(&got_grads.norm),
                param_values(&want_grads.norm),
                "norm",
            );
            for (b, (gb, wb)) in got_grads.blocks.iter().zip(&want_grads.blocks).enumerate() {
                same(
                    param_values(&gb.attn),
                    param_values(&wb.attn),
                    &format!("block {b} attn"),
                );
                same(
                    param_values(&gb.mlp),
                    param_values(&wb.mlp),
                    &format!("block {b} mlp"),
                );
                let (Some(gm), Some(wm)) = (&gb.moe, &wb.moe) else {
                    assert!(gb.moe.is_none() && wb.moe.is_none(), "{at}: block {b}");
                    continue;
                };
                same(param_values(&gm.router), param_values(&wm.router), "router");
                same(param_values(&gm.shared), param_values(&wm.shared), "shared");
                same(
                    param_values(&gm.shared_gate),
                    param_values(&wm.shared_gate),
                    "gate",
                );
                // Each local expert's gradient: the sum over every replica's tokens.
                let flat = |m: &burn_tp::transformer::ParallelSwiGlu| -> Vec<f64> {
                    param_values(m).into_iter().flatten().collect()
                };
                let all: Vec<f64> = wm.experts.iter().flat_map(flat).collect();
                let summed = ep.all_reduce(all, burn_tp::comm::ReduceOp::Sum).unwrap();
                let (per, size) = (4 / n_ep, summed.len() / 4);
                for (j, expert) in gm.experts.iter().enumerate() {
                    let e = q * per + j;
                    let want = &summed[e * size..(e + 1) * size];
                    assert_close(
                        &flat(expert),
                        want,
                        1e-4,
                        &format!("{at}: block {b} expert {e}"),
                    );
                }
            }
        })
        .unwrap();
    }
}

/// A rank's view of a MoE Llama: its non-expert parameters (tp gathered) and its experts' by
/// (block, global expert).
type Split = (Vec<Vec<f64>>, Vec<((usize, usize), Vec<f64>)>);

fn split_params(model: &burn_tp::llama::Llama, first_expert: usize) -> Split {
    use super::common::param_values;
    use burn_tp::reshard::Reshard;
    let full = model.to_full_module().unwrap();
    let mut dense = param_values(&full.tok);
    dense.extend(param_values(&full.norm));
    let mut experts = Vec::new();
    for (b, block) in full.blocks.iter().enumerate() {
        dense.extend(param_values(&block.attn));
        dense.extend(param_values(&block.attn_norm));
        dense.extend(param_values(&block.mlp_norm));
        dense.extend(param_values(&block.mlp));
        if let Some(m) = &block.moe {
            dense.extend(param_values(&m.router));
            dense.extend(param_values(&m.shared));
            dense.extend(param_values(&m.shared_gate));
            for (j, e) in m.experts.iter().enumerate() {
                let v = param_values(e).into_iter().flatten().collect();
                experts.push(((b, first_expert + j), v));
            }
        }
    }
    (dense, experts)
}

/// How [`train_moe`] reduces the gradients over dp.
#[derive(Clone, Copy, Debug)]
enum Sync {
    /// After the backward.
    After,
    /// In buckets of this many bytes during the backward.
    Buckets(usize),
    /// The distributed optimizer (buckets of this many bytes).
    Zero(usize),
}

/// Three AdamW steps of the MoE Llama at tp x dp with the experts over `ep` (of the dp ranks),
/// each dp rank on its own batches: per world rank, its (dp rank, losses, parameters after).
fn train_moe(n_tp: usize, dp: usize, ep: usize, mode: TpMode) -> Vec<(usize, Vec<f64>, Split)> {
    train_moe_with(n_tp, dp, ep, mode, Sync::After)
}

/// [`train_moe`], the gradients reduced as `sync` says.
fn train_moe_with(
    n_tp: usize,
    dp: usize,
    ep: usize,
    mode: TpMode,
    sync: Sync,
) -> Vec<(usize, Vec<f64>, Split)> {
    use super::common::token_ids;
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Int, TensorData};
    use burn_tp::dp::{
        DistributedAdamW, DpOptimizer, Experts, GradReducer, ReduceGroups, broadcast_parameters,
    };
    use burn_tp::llama::Llama;
    use burn_tp::mesh::DeviceMesh;
    use burn_tp::model::LanguageModel;
    use burn_tp::reshard::Reshard;
    super::common::device().seed(11);
    run_local(n_tp * dp, move |world| {
        let mesh = DeviceMesh::new(world.clone(), n_tp).unwrap();
        let (ep_group, expert_dp) = mesh.expert_groups(ep).unwrap();
        let solo = world.split(world.rank(), 0).unwrap();
        let device = super::common::device();
        // The unsplit model, world rank 0's draws (drawn before any other rank's, so the
        // same in every run), the same everywhere; then this rank's tp shard and experts.
        let draw = || moe_llama(mode).init(&solo, &device).unwrap();
        let full = if world.rank() == 0 {
            let full = draw();
            world.barrier().unwrap();
            full
        } else {
            world.barrier().unwrap();
            draw()
        };
        let full = broadcast_parameters(full, &world).unwrap();
        let mut model = Llama::shard_module(&full, mesh.tp_group())
            .unwrap()
            .expert_parallel(&ep_group)
            .unwrap();
        let experts = Experts {
            params: model.expert_params().into_iter().collect(),
            group: expert_dp,
        };
        let groups = ReduceGroups {
            summed: None,
            experts: Some(experts.clone()),
        };
        let dp_group = mesh.dp_group();
        let optim = match sync {
            Sync::After => DpOptimizer::new(AdamWConfig::new().init()),
            Sync::Buckets(bytes) => DpOptimizer::new(AdamWConfig::new().init())
                .with_reducer(GradReducer::with_groups(&model, dp_group, bytes, groups)),
            Sync::Zero(bytes) => {
                let config = AdamWConfig::new();
                let zero = DistributedAdamW::with_groups(&config, &model, dp_group, bytes, groups);
                DpOptimizer::distributed(config.init(), zero, config)
            }
        };
        let mut optim = optim.with_experts(experts);
        let d = mesh.dp_rank();
        let mut losses = Vec::new();
        for step in 0..3i64 {
            let ids = |add: i64| {
                let v = token_ids(16, 40, 5 + step, add + 7 * d as i64);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let view = optim.attach(model.clone());
            let loss = LanguageModel::loss(&view, ids(0), ids(1), None).unwrap();
            losses.push(f64s(loss.clone())[0]);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let working = model.clone();
            model = optim
                .step(1e-2, model, &working, grads, mesh.dp_group())
                .unwrap();
        }
        let per = 4 / ep;
        (d, losses, split_params(&model, ep_group.rank() * per))
    })
    .unwrap()
}

#[test]
fn moe_training_at_dp_x_ep_gives_the_ep_1_runs_losses_and_parameters() {
    let _lock = super::common::rng_lock();
    for (n_tp, dp, ep, mode) in [
        (1, 4, 2, TpMode::AllReduce),
        (1, 4, 4, TpMode::AllReduce),
        (2, 2, 2, TpMode::ReduceScatter),
    ] {
        let at = format!("tp {n_tp} x dp {dp} x ep {ep} {mode:?}");
        let plain = train_moe(n_tp, dp, 1, mode);
        let split = train_moe(n_tp, dp, ep, mode);
        for ((d, want_losses, (want_dense, want_experts)), (d2, losses, (dense, experts))) in
            plain.iter().zip(&split)
        {
            assert_eq!(d, d2);
            assert_close(
                losses,
                want_losses,
                1e-5,
                &format!("{at}: dp rank {d} losses"),
            );
            for (i, (a, b)) in dense.iter().zip(want_dense).enumerate() {
                assert_close(a, b, 1e-5, &format!("{at}: dp rank {d} parameter {i}"));
            }
            assert_eq!(experts.len() * ep, want_experts.len(), "{at}");
            for (key, v) in experts {
                let (_, want) = want_experts.iter().find(|(k, _)| k == key).unwrap();
                assert_close(v, want, 1e-5, &format!("{at}: dp rank {d} expert {key:?}"));
            }
        }
    }
}

/// The experts' gradients reduced in buckets during the backward, or sharded by the
/// distributed optimizer over the ranks holding the same experts, give the ep 1 run's
/// (reduced after the backward) losses and parameters. Buckets of one parameter each and of
/// everything: the experts' buckets stay apart from the dense ones either way.
#[test]
fn moe_training_with_buckets_or_the_distributed_optimizer_gives_the_ep_1_runs() {
    let _lock = super::common::rng_lock();
    for (n_tp, dp, ep, mode) in [
        (1, 4, 2, TpMode::AllReduce),
        (2, 2, 2, TpMode::ReduceScatter),
    ] {
        let plain = train_moe(n_tp, dp, 1, mode);
        for sync in [
            Sync::Buckets(1),
            Sync::Buckets(1 << 30),
            Sync::Zero(1 << 30),
        ] {
            let at = format!("tp {n_tp} x dp {dp} x ep {ep} {mode:?} {sync:?}");
            let split = train_moe_with(n_tp, dp, ep, mode, sync);
            for ((d, want_losses, (want_dense, want_experts)), (_, losses, (dense, experts))) in
                plain.iter().zip(&split)
            {
                assert_close(losses, want_losses, 1e-5, &format!("{at}: dp {d} losses"));
                for (i, (a, b)) in dense.iter().zip(want_dense).enumerate() {
                    assert_close(a, b, 1e-5, &format!("{at}: dp {d} parameter {i}"));
                }
                for (key, v) in experts {
                    let (_, want) = want_experts.iter().find(|(k, _)| k == key).unwrap();
                    assert_close(v, want, 1e-5, &format!("{at}: dp {d} expert {key:?}"));
                }
            }
        }
    }
}

/// Full recompute of a MoE Llama (a dense and a MoE block, the aux and z-losses on) gives the
/// plain backward's loss and gradients: the routers' loss spans the blocks, each recomputed
/// block's part of its gradient taken with the others held.
#[test]
fn recompute_of_a_moe_llama_gives_the_plain_loss_and_gradients() {
    use super::common::{param_values, token_ids};
    use burn::module::Module;
    use burn::optim::GradientsParams;
    use burn::tensor::{Int, TensorData};
    use burn_tp::model::LanguageModel;
    let _lock = super::common::rng_lock();
    for (n_tp, mode) in [(1, TpMode::AllReduce), (2, TpMode::ReduceScatter)] {
        super::common::device().seed(5);
        run_local(n_tp, move |tp| {
            let device = super::common::device();
            let model = moe_llama(mode).init(&tp, &device).unwrap();
            let ids = |add: i64| {
                let v = token_ids(16, 40, 3, add);
                Tensor::<2, Int>::from_data(TensorData::new(v, [8, 2]), &device)
            };
            let loss = LanguageModel::loss(&model, ids(0), ids(1), None).unwrap();
            let want = f64s(loss.clone())[0];
            let plain = GradientsParams::from_grads(loss.backward(), &model);
            let (got, grads) =
                burn_tp::recompute::loss_and_grads(&model, ids(0), ids(1), None).unwrap();
            let at = format!("tp {n_tp} {mode:?}");
            assert_close(&[f64s(got)[0]], &[want], 1e-6, &format!("{at}: loss"));
            let as_values = |g: &GradientsParams| param_values(&model.clone().map(&mut GradsOf(g)));
            for (i, (a, b)) in as_values(&grads).iter().zip(&as_values(&plain)).enumerate() {
                assert_close(a, b, 1e-5, &format!("{at}: gradient {i}"));
            }
        })
        .unwrap();
    }
}

/// Every parameter replaced by its gradient in `GradientsParams`.
struct GradsOf<'a>(&'a burn::optim::GradientsParams);

impl burn::module::ModuleMapper for GradsOf<'_> {
    fn map_float<const R: usize>(
        &mut self,
        param: burn::module::Param<Tensor<R>>,
    ) -> burn::module::Param<Tensor<R>> {
        let g = self
            .0
            .get::<R>(param.id)
            .expect("every parameter has a gradient");
        param.map(|_| g)
    }
}
