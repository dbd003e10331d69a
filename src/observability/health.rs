//! Liveness and readiness, as answered by `/healthz` and `/readyz`. Live
//! means the process answers HTTP at all. Ready means it can serve hits now:
//! the rules are loaded and the listeners are open (set by the serve wiring,
//! cleared when shutdown starts so load balancers stop sending first), the
//! backend is healthy (it reports itself so through
//! [`Metrics::set_backend_healthy`], and its own [`ReadinessCheck`] passes
//! if it has one: the cluster's "every shard can be decided from this
//! node"), and every extra check passes. The backend's health is also
//! `tollgate_backend_healthy`.

use crate::metrics::Metrics;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A condition a subsystem adds to readiness.
pub trait ReadinessCheck: Send + Sync + 'static {
    /// `Ok` when this subsystem can serve; `Err` with a short reason (no
    /// user data) otherwise.
    fn check(&self) -> Result<(), String>;
}

impl<F> ReadinessCheck for F
where
    F: Fn() -> Result<(), String> + Send + Sync + 'static,
{
    fn check(&self) -> Result<(), String> {
        self()
    }
}

/// Everything `/readyz` consults.
pub struct Readiness {
    serving: AtomicBool,
    metrics: Arc<Metrics>,
    /// The backend's own check, beside what it reports through `metrics`.
    backend: Option<Arc<dyn ReadinessCheck>>,
    checks: Vec<Arc<dyn ReadinessCheck>>,
}

impl Readiness {
    /// Not serving until [`Readiness::set_serving`] says so.
    pub fn new(metrics: Arc<Metrics>) -> Readiness {
        Readiness {
            serving: AtomicBool::new(false),
            metrics,
            backend: None,
            checks: Vec::new(),
        }
    }

    /// Makes `check` part of the backend's health (and so of
    /// `tollgate_backend_healthy`), not only of readiness.
    pub fn with_backend_check(mut self, check: Arc<dyn ReadinessCheck>) -> Readiness {
        self.backend = Some(check);
        self
    }

    /// `Ok` while the backend can decide hits, else why not.
    pub fn backend_health(&self) -> Result<(), String> {
        if !self.metrics.backend_healthy() {
            return Err("backend unavailable".into());
        }
        match &self.backend {
            Some(check) => check
                .check()
                .map_err(|why| format!("backend unavailable: {why}")),
            None => Ok(()),
        }
    }

    pub fn with_check(mut self, check: Arc<dyn ReadinessCheck>) -> Readiness {
        self.checks.push(check);
        self
    }

    /// Serving: rules loaded and listeners open. Cleared at shutdown.
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    /// `Ok` when ready, else the first reason found.
    pub fn check(&self) -> Result<(), String> {
        if !self.serving.load(Ordering::Acquire) {
            return Err("not serving (starting or shutting down)".into());
        }
        self.backend_health()?;
        self.checks.iter().try_for_each(|check| check.check())
    }
}
