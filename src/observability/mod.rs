//! Everything an operator watches: divvy's Prometheus series and statsd
//! names (so dashboards and alerts built for divvy keep working), Tollgate's
//! own `tollgate_` series, and the `/healthz` and `/readyz` endpoints. This
//! module owns the flags and environment variables that turn them on, and
//! starts and stops the exporters; the values themselves are recorded on the
//! hot path by [`crate::metrics::Metrics`] and only read here.
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
use clap::Args;
use health::Readiness;
use http::{HttpConfig, HttpEndpoint, HttpState};
use statsd::{StatsdConfig, StatsdExporter, StatsdTransport};
use std::net::SocketAddr;
use std::sync::Arc;

/// The flags of `tollgate serve` for metrics and health. Each reads the
/// environment variable divvy read; as with divvy, an empty variable counts
/// as unset (so values are kept as text and checked when the server starts).
#[derive(Args, Debug, Clone, Default)]
pub struct ObservabilityArgs {
    /// Serve Prometheus metrics, /healthz and /readyz over HTTP on this port
    /// (all interfaces) or address; needs --metrics-path too.
    #[arg(long, env = "HTTP_SERVICE_PORT", value_name = "PORT|ADDR")]
    pub metrics_listen: Option<String>,

    /// The request path that serves Prometheus metrics, matched exactly
    /// (e.g. /metrics); needs --metrics-listen too.
    #[arg(long, env = "PROMETHEUS_METRICS_PATH")]
    pub metrics_path: Option<String>,

    /// Send statsd metrics to this host; needs --statsd-port too.
    #[arg(long, env = "STATSD_HOST")]
    pub statsd_host: Option<String>,

    /// The statsd port; needs --statsd-host too.
    #[arg(long, env = "STATSD_PORT", value_name = "PORT")]
    pub statsd_port: Option<String>,

    /// Prefix of every statsd name (`P` gives `P.hit.accepted`).
    #[arg(long, env = "STATSD_PREFIX", default_value = "")]
    pub statsd_prefix: String,

    /// Send statsd over TCP instead of UDP. As divvy read STATSD_USE_TCP, any
    /// non-empty value means yes.
    #[arg(
        long,
        env = "STATSD_USE_TCP",
        value_name = "ANY",
        num_args = 0..=1,
        default_missing_value = "1",
        hide_env_values = true
    )]
    pub statsd_use_tcp: Option<String>,

    /// How often statsd metrics are flushed, in milliseconds (at most 1000).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub statsd_flush_interval_ms: u64,

    /// Largest statsd UDP datagram, in bytes.
    #[arg(long, default_value_t = 1400, value_parser = clap::value_parser!(u64).range(64..=65_000))]
    pub statsd_datagram_bytes_max: u64,
}

/// `9102` means `0.0.0.0:9102`; an address is taken as is.
fn parse_listen(text: &str) -> Result<SocketAddr, ObservabilityError> {
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    text.parse().map_err(|_| ObservabilityError::Invalid {
        setting: "HTTP_SERVICE_PORT (--metrics-listen)",
        expected: "a port or an address like 127.0.0.1:9102",
        value: text.to_owned(),
    })
}

fn parse_statsd_port(text: &str) -> Result<u16, ObservabilityError> {
    match text.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(ObservabilityError::Invalid {
            setting: "STATSD_PORT (--statsd-port)",
            expected: "a port from 1 to 65535",
            value: text.to_owned(),
        }),
    }
}

/// The value when it is set and not blank.
fn given(value: &Option<String>) -> Option<&str> {
    value.as_deref().filter(|v| !v.trim().is_empty())
}

impl ObservabilityArgs {
    /// The HTTP endpoint's configuration when both halves are given. One half
    /// alone is logged as a warning, as divvy did, and nothing is served.
    pub fn http_config(&self) -> Result<Option<HttpConfig>, ObservabilityError> {
        let listen = given(&self.metrics_listen).map(parse_listen).transpose()?;
        Ok(match (listen, given(&self.metrics_path)) {
            (Some(listen), Some(path)) => {
                // divvy compared the request target with the path as given,
                // so a path without its leading `/` never matched; add it.
                let path = if path.starts_with('/') {
                    path.to_owned()
                } else {
                    format!("/{path}")
                };
                Some(HttpConfig::new(listen, path))
            }
            (None, None) => None,
            _ => {
                tracing::warn!(
                    "only one of HTTP_SERVICE_PORT (--metrics-listen) and PROMETHEUS_METRICS_PATH \
                     (--metrics-path) is set: Prometheus metrics and health endpoints are not served"
                );
                None
            }
        })
    }

    /// The statsd configuration when both host and port are given. One alone
    /// is logged as a warning and statsd stays off.
    pub fn statsd_config(&self) -> Result<Option<StatsdConfig>, ObservabilityError> {
        let port = given(&self.statsd_port)
            .map(parse_statsd_port)
            .transpose()?;
        Ok(match (given(&self.statsd_host), port) {
            (Some(host), Some(port)) => {
                let use_tcp = given(&self.statsd_use_tcp).is_some();
                let transport = if use_tcp {
                    StatsdTransport::Tcp
                } else {
                    StatsdTransport::Udp
                };
                let prefix = self.statsd_prefix.clone();
                let mut config = StatsdConfig::new(host.trim().to_owned(), port, prefix, transport);
                config.flush_interval_ms = self.statsd_flush_interval_ms;
                config.datagram_bytes_max = self.statsd_datagram_bytes_max as usize;
                Some(config)
            }
            (None, None) => None,
            _ => {
                tracing::warn!("only one of STATSD_HOST and STATSD_PORT is set: statsd is off");
                None
            }
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ObservabilityError {
    #[error("invalid {setting}: expected {expected}, got {value:?}")]
    Invalid {
        setting: &'static str,
        expected: &'static str,
        value: String,
    },
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
}

/// The running exporters; stopped on [`Observability::stop`] or drop.
pub struct Observability {
    http: Option<HttpEndpoint>,
    statsd: Option<StatsdExporter>,
    readiness: Arc<Readiness>,
}

impl Observability {
    /// Starts what `args` turn on (possibly nothing).
    pub fn start(args: &ObservabilityArgs, observed: Observed) -> Result<Self, ObservabilityError> {
        Self::start_with(args.http_config()?, args.statsd_config()?, observed)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ObservabilityArgs {
        ObservabilityArgs {
            statsd_flush_interval_ms: 500,
            statsd_datagram_bytes_max: 1400,
            ..Default::default()
        }
    }

    #[test]
    fn a_port_listens_on_all_interfaces_and_an_address_as_given() {
        assert_eq!(
            parse_listen("9102").unwrap(),
            "0.0.0.0:9102".parse().unwrap()
        );
        assert_eq!(
            parse_listen("127.0.0.1:9102").unwrap(),
            "127.0.0.1:9102".parse().unwrap()
        );
        assert!(matches!(
            parse_listen("nine"),
            Err(ObservabilityError::Invalid { .. })
        ));
    }

    #[test]
    fn http_needs_both_halves_and_gets_a_leading_slash() {
        let mut both = args();
        both.metrics_listen = Some("127.0.0.1:0".into());
        both.metrics_path = Some("metrics".into());
        let config = both.http_config().unwrap().unwrap();
        assert_eq!(config.metrics_path, "/metrics");

        let mut one = args();
        one.metrics_listen = Some("9102".into());
        assert!(one.http_config().unwrap().is_none());
        one.metrics_path = Some(String::new());
        assert!(one.http_config().unwrap().is_none(), "empty is unset");
    }

    #[test]
    fn statsd_needs_host_and_port_and_any_tcp_value_means_tcp() {
        let mut set = args();
        set.statsd_host = Some("localhost".into());
        set.statsd_port = Some("8125".into());
        let udp = set.statsd_config().unwrap().unwrap();
        assert_eq!((udp.port, udp.transport), (8125, StatsdTransport::Udp));
        // divvy read `!!process.env.STATSD_USE_TCP`: "0" and "false" are yes.
        for value in ["1", "0", "false", "yes"] {
            set.statsd_use_tcp = Some(value.into());
            let config = set.statsd_config().unwrap().unwrap();
            assert_eq!(config.transport, StatsdTransport::Tcp, "{value}");
        }
        set.statsd_use_tcp = Some(String::new());
        let config = set.statsd_config().unwrap().unwrap();
        assert_eq!(config.transport, StatsdTransport::Udp);

        set.statsd_port = Some("0".into());
        assert!(set.statsd_config().is_err());
        set.statsd_port = None;
        assert!(set.statsd_config().unwrap().is_none());
    }
}
