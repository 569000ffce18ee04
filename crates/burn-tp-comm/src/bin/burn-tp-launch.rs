//! `burn-tp-launch --nproc N [--master-port P] -- <command> [args..]`
//!
//! Starts `N` local processes of `<command>` with torchrun's environment (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT`), forwards their output line by line with
//! a `[rank r]` prefix, and if one fails, kills the others and exits with its exit code. Each
//! launch gives its ranks a new `BURN_TP_STORE_TOKEN` (unless one is set), the secret of the
//! rendezvous store.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

fn usage() -> ! {
    eprintln!("usage: burn-tp-launch --nproc N [--master-port PORT] -- <command> [args..]");
    std::process::exit(2);
}

fn forward(
    stream: impl Read + Send + 'static,
    rank: usize,
    stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if stderr {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {line}");
            }
        }
    })
}

/// NCCL installs as `libnccl.so.2`, which cudarc does not look for: when only that name exists,
/// a directory with a `libnccl.so` link goes first on the children's `LD_LIBRARY_PATH`.
fn nccl_link_dir() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(Into::into)
        .collect();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/lib",
            "/usr/lib",
        ]
        .map(Into::into),
    );
    if dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return None;
    }
    let real = dirs
        .iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.exists())?;
    let link_dir = std::env::temp_dir().join(format!("burn-tp-launch-{}", std::process::id()));
    std::fs::create_dir_all(&link_dir).ok()?;
    #[cfg(unix)]
    std::os::unix::fs::symlink(&real, link_dir.join("libnccl.so")).ok()?;
    Some(link_dir)
}

/// 128 random bits as hex, from the kernel (std's hasher keys as a fallback off Linux).
fn new_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        use std::hash::{BuildHasher, RandomState};
        let (a, b) = (RandomState::new(), RandomState::new());
        bytes[..8].copy_from_slice(&a.hash_one(std::process::id()).to_le_bytes());
        bytes[8..].copy_from_slice(&b.hash_one(std::time::SystemTime::now()).to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn code(status: ExitStatus) -> i32 {
    status.code().unwrap_or(128)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args
        .iter()
        .position(|a| a == "--")
        .unwrap_or_else(|| usage());
    let (opts, command) = (&args[..split], &args[split + 1..]);
    if command.is_empty() {
        usage();
    }
    let mut nproc = None;
    let mut port = None;
    let mut it = opts.iter();
    while let Some(o) = it.next() {
        match o.as_str() {
            "--nproc" => nproc = it.next().and_then(|v| v.parse::<usize>().ok()),
            "--master-port" => port = it.next().and_then(|v| v.parse::<u16>().ok()),
            _ => usage(),
        }
    }
    let nproc = nproc.filter(|&n| n > 0).unwrap_or_else(|| usage());
    // A free port unless one is given.
    let port = port.unwrap_or_else(|| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(29500)
    });

    // The store's secret for this launch: only its own ranks can use the store.
    let token = std::env::var("BURN_TP_STORE_TOKEN").unwrap_or_else(|_| new_token());
    let library_path = nccl_link_dir().map(|dir| {
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        format!("{}:{old}", dir.display())
    });
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pipes = Vec::new();
    for rank in 0..nproc {
        let mut cmd = Command::new(&command[0]);
        if let Some(path) = &library_path {
            cmd.env("LD_LIBRARY_PATH", path);
        }
        let spawned = cmd
            .args(&command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("BURN_TP_STORE_TOKEN", &token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(mut child) => {
                pipes.push(forward(child.stdout.take().expect("piped"), rank, false));
                pipes.push(forward(child.stderr.take().expect("piped"), rank, true));
                children.push((rank, child));
            }
            Err(e) => {
                eprintln!(
                    "burn-tp-launch: cannot start {:?} for rank {rank}: {e}",
                    command[0]
                );
                children.iter_mut().for_each(|(_, c)| drop(c.kill()));
                std::process::exit(127);
            }
        }
    }
    // Poll: the first failure stops the rest.
    let mut failure: Option<(usize, i32)> = None;
    let mut running = children.len();
    while running > 0 {
        running = 0;
        for (rank, child) in children.iter_mut() {
            match child.try_wait() {
                Ok(Some(status)) if !status.success() && failure.is_none() => {
                    failure = Some((*rank, code(status)));
                }
                Ok(Some(_)) => {}
                Ok(None) => running += 1,
                Err(_) => {}
            }
        }
        if let Some((rank, code)) = failure {
            for (_, child) in children.iter_mut() {
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = child.kill();
                }
            }
            for (_, child) in children.iter_mut() {
                let _ = child.wait();
            }
            pipes.into_iter().for_each(|p| drop(p.join()));
            eprintln!(
                "burn-tp-launch: rank {rank} failed with exit code {code}; stopped the others"
            );
            std::process::exit(code);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    pipes.into_iter().for_each(|p| drop(p.join()));
}
