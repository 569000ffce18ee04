//! The mapping between Hugging Face's tensors and the Llama's or the Gemma's parameters, shared
//! by the import and the export: which HF tensors, in which rows, make each parameter (in the
//! model's visiting order), and HF's rotate-half rotary order against Burn's interleaved pairs.
//! Gemma's block is the Llama's with two more norms: `pre_feedforward_layernorm` after
//! `post_attention_layernorm` (which is then the attention's own, not the MLP's), and
//! `post_feedforward_layernorm` after the MLP.

use super::{HfArchitecture, HfConfig, moe};

/// One HF tensor (or rows of one: Phi-3's fused tensors) in a concatenation: its name, its first
/// row, its rows, and the head size of a rotary permutation to apply to them (q and k).
pub(super) struct Part {
    pub(super) name: String,
    pub(super) offset: usize,
    pub(super) rows: usize,
    pub(super) rope_head_dim: Option<usize>,
}

/// How one of the Llama's parameters comes from the HF tensors.
pub(super) enum Source {
    /// Our full tensor is the HF tensors' rows concatenated (transposed if `transpose`: a 2-D
    /// `[in, out]` weight from `[out, in]` ones), so our cut dimension is their rows.
    Rows { parts: Vec<Part>, transpose: bool },
    /// Our full `[in, out]` tensor is HF `name` (`[out, in]`) transposed, cut along its columns.
    Columns { name: String },
}

/// Every HF tensor the model needs, with the shape the configuration gives it.
pub(super) fn expected_shapes(c: &HfConfig) -> Vec<(String, Vec<usize>)> {
    let (d, ff, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let hd = c.head_size();
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, d])];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        out.push((format!("{p}.input_layernorm.weight"), vec![d]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        if c.architecture.is_gemma() {
            out.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![d]));
            out.push((format!("{p}.post_feedforward_layernorm.weight"), vec![d]));
        }
        if fused(c) {
            out.push((
                format!("{p}.self_attn.qkv_proj.weight"),
                vec![q + 2 * kv, d],
            ));
        } else {
            for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                out.push((format!("{p}.self_attn.{proj}.weight"), vec![rows, d]));
                if c.qkv_bias {
                    out.push((format!("{p}.self_attn.{proj}.bias"), vec![rows]));
                }
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q]));
        if c.out_bias {
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![d]));
        }
        if c.qk_norm {
            out.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            out.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        if let Some(x) = c.experts.as_ref().filter(|x| x.is_sparse(i)) {
            let names = moe::names(c.architecture);
            let m = format!("{p}.{}", names.module);
            out.push((format!("{m}.gate.weight"), vec![x.n_experts, d]));
            let [gate, up, down] = names.projections;
            for e in 0..x.n_experts {
                out.push((format!("{m}.experts.{e}.{gate}.weight"), vec![x.d_ff, d]));
                out.push((format!("{m}.experts.{e}.{up}.weight"), vec![x.d_ff, d]));
                out.push((format!("{m}.experts.{e}.{down}.weight"), vec![d, x.d_ff]));
            }
            if let Some(w) = x.shared_expert {
                out.push((format!("{m}.shared_expert.gate_proj.weight"), vec![w, d]));
                out.push((format!("{m}.shared_expert.up_proj.weight"), vec![w, d]));
                out.push((format!("{m}.shared_expert.down_proj.weight"), vec![d, w]));
                out.push((format!("{m}.shared_expert_gate.weight"), vec![1, d]));
            }
        } else if fused(c) {
            out.push((format!("{p}.mlp.gate_up_proj.weight"), vec![2 * ff, d]));
        } else {
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![ff, d]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![ff, d]));
        }
        if !c.experts.as_ref().is_some_and(|x| x.is_sparse(i)) {
            out.push((format!("{p}.mlp.down_proj.weight"), vec![d, ff]));
        }
    }
    out.push(("model.norm.weight".into(), vec![d]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![v, d]));
    }
    out
}

/// Whether q, k, v and gate, up are each one HF tensor (Phi-3's `qkv_proj`, `gate_up_proj`:
/// their rows in the order of our fused chunks).
fn fused(c: &HfConfig) -> bool {
    c.architecture == HfArchitecture::Phi3
}

/// The model's parameters in visiting order (the Llama's, or the Gemma's), each with where it
/// comes from.
pub(super) fn sources(c: &HfConfig) -> Vec<Source> {
    sources_at(c, Ep::WHOLE)
}

/// Which of a MoE layer's experts a model holds: `rank` of `size` ranks of expert parallelism,
/// each holding `n_experts / size` in order ([`crate::moe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ep {
    pub rank: usize,
    pub size: usize,
}

impl Ep {
    /// Every expert.
    pub const WHOLE: Ep = Ep { rank: 0, size: 1 };
}

/// [`sources`] of a model holding expert-parallel rank `ep`'s experts.
pub(super) fn sources_at(c: &HfConfig, ep: Ep) -> Vec<Source> {
    let hd = c.head_size();
    let rows = |name: &str, transpose: bool| Source::Rows {
        parts: vec![Part {
            name: name.into(),
            offset: 0,
            rows: 0,
            rope_head_dim: None,
        }],
        transpose,
    };
    let mut out = vec![rows("model.embed_tokens.weight", false)];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let qkv = |suffix: &str| {
            let part = |proj: &str, offset: usize, heads: usize, rope: bool| Part {
                name: format!("{p}.self_attn.{proj}.{suffix}"),
                offset: offset * hd,
                rows: heads * hd,
                rope_head_dim: rope.then_some(hd),
            };
            if fused(c) {
                vec![
                    part("qkv_proj", 0, hq, true),
                    part("qkv_proj", hq, hkv, true),
                    part("qkv_proj", hq + hkv, hkv, false),
                ]
            } else {
                vec![
                    part("q_proj", 0, hq, true),
                    part("k_proj", 0, hkv, true),
                    part("v_proj", 0, hkv, false),
                ]
            }
        };
        out.push(rows(&format!("{p}.input_layernorm.weight"), false));
        out.push(Source::Rows {
            parts: qkv("weight"),
            transpose: true,
        });
        if c.qkv_bias {
            out.push(Source::Rows {
                parts: qkv("bias"),
                transpose: false,
            });
        }
        out.push(Source::Columns {
            name: format!("{p}.self_attn.o_proj.weight"),
        });
        if c.out_bias {
            out.push(rows(&format!("{p}.self_attn.o_proj.bias"), false));
        }
        if c.qk_norm {
            // One head's features: the rotary permutation of q and k applies to them too.
            for norm in ["q_norm", "k_norm"] {
                out.push(Source::Rows {
                    parts: vec![Part {
                        name: format!("{p}.self_attn.{norm}.weight"),
                        offset: 0,
                        rows: hd,
                        rope_head_dim: Some(hd),
                    }],
                    transpose: false,
                });
            }
        }
        out.push(rows(&format!("{p}.post_attention_layernorm.weight"), false));
        if c.architecture.is_gemma() {
            out.push(rows(
                &format!("{p}.pre_feedforward_layernorm.weight"),
                false,
            ));
        }
        if let Some(x) = c.experts.as_ref().filter(|x| x.is_sparse(i)) {
            moe_sources(&mut out, c, &p, x, ep);
            continue;
        }
        let ff = c.intermediate_size;
        let gate_up = if fused(c) {
            [("gate_up_proj", 0), ("gate_up_proj", ff)]
        } else {
            [("gate_proj", 0), ("up_proj", 0)]
        };
        out.push(Source::Rows {
            parts: gate_up
                .map(|(proj, offset)| Part {
                    name: format!("{p}.mlp.{proj}.weight"),
                    offset,
                    rows: ff,
                    rope_head_dim: None,
                })
                .into(),
            transpose: true,
        });
        out.push(Source::Columns {
            name: format!("{p}.mlp.down_proj.weight"),
        });
        if c.architecture.is_gemma() {
            out.push(rows(
                &format!("{p}.post_feedforward_layernorm.weight"),
                false,
            ));
        }
    }
    out.push(rows("model.norm.weight", false));
    if !c.tie_word_embeddings {
        out.push(rows("lm_head.weight", true));
    }
    out
}

/// A MoE layer's parameters in visiting order ([`crate::moe::MoeLayer`]): the router, each
/// of `ep`'s experts' gate / up and down, the shared expert's, its gate.
fn moe_sources(
    out: &mut Vec<Source>,
    c: &HfConfig,
    p: &str,
    x: &crate::moe::ExpertsConfig,
    ep: Ep,
) {
    let names = moe::names(c.architecture);
    let m = format!("{p}.{}", names.module);
    let gated = |out: &mut Vec<Source>, prefix: String, [gate, up, down]: [&str; 3], width| {
        out.push(Source::Rows {
            parts: [gate, up]
                .map(|proj| Part {
                    name: format!("{prefix}.{proj}.weight"),
                    offset: 0,
                    rows: width,
                    rope_head_dim: None,
                })
                .into(),
            transpose: true,
        });
        out.push(Source::Columns {
            name: format!("{prefix}.{down}.weight"),
        });
    };
    // Replicated `[in, out]` weights whose rows (ours) are HF's columns.
    let router = |name: String| Source::Columns { name };
    out.push(router(format!("{m}.gate.weight")));
    let per = x.n_experts / ep.size.max(1);
    for e in ep.rank * per..(ep.rank + 1) * per {
        gated(out, format!("{m}.experts.{e}"), names.projections, x.d_ff);
    }
    if let Some(w) = x.shared_expert {
        let projections = ["gate_proj", "up_proj", "down_proj"];
        gated(out, format!("{m}.shared_expert"), projections, w);
        out.push(router(format!("{m}.shared_expert_gate.weight")));
    }
}

/// HF's rotate-half order to Burn's interleaved pairs, within each head of `hd` rows:
/// row `2i` of a head takes HF row `i`, row `2i + 1` HF row `i + hd / 2`.
pub(super) fn rope_row(r: usize, hd: usize) -> usize {
    let (head, i) = (r / hd, r % hd);
    head * hd + if i % 2 == 0 { i / 2 } else { hd / 2 + i / 2 }
}

#[cfg(test)]
mod tests {
    use super::rope_row;

    #[test]
    fn the_rotary_permutation_interleaves_the_two_halves_of_each_head() {
        // A head of 8: Burn's rows 0..8 take HF rows 0, 4, 1, 5, 2, 6, 3, 7; the next head the
        // same, shifted.
        let rows: Vec<usize> = (0..16).map(|r| rope_row(r, 8)).collect();
        assert_eq!(rows, [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]);
    }
}
