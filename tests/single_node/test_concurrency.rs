//! No over-admission under concurrency: many connections spread over every
//! serving thread hammer one actor whose limit is L; exactly L are admitted.

use crate::util;

use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::sync::Barrier;
use util::TestServer;

// On both serving loops: epoll and io_uring.
crate::in_both_serving_modes!(many_connections_on_all_threads_admit_exactly_the_limit);

fn many_connections_on_all_threads_admit_exactly_the_limit() {
    const LIMIT: usize = 5_000;
    const CONNECTIONS: usize = 32;
    const HITS_PER_CONNECTION: usize = 400;
    let server = TestServer::start_ini(&format!(
        "[op=hammer]\ncreditLimit={LIMIT}\nresetSeconds=3600\nactorField=u\n[default]\ncreditLimit=0\n"
    ));
    let barrier = Arc::new(Barrier::new(CONNECTIONS));
    let workers: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let addr = server.addr;
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut stream = util::connect(addr);
                barrier.wait();
                let mut allowed = 0;
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                // Pipeline in batches of 50 to keep many requests in flight.
                for _ in 0..HITS_PER_CONNECTION / 50 {
                    let batch: String = (0..50).map(|_| "HIT op=hammer u=one\n").collect();
                    stream.write_all(batch.as_bytes()).unwrap();
                    for _ in 0..50 {
                        let mut line = String::new();
                        reader.read_line(&mut line).unwrap();
                        match line.as_str() {
                            l if l.starts_with("OK true ") => allowed += 1,
                            l if l.starts_with("OK false 0 ") => {}
                            other => panic!("unexpected answer {other:?}"),
                        }
                    }
                }
                allowed
            })
        })
        .collect();
    let admitted: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    const { assert!(CONNECTIONS * HITS_PER_CONNECTION > LIMIT) };
    assert_eq!(admitted, LIMIT);
}
