//! The mixture-of-experts layer (`burn_tp::moe`) at tp x ep, in both tp modes: its output and
//! auxiliary loss against an f64 reference computed here from the same full weights, its
//! gradients against the tp 1 x ep 1 layer, the finite-difference check, and its errors; the
//! MoE Llama (`llama.rs`) and `train_gpt` with experts (`train_gpt.rs`).

mod llama;
mod train_gpt;

use burn::tensor::{DType, Tensor};
use burn_tp::comm::ProcessGroup;
use burn_tp::linear::{TpMode, TpSettings};
use burn_tp::local::run_local;
use burn_tp::moe::{MoeConfig, MoeLayer, MoeWeights, aux_loss};

use crate::common::{assert_close, f64s, tensor, uniform};

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
    let _lock = crate::common::rng_lock();
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
    let _lock = crate::common::rng_lock();
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
