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
use smallvec::SmallVec;

/// The steps of many requests, in order, in one atomic call.
///
/// ARGV: the number of distinct quotas `q`, then each quota's
/// `resetSeconds` and `creditLimit - 1` (the values of divvy's own script),
/// then per request the number of its counters (negated for a `PEEK`)
/// followed by each counter's quota number (1 to `q`); KEYS: the counters'
/// keys, in the same order. A batch's counters mostly share a few quotas,
/// so each counter costs one argument besides its key.
///
/// Per key, a hit is divvy's step: absent → `SET` to `creditLimit - 1` with
/// a TTL of `resetSeconds`, allow; positive → `DECR`, allow; otherwise deny
/// with credit 0. A peek answers what a hit would, changing nothing. Each
/// key answers two numbers: the credit left when allowed (never negative)
/// or `-1` when denied, then the key's TTL (Redis rounds it to the nearest
/// second; right after the `SET` it is `resetSeconds`, which is answered
/// without asking). A request whose step raised an error (its counters
/// before the failing one stay applied, as in a call of its own) answers
/// `-2, <message>` for each of its counters; the requests after it still
/// run.
pub const BATCH_SCRIPT: &str = r#"-- tollgate fixed-window batch (divvy-compatible steps)
local quotas = tonumber(ARGV[1])
local resets, credits = {}, {}
for i = 1, quotas do
  resets[tostring(i)] = ARGV[2 * i]
  credits[tostring(i)] = ARGV[2 * i + 1]
end

local function hit(key, quota, answer, n)
  local stored = redis.call('GET', key)
  if not stored then
    local credit, reset = credits[quota], resets[quota]
    redis.call('SET', key, credit, 'EX', reset)
    answer[n + 1] = tonumber(credit)
    answer[n + 2] = tonumber(reset)
  elseif tonumber(stored) > 0 then
    answer[n + 1] = redis.call('DECR', key)
    answer[n + 2] = redis.call('TTL', key)
  else
    answer[n + 1] = -1
    answer[n + 2] = redis.call('TTL', key)
  end
  return n + 2
end

local function peek(key, quota, answer, n)
  local stored = redis.call('GET', key)
  if not stored then
    answer[n + 1] = tonumber(credits[quota])
    answer[n + 2] = tonumber(resets[quota])
  else
    local credit = tonumber(stored)
    if credit > 0 then
      answer[n + 1] = credit - 1
    else
      answer[n + 1] = -1
    end
    answer[n + 2] = redis.call('TTL', key)
  end
  return n + 2
end

local function request(step, count, k, a, answer, n)
  for j = 0, count - 1 do
    n = step(KEYS[k + j], ARGV[a + j], answer, n)
  end
  return n
end

local answer, n = {}, 0
local k, a, last = 1, 2 * quotas + 2, #ARGV
while a <= last do
  local count = tonumber(ARGV[a])
  local step = hit
  if count < 0 then
    step, count = peek, -count
  end
  local ok, result = pcall(request, step, count, k, a + 1, answer, n)
  if ok then
    n = result
  else
    local message = result
    if type(result) == 'table' then message = result.err or 'script error' end
    message = tostring(message)
    for _ = 1, count do
      answer[n + 1] = -2
      answer[n + 2] = message
      n = n + 2
    end
  end
  k = k + count
  a = a + 1 + count
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
    /// The distinct quotas: `resetSeconds`, `creditLimit - 1`.
    quotas: SmallVec<[(u64, u64); 4]>,
    /// Per request: its counter count (negated for a peek), then each
    /// counter's quota number (from 1).
    steps: Vec<i64>,
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
        let count = ops.len() as i64;
        self.steps.push(if peek { -count } else { count });
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
            let quota = (reset_seconds, credit_limit - 1);
            let number = match self.quotas.iter().position(|&known| known == quota) {
                Some(index) => index + 1,
                None => {
                    self.quotas.push(quota);
                    self.quotas.len()
                }
            };
            self.steps.push(number as i64);
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
        command.arg(self.quotas.len());
        for &(reset_seconds, initial_credit) in &self.quotas {
            command.arg(reset_seconds).arg(initial_credit);
        }
        for &step in &self.steps {
            command.arg(step);
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

/// Reads `credit (or -1: denied), ttl` per key (`-2, message` for the keys
/// of a request that failed).
fn parse_reply(reply: Value, expected: usize) -> Result<Vec<CounterAnswer>, ScriptError> {
    let Value::Array(values) = reply else {
        return Err(ScriptError::Reply(format!("{reply:?}")));
    };
    if values.len() != expected * 2 {
        return Err(ScriptError::Reply(format!(
            "{} values for {expected} counters",
            values.len()
        )));
    }
    values
        .chunks_exact(2)
        .map(|pair| match pair {
            [Value::Int(-2), Value::BulkString(message)] => {
                Ok(Err(String::from_utf8_lossy(message).into_owned()))
            }
            &[Value::Int(credit), Value::Int(next_reset_seconds)] if credit >= -1 => {
                Ok(Ok(Decision {
                    allowed: credit >= 0,
                    credit: credit.max(0),
                    next_reset_seconds,
                }))
            }
            other => Err(ScriptError::Reply(format!("{other:?} for a counter"))),
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
        let reply = Value::Array([2, 3600, -1, 12].into_iter().map(Value::Int).collect());
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
        let text = Value::Array(vec![Value::BulkString(b"2".to_vec()), Value::Int(3)]);
        assert!(matches!(parse_reply(text, 1), Err(ScriptError::Reply(_))));
        let below = Value::Array(vec![Value::Int(-3), Value::Int(3)]);
        assert!(matches!(parse_reply(below, 1), Err(ScriptError::Reply(_))));
    }

    #[test]
    fn a_failed_request_answers_its_message_per_counter() {
        let failed = |message: &str| {
            [
                Value::Int(-2),
                Value::BulkString(message.as_bytes().to_vec()),
            ]
        };
        let mut values = vec![Value::Int(0), Value::Int(60)];
        values.extend(failed("WRONGTYPE nope"));
        values.extend(failed("WRONGTYPE nope"));
        let answers = parse_reply(Value::Array(values), 3).unwrap();
        assert_eq!(
            answers[0],
            Ok(Decision {
                allowed: true,
                credit: 0,
                next_reset_seconds: 60
            })
        );
        assert_eq!(answers[1], Err("WRONGTYPE nope".to_string()));
        assert_eq!(answers[2], Err("WRONGTYPE nope".to_string()));
    }

    #[test]
    fn a_call_lays_out_keys_quotas_and_steps_per_request() {
        let rules = crate::rules::RuleSet::from_ini(
            "[route=a]\ncreditLimit = 3\nresetSeconds = 60\nactorField = user\n[default]\ncreditLimit = 5\nresetSeconds = 10\n",
        )
        .unwrap();
        let rule = &rules.rules()[0];
        let op = |actor, limit, peek| CounterOp {
            rule,
            actor,
            quota: crate::limiter::WindowQuota::new(limit, 60).unwrap(),
            peek,
        };
        let mut call = ScriptCall::new(&[op("u1", 3, false), op("u2", 7, false)]);
        call.push(&[op("u3", 3, true)]);
        assert_eq!(call.len(), 3);
        assert_eq!(call.requests(), &[2, 1]);
        let keys: Vec<&[u8]> = call.keys().collect();
        assert_eq!(
            keys,
            [
                &b"divvy:route=a:u1:3:60"[..],
                b"divvy:route=a:u2:7:60",
                b"divvy:route=a:u3:3:60"
            ]
        );
        assert_eq!(call.quotas.as_slice(), &[(60, 2), (60, 6)]);
        assert_eq!(call.steps, [2, 1, 2, -1, 1]);
    }
}
