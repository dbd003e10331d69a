//! Divvy's fixed window in Redis: the key layout, the Lua scripts that apply
//! one request's hits atomically, and the call by SHA with its `NOSCRIPT`
//! fallback. A key is `divvy:<operation>:<actor>:<creditLimit>:<resetSeconds>`
//! and holds the credit left in the window; its TTL is the time left (SPEC
//! §5). Per key, the hit script does exactly what divvy's script does, so
//! divvy and Tollgate can count the same keys side by side.

use super::client::{Lease, RedisClient, RequestError};
use crate::limiter::Decision;
use crate::store::CounterOp;
use redis::{Cmd, ErrorKind, Value};
use smallvec::SmallVec;

/// One atomic step for every counter of a request, in order. Per key, as
/// divvy: absent → set to `creditLimit - 1` with a TTL of `resetSeconds`,
/// allow; positive → decrement, allow; otherwise deny with credit 0. Each key
/// answers `allowed, credit, TTL` (Redis rounds the TTL to the nearest
/// second). ARGV holds, per key, `resetSeconds` then `creditLimit - 1`, the
/// order of divvy's own script.
pub const HIT_SCRIPT: &str = r#"-- tollgate fixed-window hit (divvy-compatible)
local answer = {}
for i, key in ipairs(KEYS) do
  local reset_seconds = tonumber(ARGV[2 * i - 1])
  local initial_credit = tonumber(ARGV[2 * i])
  local stored = redis.call('GET', key)
  local allowed, credit
  if not stored then
    redis.call('SET', key, initial_credit, 'EX', reset_seconds)
    allowed, credit = 1, initial_credit
  elseif tonumber(stored) > 0 then
    allowed, credit = 1, redis.call('DECR', key)
  else
    allowed, credit = 0, 0
  end
  answer[#answer + 1] = allowed
  answer[#answer + 1] = credit
  answer[#answer + 1] = redis.call('TTL', key)
end
return answer
"#;

/// What [`HIT_SCRIPT`] would answer, changing nothing (`PEEK`).
pub const PEEK_SCRIPT: &str = r#"-- tollgate fixed-window peek (read-only)
local answer = {}
for i, key in ipairs(KEYS) do
  local reset_seconds = tonumber(ARGV[2 * i - 1])
  local initial_credit = tonumber(ARGV[2 * i])
  local stored = redis.call('GET', key)
  if not stored then
    answer[#answer + 1] = 1
    answer[#answer + 1] = initial_credit
    answer[#answer + 1] = reset_seconds
  else
    local credit = tonumber(stored)
    if credit > 0 then
      answer[#answer + 1] = 1
      answer[#answer + 1] = credit - 1
    else
      answer[#answer + 1] = 0
      answer[#answer + 1] = 0
    end
    answer[#answer + 1] = redis.call('TTL', key)
  end
end
return answer
"#;

/// A script with its SHA1, as `EVALSHA` names it.
#[derive(Debug, Clone)]
pub struct LoadedScript {
    pub body: &'static str,
    pub sha1: String,
}

impl LoadedScript {
    pub fn new(body: &'static str) -> LoadedScript {
        LoadedScript {
            body,
            sha1: redis::Script::new(body).get_hash().to_string(),
        }
    }
}

/// Divvy's key for a counter: `divvy:<operation>:<actor>:<limit>:<seconds>`.
pub fn divvy_key(
    canonical_operation: &str,
    actor: &str,
    credit_limit: u64,
    reset_seconds: u64,
) -> String {
    format!("divvy:{canonical_operation}:{actor}:{credit_limit}:{reset_seconds}")
}

/// The keys and arguments of one request's script call, owned, so that the
/// call can outlive the request's borrowed ops.
pub struct ScriptCall {
    keys: SmallVec<[String; 2]>,
    /// Per key: `resetSeconds`, `creditLimit - 1`.
    arguments: SmallVec<[(u64, u64); 2]>,
}

impl ScriptCall {
    pub fn new(ops: &[CounterOp<'_>]) -> ScriptCall {
        let mut keys = SmallVec::with_capacity(ops.len());
        let mut arguments = SmallVec::with_capacity(ops.len());
        for op in ops {
            let credit_limit = op.quota.credit_limit();
            let reset_seconds = op.quota.period_ms() / 1000;
            keys.push(divvy_key(
                &op.rule.canonical_operation,
                op.actor,
                credit_limit,
                reset_seconds,
            ));
            arguments.push((reset_seconds, credit_limit - 1));
        }
        ScriptCall { keys, arguments }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// `EVALSHA <sha> n keys… args…`, or with `by_body`, `EVAL <body> …`
    /// (which also caches the script in Redis again).
    fn command(&self, script: &LoadedScript, by_body: bool) -> Cmd {
        let mut command = if by_body {
            let mut command = redis::cmd("EVAL");
            command.arg(script.body);
            command
        } else {
            let mut command = redis::cmd("EVALSHA");
            command.arg(script.sha1.as_str());
            command
        };
        command.arg(self.keys.len());
        for key in &self.keys {
            command.arg(key.as_str());
        }
        for &(reset_seconds, initial_credit) in &self.arguments {
            command.arg(reset_seconds).arg(initial_credit);
        }
        command
    }

    /// Runs the script by SHA; if Redis lost it (restart, `SCRIPT FLUSH`),
    /// runs it once more by body. `NOSCRIPT` means nothing ran, so the retry
    /// cannot count a hit twice.
    pub async fn invoke(
        &self,
        client: &RedisClient,
        lease: &mut Lease,
        script: &LoadedScript,
    ) -> Result<SmallVec<[Decision; 2]>, ScriptError> {
        let reply = match client.send(lease, &self.command(script, false)).await {
            Err(RequestError::Redis(error)) if error.kind() == ErrorKind::NoScriptError => {
                tracing::debug!("redis answered NOSCRIPT; running the script by body");
                client.send(lease, &self.command(script, true)).await?
            }
            other => other?,
        };
        parse_reply(reply, self.len())
    }
}

/// Why a script call gave no decisions.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("unexpected script reply: {0}")]
    Reply(String),
}

/// Reads `allowed, credit, ttl` per key.
fn parse_reply(reply: Value, expected: usize) -> Result<SmallVec<[Decision; 2]>, ScriptError> {
    let numbers: Vec<i64> = redis::from_owned_redis_value(reply)
        .map_err(|error| ScriptError::Reply(error.to_string()))?;
    if numbers.len() != expected * 3 {
        return Err(ScriptError::Reply(format!(
            "{} numbers for {expected} counters",
            numbers.len()
        )));
    }
    Ok(numbers
        .chunks_exact(3)
        .map(|triple| Decision {
            allowed: triple[0] == 1,
            credit: triple[1],
            next_reset_seconds: triple[2],
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_divvy_layout() {
        assert_eq!(divvy_key("", "", 1, 60), "divvy:::1:60");
        assert_eq!(
            divvy_key("ip=* method=GET path=/pantry/*", "1.2.3.4", 3, 3600),
            "divvy:ip=* method=GET path=/pantry/*:1.2.3.4:3:3600"
        );
    }

    #[test]
    fn replies_parse_per_counter_and_wrong_shapes_are_errors() {
        let reply = Value::Array([1, 2, 3600, 0, 0, 12].into_iter().map(Value::Int).collect());
        let decisions = parse_reply(reply, 2).unwrap();
        assert_eq!(
            decisions.as_slice(),
            &[
                Decision {
                    allowed: true,
                    credit: 2,
                    next_reset_seconds: 3600
                },
                Decision {
                    allowed: false,
                    credit: 0,
                    next_reset_seconds: 12
                }
            ]
        );
        let short = Value::Array(vec![Value::Int(1)]);
        assert!(matches!(parse_reply(short, 1), Err(ScriptError::Reply(_))));
        assert!(matches!(
            parse_reply(Value::Nil, 1),
            Err(ScriptError::Reply(_))
        ));
    }
}
