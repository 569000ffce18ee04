//! burn-tp
