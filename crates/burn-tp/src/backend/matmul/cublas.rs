//! The GEMM hook on burn's CUDA backend: cuBLAS (issue 36; feature `cuda`). Compiled and linked
//! in CI; **not yet run on a GPU** (the prepared check, `.ci/gpu-check`, compares it with burn's
//! matmul on the first GPU at hand). `BURN_TP_CUBLAS=0` turns it off (burn's matmul then).
//!
//! - The arguments: [`crate::backend::matmul::gemm::gemm_args`] maps the row-major product (strides, transposed
//!   views, a batch) onto one column-major `cublasGemmStridedBatchedEx`; a layout it cannot
//!   express falls back to burn's matmul, the reason printed once per reason.
//! - Types: bf16 and f16 in, f32 accumulation; f32 under the TF32 policy: TF32 tensor cores by
//!   default, as cubecl's own matmul uses them for f32 on sm >= 80 (`BURN_TP_TF32=0`: strict
//!   f32). Other dtypes fall back.
//! - Ordering, conservatively, as the NCCL path (`cuda.rs`): taking the device pointers makes
//!   this thread's cubecl stream wait for any other stream that wrote them; then that stream is
//!   synced (every kernel writing an operand has finished); cuBLAS runs on a stream of its own,
//!   and the host waits for it before returning, so cubecl's later kernels read the result and
//!   no operand goes back to cubecl's pool while cuBLAS reads it. The cost: the GPU idles while
//!   the host enqueues around each GEMM; an event on cubecl's stream would remove it, once
//!   cubecl exposes its stream.
//! - One cuBLAS handle and stream per rank thread (thread-local), with cuBLAS's default
//!   workspace.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::{Backend, DType};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::Device as CubeDevice;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl_runtime::runtime::Runtime;
use cudarc::cublas::{CudaBlas, result as blas, sys};
use cudarc::driver::{CudaContext, CudaStream};

use crate::backend::matmul::gemm::{GemmArgs, Layout, Op, gemm_args};

type Server = <CudaRuntime as Runtime>::Server;

/// This thread's cuBLAS handle, on its own stream of device `index`.
struct Blas {
    index: usize,
    stream: Arc<CudaStream>,
    handle: CudaBlas,
}

thread_local! {
    static BLAS: RefCell<Option<Blas>> = const { RefCell::new(None) };
}

/// `a · b` (plus `acc`, in place, when given: beta = 1) through cuBLAS, or why not (the caller
/// runs burn's matmul instead).
pub(crate) fn matmul(
    a: &CubeTensor,
    b: &CubeTensor,
    acc: Option<&CubeTensor>,
) -> Result<CubeTensor, String> {
    if std::env::var("BURN_TP_CUBLAS").is_ok_and(|v| v == "0") {
        return Err("BURN_TP_CUBLAS=0".into());
    }
    let CubeDevice::Cuda(device) = &a.device else {
        return Err(format!("{:?} is not a CUDA device", a.device));
    };
    let (data_type, compute) = types(a.dtype)?;
    if b.dtype != a.dtype || acc.is_some_and(|c| c.dtype != a.dtype) {
        return Err(format!("mixed dtypes {:?} x {:?}", a.dtype, b.dtype));
    }
    let (la, lb) = (
        layout("a", a.meta.shape(), a.meta.strides())?,
        layout("b", b.meta.shape(), b.meta.strides())?,
    );
    let mut out_dims: Vec<usize> = batch_dims(a.meta.shape(), b.meta.shape())?;
    out_dims.extend([la.shape[1], lb.shape[2]]);
    let out_shape = Shape::from(out_dims);
    // The output: `acc`'s buffer when it is dense and this tensor its only holder, else a
    // fresh dense one (never cubecl's pitched rows: cuBLAS writes ldc-spaced rows of the
    // layout it is given, so any dense layout is read back right).
    let (out, beta) = match acc {
        Some(c) if c.can_mut() && c.is_contiguous() && c.meta.shape() == &out_shape => {
            (c.clone(), 1.0f32)
        }
        Some(_) => return Err("the accumulator is shared or not dense".into()),
        None => (
            empty_device_contiguous_dtype(
                a.client.clone(),
                a.device.clone(),
                out_shape.clone(),
                a.dtype,
            ),
            0.0f32,
        ),
    };
    let lo = layout("out", out.meta.shape(), out.meta.strides())?;
    let args = gemm_args(&la, &lb, &lo).map_err(|f| f.0)?;
    let pointer = |t: &CubeTensor| {
        t.client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| format!("device pointer: {e:?}"))
    };
    let (ra, rb, ro) = (pointer(a)?, pointer(b)?, pointer(&out)?);
    CubeBackend::sync(&a.device).map_err(|e| format!("device sync: {e:?}"))?;
    let (pa, pb, po) = (ra.resource().ptr, rb.resource().ptr, ro.resource().ptr);
    BLAS.with(|cell| -> Result<(), String> {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|b| b.index != device.index) {
            let ctx = CudaContext::new(device.index).map_err(|e| format!("context: {e:?}"))?;
            let stream = ctx.new_stream().map_err(|e| format!("stream: {e:?}"))?;
            let handle = CudaBlas::new(stream.clone()).map_err(|e| format!("handle: {e:?}"))?;
            *slot = Some(Blas {
                index: device.index,
                stream,
                handle,
            });
        }
        let blas_ = slot.as_ref().expect("made above");
        // Safety: the three pointers are live allocations of this GPU holding the layouts
        // `args` was computed from (their resources and tensors are held until the stream is
        // synced below); cubecl's writes to them have finished (the sync above); nothing else
        // writes `out` meanwhile.
        unsafe { launch(&blas_.handle, &args, data_type, compute, (pb, pa, po), beta) }?;
        blas_
            .stream
            .synchronize()
            .map_err(|e| format!("cuBLAS stream sync: {e:?}"))
    })?;
    drop((ra, rb, ro));
    Ok(out)
}

/// The cuBLAS data type and compute type of `dtype`.
fn types(dtype: DType) -> Result<(sys::cudaDataType, sys::cublasComputeType_t), String> {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    match dtype {
        DType::F32 if tf32() => Ok((CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32)),
        DType::F32 => Ok((CUDA_R_32F, CUBLAS_COMPUTE_32F)),
        DType::BF16 => Ok((CUDA_R_16BF, CUBLAS_COMPUTE_32F)),
        DType::F16 => Ok((CUDA_R_16F, CUBLAS_COMPUTE_32F)),
        other => Err(format!("dtype {other:?}")),
    }
}

/// The TF32 policy for f32 GEMMs: on unless `BURN_TP_TF32=0` (burn's own matmul uses TF32 for
/// f32 on sm >= 80).
pub(crate) fn tf32() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !std::env::var("BURN_TP_TF32").is_ok_and(|v| v == "0"))
}

/// A tensor of shape `shape` and element strides `strides` as a `[batch, rows, cols]` operand:
/// its leading dimensions must fold into one batch dimension with one stride.
fn layout(name: &str, shape: &[usize], strides: &[usize]) -> Result<Layout, String> {
    let r = shape.len();
    if r < 2 || strides.len() != r {
        return Err(format!("{name}: rank {r}"));
    }
    let lead = &shape[..r - 2];
    let batch: usize = lead.iter().product();
    // The batch's stride: the innermost leading dim of size > 1, each outer one spanning it.
    let mut stride = 0;
    let mut span = 1usize;
    for i in (0..r - 2).rev() {
        if shape[i] == 1 {
            continue;
        }
        if span == 1 {
            stride = strides[i];
        } else if strides[i] != stride * span {
            return Err(format!(
                "{name} {shape:?} with strides {strides:?}: its batch dimensions do not fold"
            ));
        }
        span *= shape[i];
    }
    Ok(Layout {
        shape: [batch, shape[r - 2], shape[r - 1]],
        strides: [
            if batch == 1 { 0 } else { stride },
            strides[r - 2],
            strides[r - 1],
        ],
    })
}

/// The output's leading dims: each the larger of the two (one of them 1 broadcasts); a batch
/// broadcast only over some of the dims (not foldable into one) falls back.
fn batch_dims(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    if a.len() != b.len() {
        return Err(format!("ranks of {a:?} and {b:?} differ"));
    }
    let (la, lb) = (&a[..a.len() - 2], &b[..b.len() - 2]);
    let (na, nb): (usize, usize) = (la.iter().product(), lb.iter().product());
    if na != 1 && nb != 1 && la != lb {
        return Err(format!("batch dims {la:?} and {lb:?} broadcast partly"));
    }
    Ok(if na >= nb { la.to_vec() } else { lb.to_vec() })
}

fn op(o: Op) -> sys::cublasOperation_t {
    match o {
        Op::N => sys::cublasOperation_t::CUBLAS_OP_N,
        Op::T => sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

/// One `cublasGemmStridedBatchedEx` of `args` (pointers: the first operand, the second, the
/// output).
///
/// # Safety
/// The pointers hold the layouts `args` describes, on the handle's device, and stay valid until
/// the handle's stream is synced.
unsafe fn launch(
    handle: &CudaBlas,
    args: &GemmArgs,
    data_type: sys::cudaDataType,
    compute: sys::cublasComputeType_t,
    (first, second, out): (u64, u64, u64),
    beta: f32,
) -> Result<(), String> {
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| format!("{what} {v} exceeds cuBLAS's 32-bit sizes"))
    };
    let alpha = 1.0f32;
    let [s_first, s_second, s_out] = args.batch_strides;
    let result = unsafe {
        blas::gemm_strided_batched_ex(
            *handle.handle(),
            op(args.op_first),
            op(args.op_second),
            int(args.m, "m")?,
            int(args.n, "n")?,
            int(args.k, "k")?,
            (&alpha as *const f32).cast(),
            first as *const std::ffi::c_void,
            data_type,
            int(args.ld_first, "ld")?,
            s_first as i64,
            second as *const std::ffi::c_void,
            data_type,
            int(args.ld_second, "ld")?,
            s_second as i64,
            (&beta as *const f32).cast(),
            out as *mut std::ffi::c_void,
            data_type,
            int(args.ld_out, "ld")?,
            s_out as i64,
            int(args.batch, "batch")?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    result.map_err(|e| format!("cublasGemmStridedBatchedEx: {e:?}"))
}

/// Prints why a product fell back to burn's matmul, once per reason (a layer's GEMMs repeat).
pub(crate) fn note_fallback(reason: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| Mutex::new(HashSet::new()));
    if seen
        .lock()
        .map(|mut s| s.insert(reason.to_string()))
        .unwrap_or(false)
        && reason != "BURN_TP_CUBLAS=0"
    {
        eprintln!("burn-tp: GEMM through burn's matmul, not cuBLAS: {reason}");
    }
}
