//! Offline stand-in for `cubecl-llvm` 0.11.3: exactly the items `cubecl-cuda` 0.11.3 names, with
//! the same types, and no LLVM.
//!
//! Upstream, `cubecl-llvm`'s build script downloads a prebuilt LLVM, and `cubecl-cuda` depends on
//! it even when its `cpp` feature makes the CUDA C++ / NVRTC backend the default. With this crate
//! patched in, the CUDA backend builds and links without network access; selecting its LLVM
//! backend (`CudaBackend::Llvm`) then fails at kernel compilation with an error saying so.
//!
//! Kept minimal on purpose: every item mirrors upstream's signature; nothing else is here.

use core::fmt;

use cubecl_core::ir::amd::GfxArch;
use cubecl_core::ir::nvidia::SmArch;
use cubecl_runtime::compiler::{CompilationError, Compiler};
use cubecl_runtime::config::compilation::F16Evaluation;
use cubecl_runtime::kernel::{BufferIOAttr, KernelDefinition};

/// The PTX ISA versions (upstream: `nvptx::ptx_version`).
pub mod nvptx {
    /// Upstream's `nvptx::ptx_version`.
    pub mod ptx_version {
        use core::fmt;

        /// A PTX ISA version, as the NVPTX target feature spells it: 8.7 is `87`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest version a driver of CUDA `driver` loads (12.8 is `12080`); `None`
            /// below CUDA 10.0. The same table as upstream (the runtime keys its kernel cache
            /// on it).
            pub fn for_driver(driver: i32) -> Option<Self> {
                DRIVER_PTX
                    .iter()
                    .find(|(first_driver, _)| driver >= *first_driver)
                    .map(|(_, ptx)| Self(*ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }

        const DRIVER_PTX: &[(i32, u32)] = &[
            (13030, 93),
            (13020, 92),
            (13010, 91),
            (13000, 90),
            (12090, 88),
            (12080, 87),
            (12050, 85),
            (12040, 84),
            (12030, 83),
            (12020, 82),
            (12010, 81),
            (12000, 80),
            (11080, 78),
            (11070, 77),
            (11060, 76),
            (11050, 75),
            (11040, 74),
            (11030, 73),
            (11020, 72),
            (11010, 71),
            (11000, 70),
            (10020, 65),
            (10010, 64),
            (10000, 63),
        ];
    }
}

/// Upstream's `shared::lowered_features`.
pub mod shared {
    /// What a device advertises, narrowed to what the LLVM backend lowers.
    pub mod lowered_features {
        use cubecl_core::ir::DeviceProperties;

        /// The GPU target a device's features are narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA.
            Nvptx,
        }

        /// Upstream narrows `props` for the LLVM backend; the runtime calls it only when that
        /// backend is selected, and this stand-in has none, so the properties stay as the C++
        /// backend gave them.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// LLVM compilation targets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// The CPU JIT.
    #[default]
    Cpu,
    /// NVIDIA PTX.
    Nvptx,
}

/// The LLVM backend's compiler: here, one that always refuses.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The target.
    pub target: LlvmTarget,
}

/// Options of [`PlironCompiler`] (upstream's fields).
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// Minimum CPU buffer alignment.
    pub cpu_buffer_alignment: Option<u32>,
    /// AMDGPU architecture.
    pub arch: Option<GfxArch>,
    /// CPU f16 evaluation precision.
    pub f16_evaluation: F16Evaluation,
    /// NVPTX architecture.
    pub sm_arch: Option<SmArch>,
    /// PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Scalars and static metadata in the kernel parameter block.
    pub grid_constants: bool,
}

/// Compiled PTX module (upstream's fields; never produced here).
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// IR for logging and cache keys.
    pub ir: String,
    /// Shared memory required per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// Compiled kernel artifact.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// PTX.
    NvptxCode(NvptxModule),
}

impl fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => f.write_str(&module.ir),
        }
    }
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this build replaced cubecl-llvm with its offline stand-in (no LLVM): use the \
                     CUDA C++ / NVRTC backend (cubecl-cuda's `cpp` feature, burn-tp's `cuda` \
                     feature turns it on)"
                .into(),
            backtrace: cubecl_environment::backtrace::BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        "ll"
    }

    fn lang_tag(&self) -> &'static str {
        "llvm"
    }
}
