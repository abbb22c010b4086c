//! States in Redis: one server-side script per request, on the Redis clock.

use std::fmt::Write as _;
use std::time::Duration;

use redis::{Client, Connection, Script, Value};
use tollgate_core::{Clock, Kind, Outcome, Plan, Slot, State};

use super::Store;
use super::pool::Pool;
use crate::StoreError;

/// The algebra of SPEC §2 and §3 in Lua, kept equal to `tollgate-core`'s by the conformance
/// and differential tests. It loads every slot, decides all takes, and writes only if every
/// take is granted (and the request writes); it answers with the time it used and the states
/// it loaded, from which `tollgate-core` computes the answer itself.
///
/// KEYS: one per slot. ARGV: now ("" = Redis `TIME`), writes (0/1), slot count, then per
/// slot kind (0 token bucket, 1 fixed window), rate, period, capacity, maxReserved ("" =
/// unbounded), alignment; then take count, then per take count, reserve (0/1), shards,
/// slot of A (1-based), slot of B (0 = none). Numbers come in as the shortest text that
/// reads back exactly; a state is stored, and times and states are answered, as
/// little-endian doubles packed with `struct` (16 bytes a state): exact, where Lua's
/// `tostring` keeps 14 digits and an integer reply would truncate, and far cheaper than
/// formatting text in the script.
const SCRIPT: &str = r#"
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local writes = ARGV[2] == '1'
local nslots = tonumber(ARGV[3])
local slot = {}
local p = 4
for i = 1, nslots do
  slot[i] = { kind = tonumber(ARGV[p]), rate = tonumber(ARGV[p + 1]), period = tonumber(ARGV[p + 2]),
              cap = tonumber(ARGV[p + 3]), maxr = tonumber(ARGV[p + 4]), align = tonumber(ARGV[p + 5]) }
  p = p + 6
end
local raw = redis.call('MGET', unpack(KEYS))
local work, changed = {}, {}
for i = 1, nslots do
  if raw[i] then
    local v, ts = struct.unpack('<dd', raw[i])
    work[i] = { v, ts }
  end
end

local function eval(i, st, count, reserve)
  local s = slot[i]
  local v, ts
  if st then
    v, ts = st[1], st[2]
  elseif s.kind == 0 then
    v, ts = s.cap, now
  else
    v, ts = s.cap, s.align + math.floor((now - s.align) / s.period) * s.period
  end
  local nv, nts
  if s.kind == 0 then
    nv = math.min(v + (now - ts) * s.rate / s.period, s.cap) - count
    nts = now
  else
    local w = math.floor((now - ts) / s.period)
    nv = math.min(v + s.rate * w, s.cap) - count
    nts = ts + w * s.period
  end
  local over = s.maxr ~= nil and -nv > s.maxr
  return (nv >= 0) or (reserve and not over), nv, nts
end

local all_ok = true
local ntakes = tonumber(ARGV[p])
p = p + 1
for _ = 1, ntakes do
  local count, reserve = tonumber(ARGV[p]), ARGV[p + 1] == '1'
  local shards, a, b = tonumber(ARGV[p + 2]), tonumber(ARGV[p + 3]), tonumber(ARGV[p + 4])
  p = p + 5
  local ok_a, va, ta = eval(a, work[a], count, reserve)
  local put
  local ok
  if b == 0 or shards < 2 or work[a] == nil then
    ok, put = ok_a, { { a, va, ta } }
  else
    local ok_b, vb, tb = eval(b, work[b], count, reserve)
    if ok_a and ok_b and vb > va then
      ok, put = true, { { b, vb, tb } }
    elseif ok_a then
      ok, put = true, { { a, va, ta } }
    elseif ok_b then
      ok, put = true, { { b, vb, tb } }
    else
      local balance = va + vb + count
      local ca = va + count - balance / 2
      local cb = vb + count - balance / 2
      local oka, nva, nta = eval(a, work[a], ca, reserve)
      local okb, nvb, ntb = eval(b, work[b], cb, reserve)
      ok = oka and okb
      put = { { a, nva, nta }, { b, nvb, ntb } }
    end
  end
  if ok then
    for _, w in ipairs(put) do
      work[w[1]] = { w[2], w[3] }
      changed[w[1]] = true
    end
  end
  all_ok = all_ok and ok
end

if all_ok and writes then
  for i = 1, nslots do
    if changed[i] then
      local s, v, ts = slot[i], work[i][1], work[i][2]
      -- When the state is full again (tollgate_core::full_at).
      local full = ts
      local missing = s.cap - v
      if missing > 0 then
        if s.kind == 0 then
          full = ts + missing * s.period / s.rate
        else
          full = ts + math.ceil(missing / s.rate) * s.period
        end
      end
      if full <= now then
        redis.call('DEL', KEYS[i])
      else
        -- Expire when full again, counted from the script's own now (an explicit test time
        -- works too); rounded up, so never early.
        redis.call('SET', KEYS[i], struct.pack('<dd', v, ts), 'PX', math.max(1, math.ceil(full - now)))
      end
    end
  end
end

local reply = { struct.pack('<d', now), (all_ok and writes) and '1' or '0' }
for i = 1, nslots do
  reply[i + 2] = raw[i] or ''
end
return reply
"#;

/// Options for a [`RedisStore`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    timeout: Duration,
    connections: usize,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        RedisStoreBuilder {
            prefix: "tollgate:".into(),
            timeout: Duration::from_secs(1),
            connections: 8,
        }
    }
}

impl RedisStoreBuilder {
    /// A prefix for every key (default `tollgate:`), to share a Redis with other data.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long to wait to connect, send or receive before failing (closed) with a
    /// [`StoreError`]; default 1 s.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many connections to keep (default 8); a request holds one for its round trip.
    #[must_use]
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// A store on the Redis at `url` (`redis://host:port/db`), on Redis's own clock. Nothing
    /// is connected until the first request, and a lost connection is made again by the next
    /// one, so the store recovers by itself when the server comes back.
    ///
    /// # Errors
    ///
    /// A URL that is not a Redis URL.
    pub fn open(self, url: &str) -> Result<RedisStore, StoreError> {
        self.build(url, None)
    }

    /// The same, on `clock` instead of Redis `TIME`: for tests that set the time.
    ///
    /// # Errors
    ///
    /// A URL that is not a Redis URL.
    pub fn open_with_clock<C: Clock>(
        self,
        url: &str,
        clock: C,
    ) -> Result<RedisStore<C>, StoreError> {
        self.build(url, Some(clock))
    }

    fn build<C>(self, url: &str, clock: Option<C>) -> Result<RedisStore<C>, StoreError> {
        let client = Client::open(url)
            .map_err(|e| StoreError::with_source(format!("redis: {url:?}: {e}"), e))?;
        Ok(RedisStore {
            client,
            connections: Pool::new(self.connections),
            script: Script::new(SCRIPT),
            prefix: self.prefix,
            timeout: self.timeout,
            clock,
        })
    }
}

/// States in Redis (SPEC §5): the distributed engine, for many app servers.
///
/// Each request is one `EVALSHA` of a script that runs the whole request (every limit, all
/// or nothing) on the server with Redis `TIME` (reloaded by itself after a `NOSCRIPT`). A
/// state is a hash of two numbers under `<prefix><name>:<key>:<shard>` (lengths keep names
/// and keys from running into each other), set to expire when it is full again, so storage
/// follows active limits. A Redis that cannot be reached, times out or answers garbage is a
/// [`StoreError`]: nothing is admitted.
///
/// # Examples
///
/// ```no_run
/// use tollgate::store::RedisStore;
/// use tollgate::{Config, RateLimiter, MINUTE};
///
/// let limiter = RateLimiter::new(RedisStore::open("redis://127.0.0.1:6379").unwrap());
/// let send = ("send", Config::token_bucket(10.0, MINUTE));
/// assert!(limiter.limit(send, "alice").unwrap().ok);
/// ```
pub struct RedisStore<C = tollgate_core::SystemClock> {
    client: Client,
    connections: Pool<Connection>,
    script: Script,
    prefix: String,
    timeout: Duration,
    /// `None`: Redis `TIME`.
    clock: Option<C>,
}

impl RedisStore {
    /// A store on the Redis at `url` with the default options.
    ///
    /// # Errors
    ///
    /// A URL that is not a Redis URL.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        RedisStoreBuilder::default().open(url)
    }

    /// Options: key prefix, timeout, connections.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }
}

impl<C: Clock> RedisStore<C> {
    /// The key of a state. Lengths first, so `("a:b", "c")` and `("a", "b:c")` differ, and
    /// `n` (no key) differs from `k0:` (the empty key).
    fn key(&self, name: &str, key: Option<&str>, shard: u16) -> String {
        let mut k = String::with_capacity(self.prefix.len() + name.len() + 24);
        k.push_str(&self.prefix);
        let _ = write!(k, "{}:{name}:", name.len());
        match key {
            Some(key) => {
                let _ = write!(k, "k{}:{key}", key.len());
            }
            None => k.push('n'),
        }
        let _ = write!(k, ":{shard}");
        k
    }

    fn with_connection<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let connect = || {
            let conn = self
                .client
                .get_connection_with_timeout(self.timeout)
                .map_err(|e| redis_error("cannot connect", e))?;
            conn.set_read_timeout(Some(self.timeout))
                .map_err(|e| redis_error("cannot set a timeout", e))?;
            conn.set_write_timeout(Some(self.timeout))
                .map_err(|e| redis_error("cannot set a timeout", e))?;
            Ok(conn)
        };
        self.connections.run(connect, f, |e| redis_error("request failed", e))
    }

    fn now_arg(&self) -> String {
        self.clock.as_ref().map(|c| format!("{:?}", c.now())).unwrap_or_default()
    }
}

fn redis_error(what: &str, e: redis::RedisError) -> StoreError {
    StoreError::with_source(format!("redis: {what}: {e}"), e)
}

fn num(x: f64) -> String {
    // Debug prints the shortest text that reads back as the same f64.
    format!("{x:?}")
}

/// Reads a number Redis answered as text (`TIME`).
fn parse_num(v: &Value) -> Option<f64> {
    match v {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// Reads a little-endian double packed by the script.
fn unpack_f64(bytes: &[u8]) -> Option<f64> {
    Some(f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}

/// Reads a stored state: `value` and `ts` as two packed doubles; anything else is no state.
fn unpack_state(v: &Value) -> Option<State> {
    match v {
        Value::BulkString(bytes) if bytes.len() == 16 => {
            Some(State { value: unpack_f64(&bytes[..8])?, ts: unpack_f64(&bytes[8..])? })
        }
        _ => None,
    }
}

fn garbage(what: &str) -> StoreError {
    StoreError::new(format!("redis: unexpected answer: {what}"))
}

impl<C: Clock> Store for RedisStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        let slots = plan.slots();
        let mut invocation = self.script.prepare_invoke();
        for slot in slots {
            invocation.key(self.key(slot.name, slot.key, slot.shard));
        }
        invocation.arg(self.now_arg()).arg(if plan.writes() { "1" } else { "0" }).arg(slots.len());
        for slot in slots {
            let c = &slot.config;
            let kind = match c.kind() {
                Kind::TokenBucket => "0",
                Kind::FixedWindow => "1",
            };
            invocation
                .arg(kind)
                .arg(num(c.rate()))
                .arg(num(c.period()))
                .arg(num(c.capacity()))
                .arg(c.max_reserved().map(num).unwrap_or_default())
                .arg(num(slot.alignment));
        }
        let takes: Vec<_> = plan.takes().collect();
        invocation.arg(takes.len());
        for t in &takes {
            invocation
                .arg(num(t.count))
                .arg(if t.reserve { "1" } else { "0" })
                .arg(t.shards)
                .arg(t.a + 1)
                .arg(t.b.map_or(0, |b| b + 1));
        }
        let reply: Vec<Value> = self.with_connection(|conn| invocation.invoke(conn))?;
        if reply.len() != 2 + slots.len() {
            return Err(garbage(&format!("{} values for {} slots", reply.len(), slots.len())));
        }
        let now = match &reply[0] {
            Value::BulkString(bytes) => unpack_f64(bytes),
            _ => None,
        }
        .ok_or_else(|| garbage("the time"))?;
        let committed = matches!(&reply[1], Value::BulkString(b) if b.as_slice() == b"1");
        let mut states: Vec<Option<State>> = reply[2..].iter().map(unpack_state).collect();
        // The answer comes from tollgate-core, on exactly what the script loaded and the
        // time it used; the script only mirrored the decision to write.
        let outcome = plan.decide(now, &mut states);
        if committed != (outcome.ok && plan.writes()) {
            return Err(StoreError::new(
                "redis: the script and tollgate-core disagree on this request; this is a bug",
            ));
        }
        Ok(outcome)
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("TIME");
        for slot in slots {
            pipe.cmd("GET").arg(self.key(slot.name, slot.key, slot.shard));
        }
        let reply: Vec<Value> = self.with_connection(|conn| pipe.query(conn))?;
        let time = match reply.first() {
            Some(Value::Array(t)) if t.len() == 2 => {
                let secs = parse_num(&t[0]).ok_or_else(|| garbage("TIME"))?;
                let micros = parse_num(&t[1]).ok_or_else(|| garbage("TIME"))?;
                secs * 1_000.0 + micros / 1_000.0
            }
            _ => return Err(garbage("TIME")),
        };
        let now = self.clock.as_ref().map_or(time, Clock::now);
        let states = reply[1..].iter().map(unpack_state).collect();
        Ok((now, states))
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        let keys: Vec<String> = (0..shards).map(|shard| self.key(name, key, shard)).collect();
        self.with_connection(|conn| redis::cmd("DEL").arg(&keys).query::<()>(conn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_do_not_run_into_each_other() {
        let s = RedisStore::open("redis://127.0.0.1:1").unwrap();
        assert_eq!(s.key("send", Some("alice"), 3), "tollgate:4:send:k5:alice:3");
        assert_ne!(s.key("a:b", Some("c"), 0), s.key("a", Some("b:c"), 0));
        assert_ne!(s.key("a", None, 0), s.key("a", Some(""), 0));
        assert_eq!(num(60_000.0), "60000.0");
        assert_eq!(num(0.1), "0.1");
    }
}
