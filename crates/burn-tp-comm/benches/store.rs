//! The rendezvous store's latency over loopback: a SET + GET round against its floor, a plain
//! TCP echo of the same bytes (two round trips) on this machine.
//!
//! `cargo bench -p burn-tp-comm --bench store` (with Nagle's delay on either side a round took
//! ~42 ms, delayed ACKs; one write per frame and `TCP_NODELAY` at both ends make it
//! microseconds).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use burn_tp_comm::store::{StoreClient, StoreServer};

const ROUNDS: u32 = 2000;

/// Two round trips of `len` bytes over a plain loopback socket, without Nagle: the floor.
fn echo_floor(len: usize) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; len];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf).unwrap();
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = vec![7u8; len];
    let start = Instant::now();
    for _ in 0..ROUNDS {
        for _ in 0..2 {
            c.write_all(&buf).unwrap();
            c.read_exact(&mut buf).unwrap();
        }
    }
    let mean = start.elapsed() / ROUNDS;
    drop(c);
    server.join().unwrap();
    mean
}

fn main() {
    let server = StoreServer::start("127.0.0.1:0", "secret").unwrap();
    let addr = server.addr().to_string();
    let store = StoreClient::connect(&addr, 0, "secret", Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    for i in 0..ROUNDS {
        store.set(&format!("k{i}"), &[i as u8; 64]).unwrap();
        assert_eq!(store.get(&format!("k{i}")).unwrap(), vec![i as u8; 64]);
    }
    let store_mean = start.elapsed() / ROUNDS;
    let floor = echo_floor(80);
    println!("| what (loopback, {ROUNDS} rounds) | mean | / floor |");
    println!("|---|---:|---:|");
    println!(
        "| store SET + GET of 64 bytes | {store_mean:?} | {:.2} |",
        store_mean.as_secs_f64() / floor.as_secs_f64()
    );
    println!("| floor: two TCP echoes of 80 bytes | {floor:?} | 1.00 |");
}
