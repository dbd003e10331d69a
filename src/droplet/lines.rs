//! droplet's model on the divvy line protocol, for clients that would rather
//! not speak WebSocket: `TAKE bucket=NAME [id=ID] [count=N] [reset=true|false]
//! [ls=N] [lm=N] [lh=N] [ld=N] [lw=N] [lo=N]` answers
//! `OK <accept> ls=<n> …` with the balance of each period given, in droplet's
//! field order; `QUERY bucket=NAME` answers `OK true …` with every configured
//! period (none for a bucket that does not exist). Arguments use the same
//! `k=v` grammar as `HIT`; an unknown or malformed one is an `ERR unknown`
//! naming it, and, as after any `ERR`, the connection closes.

use super::{BucketCall, Buckets, BucketsFull, SharedBuckets};
use crate::engine::{CommandExtension, Outcome, Reply};
use crate::limiter::droplet_bucket::{Balances, Period, TakeRequest};
use crate::protocol::{Pairs, Verb};
use std::fmt::Write as _;
use std::sync::Arc;

/// The arguments `TAKE` knows, for error messages.
const TAKE_ARGUMENTS: &str = "bucket, id, count, reset, ls, lm, lh, ld, lw, lo";
/// The arguments `QUERY` knows.
const QUERY_ARGUMENTS: &str = "bucket, id";

/// Why a `TAKE` or `QUERY` line cannot be executed. The message is what the
/// client reads in `ERR unknown "<message>"`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("{verb} needs bucket=<name>")]
    MissingBucket { verb: &'static str },
    #[error("unknown {verb} argument '{key}' (expected {expected})")]
    UnknownArgument {
        verb: &'static str,
        key: String,
        expected: &'static str,
    },
    #[error("count must be an integer from -2147483648 to 2147483647, got '{0}'")]
    BadCount(String),
    #[error("{field} must be an integer from 0 to 4294967295, got '{value}'")]
    BadLimit { field: &'static str, value: String },
    #[error("reset must be true or false, got '{0}'")]
    BadReset(String),
    #[error(transparent)]
    Full(#[from] BucketsFull),
}

/// Answers `TAKE` and `QUERY` lines from the shared [`Buckets`].
pub struct LineCommands {
    buckets: Arc<Buckets>,
}

impl LineCommands {
    pub fn new(buckets: Arc<Buckets>) -> LineCommands {
        LineCommands { buckets }
    }

    fn take(&self, pairs: &Pairs<'_>, now_ms: u64) -> Result<String, LineError> {
        let (bucket, request) = parse_take(pairs)?;
        let outcome = self.buckets.take(bucket.as_bytes(), &request, now_ms)?;
        Ok(format_answer(outcome.accept, &outcome.balances))
    }

    fn query(&self, pairs: &Pairs<'_>, now_ms: u64) -> Result<String, LineError> {
        let bucket = parse_query(pairs)?;
        let balances = self
            .buckets
            .query(bucket.as_bytes(), now_ms)
            .unwrap_or_default();
        Ok(format_answer(true, &balances))
    }
}

impl LineCommands {
    /// Cluster mode: the line's take or query, decided on the cluster's
    /// buckets (its answer comes later; a bucket that cannot be reached
    /// answers `ERR unknown "shard N unavailable: …"`).
    fn execute_shared(
        &self,
        shared: &Arc<dyn SharedBuckets>,
        verb: Verb,
        pairs: &Pairs<'_>,
        now_ms: u64,
    ) -> Outcome {
        let call = match verb {
            Verb::Take => parse_take(pairs).map(|(bucket, request)| BucketCall::Take {
                bucket: bucket.as_bytes(),
                request,
            }),
            _ => parse_query(pairs).map(|bucket| BucketCall::Query {
                bucket: bucket.as_bytes(),
            }),
        };
        let call = match call {
            Ok(call) => call,
            Err(error) => return Outcome::Now(Reply::error(error.to_string())),
        };
        let answers = shared.decide(&[call], self.buckets.cleanup_interval_ms(), now_ms);
        Outcome::Later(Box::pin(async move {
            match answers.await.pop() {
                Some(Ok(outcome)) => Reply::Line(format_answer(outcome.accept, &outcome.balances)),
                Some(Err(error)) => Reply::error(error),
                None => Reply::error("the cluster gave no answer".to_string()),
            }
        }))
    }
}

impl CommandExtension for LineCommands {
    fn execute(&self, verb: Verb, pairs: &Pairs<'_>, now_ms: u64) -> Option<Outcome> {
        if let (Verb::Take | Verb::Query, Some(shared)) = (verb, self.buckets.shared()) {
            return Some(self.execute_shared(shared, verb, pairs, now_ms));
        }
        let answer = match verb {
            Verb::Take => self.take(pairs, now_ms),
            Verb::Query => self.query(pairs, now_ms),
            _ => return None,
        };
        Some(Outcome::Now(match answer {
            Ok(line) => Reply::Line(line),
            Err(error) => Reply::error(error.to_string()),
        }))
    }
}

/// `OK true ls=9 lm=99`: accept, then each balance given.
fn format_answer(accept: bool, balances: &Balances) -> String {
    let mut line = String::from(if accept { "OK true" } else { "OK false" });
    for (period, balance) in balances.iter() {
        let _ = write!(line, " {}={balance}", period.field());
    }
    line
}

fn check_known(
    pairs: &Pairs<'_>,
    verb: &'static str,
    expected: &'static str,
    known: impl Fn(&str) -> bool,
) -> Result<(), LineError> {
    match pairs.iter().find(|(key, _)| !known(key)) {
        Some((key, _)) => Err(LineError::UnknownArgument {
            verb,
            key: key.to_string(),
            expected,
        }),
        None => Ok(()),
    }
}

fn parse_take<'a>(pairs: &Pairs<'a>) -> Result<(&'a str, TakeRequest), LineError> {
    check_known(pairs, "TAKE", TAKE_ARGUMENTS, |key| {
        matches!(key, "bucket" | "id" | "count" | "reset") || Period::from_field(key).is_some()
    })?;
    let bucket = pairs
        .get("bucket")
        .ok_or(LineError::MissingBucket { verb: "TAKE" })?;
    let mut request = TakeRequest::default();
    if let Some(count) = pairs.get("count") {
        request.count = count
            .parse()
            .map_err(|_| LineError::BadCount(count.to_string()))?;
    }
    if let Some(reset) = pairs.get("reset") {
        request.reset = match reset {
            "true" => true,
            "false" => false,
            other => return Err(LineError::BadReset(other.to_string())),
        };
    }
    for period in Period::ALL {
        if let Some(limit) = pairs.get(period.field()) {
            request.limits[period.index()] = limit.parse().map_err(|_| LineError::BadLimit {
                field: period.field(),
                value: limit.to_string(),
            })?;
        }
    }
    Ok((bucket, request))
}

fn parse_query<'a>(pairs: &Pairs<'a>) -> Result<&'a str, LineError> {
    check_known(pairs, "QUERY", QUERY_ARGUMENTS, |key| {
        matches!(key, "bucket" | "id")
    })?;
    pairs
        .get("bucket")
        .ok_or(LineError::MissingBucket { verb: "QUERY" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::droplet::BucketsConfig;
    use crate::protocol::parse_line;

    fn run(commands: &LineCommands, line: &str, now_ms: u64) -> String {
        let command = parse_line(line).unwrap();
        match commands.execute(command.verb, &command.pairs, now_ms) {
            Some(Outcome::Now(reply)) => {
                let mut out = Vec::new();
                reply.encode(&mut out);
                String::from_utf8(out).unwrap().trim_end().to_string()
            }
            Some(Outcome::Later(_) | Outcome::Deferred(_)) => {
                panic!("bucket commands answer at once")
            }
            None => "(not handled)".to_string(),
        }
    }

    #[test]
    fn arguments_are_checked_and_named() {
        let commands = LineCommands::new(Arc::new(Buckets::new(BucketsConfig::default())));
        let cases = [
            ("TAKE ls=1", r#"ERR unknown "TAKE needs bucket=<name>""#),
            ("QUERY", r#"ERR unknown "QUERY needs bucket=<name>""#),
            (
                "TAKE bucket=a lx=1",
                r#"ERR unknown "unknown TAKE argument 'lx' (expected bucket, id, count, reset, ls, lm, lh, ld, lw, lo)""#,
            ),
            (
                "QUERY bucket=a ls=1",
                r#"ERR unknown "unknown QUERY argument 'ls' (expected bucket, id)""#,
            ),
            (
                "TAKE bucket=a count=1.5",
                r#"ERR unknown "count must be an integer from -2147483648 to 2147483647, got '1.5'""#,
            ),
            (
                "TAKE bucket=a count=2147483648",
                r#"ERR unknown "count must be an integer from -2147483648 to 2147483647, got '2147483648'""#,
            ),
            (
                "TAKE bucket=a lm=-1",
                r#"ERR unknown "lm must be an integer from 0 to 4294967295, got '-1'""#,
            ),
            (
                "TAKE bucket=a reset=yes",
                r#"ERR unknown "reset must be true or false, got 'yes'""#,
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(run(&commands, line, 0), expected, "{line}");
        }
        assert_eq!(run(&commands, "TOPOLOGY", 0), "(not handled)");
    }

    #[test]
    fn full_store_is_an_error_line() {
        let commands = LineCommands::new(Arc::new(Buckets::new(BucketsConfig {
            stripes: 1,
            buckets_max: 1,
            cleanup_interval_ms: 60_000,
        })));
        assert_eq!(run(&commands, "TAKE bucket=a ls=5", 0), "OK true ls=4");
        assert_eq!(
            run(&commands, "TAKE bucket=b ls=5", 0),
            r#"ERR unknown "bucket limit reached (1 buckets)""#
        );
        // An existing bucket keeps working at the cap.
        assert_eq!(run(&commands, "TAKE bucket=a ls=5", 0), "OK true ls=3");
    }
}
