// The in-process limiter on every store: each call of the client's API, its answers and its
// errors, through the real addon.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";

import {
  HOUR,
  MINUTE,
  RateLimitError,
  RateLimiter,
  TollgateError,
  calculateRateLimit,
} from "../dist/index.js";
import { fresh, stores } from "./stores.mjs";

for (const [label, store] of stores()) {
  test(`every call on the ${label} store`, { skip: store === undefined && "no URL" }, async () => {
    const send = fresh("send");
    const day = fresh("day");
    const limiter = new RateLimiter({ store }, {
      [send]: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
      [day]: { kind: "fixed window", rate: 2, period: HOUR, start: 0 },
    });
    try {
      // Three granted, the fourth refused with the wait for one token (6 s at 10 a minute).
      for (let i = 0; i < 3; i++) assert.deepEqual(await limiter.limit(send, { key: "{alice}" }), { ok: true });
      const refused = await limiter.limit(send, { key: "{alice}" });
      assert.equal(refused.ok, false);
      assert.ok(refused.retryAfter > 5_000 && refused.retryAfter <= 6_000, String(refused.retryAfter));
      // Another key is its own.
      assert.equal((await limiter.limit(send, { key: "{bob}" })).ok, true);
      // check takes nothing.
      assert.equal((await limiter.check(send, { key: "{bob}", count: 2 })).ok, true);
      assert.equal((await limiter.check(send, { key: "{bob}", count: 2 })).ok, true);
      // throws: a RateLimitError naming the limit.
      await assert.rejects(limiter.limit(send, { key: "{alice}", throws: true }), (e) => {
        assert.ok(e instanceof RateLimitError);
        assert.equal(e.name, send);
        assert.ok(e.retryAfter > 0);
        return true;
      });
      // A reservation is granted with the wait, and pushes the value below zero.
      const reserved = await limiter.limit(send, { key: "{alice}", reserve: true });
      assert.equal(reserved.ok, true);
      assert.ok(reserved.retryAfter > 0);
      // getValue: the stored state and the full config; the client computes from it as the
      // engine does.
      const value = await limiter.getValue(send, { key: "{alice}" });
      assert.ok(value.value < 0, JSON.stringify(value));
      assert.equal(value.config.capacity, 3);
      assert.equal(value.config.shards, 1);
      const now = await limiter.getServerTime();
      assert.ok(Math.abs(now - Date.now()) < 5_000, `${now} vs ${Date.now()}`);
      assert.equal(calculateRateLimit(value, value.config, now, 1).ok, false);
      // A transaction is all or nothing: bob's send would grant, day's third would not. (The
      // keys' hash tag keeps a transaction's states in one slot of a Redis Cluster.)
      assert.equal((await limiter.limit(day, { key: "{bob}", count: 2 })).ok, true);
      const before = (await limiter.getValue(send, { key: "{bob}" })).value;
      const all = await limiter.transaction([
        { name: send, key: "{bob}" },
        { name: day, key: "{bob}" },
      ], { fields: true });
      assert.equal(all.ok, false);
      assert.deepEqual(all.results.map((r) => r.ok), [true, false]);
      assert.ok(Math.abs((await limiter.getValue(send, { key: "{bob}" })).value - before) < 0.01);
      assert.match(all.fields["ratelimit-policy"], new RegExp(`"${send}";q=10;w=60, "${day}";q=2;w=3600`));
      assert.ok(Number(all.fields["retry-after"]) >= 1, JSON.stringify(all.fields));
      // adjust: the work used more than was taken (a debt), then less (given back).
      assert.equal((await limiter.limit(day, { key: "{carol}" })).ok, true);
      const debt = await limiter.adjust(day, { key: "{carol}", count: 2 });
      assert.equal(debt.value, -1);
      assert.ok(debt.retryAfter > 0, JSON.stringify(debt));
      assert.equal((await limiter.limit(day, { key: "{carol}" })).ok, false);
      assert.deepEqual(await limiter.adjust(day, { key: "{carol}", count: -5 }), { value: 2 });
      await assert.rejects(limiter.adjust(day, { key: "{carol}", count: Infinity }), TypeError);
      // reset: the next request starts full.
      await limiter.reset(send, { key: "{alice}" });
      assert.equal((await limiter.getValue(send, { key: "{alice}" })).ts, 0);
      assert.equal((await limiter.limit(send, { key: "{alice}", count: 3 })).ok, true);
      // A name not among the limits, with a config of the call's own; and without one, a
      // TollgateError that took nothing.
      const inline = await limiter.limit(fresh("inline"), {
        key: "a",
        config: { kind: "token bucket", rate: 1, period: MINUTE },
      });
      assert.equal(inline.ok, true);
      await assert.rejects(limiter.limit(fresh("unknown"), { key: "a" }), (e) => {
        assert.ok(e instanceof TollgateError);
        assert.equal(e.status, 404);
        assert.equal(e.mayHaveTaken, false);
        return true;
      });
      // Bad input: SPEC §2's message, nothing consumed.
      await assert.rejects(limiter.limit(send, { key: "{bob}", count: -1 }), (e) => {
        assert.ok(e instanceof TollgateError);
        assert.equal(e.status, 400);
        assert.match(e.message, /count/);
        return true;
      });
    } finally {
      await limiter.close();
    }
  });
}

test("a bad store URL or limit throws a TypeError at the constructor", () => {
  assert.throws(() => new RateLimiter({ store: "mongodb://127.0.0.1" }), (e) => {
    assert.ok(e instanceof TypeError);
    assert.match(e.message, /unknown store; use memory, sqlite:\/\/PATH/);
    return true;
  });
  assert.throws(
    () => new RateLimiter({ store: "memory" }, { x: { kind: "token bucket", rate: -1, period: MINUTE } }),
    /\[limits\.x\]: invalid config: rate is -1/,
  );
  assert.throws(
    () => new RateLimiter({ store: "memory", leases: { x: true } }, { x: { kind: "token bucket", rate: 1, period: MINUTE } }),
    /lease = true needs a Redis or PostgreSQL store/,
  );
  assert.throws(() => new RateLimiter({ store: "memory", leases: { y: true } }, {}), /leases names "y"/);
  assert.throws(() => new RateLimiter({}), /store must be a store URL/);
});

test("a store that is down fails each call with a TollgateError, never ok", async () => {
  const name = fresh("down");
  for (const store of ["redis://127.0.0.1:1", "postgres://postgres@127.0.0.1:1/test"]) {
    const limiter = new RateLimiter({ store, storeDeadline: 500 }, {
      [name]: { kind: "token bucket", rate: 10, period: MINUTE },
    });
    for (const call of [
      () => limiter.limit(name, { key: "a" }),
      () => limiter.transaction([{ name, key: "a" }]),
      () => limiter.check(name, { key: "a" }),
    ]) {
      await assert.rejects(call(), (e) => {
        assert.ok(e instanceof TollgateError, String(e));
        assert.equal(e.status, 503);
        // Refused before anything went out: nothing taken.
        assert.equal(e.mayHaveTaken, false);
        return true;
      });
    }
  }
});

test("the memory store answers under the promise, without a turn of the event loop", async () => {
  const name = fresh("fast");
  const limiter = new RateLimiter("memory", {
    [name]: { kind: "token bucket", rate: 1, period: HOUR, capacity: 1_000 },
  });
  await limiter.limit(name); // opened
  // Each answer is ready when its promise is made: 2,000 awaited calls run as microtasks,
  // and no timer gets a turn in between.
  let ticks = 0;
  const timer = setInterval(() => ticks++, 0);
  for (let i = 0; i < 2_000; i++) await limiter.limit(name, { key: String(i % 10) });
  clearInterval(timer);
  assert.equal(ticks, 0);
  const value = await limiter.getValue(name, { key: "0" });
  assert.ok(Math.abs(value.value - 800) < 0.01, JSON.stringify(value));
});

test("{ url } is the server's client: the same class, the same calls", async () => {
  const { startServer } = await import("../../../clients/js/test/server.mjs");
  const server = await startServer();
  try {
    const name = fresh("remote");
    const config = { kind: "token bucket", rate: 10, period: MINUTE, capacity: 2 };
    const remote = new RateLimiter({ url: server.url }, { [name]: config });
    const local = new RateLimiter({ store: "memory" }, { [name]: config });
    for (const limiter of [remote, local]) {
      const answers = [];
      for (let i = 0; i < 3; i++) answers.push((await limiter.limit(name, { key: "k" })).ok);
      assert.deepEqual(answers, [true, true, false]);
      const t = await limiter.transaction([{ name, key: "k" }], { fields: true });
      assert.equal(t.fields["ratelimit-policy"], `"${name}";q=10;w=60`);
      assert.match(t.fields.ratelimit, new RegExp(`^"${name}";r=0;t=\\d+$`));
    }
  } finally {
    await server.stop();
  }
});

test("limit and check answer alike by the direct path (a defined limit) and the JSON path (a config in the call)", async () => {
  const defined = fresh("direct");
  const inline = fresh("json");
  const config = { kind: "token bucket", rate: 1, period: HOUR, capacity: 5, maxReserved: 2 };
  const limiter = new RateLimiter("memory", { [defined]: config });
  await limiter.getServerTime(); // open: the direct path is taken from here on
  const calls = [
    ["limit", { count: 2 }], ["check", { count: 4 }], ["limit", { count: 3 }], ["limit", {}],
    ["limit", { reserve: true }], ["limit", { count: 2, reserve: true }], ["check", {}],
  ];
  for (const [call, options] of calls) {
    const direct = await limiter[call](defined, { key: "k", ...options });
    const json = await limiter[call](inline, { key: "k", config, ...options });
    assert.equal(direct.ok, json.ok, `${call} ${JSON.stringify(options)}`);
    assert.equal("retryAfter" in direct, "retryAfter" in json);
    if (direct.retryAfter !== undefined) assert.ok(Math.abs(direct.retryAfter - json.retryAfter) < 50);
  }
  // The same errors, word for word (but the name), and a refusal with throws.
  const outcomes = async (name, extra) =>
    Promise.all([
      limiter.limit(name, { key: "k", count: -1, ...extra }).catch((e) => `${e.constructor.name} ${e.status} ${e.message}`),
      limiter.limit(name, { key: "k", throws: true, ...extra }).catch((e) => `${e.constructor.name} ${e.name}`),
    ]).then((all) => all.map((x) => x.replace(name, "NAME")));
  const direct = await outcomes(defined, {});
  assert.deepEqual(direct, await outcomes(inline, { config }));
  assert.match(direct[0], /^TollgateError 400 Rate limit NAME count -1 must be/);
  assert.equal(direct[1], "RateLimitError NAME");
});

test("names and keys of any length and character reach the engine whole by the direct path", async () => {
  // The addon reads a short key into the stack (up to 123 bytes of UTF-8) and a longer one
  // as a whole: keys on either side of that, with characters of 2 and 4 bytes across it,
  // are each their own, and each is the key getValue (the JSON path) reads.
  const name = fresh(`long-${"n".repeat(150)}`);
  const limiter = new RateLimiter("memory", { [name]: { kind: "token bucket", rate: 1, period: HOUR, capacity: 1 } });
  await limiter.getServerTime();
  const keys = [
    "a".repeat(122),
    "a".repeat(123),
    "a".repeat(124),
    `${"a".repeat(122)}é`,
    `${"a".repeat(121)}😀`,
    `${"a".repeat(122)}😀`,
    `${"a".repeat(124)}😀`, // 128 bytes: Node writes 124 of them, stopping before the 😀
    `${"a".repeat(127)}1`,
    `${"a".repeat(127)}2`,
    `${"ü".repeat(200)}`,
    `${"ü".repeat(199)}ö`,
    "",
  ];
  for (const key of keys) assert.deepEqual(await limiter.limit(name, { key }), { ok: true }, key);
  for (const key of keys) {
    assert.equal((await limiter.limit(name, { key })).ok, false, key);
    assert.ok((await limiter.getValue(name, { key })).value < 1, key);
  }
  // No key is not the empty key.
  assert.deepEqual(await limiter.limit(name), { ok: true });
  assert.ok((await limiter.getValue(name, { key: "never taken" })).value === 1);
});

test("arguments of the wrong type and names not defined get the same errors on both paths, and take nothing", async () => {
  // The direct path (a function per defined name, made at its first call) and the JSON path
  // check the arguments alike (tollgate-client's checkTake): a TypeError, before any work.
  const defined = fresh("typed");
  const inline = fresh("typed-json");
  const config = { kind: "token bucket", rate: 1, period: HOUR, capacity: 2 };
  const limiter = new RateLimiter("memory", { [defined]: config });
  await limiter.limit(defined, { key: "warm" }); // the direct path is made
  const outcome = (name, options) =>
    limiter.limit(name, options).then(
      (r) => JSON.stringify(r),
      // (where in its JSON body the JSON path found the fault differs: the other carries a config)
      (e) => `${e.constructor.name} ${e.status} ${e.message}`.replace(name, "NAME").replace(/ at line \d+ column \d+$/, ""),
    );
  for (const options of [{ key: 5 }, { key: {} }, { count: "2" }, { key: "k", count: [1] }, { key: "k", reserve: "yes" }, { key: "k", throws: 1 }]) {
    const direct = await outcome(defined, options);
    assert.equal(direct, await outcome(inline, { ...options, config }), JSON.stringify(options));
    assert.match(direct, /^TypeError undefined limit: /, JSON.stringify(options));
  }
  // Nothing was taken by those: both tokens of "k" are there.
  assert.equal((await limiter.getValue(defined, { key: "k" })).value, 2);
  // A name not defined, before and after a defined one's function is made.
  const missing = fresh("missing");
  for (let i = 0; i < 2; i++) {
    await assert.rejects(limiter.limit(missing, { key: "k" }), (e) => e instanceof TollgateError && e.status === 404 && e.message.includes(missing));
  }
  assert.deepEqual(await limiter.limit(defined, { key: "k", count: 2 }), { ok: true });
  assert.equal((await limiter.limit(defined, { key: "k" })).ok, false);
});

test("a limiter no longer referenced is collected with its store, a call still waiting included", {
  skip: process.env.TOLLGATE_REDIS_URL === undefined && "no TOLLGATE_REDIS_URL",
}, () => {
  // The addon holds the function its waiting answers come back through: were that to hold
  // the limiter, no limiter would ever be collected, nor its store closed. Seen here as
  // Redis connections (on a database no other test uses) that close once the limiters that
  // opened them are dropped, one of them while its call was still waiting on Redis.
  const url = new URL(process.env.TOLLGATE_REDIS_URL);
  url.pathname = "/11";
  const script = `
    import { RateLimiter } from ${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)};
    import { execFileSync } from "node:child_process";
    const ours = () => execFileSync("redis-cli", ["-u", ${JSON.stringify(process.env.TOLLGATE_REDIS_URL)}, "client", "list"])
      .toString().split("\\n").filter((line) => line.includes(" db=11 ")).length;
    const config = { a: { kind: "token bucket", rate: 1e6, period: 1000 } };
    async function made(i) {
      const limiter = new RateLimiter(${JSON.stringify(url.href)}, config);
      await limiter.limit("a", { key: "gc" + i });
      return i === 0 ? limiter.limit("a", { key: "gc" + i }) : undefined; // waiting when dropped
    }
    const waiting = await Promise.all([0, 1, 2, 3, 4].map(made).map((p) => (globalThis.gc(), p)));
    const open = ours();
    let left = open;
    for (let i = 0; i < 100 && left > 0; i++) {
      globalThis.gc();
      await new Promise((r) => setTimeout(r, 50));
      left = ours();
    }
    console.log(JSON.stringify({ open, left, waiting }));
  `;
  const run = spawnSync(process.execPath, ["--expose-gc", "--input-type=module", "-e", script], { encoding: "utf8", timeout: 30_000 });
  assert.equal(run.status, 0, run.stderr);
  const { open, left, waiting } = JSON.parse(run.stdout);
  assert.ok(open >= 5, `the 5 limiters had ${open} connections open`);
  assert.equal(left, 0, "connections of collected limiters left open");
  assert.deepEqual(waiting[0], { ok: true });
});

test("__proto__, constructor and prototype are names like any other in limits, leases and failOpen", async () => {
  const config = { kind: "token bucket", rate: 2, period: HOUR };
  // JSON.parse makes "__proto__" an own key, as a config read from a file has it.
  const own = (name, value) => JSON.parse(`{${JSON.stringify(name)}: ${JSON.stringify(value)}}`);
  for (const name of ["__proto__", "constructor", "prototype"]) {
    // A limit of that name, failing open: its own limit, taken as any.
    const limiter = new RateLimiter({ store: "memory", failOpen: [name] }, own(name, config));
    const answers = [];
    for (let i = 0; i < 3; i++) answers.push((await limiter.limit(name, { key: "k" })).ok);
    assert.deepEqual(answers, [true, true, false], name);
    assert.equal((await limiter.getValue(name, { key: "k" })).config.rate, 2);
    // A lease for it reaches its limit (and memory has no leases: the engine says so).
    assert.throws(() => new RateLimiter({ store: "memory", leases: own(name, true) }, own(name, config)), /lease = true needs a Redis/);
    // Without such a limit, each option says so.
    assert.throws(() => new RateLimiter({ store: "memory", failOpen: [name] }, { x: config }), new RegExp(`failOpen names "${name}", which is not among`));
    assert.throws(() => new RateLimiter({ store: "memory", leases: own(name, true) }, { x: config }), new RegExp(`leases names "${name}", which is not among`));
  }
  for (const target of [Object.prototype, Object, Function.prototype]) {
    for (const field of ["failOpen", "lease", "kind"]) assert.equal(Object.hasOwn(target, field), false, field);
  }
  // And a limiter made after them all is a limiter as before.
  assert.deepEqual(await new RateLimiter("memory", { x: config }).limit("x"), { ok: true });
  // An option of another shape is refused, not walked (a string's characters, say).
  assert.throws(() => new RateLimiter({ store: "memory", failOpen: "x" }, { x: config }), /failOpen must be an array/);
  assert.throws(() => new RateLimiter({ store: "memory", leases: ["x"] }, { x: config }), /leases must be an object/);
});

test("odd values are read alike by every call and path: a TypeError, nothing taken", async () => {
  const config = { kind: "token bucket", rate: 2, period: HOUR };
  const limiter = new RateLimiter("memory", { d: config });
  await limiter.getServerTime(); // open: limit and check of "d" take the direct path
  const odd = [
    ["count NaN", { count: Number.NaN }],
    ["count Infinity", { count: Infinity }],
    ["count -Infinity", { count: -Infinity }],
    ["count null", { count: null }],
    ["count a string", { count: "2" }],
    ["key null", { key: null }],
    ["key a number", { key: 5 }],
    ["key a lone high surrogate", { key: "\ud800" }],
    ["key a lone low surrogate", { key: "a\udc00b" }],
    ["reserve a string", { reserve: "yes" }],
    ["throws a number", { throws: 1 }],
  ];
  const key = () => `k${Math.random()}`;
  const calls = {
    "limit, direct": (o) => limiter.limit("d", { key: key(), ...o }),
    "check, direct": (o) => limiter.check("d", { key: key(), ...o }),
    "limit, JSON": (o) => limiter.limit("j", { key: key(), config, ...o }),
    transaction: (o) => {
      const { throws: _t, ...r } = o;
      return limiter.transaction([{ name: "d", key: key(), ...r }, ...(o.throws === undefined ? [] : [{ name: "d", key: key(), reserve: o.throws }])]);
    },
  };
  for (const [label, options] of odd) {
    for (const [path, call] of Object.entries(calls)) {
      await assert.rejects(call(options), TypeError, `${label}, ${path}`);
    }
  }
  // Options where the key belongs, and no options object: a TypeError on both paths.
  for (const options of ["alice", null, 42]) {
    await assert.rejects(limiter.limit("d", options), TypeError, String(options));
    await assert.rejects(limiter.check("j", options), TypeError, String(options));
  }
  await assert.rejects(limiter.limit("d\ud800"), TypeError);
  await assert.rejects(limiter.transaction("d"), TypeError);
  await assert.rejects(limiter.reset("d", { key: "\udfff" }), TypeError);
  await assert.rejects(limiter.getValue("d", { key: null }), TypeError);
  await assert.rejects(limiter.adjust("d", { key: 1, count: 1 }), TypeError);
  // Nothing was taken by any of them: the shared value and the lone-surrogate keys' U+FFFD
  // (what the addon read them as) are full.
  for (const k of [undefined, "\ufffd", "a\ufffdb"]) {
    assert.equal((await limiter.getValue("d", k === undefined ? {} : { key: k })).ts, 0, String(k));
  }
  // A key with a U+FFFD of its own is a key like any other, on the direct path too.
  assert.deepEqual(await limiter.limit("d", { key: "a\ufffdb" }), { ok: true });
  assert.equal((await limiter.getValue("d", { key: "a\ufffdb" })).value, 1);
  // What the engine judges is judged alike too: a negative count is its 400 on each path.
  for (const path of ["limit, direct", "limit, JSON", "transaction"]) {
    await assert.rejects(calls[path]({ count: -1 }), (e) => e instanceof TollgateError && e.status === 400, path);
  }
});

test("leases: false is no lease; a value of another kind is a TypeError", () => {
  const config = { kind: "token bucket", rate: 2, period: HOUR };
  // On memory a lease is refused by the engine: false is no lease, so no refusal.
  assert.doesNotThrow(() => new RateLimiter({ store: "memory", leases: { x: false } }, { x: config }));
  assert.throws(() => new RateLimiter({ store: "memory", leases: { x: true } }, { x: config }), /lease = true needs a Redis/);
  for (const lease of ["yes", 1, null]) {
    assert.throws(() => new RateLimiter({ store: "memory", leases: { x: lease } }, { x: config }), TypeError, String(lease));
  }
});

test("durations as the server writes them: period, storeDeadline and a lease's term", async () => {
  const limiter = new RateLimiter({ store: "memory", storeDeadline: "300ms" }, {
    perMinute: { kind: "token bucket", rate: 10, period: "1m", capacity: 1 },
    daily: { kind: "fixed window", rate: 1, period: "1d", start: 0 },
  });
  assert.deepEqual(await limiter.limit("perMinute", { key: "k" }), { ok: true });
  const refused = await limiter.limit("perMinute", { key: "k" });
  assert.ok(refused.retryAfter > 5_000 && refused.retryAfter <= 6_000, String(refused.retryAfter));
  assert.equal((await limiter.getValue("daily")).config.period, 86_400_000);
  // In a call's own config, by the JSON path.
  const inline = await limiter.check(fresh("inline"), { config: { kind: "token bucket", rate: 1, period: "1.5s" } });
  assert.deepEqual(inline, { ok: true });
  // What is not a duration, or is out of bounds, is the server's TypeError at the constructor.
  assert.throws(() => new RateLimiter({ store: "memory", storeDeadline: "soon" }), /storeDeadline: "soon" is not a duration/);
  assert.throws(() => new RateLimiter({ store: "memory", storeDeadline: "2d" }), /at most a day/);
  assert.throws(() => new RateLimiter("memory", { x: { kind: "token bucket", rate: 1, period: "1 minute" } }), /period is "1 minute"/);
  const redis = process.env.TOLLGATE_REDIS_URL;
  if (redis !== undefined) {
    const name = fresh("term");
    const leased = new RateLimiter({ store: redis, leases: { [name]: { term: "2s" } } }, {
      [name]: { kind: "token bucket", rate: 1, period: "1h", capacity: 5 },
    });
    assert.deepEqual(await leased.limit(name, { key: "k" }), { ok: true });
    await leased.close();
    assert.throws(() => new RateLimiter({ store: redis, leases: { x: { term: "forever" } } }, { x: { kind: "token bucket", rate: 1, period: "1h" } }), /lease\.term: "forever"/);
  }
});

test("calls after close() are refused with a TollgateError and take nothing, on each door", async () => {
  const config = { kind: "token bucket", rate: 10, period: HOUR, capacity: 10 };
  const refusedAfterClose = (e) => {
    assert.ok(e instanceof TollgateError, String(e));
    assert.match(e.message, /the limiter is closed/);
    assert.equal(e.mayHaveTaken, false);
    return true;
  };
  const limiters = [["memory", new RateLimiter("memory", { x: config })]];
  const redis = process.env.TOLLGATE_REDIS_URL;
  const name = fresh("closed");
  if (redis !== undefined) {
    limiters.push(["redis, leased", new RateLimiter({ store: redis, leases: { [name]: true } }, { [name]: config })]);
  }
  const { startServer } = await import("../../../clients/js/test/server.mjs");
  const server = await startServer();
  limiters.push(["a server's", new RateLimiter({ url: server.url }, { x: config })]);
  try {
    for (const [label, limiter] of limiters) {
      const limit = label === "redis, leased" ? name : "x";
      assert.deepEqual(await limiter.limit(limit, { key: "k" }), { ok: true }, label);
      await limiter.close();
      for (const call of [
        () => limiter.limit(limit, { key: "k" }),
        () => limiter.check(limit, { key: "k" }),
        () => limiter.transaction([{ name: limit, key: "k" }]),
        () => limiter.getServerTime(),
      ]) {
        await assert.rejects(call(), refusedAfterClose, label);
      }
    }
    if (redis !== undefined) {
      // The leased limit: its lease was given back at close, and no call took one again.
      const reader = new RateLimiter({ store: redis }, { [name]: config });
      const value = await reader.getValue(name, { key: "k" });
      assert.ok(value.value > 8.9, `the store holds ${value.value} of 10: a lease is still out`);
      await reader.close();
    }
  } finally {
    await server.stop();
  }
});

test("a transaction of 2,000 limits answers in process (its body is past the server's 64 KiB)", async () => {
  const names = Array.from({ length: 2_000 }, (_, i) => `${fresh("many")}-${i}`.padEnd(48, "x"));
  const limiter = new RateLimiter("memory", Object.fromEntries(names.map((n) => [n, { kind: "token bucket", rate: 1, period: MINUTE }])));
  const requests = names.map((name) => ({ name, key: "alice" }));
  assert.ok(JSON.stringify({ limits: requests }).length > 64 * 1024);
  const taken = await limiter.transaction(requests);
  assert.equal(taken.ok, true);
  assert.equal(taken.results.length, 2_000);
  assert.equal((await limiter.transaction(requests)).ok, false);
});
