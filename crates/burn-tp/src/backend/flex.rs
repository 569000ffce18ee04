//! `TpBackend` for Flex, Burn's CPU backend: the trait's defaults (the host transport and the
//! overlapped linears of [`crate::backend::matmul::overlap`]), with the inputs of a collective read in place from
//! the tensor's storage instead of copied out of it. Every rank is a thread on the one Flex device.

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::DType;
use burn_flex::FlexTensor;
use burn_tp_comm::{CommError, ProcessGroup, SendBuf};

use super::{
    AllToAllSpec, AttentionSpec, Bias, Collective, CollectiveOutput, NormSpec, PendingCollective,
    TpBackend,
};
use std::sync::atomic::{AtomicU8, Ordering};

use crate::backend::attention::{flash, flash_cpu};
use crate::backend::collective::all_to_all::host_all_to_all_with;
use crate::backend::collective::host::{DataRead, HostElement, HostRead, host_start_with};
use crate::backend::fused::swiglu::{self, GluActivation};
use crate::backend::fused::{activation_cpu, gelu, norm, norm_cpu};

impl TpBackend for Flex {
    fn tp_start(
        x: FloatTensor<Self>,
        op: Collective,
        group: ProcessGroup,
    ) -> PendingCollective<Self> {
        host_start_with::<Self, _>(x, op, group, |moved| Ok(FlexRead(moved)))
    }

    fn tp_all_to_all(
        x: FloatTensor<Self>,
        spec: AllToAllSpec,
        group: ProcessGroup,
    ) -> CollectiveOutput<Self> {
        host_all_to_all_with::<Self, _>(x, &spec, &group, |t| Ok(FlexRead(t))).into()
    }

    /// The CPU kernel (`fused/activation_cpu.rs`: one pass) for f32 and half inputs; the tensor ops
    /// for f64 or with [`set_cpu_kernels`]`(false)`.
    fn tp_glu(y: FloatTensor<Self>, act: GluActivation) -> FloatTensor<Self> {
        match cpu_kernel(&y) {
            true => activation_cpu::glu_forward(y, act),
            false => swiglu::forward::<Self>(y, act),
        }
    }

    fn tp_glu_backward(
        y: FloatTensor<Self>,
        dz: FloatTensor<Self>,
        act: GluActivation,
    ) -> FloatTensor<Self> {
        match cpu_kernel(&y) {
            true => activation_cpu::glu_backward(y, dz, act),
            false => swiglu::backward::<Self>(y, dz, act),
        }
    }

    /// The CPU kernel (`fused/activation_cpu.rs`: one pass, a vectorized normal CDF) for f32
    /// and half inputs; Burn's `gelu` for f64 or with [`set_cpu_kernels`]`(false)`.
    fn tp_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match cpu_kernel(&x) {
            true => activation_cpu::gelu_forward(x),
            false => <Self as burn::backend::ops::ActivationOps<Self>>::gelu(x),
        }
    }

    fn tp_gelu_backward(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        match cpu_kernel(&x) {
            true => activation_cpu::gelu_backward(x, dy),
            false => gelu::backward::<Self>(x, dy),
        }
    }

    /// The CPU kernel (`fused/norm_cpu.rs`: one pass over the rows) for f32 and half inputs;
    /// the tensor ops (and Burn's layer norm) for f64 or with [`set_cpu_kernels`]`(false)`.
    fn tp_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Bias<Self>,
        spec: NormSpec,
    ) -> FloatTensor<Self> {
        match cpu_kernel(&x) {
            true => norm_cpu::forward(x, gamma, beta.into_option(), &spec),
            false => norm::forward::<Self>(x, gamma, beta.into_option(), &spec),
        }
    }

    fn tp_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        spec: NormSpec,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        match cpu_kernel(&x) {
            true => norm_cpu::backward(x, gamma, dy, &spec),
            false => norm::backward::<Self>(x, gamma, dy, &spec),
        }
    }

    /// The CPU kernel (`flash_cpu/`: f32 tiles between GEMM calls) for f32 and half inputs; the
    /// tensor-op tiles for f64 or with [`set_cpu_kernels`]`(false)`.
    fn tp_attention_kernel(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cpu_kernel(&q) {
            true => flash_cpu::forward(q, k, v, &spec),
            false => flash::forward::<Self>(q, k, v, &spec),
        }
    }

    fn tp_attention_kernel_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        spec: AttentionSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        match cpu_kernel(&q) {
            true => flash_cpu::backward(q, k, v, out, lse, d_out, &spec),
            false => flash::backward::<Self>(q, k, v, out, lse, d_out, &spec),
        }
    }
}

/// Whether a CPU kernel runs the op on `x`: f32 and half (computed in f32), not f64, unless
/// they are switched off ([`set_cpu_kernels`]).
fn cpu_kernel(x: &FlexTensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) && cpu_kernels()
}

/// 0: not read yet, 1: on, 2: off.
static CPU_KERNELS: AtomicU8 = AtomicU8::new(0);

/// Whether Flex runs burn-tp's CPU kernels (the attention's tiles, the gated MLP's gate, the
/// GELU, the norms) or
/// the same ops composed of Burn's tensor ops (the unfused path, kept for comparison). On by
/// default; `BURN_TP_CPU_KERNELS=0` in the environment starts the process with them off.
pub fn cpu_kernels() -> bool {
    match CPU_KERNELS.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("BURN_TP_CPU_KERNELS").map_or(true, |v| v != "0");
            CPU_KERNELS.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

/// Switches burn-tp's CPU kernels on or off for the whole process ([`cpu_kernels`]): benches
/// time both paths in one run, tests hold one to the other.
pub fn set_cpu_kernels(on: bool) {
    CPU_KERNELS.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// A Flex tensor's values: its storage itself when it is laid out as the flat buffer (contiguous,
/// from the start), else a contiguous copy.
struct FlexRead(FlexTensor);

/// A view of a Flex tensor's storage; holding the tensor keeps the storage alive and, being a
/// second owner, makes Flex copy before any in-place write to it.
struct FlexView<T> {
    tensor: FlexTensor,
    len: usize,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: HostElement> SendBuf<T> for FlexView<T> {
    fn as_slice(&self) -> &[T] {
        &self.tensor.storage::<T>()[..self.len]
    }
}

impl HostRead for FlexRead {
    fn values<T: HostElement>(self) -> Result<Box<dyn SendBuf<T>>, CommError> {
        let t = self.0;
        let len = t.layout().num_elements();
        if t.is_contiguous() && t.layout().start_offset() == 0 && t.dtype() == T::dtype() {
            return Ok(Box::new(FlexView {
                tensor: t,
                len,
                _t: std::marker::PhantomData,
            }));
        }
        DataRead(t.into_data()).values::<T>()
    }
}
