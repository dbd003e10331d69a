//! A small closed-loop load driver for comparing Tollgate's three request
//! kinds under identical conditions: `HIT` lines, `TAKE` lines (both on the
//! divvy port) and droplet's protobuf over WebSocket. It exists until the
//! load generator (`loadtest/`) speaks `TAKE` answers and droplet's protocol;
//! see docs/benchmarks.md for the figures and the command lines.
//!
//! Each connection keeps `depth` requests in flight: whenever answers arrive,
//! it sends as many new requests in one write. A request's latency runs from
//! the write that carried it to the read that completed its answer. Keys
//! cycle over `keys` distinct actors or buckets. Runs on one thread.

use clap::{Parser, ValueEnum};
use futures_util::{FutureExt, SinkExt, StreamExt};
use prost::Message as _;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tollgate::droplet::proto::RequestMessage;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    /// `HIT route=bench ip=<key>` lines.
    Hit,
    /// `TAKE bucket=<key> ls=1000 lm=50000` lines.
    Take,
    /// The same take as a droplet protobuf over WebSocket.
    Ws,
}

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, value_enum)]
    mode: Mode,
    /// The divvy port (hit, take) or the droplet endpoint (ws).
    #[arg(long)]
    addr: SocketAddr,
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 16)]
    depth: usize,
    /// Distinct actors or buckets.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    #[arg(long, default_value_t = 1_000)]
    warmup_ms: u64,
    #[arg(long, default_value_t = 5_000)]
    duration_ms: u64,
}

#[derive(Default)]
struct Stats {
    latencies_us: Vec<u32>,
    errors: u64,
}

fn request_line(mode: Mode, key: usize) -> Vec<u8> {
    match mode {
        Mode::Hit => format!("HIT route=bench ip=10.0.{}.{}\n", key / 256, key % 256).into_bytes(),
        _ => format!("TAKE bucket=b{key} ls=1000 lm=50000\n").into_bytes(),
    }
}

fn request_frame(key: usize) -> Vec<u8> {
    RequestMessage {
        bucket: Some(format!("b{key}").into_bytes()),
        id: Some(b"bench".to_vec()),
        count: None,
        reset: None,
        ls: Some(1_000),
        lm: Some(50_000),
        lh: None,
        ld: None,
        lw: None,
        lo: None,
        r#type: None,
    }
    .encode_to_vec()
}

struct Clock {
    measure_from: Instant,
    stop_at: Instant,
}

fn record(stats: &RefCell<Stats>, clock: &Clock, sent: Instant, now: Instant) {
    if sent >= clock.measure_from {
        let us = now
            .duration_since(sent)
            .as_micros()
            .min(u128::from(u32::MAX)) as u32;
        stats.borrow_mut().latencies_us.push(us);
    }
}

async fn line_connection(
    args: Rc<Args>,
    index: usize,
    clock: Rc<Clock>,
    stats: Rc<RefCell<Stats>>,
) {
    let Ok(mut stream) = TcpStream::connect(args.addr).await else {
        stats.borrow_mut().errors += 1;
        return;
    };
    let _ = stream.set_nodelay(true);
    let mut key = index * 7919;
    let mut in_flight: VecDeque<Instant> = VecDeque::new();
    let mut out = Vec::new();
    let mut input = vec![0u8; 64 * 1024];
    let mut partial = 0usize;
    let mut to_send = args.depth;
    loop {
        let now = Instant::now();
        if now >= clock.stop_at {
            return;
        }
        out.clear();
        for _ in 0..to_send {
            key = (key + 1) % args.keys;
            out.extend_from_slice(&request_line(args.mode, key));
            in_flight.push_back(now);
        }
        if stream.write_all(&out).await.is_err() {
            stats.borrow_mut().errors += 1;
            return;
        }
        let read = match stream.read(&mut input[partial..]).await {
            Ok(0) | Err(_) => {
                stats.borrow_mut().errors += 1;
                return;
            }
            Ok(n) => n,
        };
        let now = Instant::now();
        let filled = partial + read;
        let mut start = 0;
        to_send = 0;
        while let Some(newline) = memchr::memchr(b'\n', &input[start..filled]) {
            if input[start..].starts_with(b"ERR") {
                stats.borrow_mut().errors += 1;
            }
            start += newline + 1;
            if let Some(sent) = in_flight.pop_front() {
                record(&stats, &clock, sent, now);
            }
            to_send += 1;
        }
        input.copy_within(start..filled, 0);
        partial = filled - start;
    }
}

async fn ws_connection(args: Rc<Args>, index: usize, clock: Rc<Clock>, stats: Rc<RefCell<Stats>>) {
    let url = format!("ws://{}/", args.addr);
    let Ok((mut ws, _)) = tokio_tungstenite::connect_async(url).await else {
        stats.borrow_mut().errors += 1;
        return;
    };
    let mut key = index * 7919;
    let mut in_flight: VecDeque<Instant> = VecDeque::new();
    let mut to_send = args.depth;
    loop {
        let now = Instant::now();
        if now >= clock.stop_at {
            let _ = ws.close(None).await;
            return;
        }
        for _ in 0..to_send {
            key = (key + 1) % args.keys;
            if ws
                .feed(Message::Binary(request_frame(key).into()))
                .await
                .is_err()
            {
                stats.borrow_mut().errors += 1;
                return;
            }
            in_flight.push_back(now);
        }
        if ws.flush().await.is_err() {
            stats.borrow_mut().errors += 1;
            return;
        }
        let mut answered = Vec::new();
        match ws.next().await {
            Some(Ok(message)) => answered.push(message),
            _ => {
                stats.borrow_mut().errors += 1;
                return;
            }
        }
        while let Some(Some(Ok(message))) = ws.next().now_or_never() {
            answered.push(message);
        }
        let now = Instant::now();
        to_send = 0;
        for message in answered {
            if !message.is_binary() {
                stats.borrow_mut().errors += 1;
                continue;
            }
            if let Some(sent) = in_flight.pop_front() {
                record(&stats, &clock, sent, now);
            }
            to_send += 1;
        }
    }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    f64::from(sorted[rank]) / 1000.0
}

fn main() {
    let args = Rc::new(Args::parse());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let start = Instant::now();
    let clock = Rc::new(Clock {
        measure_from: start + Duration::from_millis(args.warmup_ms),
        stop_at: start + Duration::from_millis(args.warmup_ms + args.duration_ms),
    });
    let stats = Rc::new(RefCell::new(Stats::default()));
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        let mut tasks = Vec::new();
        for index in 0..args.connections {
            let (args, clock, stats) = (Rc::clone(&args), Rc::clone(&clock), Rc::clone(&stats));
            tasks.push(tokio::task::spawn_local(async move {
                match args.mode {
                    Mode::Ws => ws_connection(args, index, clock, stats).await,
                    _ => line_connection(args, index, clock, stats).await,
                }
            }));
        }
        for task in tasks {
            let _ = task.await;
        }
    });
    let mut stats = stats.borrow_mut();
    stats.latencies_us.sort_unstable();
    let count = stats.latencies_us.len();
    let seconds = args.duration_ms as f64 / 1000.0;
    println!(
        "{{\"mode\":\"{:?}\",\"connections\":{},\"depth\":{},\"requests\":{},\"errors\":{},\"per_second\":{:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3}}}",
        args.mode,
        args.connections,
        args.depth,
        count,
        stats.errors,
        count as f64 / seconds,
        percentile(&stats.latencies_us, 50.0),
        percentile(&stats.latencies_us, 99.0),
        percentile(&stats.latencies_us, 99.9),
    );
}
