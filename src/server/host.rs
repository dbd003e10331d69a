//! A node thread: one OS thread that drives one current-thread tokio runtime
//! for as long as it lives, and runs, beside the tasks spawned on that
//! runtime from anywhere, `!Send` jobs handed to it (a serving thread's
//! accept loop, on a `LocalSet`; the connections it accepts are tasks of
//! the runtime).
//!
//! A cluster node on few cores uses one: its peer links, replicator and
//! shard groups are tasks of the runtime, and its first serving thread's
//! clients are a job, so handing a hit between the client side and the
//! cluster side is a wake-up within one thread, not a cross-thread one (an
//! eventfd write and a context switch each way). The thread drives the
//! runtime from the moment it starts, before any job arrives, so the
//! cluster's tasks run while the rest of the server is still being built.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// A job for the node thread: builds a future that runs on its `LocalSet`.
pub type HostJob = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

pub struct HostThread {
    runtime: Arc<Runtime>,
    jobs: Option<mpsc::UnboundedSender<HostJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HostThread {
    /// Starts the thread, named `name`, driving a new current-thread runtime.
    pub fn start(name: &str) -> std::io::Result<HostThread> {
        let runtime = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
        );
        let (jobs, mut received) = mpsc::unbounded_channel::<HostJob>();
        let driven = Arc::clone(&runtime);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&driven, async move {
                    let mut running = JoinSet::new();
                    loop {
                        tokio::select! {
                            job = received.recv() => match job {
                                Some(job) => {
                                    running.spawn_local(job());
                                }
                                None => break,
                            },
                            Some(_) = running.join_next(), if !running.is_empty() => {}
                        }
                    }
                    // Stopping: let the jobs still running finish (they
                    // were told to stop by their own means).
                    while running.join_next().await.is_some() {}
                });
            })?;
        Ok(HostThread {
            runtime,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// The runtime the thread drives: spawn on it from anywhere, or
    /// `block_on` it from another thread (that thread then polls only its
    /// own future; this thread keeps running the tasks and the drivers).
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// Runs `job` on the thread; `Err` gives it back when the thread has
    /// stopped.
    pub fn run(&self, job: HostJob) -> Result<(), HostJob> {
        match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|error| error.0),
            None => Err(job),
        }
    }
}

impl Drop for HostThread {
    /// Stops taking jobs, waits for those running to end, then stops the
    /// thread (the runtime's tasks are dropped with the runtime).
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn spawned_tasks_and_local_jobs_share_the_one_thread() {
        let host = HostThread::start("test-host").expect("host thread");
        let (sender, receiver) = std::sync::mpsc::channel();
        // A task spawned from this thread runs on the host thread, with no
        // job yet.
        let spawned = sender.clone();
        host.runtime().spawn(async move {
            let _ = spawned.send(("task", std::thread::current().name().map(str::to_string)));
        });
        let ran = receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("spawned task ran");
        assert_eq!(ran, ("task", Some("test-host".to_string())));
        // A !Send job (an Rc inside) runs there too, and can spawn_local.
        let job_sender = sender.clone();
        let job: HostJob = Box::new(move || {
            Box::pin(async move {
                let shared = std::rc::Rc::new(AtomicUsize::new(0));
                let inner = std::rc::Rc::clone(&shared);
                tokio::task::spawn_local(async move { inner.fetch_add(1, Ordering::SeqCst) })
                    .await
                    .expect("local task");
                let name = std::thread::current().name().map(str::to_string);
                let _ =
                    job_sender.send(("job", name.filter(|_| shared.load(Ordering::SeqCst) == 1)));
            })
        });
        assert!(host.run(job).is_ok());
        let ran = receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("job ran");
        assert_eq!(ran, ("job", Some("test-host".to_string())));
        // block_on from another thread works while the host drives.
        let answer = host.runtime().block_on(async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            7
        });
        assert_eq!(answer, 7);
    }

    #[test]
    fn dropping_waits_for_running_jobs() {
        let host = HostThread::start("test-host-drop").expect("host thread");
        let finished = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&finished);
        let job: HostJob = Box::new(move || {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                seen.fetch_add(1, Ordering::SeqCst);
            })
        });
        assert!(host.run(job).is_ok());
        drop(host);
        assert_eq!(finished.load(Ordering::SeqCst), 1);
    }
}
