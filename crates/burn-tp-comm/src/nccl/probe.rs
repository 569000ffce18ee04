//! Library discovery: cudarc loads `libcuda` and `libnccl` at run time and panics if they are
//! missing, so [`probe`] checks first (and reads the driver's and NVRTC's versions).

use crate::{CommError, Result};

/// The libraries NCCL needs, found or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `libcuda` loads.
    pub cuda: bool,
    /// `libnccl` loads under a name cudarc tries.
    pub nccl: bool,
    /// `libnccl.so.2` loads (NCCL's real soname).
    pub nccl_soname: bool,
    /// The CUDA version the driver supports, as `(major, minor)`.
    pub driver: Option<(i32, i32)>,
    /// NVRTC's version (burn's CUDA kernels are compiled by it at run time), if `libnvrtc.so`
    /// loads; `None` when it does not (only NCCL on raw buffers works then).
    pub nvrtc: Option<(i32, i32)>,
}

impl Probe {
    /// Why burn's CUDA kernels could not be compiled and run here, if they could not: NVRTC
    /// missing, or newer than the driver (its PTX would be refused at load).
    pub fn kernel_problem(&self) -> Option<String> {
        match (self.nvrtc, self.driver) {
            (None, _) => Some(
                "NVRTC (libnvrtc.so) was not found: burn's CUDA kernels are compiled by it at run \
                 time; install the CUDA toolkit's NVRTC or the nvidia-cuda-nvrtc package and put \
                 its directory (with a `libnvrtc.so` link) on LD_LIBRARY_PATH"
                    .into(),
            ),
            (Some(n), Some(d)) if n > d => Some(format!(
                "NVRTC {}.{} is newer than the driver's CUDA {}.{}: its PTX would be refused; \
                 put an NVRTC of CUDA <= {}.{} first on LD_LIBRARY_PATH",
                n.0, n.1, d.0, d.1, d.0, d.1
            )),
            _ => None,
        }
    }
}

/// NVRTC's version, from the first of the names cudarc tries that loads.
fn nvrtc_version() -> Option<(i32, i32)> {
    for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
        // Safety: NVRTC's initialisers have no preconditions; `nvrtcVersion` writes two ints.
        unsafe {
            let Ok(lib) = libloading::Library::new(name) else {
                continue;
            };
            type Version = unsafe extern "C" fn(*mut i32, *mut i32) -> i32;
            let Ok(f) = lib.get::<Version>(b"nvrtcVersion\0") else {
                continue;
            };
            let (mut major, mut minor) = (0, 0);
            if f(&mut major, &mut minor) == 0 {
                return Some((major, minor));
            }
        }
    }
    None
}

/// The CUDA version the loaded driver supports.
fn driver_version() -> Option<(i32, i32)> {
    let mut v = 0;
    // Safety: libcuda is present (checked by the caller); the call writes one int.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (status == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some((v / 1000, v % 1000 / 10))
}

/// Checks for libcuda and libnccl without panicking, and reads the driver's and NVRTC's
/// versions ([`Probe::kernel_problem`] says whether burn's kernels can run).
///
/// # Errors
/// What is missing, and what to do about it.
pub fn probe() -> Result<Probe> {
    // Safety: only dlopen; no symbol is called.
    let p = unsafe {
        Probe {
            cuda: cudarc::driver::sys::is_culib_present(),
            nccl: cudarc::nccl::sys::is_culib_present(),
            nccl_soname: libloading::Library::new("libnccl.so.2").is_ok(),
            driver: None,
            nvrtc: nvrtc_version(),
        }
    };
    let p = Probe {
        driver: if p.cuda { driver_version() } else { None },
        ..p
    };
    if !p.cuda {
        return Err(CommError::Backend(
            "NCCL: libcuda was not found (no NVIDIA driver on this machine?)".into(),
        ));
    }
    if !p.nccl {
        return Err(CommError::Backend(if p.nccl_soname {
            "NCCL: libnccl.so.2 is installed but cudarc loads `libnccl.so`: add a link \
             `libnccl.so -> libnccl.so.2` in a directory on LD_LIBRARY_PATH (burn-tp-launch does)"
                .into()
        } else {
            "NCCL: libnccl was not found (install NCCL, or add its directory to LD_LIBRARY_PATH)"
                .into()
        }));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::Probe;

    fn probe(driver: Option<(i32, i32)>, nvrtc: Option<(i32, i32)>) -> Probe {
        Probe {
            cuda: true,
            nccl: true,
            nccl_soname: true,
            driver,
            nvrtc,
        }
    }

    #[test]
    fn nvrtc_missing_or_newer_than_the_driver_is_named() {
        let missing = probe(Some((13, 0)), None).kernel_problem().unwrap();
        assert!(missing.contains("libnvrtc.so"), "{missing}");
        let newer = probe(Some((13, 0)), Some((13, 1)))
            .kernel_problem()
            .unwrap();
        assert!(
            newer.contains("NVRTC 13.1") && newer.contains("13.0"),
            "{newer}"
        );
        assert_eq!(probe(Some((13, 0)), Some((13, 0))).kernel_problem(), None);
        assert_eq!(probe(Some((13, 0)), Some((12, 8))).kernel_problem(), None);
        // An unknown driver version is not a reason to refuse.
        assert_eq!(probe(None, Some((12, 8))).kernel_problem(), None);
    }
}
