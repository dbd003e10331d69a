//! The flags and divvy's environment variables that turn the exporters on,
//! read into an [`ObservabilityConfig`]. As with divvy, an empty variable
//! counts as unset, so values are kept as text until checked here; one half
//! of a pair (metrics port and path, statsd host and port) is a warning and
//! leaves that exporter off.

use crate::observability::http::HttpConfig;
use crate::observability::statsd::{StatsdConfig, StatsdTransport};
use crate::observability::ObservabilityConfig;
use clap::Args;
use std::net::SocketAddr;

/// The flags of `tollgate serve` for metrics and health. Each reads the
/// environment variable divvy read.
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

/// A setting that does not parse; the message names the variable and flag.
#[derive(Debug, thiserror::Error)]
#[error("invalid {setting}: expected {expected}, got {value:?}")]
pub struct InvalidSetting {
    setting: &'static str,
    expected: &'static str,
    value: String,
}

/// `9102` means `0.0.0.0:9102`; an address is taken as is, a host name
/// resolved.
fn parse_listen(text: &str) -> Result<SocketAddr, InvalidSetting> {
    let text = text.trim();
    super::values::resolve_listen(text).ok_or_else(|| InvalidSetting {
        setting: "HTTP_SERVICE_PORT (--metrics-listen)",
        expected: "a port or an address like 127.0.0.1:9102",
        value: text.to_owned(),
    })
}

fn parse_statsd_port(text: &str) -> Result<u16, InvalidSetting> {
    match text.trim().parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(InvalidSetting {
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
    pub fn into_config(self) -> Result<ObservabilityConfig, InvalidSetting> {
        Ok(ObservabilityConfig {
            http: self.http_config()?,
            statsd: self.statsd_config()?,
        })
    }

    /// The HTTP endpoint's configuration when both halves are given. One half
    /// alone is logged as a warning, as divvy did, and nothing is served.
    fn http_config(&self) -> Result<Option<HttpConfig>, InvalidSetting> {
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
    fn statsd_config(&self) -> Result<Option<StatsdConfig>, InvalidSetting> {
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
        let error = parse_listen("nine").unwrap_err().to_string();
        assert_eq!(
            error,
            "invalid HTTP_SERVICE_PORT (--metrics-listen): expected a port or an address like 127.0.0.1:9102, got \"nine\""
        );
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
