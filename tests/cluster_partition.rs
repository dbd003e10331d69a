//! Partitions with real processes: every peer link goes through a
//! fault-injection proxy (tests/cluster_support/proxy.rs). The proxy itself
//! is tested first against an echo server; then the node leading the most
//! shards is cut off under load (strict mode): it answers its hits with a
//! prompt `ERR` and never a `true`, the majority elects new leaders and
//! keeps serving, and after healing the cluster converges with no counter
//! going backwards and no limit exceeded.

mod cluster_support;

use cluster_support::proxy::{Mode, Proxy};
use cluster_support::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// An echo server on a free port, on its own thread (one thread per
/// connection; it ends with the test process).
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

fn connect(proxy: &Proxy) -> TcpStream {
    let stream = TcpStream::connect(proxy.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(1_500)))
        .unwrap();
    stream
}

/// Sends `text` and reads the echo; `None` when nothing (or not all) came
/// back within the read timeout, or the connection closed.
fn echo(stream: &mut TcpStream, text: &[u8]) -> Option<Duration> {
    let sent = Instant::now();
    stream.write_all(text).ok()?;
    let mut got = vec![0u8; text.len()];
    stream.read_exact(&mut got).ok()?;
    assert_eq!(got, text);
    Some(sent.elapsed())
}

#[test]
fn the_proxy_forwards_cuts_blackholes_delays_and_heals() {
    let proxy = Proxy::start(echo_server());
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"hello").is_some());
    let stats = proxy.stats();
    assert_eq!((stats.connections, stats.bytes_forwarded), (1, 10));

    // Delay: each chunk arrives after the delay, both ways.
    proxy.set_delay(150);
    let took = echo(&mut stream, b"slow").unwrap();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    proxy.set_delay(0);

    // Blackhole: the connection stays open, nothing comes back, and the
    // bytes are counted as dropped; a new connection is blackholed too.
    proxy.blackhole();
    assert_eq!(proxy.mode(), Mode::Blackhole);
    assert!(echo(&mut stream, b"lost").is_none());
    let mut during = connect(&proxy);
    assert!(echo(&mut during, b"lost too").is_none());
    assert!(proxy.stats().bytes_dropped >= 12);

    // Heal: streams with holes are closed; new connections forward.
    proxy.heal();
    let mut buf = [0u8; 1];
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"back").is_some());

    // Cut: open connections close at once, new ones are closed on accept.
    proxy.cut();
    let cut_at = Instant::now();
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    assert!(cut_at.elapsed() < Duration::from_millis(500));
    let mut refused = connect(&proxy);
    assert!(matches!(refused.read(&mut buf), Ok(0) | Err(_)));
    assert!(proxy.stats().refused >= 1);
    proxy.heal();
    let mut stream = connect(&proxy);
    assert!(echo(&mut stream, b"healed").is_some());
    let forwarded = proxy.stats().bytes_forwarded;
    drop(proxy);
    // Dropping the proxy closes its connections.
    assert!(matches!(stream.read(&mut buf), Ok(0) | Err(_)));
    assert!(forwarded >= 2 * (5 + 4 + 4 + 6) as u64, "{forwarded}");
}
