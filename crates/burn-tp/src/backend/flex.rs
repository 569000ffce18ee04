//! `TpBackend` for Flex, Burn's CPU backend: the trait's defaults (the host transport and the
//! overlapped linears of [`super::overlap`]). Every rank is a thread on the one Flex device.

use burn::backend::Flex;

use super::TpBackend;

impl TpBackend for Flex {}
