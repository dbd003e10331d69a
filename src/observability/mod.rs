//! Everything an operator watches: divvy's Prometheus series and statsd
//! names (so dashboards and alerts built for divvy keep working), Tollgate's
//! own `tollgate_` series, and the `/healthz` and `/readyz` endpoints. This
//! module starts and stops the exporters ([`ObservabilityConfig`] says which;
//! the CLI reads divvy's environment variables into it); the values
//! themselves are recorded on the hot path by [`crate::metrics::Metrics`] and
//! only read here.
//!
//! - [`exposition`]: renders the exposition text at scrape time.
//! - [`http`]: the HTTP endpoint (metrics path, health, readiness).
//! - [`health`]: what readiness means.
//! - [`statsd`]: the statsd sender thread (UDP or TCP).

pub mod exposition;
pub mod health;
pub mod http;
pub mod statsd;

use crate::droplet::Buckets;
use crate::engine::Engine;
use crate::store::MemoryStore;
use health::Readiness;
use http::{HttpConfig, HttpEndpoint, HttpState};
use statsd::{StatsdConfig, StatsdExporter};
use std::net::SocketAddr;
use std::sync::Arc;

/// Which exporters run. Both are off by default; `tollgate serve` turns them
/// on from divvy's environment variables and its own flags.
#[derive(Debug, Clone, Default)]
pub struct ObservabilityConfig {
    /// Prometheus metrics, `/healthz` and `/readyz` over HTTP.
    pub http: Option<HttpConfig>,
    /// statsd metrics.
    pub statsd: Option<StatsdConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum ObservabilityError {
    #[error(transparent)]
    Export(#[from] exposition::ExportError),
    #[error(transparent)]
    Http(#[from] http::HttpError),
    #[error(transparent)]
    Statsd(#[from] statsd::StatsdError),
}

/// What the exporters observe.
pub struct Observed {
    pub engine: Arc<Engine>,
    /// The in-memory store (absent when counters live in Redis).
    pub store: Option<Arc<MemoryStore>>,
    /// The droplet token buckets, when the server keeps them.
    pub buckets: Option<Arc<Buckets>>,
    pub readiness: Arc<Readiness>,
    /// A cluster node's data-path counters, in cluster mode.
    pub cluster: Option<exposition::ClusterSource>,
}

/// The running exporters; stopped on [`Observability::stop`] or drop.
pub struct Observability {
    http: Option<HttpEndpoint>,
    statsd: Option<StatsdExporter>,
    readiness: Arc<Readiness>,
}

impl Observability {
    /// Starts what `config` turns on (possibly nothing).
    pub fn start(
        config: &ObservabilityConfig,
        observed: Observed,
    ) -> Result<Self, ObservabilityError> {
        Self::start_with(config.http.clone(), config.statsd.clone(), observed)
    }

    pub fn start_with(
        http: Option<HttpConfig>,
        statsd: Option<StatsdConfig>,
        observed: Observed,
    ) -> Result<Self, ObservabilityError> {
        let statsd = match statsd {
            Some(config) => Some(StatsdExporter::start(
                config,
                Arc::clone(&observed.engine.metrics),
            )?),
            None => None,
        };
        let http = match http {
            Some(config) => {
                let state = HttpState {
                    exporter: exposition::PrometheusExporter::new(exposition::ExportSources {
                        engine: observed.engine,
                        store: observed.store,
                        buckets: observed.buckets,
                        readiness: Arc::clone(&observed.readiness),
                        cluster: observed.cluster,
                    })?,
                    readiness: Arc::clone(&observed.readiness),
                    metrics_path: config.metrics_path.clone(),
                };
                Some(HttpEndpoint::start(config, state)?)
            }
            None => None,
        };
        Ok(Observability {
            http,
            statsd,
            readiness: observed.readiness,
        })
    }

    /// The HTTP endpoint's address, when it runs.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(HttpEndpoint::local_addr)
    }

    /// `http://<addr><metrics path>`, when the HTTP endpoint runs.
    pub fn metrics_url(&self) -> Option<String> {
        self.http
            .as_ref()
            .map(|http| format!("http://{}{}", http.local_addr(), http.metrics_path()))
    }

    pub fn readiness(&self) -> &Arc<Readiness> {
        &self.readiness
    }

    /// Stops the HTTP endpoint, and flushes and stops statsd.
    pub fn stop(self) {
        if let Some(http) = self.http {
            http.stop();
        }
        if let Some(statsd) = self.statsd {
            statsd.stop();
        }
    }
}
