//! A Gemma 2 / 3 `config.json`'s own fields (rotary bases per layer type, layer types, what
//! burn-tp's Gemma does not do) read and checked, for [`HfConfig`](super::HfConfig).

use std::path::Path;

use serde_json::Value;

use super::arch::HfArchitecture;
use crate::Result;
use crate::attention::LayerType;
use crate::error::file_error;

/// Gemma's rotary bases `(full, sliding)`: Gemma 3's `rope_parameters` keyed by layer type
/// (transformers 5), else `rope_theta` and `rope_local_base_freq`, defaults 1,000,000 and
/// 10,000 (transformers' `Gemma3TextConfig`); Gemma 2's one base (`rope_parameters` or
/// `rope_theta`, default 10,000) for both. Scaled rotary positions are refused.
pub(super) fn gemma_rope(
    v: &Value,
    architecture: HfArchitecture,
    path: &Path,
) -> Result<(f64, f64)> {
    let present = |x: Option<&Value>| x.filter(|x| !x.is_null()).cloned();
    let mut bases = [None, None];
    if let Some(rope) = present(v.get("rope_parameters")) {
        let keyed = rope.get("full_attention").is_some() || rope.get("sliding_attention").is_some();
        let entries: Vec<(String, Option<Value>, usize)> = if keyed {
            vec![
                (
                    "full_attention".into(),
                    present(rope.get("full_attention")),
                    0,
                ),
                (
                    "sliding_attention".into(),
                    present(rope.get("sliding_attention")),
                    1,
                ),
            ]
        } else {
            vec![(String::new(), Some(rope.clone()), 0)]
        };
        for (key, params, slot) in entries {
            let Some(params) = params else { continue };
            let field = if key.is_empty() {
                "rope_parameters".to_string()
            } else {
                format!("rope_parameters.{key}")
            };
            let kind = params
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
            if kind != "default" {
                return Err(file_error(
                    path,
                    format!("`{field}` of type {kind:?} is not supported (Gemma: default is)"),
                ));
            }
            bases[slot] = params.get("rope_theta").and_then(Value::as_f64);
        }
    }
    if let Some(scaling) = present(v.get("rope_scaling")) {
        return Err(file_error(
            path,
            format!("`rope_scaling` is not supported for Gemma (none is): {scaling}"),
        ));
    }
    let number = |name: &str, default: f64| v.get(name).and_then(Value::as_f64).unwrap_or(default);
    if architecture == HfArchitecture::Gemma2 {
        let theta = bases[0].unwrap_or_else(|| number("rope_theta", 10_000.0));
        return Ok((theta, theta));
    }
    Ok((
        bases[0].unwrap_or_else(|| number("rope_theta", 1_000_000.0)),
        bases[1].unwrap_or_else(|| number("rope_local_base_freq", 10_000.0)),
    ))
}

/// What a Gemma `config` has that burn-tp's Gemma does not do, refused naming the field.
pub(super) fn gemma_checks(v: &Value, path: &Path) -> Result<()> {
    for field in ["use_bidirectional_attention", "attention_bias"] {
        if v.get(field).and_then(Value::as_bool) == Some(true) {
            return Err(file_error(
                path,
                format!("`{field}` = true is not supported for Gemma"),
            ));
        }
    }
    Ok(())
}

/// Gemma's layer types: `layer_types`, else every `sliding_window_pattern`-th layer (default
/// `pattern`: Gemma 3's 6, Gemma 2's 2) full and the others sliding, as transformers' configs.
pub(super) fn gemma_layer_types(
    v: &Value,
    layers: usize,
    pattern: u64,
    path: &Path,
) -> Result<Vec<LayerType>> {
    let Some(types) = v.get("layer_types").and_then(Value::as_array) else {
        let pattern = v
            .get("sliding_window_pattern")
            .and_then(Value::as_u64)
            .unwrap_or(pattern)
            .max(1) as usize;
        return Ok((0..layers)
            .map(|i| match (i + 1) % pattern {
                0 => LayerType::Full,
                _ => LayerType::Sliding,
            })
            .collect());
    };
    if types.len() != layers {
        return Err(file_error(
            path,
            format!(
                "`layer_types` has {} entries for {layers} layers",
                types.len()
            ),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(LayerType::Sliding),
            Some("full_attention") => Ok(LayerType::Full),
            _ => Err(file_error(
                path,
                format!(
                    "`layer_types` entry {t} is not supported (sliding_attention and \
                     full_attention are)"
                ),
            )),
        })
        .collect()
}
