//! States in Redis: one server-side script per request, on the Redis clock.

use std::fmt::Write as _;
use std::time::Duration;

use redis::{Client, Script, Value};
#[cfg(feature = "redis-cluster")]
use tollgate_core::Split;
use tollgate_core::{Clock, Kind, OneTake, Outcome, Plan, Slot, State, Taken};

use super::Store;
use super::group::{Group, OneAnswer, fail_all};
use super::pool::Pool;
use crate::StoreError;

/// Lua: `now`, the request's time in ms: `ARGV[1]` (a test's own time) or Redis `TIME`.
macro_rules! lua_now {
    () => {
        r#"
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
"#
    };
}

/// Lua: saves the state (`v`, `ts`) under `key`, given `token_bucket`, `rate`, `period`,
/// `cap` and `now`: deleted if it is full again by `now`, else set to expire when it will be
/// (`tollgate_core::full_at`), counted from the script's own now (an explicit test time works
/// too) and rounded up, so never early. One copy for every script.
macro_rules! lua_save {
    () => {
        r#"
do
  local full = ts
  local missing = cap - v
  if missing > 0 then
    if token_bucket then
      full = ts + missing * period / rate
    else
      full = ts + math.ceil(missing / rate) * period
    end
  end
  if full <= now then
    redis.call('DEL', key)
  else
    -- The expiry as text made here: a number argument would be formatted by Redis with
    -- '%.17g', about 0.5 us slower a call (measured).
    redis.call('SET', key, struct.pack('<dd', v, ts), 'PX',
      string.format('%d', math.max(1, math.ceil(full - now))))
  end
end
"#
    };
}

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
const SCRIPT: &str = concat!(
    lua_now!(),
    r#"
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
      local key, v, ts = KEYS[i], work[i][1], work[i][2]
      local token_bucket, rate, period, cap = slot[i].kind == 0, slot[i].rate, slot[i].period, slot[i].cap
"#,
    lua_save!(),
    r#"
    end
  end
end

local reply = { struct.pack('<d', now), (all_ok and writes) and '1' or '0' }
for i = 1, nslots do
  reply[i + 2] = raw[i] or ''
end
return reply
"#
);

/// Lua: one take from one unsharded limit, with no tables, loops or closures, which cost a
/// script far more than its arithmetic. The same algebra as [`SCRIPT`] (the differential
/// and conformance tests run both). Given `key` and `args` (see [`SCRIPT_ONE`]) and `time`
/// (Redis `TIME` once read, else nil), it leaves the answer in `answer`.
macro_rules! lua_one {
    () => {
        concat!(
            r#"
local writes, kind, reserve, rate, period, cap, maxr, align, count, now =
  struct.unpack('<BBBddddddd', args)
if now ~= now then
  if not time then
    local t = redis.call('TIME')
    time = t[1] * 1000 + t[2] / 1000
  end
  now = time
end
local raw = redis.call('GET', key)
local v, ts
if raw then
  v, ts = struct.unpack('<dd', raw)
elseif kind == 0 then
  v, ts = cap, now
else
  v, ts = cap, align + math.floor((now - align) / period) * period
end
local nv, nts
if kind == 0 then
  nv = math.min(v + (now - ts) * rate / period, cap) - count
  nts = now
else
  local w = math.floor((now - ts) / period)
  nv = math.min(v + rate * w, cap) - count
  nts = ts + w * period
end
local wrote = '0'
-- maxr is NaN when unbounded: the comparison is then false.
if writes == 1 and (nv >= 0 or (reserve == 1 and not (-nv > maxr))) then
  wrote = '1'
  local token_bucket, v, ts = kind == 0, nv, nts
"#,
            lua_save!(),
            r#"
end
local answer = struct.pack('<d', now) .. wrote .. (raw or '')
"#
        )
    };
}

/// The common request alone: one take from one unsharded limit.
///
/// KEYS: the state. ARGV: one string of 59 bytes, [`one_args`]: writes, kind (0 token
/// bucket, 1 fixed window) and reserve as bytes, then rate, period, capacity, maxReserved
/// (NaN = unbounded), alignment, count and now (NaN = Redis `TIME`) as little-endian
/// doubles. One argument read by one `struct.unpack` costs the server about a quarter less
/// than ten arguments in text read by `tonumber` each (measured: 12 -> 9 us a call), and is
/// exact. Answers one string: the time it used (a packed double), `1` if it wrote (else
/// `0`), then the state it loaded (16 bytes, or nothing).
const SCRIPT_ONE: &str =
    concat!("local key, args, time = KEYS[1], ARGV[1], nil\n", lua_one!(), "return answer\n");

/// The most one-takes a grouped round trip carries: at about 4 us of Redis time each (the
/// script's share per take in a group of 32), a full trip holds Redis for about 0.3 ms.
const MOST_PER_TRIP: usize = 64;

/// Several one-takes sent together (see [`Group`]): the same as [`SCRIPT_ONE`] for each
/// (KEYS\[i\], ARGV\[i\]) in turn, one Redis `TIME` for all, all in one atomic run; answers
/// the list of their answers. A state named twice is read again after its first take, so
/// the takes answer as if sent one after the other. A take that fails (its key holds
/// something else than a state) fails alone, before it writes: its answer is
/// [`SCRIPT_ERROR`] and the reason. Not used for one take alone: the loop and the list
/// cost about 2 us more a call than [`SCRIPT_ONE`].
const SCRIPT_GROUP: &str = concat!(
    "local time\nlocal function one(key, args)\n",
    lua_one!(),
    r#"
return answer
end
local answers = {}
for i = 1, #KEYS do
  local ok, answer = pcall(one, KEYS[i], ARGV[i])
  if not ok then
    answer = 'script error: ' .. (type(answer) == 'table' and tostring(answer.err) or tostring(answer))
  end
  answers[i] = answer
end
return answers
"#
);

/// How an answer of [`SCRIPT_GROUP`] for a take that failed begins (its ninth byte, `r`,
/// is never that of a take's answer, `0` or `1`).
const SCRIPT_ERROR: &[u8] = b"script error: ";

/// Gives a take back to one state (Redis Cluster, when the second shard of a take across two
/// nodes refused): if the state is still exactly what the take wrote, the state it replaced
/// is restored; if another request changed it since, the amount is added back at the
/// script's now, up to capacity. Either way the limit holds no more than had the take never
/// happened.
///
/// KEYS: the state. ARGV: now ("" = `TIME`), the state written (16 bytes), the state it
/// replaced (16 bytes, or "" for none), kind (0/1), rate, period, capacity, amount.
#[cfg(feature = "redis-cluster")]
const GIVE_BACK: &str = concat!(
    lua_now!(),
    r#"
local kind, rate, period, cap = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cur = redis.call('GET', KEYS[1])
local v, ts
if cur == ARGV[2] then
  if ARGV[3] == '' then
    redis.call('DEL', KEYS[1])
    return 1
  end
  v, ts = struct.unpack('<dd', ARGV[3])
elseif cur and #cur == 16 then
  v, ts = struct.unpack('<dd', cur)
  if kind == 0 then
    v = math.min(v + (now - ts) * rate / period, cap)
    ts = now
  else
    local w = math.floor((now - ts) / period)
    v = math.min(v + rate * w, cap)
    ts = ts + w * period
  end
  v = math.min(v + tonumber(ARGV[8]), cap)
else
  -- Gone (full again, or reset): nothing to give back.
  return 0
end
local key, token_bucket = KEYS[1], kind == 0
"#,
    lua_save!(),
    r#"
return 1
"#
);

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
    /// A prefix for every key (default `tollgate:`), to share a Redis with other data. On
    /// Redis Cluster, a prefix with a hash tag (`{tollgate}:`) keeps every state in one hash
    /// slot: every transaction is then possible, and everything lives on one node.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long to wait to connect, send or receive before failing (closed) with a
    /// [`StoreError`]; default 1 s. A request that waits for a grouped round trip (see
    /// [`RedisStoreBuilder::connections`]) fails after twice this: one round trip of others,
    /// then its own; if it was never sent, nothing was taken.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many connections to keep (default 8); a request holds one for its round trip.
    /// On one Redis, a one-take request (the common `limit`) that finds every connection
    /// busy waits for the next round trip, which carries up to 64 waiting requests in one
    /// script run (group commit: fewer round trips and far less Redis time per request under
    /// load; each request is still taken on its own, in arrival order, atomically). On Redis
    /// Cluster, each is a connection to every node, and requests are not grouped.
    #[must_use]
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// A store on the Redis at `url`, on Redis's own clock: `redis://HOST:PORT/DB`, or
    /// `redis+cluster://HOST:PORT,HOST:PORT,…` for Redis Cluster (feature `redis-cluster`;
    /// the nodes to start from, optionally after `USER:PASSWORD@`). Nothing is connected until
    /// the first request, and a lost connection is made again by the next one, so the store
    /// recovers by itself when the server comes back.
    ///
    /// # Errors
    ///
    /// A URL that is not a Redis URL, or a cluster URL without the `redis-cluster` feature.
    pub fn open(self, url: &str) -> Result<RedisStore, StoreError> {
        self.build(url, None)
    }

    /// The same, on `clock` instead of Redis `TIME`: for tests that set the time.
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::open`].
    pub fn open_with_clock<C: Clock>(
        self,
        url: &str,
        clock: C,
    ) -> Result<RedisStore<C>, StoreError> {
        self.build(url, Some(clock))
    }

    fn build<C>(self, url: &str, clock: Option<C>) -> Result<RedisStore<C>, StoreError> {
        let server = match url.strip_prefix("redis+cluster://") {
            Some(nodes) => cluster(nodes, self.timeout)
                .map_err(|e| StoreError::with_source(format!("redis: {url:?}: {e}"), e))?,
            None => Server::One(
                Client::open(url)
                    .map_err(|e| StoreError::with_source(format!("redis: {url:?}: {e}"), e))?,
            ),
        };
        Ok(RedisStore {
            server,
            connections: Pool::new(self.connections),
            group: Group::new(self.connections, MOST_PER_TRIP),
            script: Script::new(SCRIPT),
            one: Script::new(SCRIPT_ONE),
            one_group: Script::new(SCRIPT_GROUP),
            #[cfg(feature = "redis-cluster")]
            give_back: Script::new(GIVE_BACK),
            prefix: self.prefix,
            timeout: self.timeout,
            clock,
        })
    }
}

/// The client of a `redis+cluster://` URL: the nodes to start from, each a `redis://` URL
/// with the same credentials.
#[cfg(feature = "redis-cluster")]
fn cluster(nodes: &str, timeout: Duration) -> redis::RedisResult<Server> {
    let (auth, nodes) = match nodes.rsplit_once('@') {
        Some((auth, nodes)) => (format!("{auth}@"), nodes),
        None => (String::new(), nodes),
    };
    let nodes = nodes.split('/').next().unwrap_or_default();
    let urls: Vec<String> = nodes
        .split(',')
        .filter(|n| !n.trim().is_empty())
        .map(|n| format!("redis://{auth}{}", n.trim()))
        .collect();
    if urls.is_empty() {
        return Err(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "no cluster nodes given",
        )));
    }
    let client = redis::cluster::ClusterClient::builder(urls)
        .connection_timeout(timeout)
        .response_timeout(timeout)
        // Few retries: a request that may have run is not run many times over (a repeat can
        // only take twice, never admit more), and a dead node fails the request in time.
        .retries(2)
        .build()?;
    Ok(Server::Cluster(client))
}

#[cfg(not(feature = "redis-cluster"))]
fn cluster(_: &str, _: Duration) -> redis::RedisResult<Server> {
    Err(redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "Redis Cluster needs tollgate's `redis-cluster` feature",
    )))
}

/// Where the states are: one Redis, or a Redis Cluster.
enum Server {
    One(Client),
    #[cfg(feature = "redis-cluster")]
    Cluster(redis::cluster::ClusterClient),
}

/// A connection to one Redis, or to the nodes of a cluster.
type Conn = Box<dyn redis::ConnectionLike + Send>;

/// States in Redis or Redis Cluster (SPEC §5): the distributed engine, for many app servers.
///
/// Each request is one `EVALSHA` of a script that runs the whole request (every limit, all
/// or nothing) on the server with Redis `TIME` (reloaded by itself after a `NOSCRIPT`);
/// under load, concurrent one-take requests share a round trip and a script run (see
/// [`RedisStoreBuilder::connections`]). A
/// state is two packed doubles under `<prefix><name>:<key>:<shard>` (lengths keep names
/// and keys from running into each other), set to expire when it is full again, so storage
/// follows active limits. A Redis that cannot be reached, times out or answers garbage is a
/// [`StoreError`]: nothing is admitted.
///
/// # Redis Cluster
///
/// With a `redis+cluster://` URL, each state is placed by its own key, so the shards of a hot
/// limit spread over the cluster's nodes. A request whose states share one hash slot runs as
/// above. A sharded take whose two shards (SPEC §3) are in different slots runs in atomic
/// steps of one shard each: the shards are read, the choice is made, and the chosen shard is
/// taken from by the script, which decides again on the state it finds, so a concurrent
/// request can make it refuse but never over-admit. When neither shard alone suffices but
/// both together do, A is taken from, then B; if B refuses, A's take is given back (restored
/// exactly if nothing else touched A meanwhile). Meanwhile a concurrent request may see A
/// lower and be refused: a refusal too many, never an admission too many.
///
/// A transaction over states in different hash slots cannot be atomic on a cluster, and is
/// refused with an error (nothing taken). Give its limits a common hash tag: Redis places a
/// key by the first `{…}` in it, so the keys `{user42}` of two limits put both in one slot
/// (the shards of a limit with such a key then share that slot too). A store prefix with a
/// tag keeps every state in one slot.
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
    server: Server,
    connections: Pool<Conn>,
    /// One-takes on one Redis, sent together when every connection is busy.
    group: Group<(String, Vec<u8>), Value>,
    script: Script,
    one: Script,
    one_group: Script,
    #[cfg(feature = "redis-cluster")]
    give_back: Script,
    prefix: String,
    timeout: Duration,
    /// `None`: Redis `TIME`.
    clock: Option<C>,
}

impl RedisStore {
    /// A store on the Redis (or Redis Cluster) at `url` with the default options.
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::open`].
    pub fn open(url: &str) -> Result<Self, StoreError> {
        RedisStoreBuilder::default().open(url)
    }

    /// Options: key prefix, timeout, connections.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }
}

/// What one run of the script saw and did.
#[cfg_attr(not(feature = "redis-cluster"), allow(dead_code))]
struct Ran {
    outcome: Outcome,
    /// The states it loaded, as stored (empty: none).
    loaded: Vec<Vec<u8>>,
    /// The states after it (the new ones where it wrote).
    states: Vec<Option<State>>,
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

    fn is_cluster(&self) -> bool {
        !matches!(self.server, Server::One(_))
    }

    fn with_connection<T>(
        &self,
        f: impl FnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let connect = || -> Result<Conn, StoreError> {
            match &self.server {
                Server::One(client) => {
                    let conn = client
                        .get_connection_with_timeout(self.timeout)
                        .map_err(|e| redis_error("cannot connect", e))?;
                    conn.set_read_timeout(Some(self.timeout))
                        .map_err(|e| redis_error("cannot set a timeout", e))?;
                    conn.set_write_timeout(Some(self.timeout))
                        .map_err(|e| redis_error("cannot set a timeout", e))?;
                    Ok(Box::new(conn))
                }
                #[cfg(feature = "redis-cluster")]
                Server::Cluster(client) => Ok(Box::new(
                    client.get_connection().map_err(|e| redis_error("cannot connect", e))?,
                )),
            }
        };
        self.connections.run(connect, f, |e| redis_error("request failed", e))
    }

    fn now_arg(&self) -> String {
        self.clock.as_ref().map(|c| format!("{:?}", c.now())).unwrap_or_default()
    }

    /// Sends one-takes (`(key, one_args)`) in one round trip: [`SCRIPT_ONE`] for one,
    /// [`SCRIPT_GROUP`] for several; answers each with its reply (see [`unpack_one`]).
    fn send_ones(&self, requests: &[&(String, Vec<u8>)]) -> Vec<Result<Value, StoreError>> {
        let script = if requests.len() == 1 { &self.one } else { &self.one_group };
        let mut invocation = script.prepare_invoke();
        for (key, args) in requests {
            invocation.key(key).arg(args.as_slice());
        }
        let reply = self.with_connection(|conn| invocation.invoke::<Value>(&mut **conn));
        let replies = match reply {
            Ok(reply) if requests.len() == 1 => return vec![Ok(reply)],
            Ok(Value::Array(replies)) if replies.len() == requests.len() => Ok(replies),
            Ok(_) => Err(garbage(&format!("not {} answers", requests.len()))),
            Err(e) => Err(e),
        };
        match replies {
            Ok(replies) => replies.into_iter().map(Ok).collect(),
            Err(e) => fail_all(requests.len(), e),
        }
    }

    /// Runs the script for `plan`, whose slots are stored under `keys`, in one round trip.
    fn run(&self, plan: &Plan<'_>, keys: &[String]) -> Result<Ran, StoreError> {
        let slots = plan.slots();
        let mut invocation = self.script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        invocation.arg(self.now_arg()).arg(if plan.writes() { "1" } else { "0" }).arg(slots.len());
        for slot in slots {
            let c = &slot.config;
            invocation
                .arg(kind_code(c.kind()))
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
        let reply: Vec<Value> = self.with_connection(|conn| invocation.invoke(&mut **conn))?;
        if reply.len() != 2 + slots.len() {
            return Err(garbage(&format!("{} values for {} slots", reply.len(), slots.len())));
        }
        let now = unpack_time(&reply[0])?;
        let committed = matches!(&reply[1], Value::BulkString(b) if b.as_slice() == b"1");
        let mut states: Vec<Option<State>> = reply[2..].iter().map(unpack_state).collect();
        // The answer comes from tollgate-core, on exactly what the script loaded and the
        // time it used; the script only mirrored the decision to write.
        let outcome = plan.decide(now, &mut states);
        if committed != (outcome.ok && plan.writes()) {
            return Err(disagree());
        }
        let loaded = reply
            .into_iter()
            .skip(2)
            .map(|v| match v {
                Value::BulkString(bytes) => bytes,
                _ => Vec::new(),
            })
            .collect();
        Ok(Ran { outcome, loaded, states })
    }

    /// Reads the states under `keys` and the time: one pipeline on one Redis, one command
    /// per key on a cluster (the keys may be on different nodes).
    fn read_keys(&self, keys: &[String]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let reply: Vec<Value> = if self.is_cluster() {
            self.with_connection(|conn| {
                let mut reply = vec![redis::cmd("TIME").query(&mut **conn)?];
                for key in keys {
                    reply.push(redis::cmd("GET").arg(key).query(&mut **conn)?);
                }
                Ok(reply)
            })?
        } else {
            let mut pipe = redis::pipe();
            pipe.cmd("TIME");
            for key in keys {
                pipe.cmd("GET").arg(key);
            }
            self.with_connection(|conn| pipe.query(&mut **conn))?
        };
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
}

#[cfg(feature = "redis-cluster")]
impl<C: Clock> RedisStore<C> {
    /// A request whose states are in several hash slots of a cluster: a sharded take runs in
    /// steps (see [`RedisStore`]); anything else is refused with an error.
    fn execute_split(&self, plan: &Plan<'_>, keys: &[String]) -> Result<Outcome, StoreError> {
        let n = plan.slots().len();
        // Only one take over two shards splits: refuse anything else before any round trip.
        if n != 2 || plan.takes().nth(1).is_some() {
            return Err(cross_slot(plan, keys));
        }
        let (now, states) = self.read_keys(keys)?;
        let Some(split) = plan.split(now, &states) else {
            return Err(cross_slot(plan, keys));
        };
        match &split {
            Split::Done(outcome) => Ok(outcome.clone()),
            Split::One { slot, plan } => {
                let ran = self.run(plan, std::slice::from_ref(&keys[*slot]))?;
                Ok(split.outcome(n, &[ran.outcome]))
            }
            Split::Both { slots: [a, b], plans: [pa, pb] } => {
                let first = self.run(pa, std::slice::from_ref(&keys[*a]))?;
                if !first.outcome.ok {
                    return Ok(split.outcome(n, &[first.outcome]));
                }
                let second = self.run(pb, std::slice::from_ref(&keys[*b]));
                if let Ok(second) = &second
                    && second.outcome.ok
                {
                    return Ok(split.outcome(n, &[first.outcome, second.outcome.clone()]));
                }
                self.give_back(pa, &keys[*a], &first)?;
                Ok(split.outcome(n, &[first.outcome, second?.outcome]))
            }
        }
    }

    /// Gives back what `ran` took from the one slot of `plan` (see [`GIVE_BACK`]).
    fn give_back(&self, plan: &Plan<'_>, key: &str, ran: &Ran) -> Result<(), StoreError> {
        let slot = &plan.slots()[0];
        let amount = plan.takes().next().map_or(0.0, |t| t.count);
        let written = ran.states[0].map(pack_state).unwrap_or_default();
        let c = &slot.config;
        let mut invocation = self.give_back.prepare_invoke();
        invocation
            .key(key)
            .arg(self.now_arg())
            .arg(written)
            .arg(ran.loaded[0].as_slice())
            .arg(kind_code(c.kind()))
            .arg(num(c.rate()))
            .arg(num(c.period()))
            .arg(num(c.capacity()))
            .arg(num(amount));
        self.with_connection(|conn| invocation.invoke::<i64>(&mut **conn)).map(drop)
    }
}

/// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of the part between its
/// first `{` and the next `}` if that part is not empty, modulo 16384.
#[cfg(feature = "redis-cluster")]
fn hash_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let mut crc: u16 = 0;
    for &byte in tagged.unwrap_or(key) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

/// The error for a transaction whose states are in several hash slots.
#[cfg(feature = "redis-cluster")]
fn cross_slot(plan: &Plan<'_>, keys: &[String]) -> StoreError {
    let mut slots: Vec<u16> = keys.iter().map(|k| hash_slot(k.as_bytes())).collect();
    slots.sort_unstable();
    slots.dedup();
    let names: Vec<&str> = plan.slots().iter().map(|s| s.name).collect();
    StoreError::new(format!(
        "redis cluster: this request's states ({}) are in {} hash slots, and a request is \
         atomic on a cluster only within one; give its limits' keys a common hash tag (such \
         as {{user42}}) or the store a prefix with one (such as {{tollgate}}:)",
        names.join(", "),
        slots.len()
    ))
}

/// How the scripts name a limit's kind: 0 token bucket, 1 fixed window (a byte in
/// [`one_args`], its digit as a text argument).
fn kind_code(kind: Kind) -> u8 {
    match kind {
        Kind::TokenBucket => 0,
        Kind::FixedWindow => 1,
    }
}

/// The one argument of [`SCRIPT_ONE`] for `take`; `now` is NaN for Redis `TIME`.
fn one_args(take: &OneTake<'_>, now: f64) -> Vec<u8> {
    let c = &take.slot.config;
    let mut args = Vec::with_capacity(3 + 7 * 8);
    args.push(u8::from(take.writes));
    args.push(kind_code(c.kind()));
    args.push(u8::from(take.reserve));
    let numbers = [
        c.rate(),
        c.period(),
        c.capacity(),
        c.max_reserved().unwrap_or(f64::NAN),
        take.slot.alignment,
        take.count,
        now,
    ];
    for x in numbers {
        args.extend_from_slice(&x.to_le_bytes());
    }
    args
}

/// Reads [`SCRIPT_ONE`]'s answer: the time it used, whether it wrote, and the state it
/// loaded.
fn unpack_one(reply: &Value) -> Result<OneAnswer, StoreError> {
    let Value::BulkString(reply) = reply else {
        return Err(garbage("not a string for one slot"));
    };
    if reply.starts_with(SCRIPT_ERROR) {
        return Err(StoreError::new(format!("redis: {}", String::from_utf8_lossy(reply))));
    }
    let (wrote, state) = match reply.get(8..) {
        Some([b'0', state @ ..]) => (false, state),
        Some([b'1', state @ ..]) => (true, state),
        _ => return Err(garbage(&format!("{} bytes for one slot", reply.len()))),
    };
    let now = unpack_f64(reply).ok_or_else(|| garbage("the time"))?;
    let loaded = match state.len() {
        0 => None,
        16 => Some(State {
            value: unpack_f64(&state[..8]).ok_or_else(|| garbage("a state"))?,
            ts: unpack_f64(&state[8..]).ok_or_else(|| garbage("a state"))?,
        }),
        n => return Err(garbage(&format!("a state of {n} bytes"))),
    };
    Ok((now, wrote, loaded))
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

/// Reads the time a script answered (a packed double).
fn unpack_time(v: &Value) -> Result<f64, StoreError> {
    match v {
        Value::BulkString(bytes) => unpack_f64(bytes),
        _ => None,
    }
    .ok_or_else(|| garbage("the time"))
}

/// The error when the script wrote where tollgate-core, on the same states, would not (or
/// the other way round).
fn disagree() -> StoreError {
    StoreError::new("redis: the script and tollgate-core disagree on this request; this is a bug")
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

/// A state as the script stores it (`struct.pack('<dd', value, ts)`).
#[cfg(feature = "redis-cluster")]
fn pack_state(state: State) -> Vec<u8> {
    let mut bytes = state.value.to_le_bytes().to_vec();
    bytes.extend_from_slice(&state.ts.to_le_bytes());
    bytes
}

fn garbage(what: &str) -> StoreError {
    StoreError::new(format!("redis: unexpected answer: {what}"))
}

impl<C: Clock> Store for RedisStore<C> {
    fn execute(&self, plan: &Plan<'_>) -> Result<Outcome, StoreError> {
        let keys: Vec<String> =
            plan.slots().iter().map(|s| self.key(s.name, s.key, s.shard)).collect();
        #[cfg(feature = "redis-cluster")]
        if self.is_cluster() {
            let first = hash_slot(keys[0].as_bytes());
            if keys[1..].iter().any(|k| hash_slot(k.as_bytes()) != first) {
                return self.execute_split(plan, &keys);
            }
        }
        self.run(plan, &keys).map(|ran| ran.outcome)
    }

    fn execute_one(&self, take: &OneTake<'_>) -> Result<Taken, StoreError> {
        let slot = &take.slot;
        let now = self.clock.as_ref().map_or(f64::NAN, Clock::now);
        let request = (self.key(slot.name, slot.key, slot.shard), one_args(take, now));
        let reply = if self.is_cluster() {
            // The states of concurrent requests are on different nodes: one at a time.
            self.send_ones(&[&request]).pop().unwrap_or_else(|| Err(garbage("no answer")))?
        } else {
            // A request may wait for one round trip of others before its own.
            self.group.run(request, 2 * self.timeout, |requests| self.send_ones(requests))?
        };
        let (now, wrote, loaded) = unpack_one(&reply)?;
        // As for a plan: the answer is tollgate-core's, on what the script loaded.
        let (taken, new) = take.decide(now, loaded);
        if wrote != new.is_some() {
            return Err(disagree());
        }
        Ok(taken)
    }

    fn read(&self, slots: &[Slot<'_>]) -> Result<(f64, Vec<Option<State>>), StoreError> {
        let keys: Vec<String> = slots.iter().map(|s| self.key(s.name, s.key, s.shard)).collect();
        self.read_keys(&keys)
    }

    fn delete(&self, name: &str, key: Option<&str>, shards: u16) -> Result<(), StoreError> {
        let keys: Vec<String> = (0..shards).map(|shard| self.key(name, key, shard)).collect();
        if self.is_cluster() {
            // One command per key: a cluster refuses a DEL over several hash slots.
            return self.with_connection(|conn| {
                keys.iter().try_for_each(|k| redis::cmd("DEL").arg(k).query::<()>(&mut **conn))
            });
        }
        self.with_connection(|conn| redis::cmd("DEL").arg(&keys).query::<()>(&mut **conn))
    }
}

#[cfg(test)]
mod tests {
    use tollgate_core::{Config, MINUTE, Take};

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

    #[test]
    fn the_answer_for_one_slot_is_read_exactly_or_refused() {
        let time = 1_700_000_000_123.25_f64.to_le_bytes();
        let answer =
            |wrote: &[u8], state: &[u8]| Value::BulkString([&time[..], wrote, state].concat());
        let state = State { value: -2.5, ts: 1_700_000_000_000.0 };
        let mut packed = state.value.to_le_bytes().to_vec();
        packed.extend_from_slice(&state.ts.to_le_bytes());
        let (now, wrote, loaded) = unpack_one(&answer(b"1", &packed)).unwrap();
        assert_eq!((now, wrote, loaded), (1_700_000_000_123.25, true, Some(state)));
        assert_eq!(unpack_one(&answer(b"0", b"")).unwrap(), (1_700_000_000_123.25, false, None));
        for garbage in [answer(b"1", &packed[..15]), answer(b"2", b""), answer(b"", b"")] {
            assert!(unpack_one(&garbage).is_err());
        }
        assert!(unpack_one(&Value::Int(1)).is_err());
        let take = Take {
            name: "t",
            key: None,
            config: Config::token_bucket(10.0, MINUTE),
            count: 1.0,
            reserve: false,
        };
        let args = one_args(&OneTake::new(&take, 0, true).unwrap(), f64::NAN);
        assert_eq!(args.len(), 59);
        assert_eq!(args[..3], [1, 0, 0]);
        assert_eq!(args[3..11], 10.0_f64.to_le_bytes());
        assert!(f64::from_le_bytes(args[27..35].try_into().unwrap()).is_nan(), "unbounded");
    }
}

/// The give-back of a take across two cluster nodes, on the cluster of
/// `TOLLGATE_REDIS_CLUSTER_URL` (skipped without it, unless `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(all(test, feature = "redis-cluster"))]
mod give_back_tests {
    use tollgate_core::{Config, MINUTE, ManualClock, Take};

    use super::*;

    fn cluster_url() -> Option<String> {
        crate::store::group::testing::backend_url("TOLLGATE_REDIS_CLUSTER_URL")
    }

    #[test]
    fn restores_exactly_or_adds_back() {
        let Some(url) = cluster_url() else { return };
        const T0: f64 = 1_700_000_000_000.0;
        let clock = ManualClock::new(T0);
        let prefix = format!("tollgate-give-back:{}:", std::process::id());
        let store = RedisStore::builder().prefix(prefix).open_with_clock(&url, clock).unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        let plan = |count: f64| {
            let mut plan = Plan::new(true);
            let take = Take { name: "t", key: Some("k"), config, count, reserve: false };
            plan.push(&take, 0, 0).unwrap();
            plan
        };
        let key = store.key("t", Some("k"), 0);
        let keys = std::slice::from_ref(&key);
        let value = || store.read_keys(keys).unwrap().1[0].map(|s| s.value);

        // Nothing touched the state since the take: the state before it comes back.
        let four = plan(4.0);
        let ran = store.run(&four, keys).unwrap();
        assert_eq!(value(), Some(6.0));
        store.give_back(&four, &key, &ran).unwrap();
        assert_eq!(value(), None, "there was no state before the take");
        store.run(&plan(1.0), keys).unwrap();
        let ran = store.run(&four, keys).unwrap();
        store.give_back(&four, &key, &ran).unwrap();
        assert_eq!(value(), Some(9.0), "the state before the take, exactly");

        // Another take came between: the amount is added back, up to capacity.
        let ran = store.run(&four, keys).unwrap();
        store.run(&plan(2.0), keys).unwrap();
        assert_eq!(value(), Some(3.0));
        store.give_back(&four, &key, &ran).unwrap();
        assert_eq!(value(), Some(7.0));
        store.delete("t", Some("k"), 1).unwrap();
    }
}

/// The scripts on the Redis of `TOLLGATE_REDIS_URL` (skipped without it, unless
/// `TOLLGATE_REQUIRE_BACKENDS=1`).
#[cfg(test)]
mod on_redis_tests {
    use tollgate_core::{Config, MINUTE, ManualClock, SECOND, Take};

    use super::*;
    use crate::store::group::testing::{T0, backend_url, grouped_takes_answer_as_memory, writing};

    fn url() -> Option<String> {
        backend_url("TOLLGATE_REDIS_URL")
    }

    /// `takes` in one round trip, at the clock's time: each answer as [`unpack_one`] reads it.
    fn send_group(
        redis: &RedisStore<ManualClock>,
        takes: &[OneTake<'_>],
        now: f64,
    ) -> Vec<Result<OneAnswer, StoreError>> {
        let requests: Vec<(String, Vec<u8>)> = takes
            .iter()
            .map(|o| (redis.key(o.slot.name, o.slot.key, o.slot.shard), one_args(o, now)))
            .collect();
        let replies = redis.send_ones(&requests.iter().collect::<Vec<_>>());
        replies.into_iter().map(|r| unpack_one(&r?)).collect()
    }

    fn open(url: &str, clock: &ManualClock, test: &str) -> RedisStore<ManualClock> {
        let prefix = format!("tollgate-{test}:{}:", std::process::id());
        RedisStore::builder().prefix(prefix).open_with_clock(url, clock.clone()).unwrap()
    }

    #[test]
    fn grouped_takes_answer_as_memory_one_after_the_other() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = open(&url, &clock, "group");
        grouped_takes_answer_as_memory(&clock, &redis, |ones| {
            send_group(&redis, ones, clock.now()).into_iter().map(Result::unwrap).collect()
        });
    }

    /// A key that holds something else than a state fails its own take, alone or in a
    /// group; the group's other takes are answered and saved.
    #[test]
    fn a_foreign_value_fails_only_its_own_take() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = open(&url, &clock, "foreign");
        let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let config = Config::token_bucket(10.0, MINUTE);
        let take = |key| Take { name: "t", key: Some(key), config, count: 1.0, reserve: false };
        let bad_key = redis.key("t", Some("bad"), 0);
        let _: () = redis::cmd("SET").arg(&bad_key).arg("x").query(&mut conn).unwrap();
        let (bad, good) = (take("bad"), take("good"));
        assert!(redis.execute_one(&writing(&bad)).is_err(), "alone");
        let group = [writing(&good), writing(&bad), writing(&good)];
        let answers = send_group(&redis, &group, clock.now());
        let error = answers[1].as_ref().unwrap_err().message().to_owned();
        assert!(error.starts_with("redis: script error: "), "{error}");
        assert_eq!(answers[0].as_ref().unwrap().2, None);
        assert_eq!(answers[2].as_ref().unwrap().2, Some(State { value: 9.0, ts: T0 }));
        let slot = [writing(&good).slot];
        assert_eq!(redis.read(&slot).unwrap().1, [Some(State { value: 8.0, ts: T0 })]);
        redis.delete("t", Some("good"), 1).unwrap();
        redis.delete("t", Some("bad"), 1).unwrap();
    }

    /// A state expires exactly when it would be full again (rounded up to the ms), alone,
    /// grouped and in a transaction; one left full is deleted.
    #[test]
    fn states_expire_when_full_again() {
        let Some(url) = url() else { return };
        let clock = ManualClock::new(T0);
        let redis = open(&url, &clock, "expiry");
        let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let mut pttl = |name: &str, key: &str| -> i64 {
            redis::cmd("PTTL").arg(redis.key(name, Some(key), 0)).query(&mut conn).unwrap()
        };
        let bucket = Config::token_bucket(10.0, MINUTE);
        let window = Config::fixed_window(10.0, MINUTE).with_start(T0 - 15.0 * SECOND);
        let take =
            |name, key, config, count| Take { name, key: Some(key), config, count, reserve: false };
        let one = |t: &Take<'_>| redis.execute_one(&writing(t)).unwrap();

        // 4 of 10 a minute taken: full again in 4 x 6 s.
        assert!(one(&take("tb", "alone", bucket, 4.0)).decision.ok);
        assert!((23_000..=24_000).contains(&pttl("tb", "alone")));
        // A window that began 15 s ago: full again when the next one begins, in 45 s.
        assert!(one(&take("fw", "alone", window, 3.0)).decision.ok);
        assert!((44_000..=45_000).contains(&pttl("fw", "alone")));
        // Taking nothing leaves a new state full: nothing is stored (-2: no such key).
        assert!(one(&take("tb", "nothing", bucket, 0.0)).decision.ok);
        assert_eq!(pttl("tb", "nothing"), -2);

        // Grouped: 1, then 2 more of the same state: full again in 3 x 6 s.
        let (a, b) = (take("tb", "grouped", bucket, 1.0), take("tb", "grouped", bucket, 2.0));
        let answers = send_group(&redis, &[writing(&a), writing(&b)], clock.now());
        assert!(answers.iter().all(|r| r.as_ref().unwrap().1), "both wrote");
        assert!((17_000..=18_000).contains(&pttl("tb", "grouped")));

        // A transaction (the general script): 5 of the bucket, 1 of the window.
        let mut plan = Plan::new(true);
        plan.push(&take("tb", "tx", bucket, 5.0), 0, 0).unwrap();
        plan.push(&take("fw", "tx", window, 1.0), 0, 0).unwrap();
        assert!(redis.execute(&plan).unwrap().ok);
        assert!((29_000..=30_000).contains(&pttl("tb", "tx")));
        assert!((44_000..=45_000).contains(&pttl("fw", "tx")));

        for (name, key) in
            [("tb", "alone"), ("fw", "alone"), ("tb", "grouped"), ("tb", "tx"), ("fw", "tx")]
        {
            redis.delete(name, Some(key), 1).unwrap();
        }
    }
}
