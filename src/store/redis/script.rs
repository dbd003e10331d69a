//! Divvy's fixed window in Redis: the key layout, the Lua script that
//! applies the hits and peeks of a read batch's requests in one call, and
//! the call by SHA with its `NOSCRIPT` fallback. A key is
//! `divvy:<operation>:<actor>:<creditLimit>:<resetSeconds>` and holds the
//! credit left in the window; its TTL is the time left (SPEC §5). Per key,
//! a hit does exactly what divvy's script does, so divvy and Tollgate can
//! count the same keys side by side; each request's counters are applied in
//! order, and a request whose step fails (a key of the wrong type) fails
//! alone, as when each request was a call of its own.

use super::client::{Lease, RedisClient, RequestError};
use crate::limiter::Decision;
use crate::store::CounterOp;
use redis::{Cmd, ErrorKind, Value};

/// The steps of many requests, in order, in one atomic call. ARGV holds,
/// per request, the number of its counters, `1` for a `PEEK` (`0` for a
/// hit), then per counter `resetSeconds` and `creditLimit - 1` (the order of
/// divvy's own script); KEYS holds the counters' keys in the same order.
///
/// Per key, a hit is divvy's step: absent → set to `creditLimit - 1` with a
/// TTL of `resetSeconds`, allow; positive → decrement, allow; otherwise deny
/// with credit 0. A peek answers what a hit would, changing nothing. Each
/// key answers `allowed, credit, TTL` (Redis rounds the TTL to the nearest
/// second). A request whose step raised an error (applied counters before it
/// stay applied, as in a failed call of its own) answers `-1, <message>, 0`
/// for each of its counters; the requests after it still run.
pub const BATCH_SCRIPT: &str = r#"-- tollgate fixed-window batch (divvy-compatible steps)
local function hit(key, reset_seconds, initial_credit, answer)
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

local function peek(key, reset_seconds, initial_credit, answer)
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

local function request(step, count, k, a, answer)
  for j = 0, count - 1 do
    step(KEYS[k + j], tonumber(ARGV[a + 2 * j]), tonumber(ARGV[a + 2 * j + 1]), answer)
  end
end

local answer = {}
local k, a, n = 1, 1, #ARGV
while a <= n do
  local count = tonumber(ARGV[a])
  local step = hit
  if ARGV[a + 1] == '1' then step = peek end
  local before = #answer
  local ok, failure = pcall(request, step, count, k, a + 2, answer)
  if not ok then
    for i = #answer, before + 1, -1 do answer[i] = nil end
    local message = failure
    if type(failure) == 'table' then message = failure.err or 'script error' end
    message = tostring(message)
    for _ = 1, count do
      answer[#answer + 1] = -1
      answer[#answer + 1] = message
      answer[#answer + 1] = 0
    end
  end
  k = k + count
  a = a + 2 + 2 * count
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
    let mut key = Vec::new();
    write_divvy_key(
        &mut key,
        canonical_operation,
        actor,
        credit_limit,
        reset_seconds,
    );
    // Text joined with ASCII: always UTF-8.
    String::from_utf8_lossy(&key).into_owned()
}

/// Appends divvy's key for a counter to `out` (see [`divvy_key`]).
fn write_divvy_key(
    out: &mut Vec<u8>,
    canonical_operation: &str,
    actor: &str,
    credit_limit: u64,
    reset_seconds: u64,
) {
    let mut numbers = itoa::Buffer::new();
    out.extend_from_slice(b"divvy:");
    out.extend_from_slice(canonical_operation.as_bytes());
    out.push(b':');
    out.extend_from_slice(actor.as_bytes());
    out.push(b':');
    out.extend_from_slice(numbers.format(credit_limit).as_bytes());
    out.push(b':');
    out.extend_from_slice(numbers.format(reset_seconds).as_bytes());
}

/// Most counters one script call carries. A read batch with more is sent
/// as several calls, back to back on one connection, so that no call holds
/// Redis (and divvy's clients sharing it) for long: a counter costs Redis a
/// few microseconds.
pub const CALL_COUNTERS_MAX: usize = 64;

/// The keys and arguments of one call of [`BATCH_SCRIPT`], owned, so that
/// the call can outlive the requests' borrowed ops.
#[derive(Default)]
pub struct ScriptCall {
    /// The keys, back to back; key `i` ends at `key_ends[i]`.
    key_bytes: Vec<u8>,
    key_ends: Vec<u32>,
    /// ARGV, in [`BATCH_SCRIPT`]'s order.
    argv: Vec<u64>,
    /// How many counters each request has, in order.
    requests: Vec<u32>,
}

impl ScriptCall {
    /// A call for one request's ops.
    pub fn new(ops: &[CounterOp<'_>]) -> ScriptCall {
        let mut call = ScriptCall::default();
        call.push(ops);
        call
    }

    /// Adds one request's ops (all hits, or all peeks), in order.
    pub fn push(&mut self, ops: &[CounterOp<'_>]) {
        let peek = ops.iter().any(|op| op.peek);
        self.argv.push(ops.len() as u64);
        self.argv.push(u64::from(peek));
        for op in ops {
            let credit_limit = op.quota.credit_limit();
            let reset_seconds = op.quota.period_ms() / 1000;
            write_divvy_key(
                &mut self.key_bytes,
                &op.rule.canonical_operation,
                op.actor,
                credit_limit,
                reset_seconds,
            );
            self.key_ends.push(self.key_bytes.len() as u32);
            self.argv.push(reset_seconds);
            self.argv.push(credit_limit - 1);
        }
        self.requests.push(ops.len() as u32);
    }

    /// Counters in the call.
    pub fn len(&self) -> usize {
        self.key_ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.key_ends.is_empty()
    }

    /// How many counters each request of the call has, in order.
    pub fn requests(&self) -> &[u32] {
        &self.requests
    }

    fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.key_ends.iter().map(move |&end| {
            let key = &self.key_bytes[start..end as usize];
            start = end as usize;
            key
        })
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
        command.arg(self.len());
        for key in self.keys() {
            command.arg(key);
        }
        for &argument in &self.argv {
            command.arg(argument);
        }
        command
    }

    /// Runs the script by SHA; if Redis lost it (restart, `SCRIPT FLUSH`),
    /// runs it once more by body. `NOSCRIPT` means nothing ran, so the retry
    /// cannot count a hit twice. Answers each counter, in order: its
    /// decision, or why its request failed in Redis.
    pub async fn invoke(
        &self,
        client: &RedisClient,
        lease: &mut Lease,
        script: &LoadedScript,
    ) -> Result<Vec<CounterAnswer>, ScriptError> {
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

/// One counter's answer: its decision, or the error its request's step
/// raised in Redis.
pub type CounterAnswer = Result<Decision, String>;

/// Why a script call gave no decisions.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("unexpected script reply: {0}")]
    Reply(String),
}

/// Reads `allowed, credit, ttl` per key (`-1, message, 0` for the keys of a
/// request that failed).
fn parse_reply(reply: Value, expected: usize) -> Result<Vec<CounterAnswer>, ScriptError> {
    let Value::Array(values) = reply else {
        return Err(ScriptError::Reply(format!("{reply:?}")));
    };
    if values.len() != expected * 3 {
        return Err(ScriptError::Reply(format!(
            "{} values for {expected} counters",
            values.len()
        )));
    }
    let number = |value: &Value| match *value {
        Value::Int(number) => Ok(number),
        ref other => Err(ScriptError::Reply(format!(
            "{other:?} where a number belongs"
        ))),
    };
    values
        .chunks_exact(3)
        .map(|triple| match (&triple[0], &triple[1]) {
            (Value::Int(-1), Value::BulkString(message)) => {
                Ok(Err(String::from_utf8_lossy(message).into_owned()))
            }
            _ => Ok(Ok(Decision {
                allowed: number(&triple[0])? == 1,
                credit: number(&triple[1])?,
                next_reset_seconds: number(&triple[2])?,
            })),
        })
        .collect()
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
                Ok(Decision {
                    allowed: true,
                    credit: 2,
                    next_reset_seconds: 3600
                }),
                Ok(Decision {
                    allowed: false,
                    credit: 0,
                    next_reset_seconds: 12
                })
            ]
        );
        let short = Value::Array(vec![Value::Int(1)]);
        assert!(matches!(parse_reply(short, 1), Err(ScriptError::Reply(_))));
        assert!(matches!(
            parse_reply(Value::Nil, 1),
            Err(ScriptError::Reply(_))
        ));
        let text = Value::Array(vec![
            Value::Int(1),
            Value::BulkString(b"2".to_vec()),
            Value::Int(3),
        ]);
        assert!(matches!(parse_reply(text, 1), Err(ScriptError::Reply(_))));
    }

    #[test]
    fn a_failed_request_answers_its_message_per_counter() {
        let failed = |message: &str| {
            [
                Value::Int(-1),
                Value::BulkString(message.as_bytes().to_vec()),
                Value::Int(0),
            ]
        };
        let mut values = vec![Value::Int(1), Value::Int(0), Value::Int(60)];
        values.extend(failed("WRONGTYPE nope"));
        values.extend(failed("WRONGTYPE nope"));
        let answers = parse_reply(Value::Array(values), 3).unwrap();
        assert!(answers[0].is_ok());
        assert_eq!(answers[1], Err("WRONGTYPE nope".to_string()));
        assert_eq!(answers[2], Err("WRONGTYPE nope".to_string()));
    }

    #[test]
    fn a_call_lays_out_keys_and_arguments_per_request() {
        let rules = crate::rules::RuleSet::from_ini(
            "[route=a]\ncreditLimit = 3\nresetSeconds = 60\nactorField = user\n[default]\ncreditLimit = 5\nresetSeconds = 10\n",
        )
        .unwrap();
        let rule = &rules.rules()[0];
        let op = |actor, peek| CounterOp {
            rule,
            actor,
            quota: crate::limiter::WindowQuota::new(3, 60).unwrap(),
            peek,
        };
        let mut call = ScriptCall::new(&[op("u1", false), op("u2", false)]);
        call.push(&[op("u3", true)]);
        assert_eq!(call.len(), 3);
        assert_eq!(call.requests(), &[2, 1]);
        let keys: Vec<&[u8]> = call.keys().collect();
        assert_eq!(
            keys,
            [
                &b"divvy:route=a:u1:3:60"[..],
                b"divvy:route=a:u2:3:60",
                b"divvy:route=a:u3:3:60"
            ]
        );
        assert_eq!(call.argv, [2, 0, 60, 2, 60, 2, 1, 1, 60, 2]);
    }
}
