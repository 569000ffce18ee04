//! Cross-crate tests live in `integration/`.
