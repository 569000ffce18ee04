//! The rendezvous store over loopback, and the launcher with several processes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use burn_tp_comm::store::{LaunchEnv, StoreClient, StoreServer};

#[test]
fn ranks_meet_and_exchange_values_through_the_store() {
    let server = StoreServer::start("127.0.0.1:0", "").unwrap();
    let addr = server.addr().to_string();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let store = StoreClient::connect(&addr, rank, "", Duration::from_secs(10)).unwrap();
                store
                    .set(&format!("id/{rank}"), format!("rank-{rank}").as_bytes())
                    .unwrap();
                store.barrier("b", 4).unwrap();
                (0..4)
                    .map(|r| String::from_utf8(store.get(&format!("id/{r}")).unwrap()).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(
            h.join().unwrap(),
            vec!["rank-0", "rank-1", "rank-2", "rank-3"]
        );
    }
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let server = StoreServer::start("127.0.0.1:0", "").unwrap();
    let addr = server.addr().to_string();
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect(&addr, rank, "", Duration::from_millis(300)).unwrap();
                store.barrier("b", 3).unwrap_err().to_string()
            })
        })
        .collect();
    for h in handles {
        let msg = h.join().unwrap();
        assert!(
            msg.contains("rank(s) [2] did not arrive") && msg.contains(&addr),
            "{msg}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    // Nobody listening: the connect error names the address and the rank.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let e = StoreClient::connect(&dead, 7, "", Duration::from_millis(200))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&dead) && e.contains("rank 7"), "{e}");
}

fn launch(extra_env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_burn-tp-launch"));
    // The rank program is this test binary, running only `rank_program` (see there).
    let me = std::env::current_exe().unwrap();
    cmd.args(["--nproc", "3", "--"])
        .arg(me)
        .args([
            "--exact",
            "rank_program",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(RANK_PROGRAM, "1");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn the_launcher_runs_a_three_process_job_that_meets_at_the_store() {
    let out = launch(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r} of 3: sum 60")),
            "{stdout}"
        );
    }
}

#[test]
fn the_launcher_stops_the_others_when_a_rank_fails_and_exits_with_its_code() {
    let start = Instant::now();
    // The survivors would wait 30 s for the failed rank's value; the launcher kills them.
    let out = launch(&[("FAIL_RANK", "1"), ("STORE_TIMEOUT_S", "30")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("[rank 1] failing on purpose"), "{stderr}");
    assert!(
        stderr.contains("rank 1 failed with exit code 3"),
        "{stderr}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}

const RANK_PROGRAM: &str = "BURN_TP_TEST_RANK_PROGRAM";

/// The rank program the launcher tests start (a no-op in a normal test run): meets at the store,
/// exchanges one value per rank, prints the sum, exits. With `FAIL_RANK=r`, rank `r` exits with
/// code 3 after the rendezvous (and the others wait for a value that never comes).
#[test]
fn rank_program() {
    if std::env::var_os(RANK_PROGRAM).is_none() {
        return;
    }
    let env = match LaunchEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let timeout = Duration::from_secs(
        std::env::var("STORE_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(20),
    );
    let (_server, store) = match env.rendezvous(timeout) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(4);
        }
    };
    if std::env::var("FAIL_RANK")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        == Some(env.rank)
    {
        eprintln!("failing on purpose");
        std::process::exit(3);
    }
    store
        .set(
            &format!("value/{}", env.rank),
            &((env.rank as u64 + 1) * 10).to_le_bytes(),
        )
        .unwrap();
    let mut sum = 0;
    for r in 0..env.world_size {
        match store.get(&format!("value/{r}")) {
            Ok(v) => sum += u64::from_le_bytes(v[..8].try_into().unwrap()),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(5);
            }
        }
    }
    // Rank 0 hosts the store: it leaves last, once every other rank is done with the store
    // (after the barrier, a peer may still be reading the last marks).
    store.barrier("done", env.world_size).unwrap();
    if env.rank == 0 {
        for r in 1..env.world_size {
            store.get(&format!("left/{r}")).unwrap();
        }
    } else {
        store.set(&format!("left/{}", env.rank), &[1]).unwrap();
    }
    // On a line of its own, after the test harness's "test rank_program ... ".
    println!("\nrank {} of {}: sum {sum}", env.rank, env.world_size);
    std::process::exit(0);
}

/// A raw request frame, as a hostile client would write it.
fn raw_frame(op: u8, key: &[u8], val: &[u8]) -> Vec<u8> {
    let mut f = vec![op];
    f.extend_from_slice(&(key.len() as u32).to_le_bytes());
    f.extend_from_slice(key);
    f.extend_from_slice(&(val.len() as u32).to_le_bytes());
    f.extend_from_slice(val);
    f
}

#[test]
fn a_client_without_the_token_can_neither_read_nor_write() {
    let server = StoreServer::start("127.0.0.1:0", "the-launch-secret").unwrap();
    let addr = server.addr().to_string();
    let honest =
        StoreClient::connect(&addr, 0, "the-launch-secret", Duration::from_secs(5)).unwrap();
    honest.set("nccl/id", b"real").unwrap();
    let e = StoreClient::connect(&addr, 9, "a-guess", Duration::from_secs(5))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("wrong token") && e.contains("rank 9"), "{e}");
    // A raw client that skips the hello and sends a SET is cut off before it is applied.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(&raw_frame(1, b"nccl/id", b"forged")).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "closed without a reply");
    assert_eq!(honest.get("nccl/id").unwrap(), b"real");
}

#[test]
fn hostile_frames_and_idle_connections_leave_the_store_serving() {
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let addr = server.addr().to_string();
    let hello = raw_frame(3, b"", b"t");
    let start = Instant::now();
    // Garbage, a 4 GiB length prefix, an unknown op, a GET with u64::MAX milliseconds.
    let hostile: Vec<Vec<u8>> = vec![
        vec![0xff; 64],
        [hello.clone(), vec![1], u32::MAX.to_le_bytes().to_vec()].concat(),
        [hello.clone(), raw_frame(77, b"k", b"v")].concat(),
        [
            hello.clone(),
            raw_frame(2, b"never", &u64::MAX.to_le_bytes()),
        ]
        .concat(),
    ];
    let mut held = Vec::new();
    for bytes in hostile {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&bytes).unwrap();
        held.push(s);
    }
    // 2,000 connections that never say hello: at most MAX_CONNECTIONS are served, the rest are
    // closed on accept, and each is dropped after HELLO_TIMEOUT.
    let idle: Vec<TcpStream> = (0..2000)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    let opened = start.elapsed();
    assert!(idle.len() > 600, "only {} connections opened", idle.len());
    // An honest client gets in (retrying while the slots are taken) and is served.
    let store = StoreClient::connect(&addr, 0, "t", Duration::from_secs(20)).unwrap();
    eprintln!(
        "{} connections opened in {opened:?}; an honest client in after {:?}",
        idle.len(),
        start.elapsed()
    );
    store.set("after", b"ok").unwrap();
    assert_eq!(store.get("after").unwrap(), b"ok");
    // The GET of u64::MAX ms still waits (capped at a day) without having hurt anyone.
    drop(held);
    drop(idle);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "opened in {opened:?}"
    );
}

#[test]
fn values_over_the_quotas_are_refused_with_the_reason() {
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let addr = server.addr().to_string();
    let greedy = StoreClient::connect(&addr, 1, "t", Duration::from_secs(5)).unwrap();
    let mib = vec![7u8; (1 << 20) - 64];
    let mut accepted = 0;
    let refusal = loop {
        match greedy.set(&format!("big/{accepted}"), &mib) {
            Ok(()) => accepted += 1,
            Err(e) => break e.to_string(),
        }
        assert!(accepted <= 200, "200 x 1 MiB accepted from one client");
    };
    assert_eq!(accepted, 16, "{refusal}");
    assert!(refusal.contains("quota of 16777216 bytes"), "{refusal}");
    // Over the whole store: four more clients fill it to 64 MiB, then every set is refused.
    let others: Vec<StoreClient> = (2..7)
        .map(|r| StoreClient::connect(&addr, r, "t", Duration::from_secs(5)).unwrap())
        .collect();
    let mut store_refusal = None;
    'fill: for (i, c) in others.iter().enumerate() {
        for j in 0..16 {
            if let Err(e) = c.set(&format!("more/{i}/{j}"), &mib) {
                store_refusal = Some(e.to_string());
                break 'fill;
            }
        }
    }
    let e = store_refusal.expect("the store quota stops the fifth client");
    assert!(e.contains("store's quota of 67108864 bytes"), "{e}");
    // A value over 1 MiB closes the connection; small keys still work on a fresh client.
    assert!(greedy.set("huge", &vec![0u8; (1 << 20) + 1]).is_err());
    let small = StoreClient::connect(&addr, 8, "t", Duration::from_secs(5)).unwrap();
    assert_eq!(small.get("big/0").unwrap().len(), mib.len());
}
