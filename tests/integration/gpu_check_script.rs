//! `.ci/gpu-check` without a GPU: its library search on a fake directory tree, and a whole
//! `run` with stand-in binaries, which must leave at most 8 files under OUT (what the GPU
//! machine sends back) and a figures file even when the check is killed by its bound.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/gpu-check")
}

/// A fresh folder under the system's temporary one.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-tp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, b"").unwrap();
}

fn target(link: &Path) -> PathBuf {
    std::fs::canonicalize(link).unwrap_or_else(|e| panic!("{}: {e}", link.display()))
}

#[test]
fn discovery_prefers_the_driver_mount_and_the_toolkit_and_links_every_name_cudarc_tries() {
    let dir = scratch("discover");
    let root = dir.join("root");
    let wheels = dir.join("site-packages/nvidia");
    // The driver in its container mount and an older stub in the system folder; NVRTC in the
    // toolkit (13.0) and a newer one in a wheel (13.1); NCCL only in a wheel, as its soname.
    let driver = root.join("usr/local/nvidia/lib64/libcuda.so.580.95.05");
    touch(&driver);
    touch(&root.join("usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    let nvrtc = root.join("usr/local/cuda/lib64/libnvrtc.so.13.0.48");
    touch(&nvrtc);
    let builtins = root.join("usr/local/cuda/lib64/libnvrtc-builtins.so.13.0.48");
    touch(&builtins);
    touch(&root.join("usr/local/cuda/include/cuda_fp16.h"));
    touch(&wheels.join("cuda_nvrtc/lib/libnvrtc.so.13"));
    touch(&wheels.join("cuda_nvrtc/lib/libnvrtc-builtins.so.13.1"));
    let nccl = wheels.join("nccl/lib/libnccl.so.2");
    touch(&nccl);
    let links = dir.join("links");
    let out = Command::new("bash")
        .arg(script())
        .args(["discover", links.to_str().unwrap()])
        .env("GPU_CHECK_ROOT", &root)
        .env(
            "GPU_CHECK_WHEELS",
            format!(
                "{} {}",
                wheels.join("cuda_nvrtc/lib").display(),
                wheels.join("nccl/lib").display()
            ),
        )
        .env_remove("CUDA_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    for name in [
        "libcuda.so",
        "libcuda.so.1",
        "libcuda.so.12",
        "libcuda.so.13",
    ] {
        assert_eq!(target(&links.join(name)), target(&driver), "{name}");
    }
    for name in ["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.13"] {
        assert_eq!(target(&links.join(name)), target(&nvrtc), "{name}");
    }
    assert_eq!(
        target(&links.join("libnvrtc-builtins.so")),
        target(&builtins)
    );
    // cudarc tries libnccl.so (and .so.12, .so.1, ...), never NCCL's soname .so.2.
    for name in ["libnccl.so", "libnccl.so.1", "libnccl.so.2"] {
        assert_eq!(target(&links.join(name)), target(&nccl), "{name}");
    }
    assert!(
        stdout.contains(&format!(
            "export CUDA_PATH={}",
            root.join("usr/local/cuda").display()
        )),
        "{stdout}"
    );
    let path = stdout
        .lines()
        .find_map(|l| l.strip_prefix("export LD_LIBRARY_PATH="))
        .unwrap_or_else(|| panic!("no LD_LIBRARY_PATH in {stdout}"));
    assert!(path.starts_with(links.to_str().unwrap()), "{path}");
    assert!(stdout.contains("NOT FOUND: libcudart.so"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An executable shell script at `path`.
fn stub(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_run_leaves_three_files_under_out_and_reports_each_check() {
    let dir = scratch("gpu-check-run");
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    std::fs::copy(script(), bundle.join("gpu-check")).unwrap();
    // Stand-ins: the NCCL tests pass; gpu_check writes a figure, leaves files in its scratch
    // folder, and fails one check.
    stub(
        &bundle.join("bin/nccl-tests"),
        "echo 'test collectives ... ok'",
    );
    stub(
        &bundle.join("bin/gpu_check"),
        r#"printf '{\n  "device_path.status": "ok",\n  "train_gpt.status": "FAILED: x"\n}\n' > "$1/figures.json"
mkdir -p "$2/train_gpt" && for i in 1 2 3 4 5 6 7 8 9; do echo $i > "$2/train_gpt/f$i"; done
exit 1"#,
    );
    let out = dir.join("out");
    let scratch_dir = dir.join("scratch");
    let run = Command::new("bash")
        .arg(bundle.join("gpu-check"))
        .args(["run", out.to_str().unwrap()])
        .env("GPU_CHECK_SCRATCH", &scratch_dir)
        .env("GPU_CHECK_ROOT", dir.join("no-root"))
        .env("GPU_CHECK_WHEELS", "")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&run.stdout);
    assert_eq!(run.status.code(), Some(1), "{log}");
    let mut names: Vec<String> = walk(&out)
        .iter()
        .map(|p| p.strip_prefix(&out).unwrap().display().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["figures.json", "log.txt", "summary.txt"], "{log}");
    let figures = std::fs::read_to_string(out.join("figures.json")).unwrap();
    for want in [
        "\"nccl_world_1.status\": \"ok\"",
        "\"train_gpt.status\": \"FAILED: x\"",
        "\"gpu_check.exit\": 1",
        "gpu_check_run.seconds",
    ] {
        assert!(figures.contains(want), "{want} not in {figures}");
    }
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert!(summary.starts_with("status 1"), "{summary}");
    assert!(summary.contains("train_gpt.status"), "{summary}");
    let log_file = std::fs::read_to_string(out.join("log.txt")).unwrap();
    for phase in ["discover:", "nccl: ok (", "gpu_check: exit 1 ("] {
        assert!(log_file.contains(phase), "{phase} not in {log_file}");
    }
    assert!(
        log_file.contains("CUBECL_AUTOTUNE_LEVEL=minimal NCCL_DEBUG=WARN"),
        "{log_file}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every file under `dir`, recursively (links included, not followed).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() && !path.is_symlink() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// The GPU check's tp = 2 step (`checks::llama_steps_on_threads`) on the CPU: ranks as threads
/// sharing one device give the tp = 1 losses (f32, 1e-4), and a bf16 run stays finite and near
/// them.
#[test]
fn the_gpu_checks_threaded_llama_step_gives_the_tp_1_losses() {
    use burn::tensor::{Device, FloatDType};
    use burn_tp::llama::LlamaConfig;
    use burn_tp_examples::checks::llama_steps_on_threads;
    let _rng = crate::common::rng_lock();
    let config = LlamaConfig::new(64, 16, 32, 4, 2, 2, 64);
    let device = Device::flex();
    let run = |tp, dtype| llama_steps_on_threads(&config, tp, &device, (2, 3), dtype).unwrap();
    let one = run(1, FloatDType::F32);
    let two = run(2, FloatDType::F32);
    assert_eq!(one.losses.len(), 3);
    assert!(one.losses[2] < one.losses[0], "{:?}", one.losses);
    crate::common::assert_close(&two.losses, &one.losses, 1e-4, "tp 2 on threads vs tp 1");
    assert!(two.step_s > 0.0 && one.step_s > 0.0);
    let half = run(2, FloatDType::BF16);
    crate::common::assert_close(&half.losses, &one.losses, 3e-2, "bf16 at tp 2");
}
