// The client against the real server: every operation with its numbers, every error.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";

import {
  RateLimiter,
  RateLimitError,
  TollgateError,
  calculateRateLimit,
  isRateLimitError,
  DAY,
  MINUTE,
} from "../dist/index.js";
import { startServer } from "./server.mjs";

const CONFIG = `
[server]
tokens = ["full-token"]
readTokens = ["read-token"]

[limits.sendMessage]
kind = "token bucket"
rate = 10
period = 60000
capacity = 3

[limits.daily]
kind = "fixed window"
rate = 3
period = "1d"
start = 0
`;

// Named in code: travels inline with each call.
const inCode = {
  upload: { kind: "fixed window", rate: 5, period: DAY, start: 0 },
  burst: { kind: "token bucket", rate: 50, period: DAY, capacity: 50 },
};

let server;
let limiter;
let unique = 0;
/** A key no other test uses. */
const key = () => `k${++unique}-${Math.random()}`;

before(async () => {
  server = await startServer({ config: CONFIG });
  limiter = new RateLimiter({ url: server.url, token: "full-token" }, inCode);
});
after(() => server.stop());

/** Runs every operation against `limiter` with exact numbers. */
async function everyOperation(limiter) {
  // A token bucket of 3: three granted, the fourth refused with at most 6 s to wait.
  const alice = key();
  for (let i = 0; i < 3; i++) {
    assert.deepEqual(await limiter.limit("sendMessage", { key: alice }), { ok: true });
  }
  const refused = await limiter.limit("sendMessage", { key: alice });
  assert.equal(refused.ok, false);
  assert.ok(refused.retryAfter > 5_000 && refused.retryAfter <= 6_000, `${refused.retryAfter}`);
  // check takes nothing, and says the same.
  const checked = await limiter.check("sendMessage", { key: alice });
  assert.equal(checked.ok, false);
  // reset: full again.
  await limiter.reset("sendMessage", { key: alice });
  assert.deepEqual(await limiter.check("sendMessage", { key: alice, count: 3 }), { ok: true });

  // A fixed window aligned to midnight UTC: exact numbers, no refill within the test.
  const bob = key();
  assert.deepEqual(await limiter.limit("daily", { key: bob, count: 2 }), { ok: true });
  const before = await limiter.getServerTime();
  const value = await limiter.getValue("daily", { key: bob });
  const midnight = Math.floor(before / DAY) * DAY;
  assert.equal(value.value, 1);
  assert.equal(value.ts, midnight);
  assert.equal(value.shard, 0);
  assert.deepEqual(value.config, {
    kind: "fixed window",
    rate: 3,
    period: DAY,
    capacity: 3,
    shards: 1,
    start: 0,
  });
  // A reservation books tomorrow's tokens: granted, to be done at the next midnight.
  const reserved = await limiter.limit("daily", { key: bob, count: 2, reserve: true });
  const after = await limiter.getServerTime();
  assert.equal(reserved.ok, true);
  assert.ok(
    reserved.retryAfter <= midnight + DAY - before && reserved.retryAfter >= midnight + DAY - after,
    `${reserved.retryAfter}`,
  );
  assert.equal((await limiter.getValue("daily", { key: bob })).value, -1);

  // A config named in code travels with the call; a config in the call works for any name.
  const carol = key();
  assert.deepEqual(await limiter.limit("upload", { key: carol, count: 5 }), { ok: true });
  assert.equal((await limiter.limit("upload", { key: carol })).ok, false);
  assert.equal((await limiter.getValue("upload", { key: carol })).value, 0);
  const oneOff = { kind: "token bucket", rate: 1, period: DAY, capacity: 2 };
  assert.deepEqual(await limiter.limit("oneOff", { key: carol, config: oneOff }), { ok: true });
  assert.equal((await limiter.getValue("oneOff", { key: carol, config: oneOff })).config.capacity, 2);

  // A transaction is all or nothing.
  const dave = key();
  await limiter.limit("upload", { key: dave, count: 4 });
  const both = await limiter.transaction([
    { name: "daily", key: dave, count: 2 },
    { name: "upload", key: dave, count: 2 },
  ]);
  assert.equal(both.ok, false);
  assert.deepEqual(both.results[0], { ok: true });
  assert.equal(both.results[1].ok, false);
  assert.equal((await limiter.getValue("daily", { key: dave })).value, 3, "nothing taken");
  const granted = await limiter.transaction([
    { name: "daily", key: dave, count: 2 },
    { name: "upload", key: dave, count: 1 },
  ]);
  assert.deepEqual(granted, { ok: true, results: [{ ok: true }, { ok: true }] });
  assert.equal((await limiter.getValue("daily", { key: dave })).value, 1);

  // adjust: a cost settled after the work, signed, never refused, never above capacity.
  const erin = key();
  assert.deepEqual(await limiter.limit("daily", { key: erin, count: 2 }), { ok: true });
  assert.deepEqual(await limiter.adjust("daily", { key: erin, count: -1 }), { value: 2 });
  const debt = await limiter.adjust("daily", { key: erin, count: 4 });
  assert.equal(debt.value, -2);
  assert.ok(debt.retryAfter > 0 && debt.retryAfter <= DAY, `${debt.retryAfter}`);
  assert.equal((await limiter.limit("daily", { key: erin })).ok, false, "the debt comes first");
  assert.deepEqual(await limiter.adjust("daily", { key: erin, count: -10 }), { value: 3 });
  assert.deepEqual(await limiter.adjust("oneOff", { key: erin, count: 5, config: oneOff }), {
    value: -3,
    retryAfter: 3 * DAY,
  });
  await assert.rejects(limiter.adjust("daily", { key: erin, count: Number.NaN }), TypeError);
  assert.deepEqual(await limiter.adjust("daily", { key: erin, count: 0 }), { value: 3 });

  // The server's clock.
  const now = await limiter.getServerTime();
  assert.ok(Math.abs(now - Date.now()) < 5_000);
}

test("every operation, with the server's numbers (memory store)", async () => {
  await everyOperation(limiter);
});

test("every operation on the SQLite store", async () => {
  const sqlite = await startServer({ config: CONFIG, store: "sqlite://tollgate.db" });
  try {
    await everyOperation(new RateLimiter({ url: sqlite.url, token: "full-token" }, inCode));
  } finally {
    await sqlite.stop();
  }
});

test("throws: a refusal rejects with a RateLimitError", async () => {
  const k = key();
  await limiter.limit("daily", { key: k, count: 3 });
  const error = await limiter.limit("daily", { key: k, throws: true }).then(
    () => assert.fail("no error"),
    (e) => e,
  );
  assert.ok(error instanceof RateLimitError);
  assert.ok(isRateLimitError(error));
  assert.equal(error.kind, "RateLimited");
  assert.equal(error.name, "daily");
  assert.ok(error.retryAfter > 0 && error.retryAfter <= DAY);
  assert.ok(!(error instanceof TollgateError));
  // A reservation that must wait is no error.
  const reserved = await limiter.limit("daily", { key: k, reserve: true, throws: true });
  assert.equal(reserved.ok, true);
  assert.ok(reserved.retryAfter > 0);
});

/** The TollgateError a call rejects with. */
async function failure(promise) {
  const error = await promise.then(
    (v) => assert.fail(`no error: ${JSON.stringify(v)}`),
    (e) => e,
  );
  assert.ok(error instanceof TollgateError, `${error}`);
  return error;
}

test("errors: 400 names the field, 401, 403 for a read token, 404 for an unknown name", async () => {
  const bad = await failure(limiter.limit("sendMessage", { count: -1 }));
  assert.equal(bad.status, 400);
  assert.equal(bad.message, "Rate limit sendMessage count -1 must be a finite number >= 0.");
  assert.equal(bad.mayHaveTaken, false);
  const badConfig = await failure(
    limiter.limit("x", { config: { kind: "token bucket", rate: -1, period: MINUTE } }),
  );
  assert.equal(badConfig.status, 400);
  assert.match(badConfig.message, /rate is -1/);

  const wrong = new RateLimiter({ url: server.url, token: "wrong" });
  const unauthorized = await failure(wrong.limit("sendMessage"));
  assert.equal(unauthorized.status, 401);
  assert.equal(unauthorized.message, "wrong bearer token");
  const none = await failure(new RateLimiter({ url: server.url }).getServerTime());
  assert.equal(none.status, 401);

  // A read token reads; a write with it is 403, and takes nothing.
  const reader = new RateLimiter({ url: server.url, token: "read-token" });
  const k = key();
  assert.deepEqual(await reader.check("daily", { key: k, count: 3 }), { ok: true });
  assert.equal((await reader.getValue("daily", { key: k })).value, 3);
  assert.ok((await reader.getServerTime()) > 0);
  assert.equal((await reader.getServerLimits()).daily.rate, 3);
  for (const write of [
    () => reader.limit("daily", { key: k }),
    () => reader.reset("daily", { key: k }),
    () => reader.transaction([{ name: "daily", key: k }]),
    () => reader.adjust("daily", { key: k, count: 1 }),
  ]) {
    const forbidden = await failure(write());
    assert.equal(forbidden.status, 403);
    assert.match(forbidden.message, /^a read token may call \/v1\/value, \/v1\/check/);
  }
  assert.equal((await limiter.getValue("daily", { key: k })).value, 3);

  const unknown = await failure(limiter.limit("sendMesage"));
  assert.equal(unknown.status, 404);
  assert.match(unknown.message, /^Rate limit sendMesage not defined\./);
  // A name the server defines keeps its config.
  const override = await failure(limiter.limit("daily", { config: inCode.upload }));
  assert.equal(override.status, 400);
});

test("errors: 503 from a store that cannot be reached, with mayHaveTaken", async () => {
  const down = await startServer({ store: "redis://127.0.0.1:1" });
  try {
    const client = new RateLimiter({ url: down.url }, inCode);
    const error = await failure(client.limit("upload"));
    assert.equal(error.status, 503);
    assert.match(error.message, /cannot connect/);
    // Refused before anything was sent to the store: nothing can have been taken.
    assert.equal(error.mayHaveTaken, false);
  } finally {
    await down.stop();
  }
  // A store that may have applied the write says so; the client passes it on.
  const answer = { error: "the store did not answer in time", mayHaveTaken: true };
  const fake = async () => new Response(JSON.stringify(answer), { status: 503 });
  const error = await failure(new RateLimiter({ url: "http://127.0.0.1:9", fetch: fake }).limit("a", { config: inCode.upload }));
  assert.deepEqual([error.status, error.mayHaveTaken, error.message], [503, true, answer.error]);
});

test("errors: a timeout and a refused connection are TollgateErrors", async () => {
  // A server of our own that accepts connections and never answers.
  const sockets = [];
  const silent = createServer((socket) => sockets.push(socket));
  await new Promise((done) => silent.listen(0, "127.0.0.1", done));
  const port = silent.address().port;
  try {
    const client = new RateLimiter({ url: `http://127.0.0.1:${port}`, timeoutMs: 200 }, inCode);
    const started = Date.now();
    const late = await failure(client.limit("upload"));
    assert.ok(Date.now() - started < 2_000);
    assert.equal(late.status, undefined);
    assert.match(late.message, /^no answer from http:\/\/127\.0\.0\.1:\d+\/v1\/limit in time/);
    assert.equal(late.mayHaveTaken, true, "a write that went out may have been applied");
    const lateRead = await failure(client.check("upload"));
    assert.equal(lateRead.mayHaveTaken, false);
  } finally {
    sockets.forEach((s) => s.destroy());
    await new Promise((done) => silent.close(done));
  }
  // A port where nothing listens (bound, then closed).
  const closed = createServer();
  await new Promise((done) => closed.listen(0, "127.0.0.1", done));
  const free = closed.address().port;
  await new Promise((done) => closed.close(done));
  const refused = await failure(new RateLimiter({ url: `http://127.0.0.1:${free}` }, inCode).limit("upload"));
  assert.equal(refused.status, undefined);
  assert.match(refused.message, /ECONNREFUSED/);
  assert.equal(refused.mayHaveTaken, false);
});

test("200 concurrent calls against a limit of 50 admit exactly 50", async () => {
  const k = key();
  const answers = await Promise.all(
    Array.from({ length: 200 }, () => limiter.limit("burst", { key: k })),
  );
  assert.equal(answers.filter((a) => a.ok).length, 50);
  assert.equal(answers.filter((a) => !a.ok).length, 150);
});

test("a URL that is not http(s) is refused at once", () => {
  assert.throws(() => new RateLimiter({ url: "127.0.0.1:8787" }), /must be an http/);
});

test("limits named __proto__, constructor or prototype are names like any other", async () => {
  // Through a door that records each request's body: the config sent is the limit's own,
  // and a name not among the limits sends none (it was Object.prototype's, or Object).
  const bodies = [];
  const door = async (_method, _path, body) => {
    bodies.push(JSON.parse(body));
    return { status: 200, text: '{"ok": true}' };
  };
  const config = { kind: "token bucket", rate: 1, period: MINUTE };
  const limits = JSON.parse(`{"__proto__": ${JSON.stringify(config)}, "constructor": ${JSON.stringify(config)}}`);
  const limiter = new RateLimiter({ door }, limits);
  for (const name of ["__proto__", "constructor", "prototype", "toString"]) await limiter.limit(name);
  assert.deepEqual(bodies.map((b) => b.config), [config, config, undefined, undefined]);
  // A limiter without them sends no config for them (the server's own limit of that name).
  bodies.length = 0;
  const bare = new RateLimiter({ door });
  for (const name of ["__proto__", "constructor"]) await bare.limit(name);
  await bare.transaction([{ name: "__proto__" }]).catch(() => {});
  await bare.getValue("__proto__").catch(() => {});
  assert.deepEqual(bodies.map((b) => b.config ?? b.limits?.[0].config), [undefined, undefined, undefined, undefined]);
  assert.equal(Object.prototype.kind, undefined);
});

test("durations as the server writes them: a period of \"1m\", timeoutMs of \"10s\" and \"200ms\"", async () => {
  // In a config sent with the call, and in the client's own timeout.
  const client = new RateLimiter({ url: server.url, token: "full-token", timeoutMs: "10s" }, {
    perMinute: { kind: "token bucket", rate: 10, period: "1m", capacity: 1 },
  });
  const k = key();
  assert.deepEqual(await client.limit("perMinute", { key: k }), { ok: true });
  const refused = await client.limit("perMinute", { key: k });
  assert.ok(refused.retryAfter > 5_000 && refused.retryAfter <= 6_000, String(refused.retryAfter));
  const value = await client.getValue("perMinute", { key: k });
  assert.equal(value.config.period, 60_000);
  // calculateRateLimit reads "1m" as the server did.
  const local = calculateRateLimit(value, { kind: "token bucket", rate: 10, period: "1m", capacity: 1 }, value.ts);
  assert.equal(local.ok, false);
  assert.ok(Math.abs(local.retryAfter - 6_000) < 1, String(local.retryAfter));
  // "200ms" is 200 ms: a server that never answers fails the call then, not at once.
  const sockets = [];
  const silent = createServer((socket) => sockets.push(socket));
  await new Promise((done) => silent.listen(0, "127.0.0.1", done));
  try {
    const started = Date.now();
    await failure(new RateLimiter({ url: `http://127.0.0.1:${silent.address().port}`, timeoutMs: "200ms" }).getServerTime());
    const took = Date.now() - started;
    assert.ok(took >= 190 && took < 2_000, `${took} ms`);
  } finally {
    sockets.forEach((s) => s.destroy());
    await new Promise((done) => silent.close(done));
  }
  for (const timeoutMs of ["soon", "10", 0, -1, "2d", Number.NaN]) {
    assert.throws(() => new RateLimiter({ url: server.url, timeoutMs }), TypeError, String(timeoutMs));
  }
});
