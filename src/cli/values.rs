//! Flag values: the library's choice enums (`--unavailable-policy`,
//! `--backend`, `--consistency`), their names on the command line and the
//! help line of each (implemented here so that the library's types stay free
//! of `clap`), and listen addresses, which may name a host.

use crate::cluster::Consistency;
use crate::engine::UnavailablePolicy;
use crate::store::redis::BackendKind;
use clap::builder::PossibleValue;
use clap::ValueEnum;
use std::net::{SocketAddr, ToSocketAddrs};

/// A listen address: `IP:PORT`, `HOST:PORT` (resolved once, at start; an
/// IPv4 address first, as `localhost` most often means 127.0.0.1) or a bare
/// `PORT` (every interface). `None` when it is none of these.
pub fn resolve_listen(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Some(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    if let Ok(addr) = text.parse() {
        return Some(addr);
    }
    let (host, port) = text.rsplit_once(':')?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return None;
    }
    let addrs: Vec<SocketAddr> = text.to_socket_addrs().ok()?.collect();
    addrs
        .iter()
        .find(|addr| addr.is_ipv4())
        .or(addrs.first())
        .copied()
}

/// `--listen`, `--droplet-listen`: see [`resolve_listen`].
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    resolve_listen(text).ok_or_else(|| {
        "expected HOST:PORT (127.0.0.1:8321, localhost:8321, [::1]:8321) or a port".to_owned()
    })
}

impl ValueEnum for UnavailablePolicy {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            UnavailablePolicy::Error,
            UnavailablePolicy::Allow,
            UnavailablePolicy::Deny,
        ]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            UnavailablePolicy::Error => PossibleValue::new("error")
                .help("`ERR unknown \"<reason>\"`, as divvy answers when Redis fails"),
            UnavailablePolicy::Allow => {
                PossibleValue::new("allow").help("Fail open: `OK true <creditLimit> 0`")
            }
            UnavailablePolicy::Deny => {
                PossibleValue::new("deny").help("Fail closed: `OK false 0 -1`")
            }
        })
    }
}

impl ValueEnum for BackendKind {
    fn value_variants<'a>() -> &'a [Self] {
        &[BackendKind::Memory, BackendKind::Redis]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            BackendKind::Memory => {
                PossibleValue::new("memory").help("In this process's memory (the default)")
            }
            BackendKind::Redis => PossibleValue::new("redis")
                .help("In Redis, in divvy's key layout (single node; shares divvy's Redis)"),
        })
    }
}

impl ValueEnum for Consistency {
    fn value_variants<'a>() -> &'a [Self] {
        &[Consistency::Strict, Consistency::Fast]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Consistency::Strict => PossibleValue::new(self.as_str())
                .help("After the shard's entry is committed by a majority of its replicas"),
            Consistency::Fast => PossibleValue::new(self.as_str())
                .help("At once from the leader's state; replicated in the background"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_may_name_a_host_or_only_a_port() {
        assert_eq!(
            parse_listen("127.0.0.1:9").unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert_eq!(parse_listen("[::1]:9").unwrap(), "[::1]:9".parse().unwrap());
        assert_eq!(
            parse_listen("8321").unwrap(),
            "0.0.0.0:8321".parse().unwrap()
        );
        assert!(parse_listen("localhost:8321").unwrap().ip().is_loopback());
        for bad in ["", "localhost", ":80", "host:port", "1.2.3.4:99999"] {
            assert!(parse_listen(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_value_has_a_name_that_parses_back() {
        fn check<T: ValueEnum + PartialEq + std::fmt::Debug>() {
            for value in T::value_variants() {
                let name = value.to_possible_value().unwrap();
                assert_eq!(T::from_str(name.get_name(), false).as_ref(), Ok(value));
            }
        }
        check::<UnavailablePolicy>();
        check::<BackendKind>();
        check::<Consistency>();
    }
}
