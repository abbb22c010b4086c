// A concurrency limit in each framework's middleware (`concurrency`), through real HTTP
// requests to a real listening app: a slot acquired before the handler and released exactly
// once when the response is over, however it ends (sent, the handler's throw, the client gone,
// an answer sent early, a timeout); a refusal answered with its status and `Retry-After`; the
// order with the rate limits (a request the slot refuses takes no token, a request the rate
// limits refuse holds no slot). The handlers wait on gates the tests open, so that "at once"
// is a state the test sees, not a race it hopes to win.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { createServer, get as httpGet } from "node:http";
import { join } from "node:path";
import { test } from "node:test";

import { serve } from "@hono/node-server";
import timeout from "connect-timeout";
import express from "express";
import Fastify from "fastify";
import { Hono } from "hono";

import { HOUR, RateLimiter } from "../dist/index.js";
import { rateLimit } from "../dist/express.js";
import { rateLimitHook } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { startServer } from "../../../clients/js/test/server.mjs";
import { listening } from "./listening.mjs";
import { fresh } from "./stores.mjs";

const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

/** A point a handler waits at: `inside` resolves when it got there, `open()` lets it on. */
function gate() {
  let entered;
  let open;
  const inside = new Promise((resolve) => (entered = resolve));
  const opened = new Promise((resolve) => (open = resolve));
  return { inside, entered, opened, open };
}

/**
 * The routes each framework's app serves behind the middleware made of `options`:
 * `/wait` answers "done" once its gate (`gates.next`, taken as the handler starts) opens;
 * `/throw` throws; `/fast` answers at once.
 */
const apps = {
  async express(options, gates) {
    const app = express();
    const limited = rateLimit(options);
    app.get("/wait", limited, async (_req, res) => {
      const g = gates.take();
      g.entered();
      await g.opened;
      res.send("done");
    });
    app.get("/throw", limited, () => {
      throw new Error("the handler failed");
    });
    app.get("/fast", limited, (_req, res) => res.send("hello"));
    // The answer sent first, the work after it (as a handler that acknowledges, then works).
    app.get("/early", limited, async (_req, res) => {
      res.send("early");
      const g = gates.take();
      g.entered();
      await g.opened;
    });
    // Express's own answer of an error, quietly (its default logs each stack).
    app.use((error, _req, res, _next) => res.status(500).send(error.message));
    return listening(createServer(app));
  },
  async fastify(options, gates) {
    const app = Fastify();
    app.addHook("onRequest", rateLimitHook(options));
    app.get("/wait", async () => {
      const g = gates.take();
      g.entered();
      await g.opened;
      return "done";
    });
    app.get("/throw", async () => {
      throw new Error("the handler failed");
    });
    app.get("/fast", async () => "hello");
    const url = await app.listen({ port: 0, host: "127.0.0.1" });
    return { url, close: () => app.close() };
  },
  async hono(options, gates) {
    const app = new Hono();
    app.use("*", rateLimiter(options));
    app.get("/wait", async (c) => {
      const g = gates.take();
      g.entered();
      await g.opened;
      return c.text("done");
    });
    app.get("/throw", () => {
      throw new Error("the handler failed");
    });
    app.get("/fast", (c) => c.text("hello"));
    app.onError((error, c) => c.text(error.message, 500));
    return new Promise((resolve) => {
      const server = serve({ fetch: app.fetch, port: 0, hostname: "127.0.0.1" }, (info) => {
        resolve({ url: `http://127.0.0.1:${info.port}`, close: () => new Promise((done) => server.close(done)) });
      });
    });
  },
};

/** The gates of an app's handlers, in the order they start. */
function gates() {
  const made = [];
  let taken = 0;
  return {
    /** The gate of the next handler to start (made now if the test has not asked for it). */
    take: () => (made[taken] ??= gate(), made[taken++]),
    /** The gate of the `i`th handler to start (0 the first). */
    at: (i) => (made[i] ??= gate()),
    /** How many handlers started. */
    get started() {
      return taken;
    },
  };
}

/** Counts `limiter.release`'s calls and their answers (true: the slot was held). */
function releases(limiter) {
  const calls = [];
  const release = limiter.release.bind(limiter);
  limiter.release = (...args) => {
    const answer = release(...args);
    calls.push(answer);
    return answer;
  };
  return {
    get count() {
      return calls.length;
    },
    /** The answers, once `n` calls were made (waiting up to 2 s for the last). */
    async answers(n) {
      for (let i = 0; i < 200 && calls.length < n; i++) await sleep(10);
      // Time for a second call, if the guard failed (`close` comes after `finish`).
      await sleep(50);
      return Promise.all(calls);
    },
  };
}

/** Makes `limiter`'s acquires answer 200 ms late (a slow store); resolves when the first
 *  one starts. */
function slowAcquires(limiter) {
  const acquire = limiter.acquire.bind(limiter);
  let started;
  const starting = new Promise((resolve) => (started = resolve));
  limiter.acquire = async (...args) => {
    started();
    await sleep(200);
    return acquire(...args);
  };
  return starting;
}

async function get(url, headers = {}) {
  const response = await fetch(url, { headers });
  return { status: response.status, headers: response.headers, body: await response.text() };
}

const user = { "x-user": "alice" };

/** A limiter with a rate limit that admits 3 (refilled one an hour: a test never sees it)
 *  and a concurrency limit of 1 slot held up to 30 s. */
function limiterOf(store = "memory", { capacity = 3 } = {}) {
  const rate = fresh("perUser");
  const slots = fresh("inFlight");
  const limiter = new RateLimiter(store, {
    [rate]: { kind: "token bucket", rate: 1, period: HOUR, capacity },
    [slots]: { kind: "concurrency", max: 1, ttl: "30s" },
  });
  return { limiter, rate, slots };
}

/** The rate limit's tokens left for alice, down to whole ones. */
async function tokens(limiter, rate) {
  return Math.floor((await limiter.getValue(rate, { key: "alice" })).value);
}

async function inFlight(limiter, slots) {
  return (await limiter.getSlotsValue(slots, { key: "alice" })).inFlight;
}

/** A second request while the first holds the one slot: refused with `status` and
 *  Retry-After, taking no token; the first's slot released once, when its response ended. */
async function refusedWhileHeld(framework, limiter, rate, slots, status) {
  const held = gates();
  const options = { limiter, limits: rate, concurrency: slots, key: { header: "x-user" } };
  const app = await apps[framework](status === 429 ? options : { ...options, concurrencyStatusCode: status }, held);
  const released = releases(limiter);
  try {
    const first = get(`${app.url}/wait`, user);
    await held.at(0).inside;
    assert.deepEqual(await limiter.getSlotsValue(slots, { key: "alice" }), { inFlight: 1, max: 1, holders: 1 });
    assert.equal(await tokens(limiter, rate), 2);

    const second = await get(`${app.url}/fast`, user);
    assert.equal(second.status, status, second.body);
    assert.equal(second.headers.get("retry-after"), "30");
    assert.match(second.headers.get("content-type"), /application\/json/);
    const body = JSON.parse(second.body);
    assert.equal(body.kind, "RateLimited");
    assert.equal(body.name, slots);
    assert.ok(body.retryAfter > 29_000 && body.retryAfter <= 30_000, String(body.retryAfter));
    // Refused by the slot: no RateLimit fields (no limit was taken), no token taken.
    assert.equal(second.headers.get("ratelimit"), null);
    assert.equal(await tokens(limiter, rate), 2);
    assert.equal(released.count, 0);

    held.at(0).open();
    const done = await first;
    assert.equal(done.status, 200);
    assert.equal(done.body, "done");
    assert.equal(done.headers.get("ratelimit"), `"${rate}";r=2;t=3600`);
    assert.deepEqual(await released.answers(1), [true]);
    assert.deepEqual(await limiter.getSlotsValue(slots, { key: "alice" }), { inFlight: 0, max: 1, holders: 0 });
    // Free again: the next request holds it, and lets it go.
    assert.equal((await get(`${app.url}/fast`, user)).status, 200);
    assert.deepEqual(await released.answers(2), [true, true]);
    assert.equal(await inFlight(limiter, slots), 0);
    assert.equal(await tokens(limiter, rate), 1);
  } finally {
    await app.close();
  }
}

for (const framework of Object.keys(apps)) {
  test(`${framework}: max 1, a second request at once refused 503 (concurrencyStatusCode) with Retry-After, no token taken`, async () => {
    const { limiter, rate, slots } = limiterOf();
    await refusedWhileHeld(framework, limiter, rate, slots, 503);
  });

  test(`${framework}: over a server's client, refused 429 by default`, async () => {
    const rate = fresh("perUser");
    const slots = fresh("inFlight");
    const server = await startServer({
      config:
        `[limits.${rate}]\nkind = "token bucket"\nrate = 1\nperiod = "1h"\ncapacity = 3\n` +
        `[limits.${slots}]\nkind = "concurrency"\nmax = 1\nttl = "30s"\n`,
    });
    try {
      await refusedWhileHeld(framework, new RateLimiter({ url: server.url }), rate, slots, 429);
    } finally {
      await server.stop();
    }
  });

  test(`${framework}: the handler throws, its slot is released once`, async () => {
    const { limiter, rate, slots } = limiterOf();
    const app = await apps[framework]({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } }, gates());
    const released = releases(limiter);
    try {
      const answer = await get(`${app.url}/throw`, user);
      assert.equal(answer.status, 500);
      assert.deepEqual(await released.answers(1), [true]);
      assert.equal(await inFlight(limiter, slots), 0);
      assert.equal((await get(`${app.url}/fast`, user)).status, 200);
    } finally {
      await app.close();
    }
  });

  test(`${framework}: the client gone mid-request, its slot is released once`, async () => {
    const { limiter, rate, slots } = limiterOf();
    const held = gates();
    const app = await apps[framework]({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } }, held);
    const released = releases(limiter);
    try {
      const request = httpGet(`${app.url}/wait`, { headers: user });
      const gone = new Promise((resolve) => request.once("error", resolve));
      await held.at(0).inside;
      assert.equal(await inFlight(limiter, slots), 1);
      request.destroy();
      await gone;
      if (framework === "hono") {
        // Released when the handlers are done (Hono has no event of a response's end): held
        // while the handler still waits.
        await sleep(100);
        assert.equal(released.count, 0);
        assert.equal(await inFlight(limiter, slots), 1);
        held.at(0).open();
      } else {
        // Released at the response's `close`, the handler still waiting.
        assert.deepEqual(await released.answers(1), [true]);
        assert.equal(await inFlight(limiter, slots), 0);
        held.at(0).open();
        // The handler answers a connection that is gone: nothing breaks, nothing more released.
        await sleep(50);
      }
      assert.deepEqual(await released.answers(1), [true]);
      assert.equal(await inFlight(limiter, slots), 0);
      assert.equal((await get(`${app.url}/fast`, user)).status, 200);
    } finally {
      await app.close();
    }
  });

  test(`${framework}: refused by the rate limit, the slot is released before the answer`, async () => {
    const { limiter, rate, slots } = limiterOf("memory", { capacity: 1 });
    const app = await apps[framework]({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } }, gates());
    const released = releases(limiter);
    try {
      assert.equal((await get(`${app.url}/fast`, user)).status, 200);
      assert.deepEqual(await released.answers(1), [true]);
      const refused = await get(`${app.url}/fast`, user);
      assert.equal(refused.status, 429);
      assert.equal(JSON.parse(refused.body).name, rate);
      assert.equal(refused.headers.get("ratelimit"), `"${rate}";r=0;t=3600`);
      // Called before the 429 was written.
      assert.equal(released.count, 2);
      assert.deepEqual(await released.answers(2), [true, true]);
      assert.deepEqual(await limiter.getSlotsValue(slots, { key: "alice" }), { inFlight: 0, max: 1, holders: 0 });
      assert.equal(await tokens(limiter, rate), 0);
    } finally {
      await app.close();
    }
  });

  test(`${framework}: a concurrency limit alone, per key; a skipped request holds no slot`, async () => {
    const { limiter, slots } = limiterOf();
    const held = gates();
    const skip = (request) => (framework === "hono" ? request.req.header("x-skip") : request.headers["x-skip"]) !== undefined;
    const app = await apps[framework]({ limiter, concurrency: slots, key: { header: "x-user" }, skip }, held);
    try {
      const first = get(`${app.url}/wait`, user);
      await held.at(0).inside;
      const refused = await get(`${app.url}/fast`, user);
      assert.equal(refused.status, 429);
      assert.equal(refused.headers.get("retry-after"), "30");
      // Another key has its own slot; a skipped request takes none.
      const bob = await get(`${app.url}/fast`, { "x-user": "bob" });
      assert.equal(bob.status, 200);
      assert.equal(bob.headers.get("ratelimit"), null);
      assert.equal(bob.headers.get("ratelimit-policy"), null);
      assert.equal((await get(`${app.url}/fast`, { ...user, "x-skip": "1" })).status, 200);
      assert.equal(await inFlight(limiter, slots), 1);
      held.at(0).open();
      assert.equal((await first).status, 200);
    } finally {
      await app.close();
    }
  });
}

test("express: an answer sent before the handler's work ends releases at finish", async () => {
  const { limiter, rate, slots } = limiterOf();
  const held = gates();
  const app = await apps.express({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } }, held);
  const released = releases(limiter);
  try {
    const early = await get(`${app.url}/early`, user);
    assert.equal(early.status, 200);
    assert.equal(early.body, "early");
    await held.at(0).inside;
    assert.deepEqual(await released.answers(1), [true]);
    assert.equal(await inFlight(limiter, slots), 0);
    held.at(0).open();
    await sleep(50);
    assert.equal(released.count, 1);
    assert.equal((await get(`${app.url}/fast`, user)).status, 200);
    assert.deepEqual(await released.answers(2), [true, true]);
  } finally {
    await app.close();
  }
});

test("express: a timeout's answer releases the slot; so does one sent while the slot was acquired", async () => {
  const { limiter, rate, slots } = limiterOf();
  const held = gates();
  const app = express();
  app.use(timeout("100ms"));
  const limited = rateLimit({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } });
  app.get("/wait", limited, async (_req, res) => {
    const g = held.take();
    g.entered();
    await g.opened;
    if (!res.headersSent) res.send("done");
  });
  app.use((error, _req, res, _next) => res.status(503).send(error.message));
  const server = await listening(createServer(app));
  const released = releases(limiter);
  try {
    // The handler waits past the timeout: its 503 ends the response, and frees the slot.
    const late = await get(`${server.url}/wait`, user);
    assert.equal(late.status, 503);
    assert.match(late.body, /timeout/i);
    assert.deepEqual(await released.answers(1), [true]);
    assert.equal(await inFlight(limiter, slots), 0);
    held.at(0).open();

    // The acquire answers after the timeout answered (a slow store): the slot is released
    // at once, and the handler never runs.
    slowAcquires(limiter);
    const slow = await get(`${server.url}/wait`, user);
    assert.equal(slow.status, 503);
    assert.deepEqual(await released.answers(2), [true, true]);
    await sleep(300);
    assert.equal(released.count, 2);
    assert.equal(await inFlight(limiter, slots), 0);
    assert.equal(held.started, 1);
  } finally {
    await server.close();
  }
});

test("fastify: a client gone while the slot was acquired: released at once", async () => {
  const { limiter, rate, slots } = limiterOf();
  const held = gates();
  const app = await apps.fastify({ limiter, limits: rate, concurrency: slots, key: { header: "x-user" } }, held);
  const released = releases(limiter);
  const acquiring = slowAcquires(limiter);
  try {
    const request = httpGet(`${app.url}/wait`, { headers: user });
    request.once("error", () => {});
    await acquiring;
    request.destroy();
    assert.deepEqual(await released.answers(1), [true]);
    assert.equal(await inFlight(limiter, slots), 0);
  } finally {
    await app.close();
  }
});

test("a store that fails the acquire: 503, or with passOnStoreError the request passes untouched", async () => {
  const slots = fresh("inFlight");
  const rate = fresh("perUser");
  const down = new RateLimiter({ store: "redis://127.0.0.1:1" }, {
    [rate]: { kind: "token bucket", rate: 1, period: HOUR, capacity: 3 },
    [slots]: { kind: "concurrency", max: 1 },
  });
  const released = releases(down);
  const told = [];
  for (const framework of Object.keys(apps)) {
    const base = { limiter: down, limits: rate, concurrency: slots, key: { header: "x-user" }, onStoreError: (e) => told.push(e) };
    const closed = await apps[framework](base, gates());
    const open = await apps[framework]({ ...base, passOnStoreError: true }, gates());
    try {
      const refused = await get(`${closed.url}/fast`, user);
      assert.equal(refused.status, 503, `${framework}: ${refused.body}`);
      assert.deepEqual(JSON.parse(refused.body), { error: "rate limit store unavailable", mayHaveTaken: false });
      const passed = await get(`${open.url}/fast`, user);
      assert.equal(passed.status, 200, framework);
      assert.equal(passed.body, "hello");
    } finally {
      await closed.close();
      await open.close();
    }
  }
  // One failure told per request (the acquire's: the limits were not taken after it), and
  // nothing to release.
  assert.equal(told.length, 6);
  assert.equal(released.count, 0);
});

test("concurrency's options are checked when the middleware is made", () => {
  const { limiter, rate, slots } = limiterOf();
  const made = (options) => () => rateLimit({ limiter, ...options });
  assert.throws(made({ limits: rate, concurrency: "nowhere" }), /concurrency: "nowhere" is not a limit of the limiter; its concurrency limits are "inFlight/);
  assert.throws(made({ concurrency: rate }), /is a rate limit \(give it in limits\)/);
  assert.throws(made({ concurrency: { name: slots, count: 2 } }), /count is 2, more than its max \(1\)/);
  assert.throws(made({ concurrency: { name: slots, count: 0 } }), /count must be a whole number of slots, at least 1/);
  assert.throws(made({ concurrency: { name: slots, ttl: "soon" } }), /ttl must be milliseconds/);
  assert.throws(made({ concurrency: { name: slots, ttl: 0 } }), /ttl must be more than 0 ms/);
  assert.throws(made({ concurrency: 7 }), /concurrency must be a concurrency limit's name/);
  assert.throws(made({}), /give limits \(rate limits' names\), concurrency \(a concurrency limit's name\), or both/);
  assert.throws(made({ limits: rate, concurrencyStatusCode: 503 }), /give concurrency too/);
  assert.throws(made({ limits: rate, concurrency: slots, concurrencyStatusCode: 1000 }), /concurrencyStatusCode must be an HTTP status/);
  assert.throws(() => rateLimitHook({ limiter, concurrency: "nowhere" }), TypeError);
  assert.throws(() => rateLimiter({ limiter, concurrency: "nowhere" }), TypeError);
  // Well made: a name, or { name, count, ttl }.
  rateLimit({ limiter, concurrency: { name: slots, count: 1, ttl: "2m" } });
  rateLimit({ limiter, limits: rate, concurrency: slots, concurrencyStatusCode: 503 });
});

test("express: { name, ttl } holds the slot that long; a concurrency limit the server does not define is 500, said once", async () => {
  const { limiter, rate, slots } = limiterOf();
  const held = gates();
  const app = await apps.express({ limiter, limits: rate, concurrency: { name: slots, ttl: "5s" }, key: { header: "x-user" } }, held);
  try {
    const first = get(`${app.url}/wait`, user);
    await held.at(0).inside;
    const refused = await get(`${app.url}/fast`, user);
    assert.equal(refused.status, 429);
    assert.equal(refused.headers.get("retry-after"), "5");
    // Without any header set (standardHeaders: false), no Retry-After, as for the limits'
    // refusals (and express-rate-limit's).
    const bare = await apps.express({ limiter, concurrency: slots, key: { header: "x-user" }, standardHeaders: false }, gates());
    try {
      const quiet = await get(`${bare.url}/fast`, user);
      assert.equal(quiet.status, 429);
      assert.equal(quiet.headers.get("retry-after"), null);
    } finally {
      await bare.close();
    }
    held.at(0).open();
    assert.equal((await first).status, 200);
  } finally {
    await app.close();
  }

  const server = await startServer({ config: `[limits.${rate}]\nkind = "token bucket"\nrate = 1\nperiod = "1h"\n` });
  const errors = [];
  const error = console.error;
  console.error = (line) => errors.push(String(line));
  try {
    const remote = await apps.express({ limiter: new RateLimiter({ url: server.url }), limits: rate, concurrency: slots, key: { header: "x-user" } }, gates());
    try {
      for (let i = 0; i < 2; i++) {
        const answer = await get(`${remote.url}/fast`, user);
        assert.equal(answer.status, 500);
        assert.deepEqual(JSON.parse(answer.body), { error: `Concurrency limit ${slots} is not defined.` });
      }
    } finally {
      await remote.close();
    }
  } finally {
    console.error = error;
    await server.stop();
  }
  assert.equal(errors.length, 1, errors.join("\n"));
  // Said when the server's limits were read (with those it defines), or at the first
  // request that named it, whichever came first.
  assert.match(errors[0], new RegExp(`concurrency limit "${slots}" is not defined by the limiter`));
});

// A concurrency limit named in `limits` (not `concurrency`): a transaction would acquire its
// slot per request, and the middleware, holding no ticket, would never release it: the slots
// would leak until their ttl, and the limit then refuse everyone. An error instead.

test("a concurrency limit in limits, in process: a TypeError when the middleware is made", () => {
  const { limiter, rate, slots } = limiterOf();
  const said = new RegExp(`^TypeError: limits: "${slots}" is a concurrency limit: give it as \`concurrency\`, not in \`limits\`$`);
  for (const limits of [slots, [rate, slots], { name: slots, count: 1 }]) {
    assert.throws(() => rateLimit({ limiter, limits }), said);
    assert.throws(() => rateLimit({ limiter, limits, concurrency: slots }), said);
    assert.throws(() => rateLimitHook({ limiter, limits }), said);
    assert.throws(() => rateLimiter({ limiter, limits }), said);
  }
});

/** `console.error`'s lines while `body` runs. */
async function errorsOf(body) {
  const errors = [];
  const error = console.error;
  console.error = (line) => errors.push(String(line));
  try {
    await body();
  } finally {
    console.error = error;
  }
  return errors;
}

/** The slots alice holds of `slots`, once the releases sent have landed (up to 2 s). */
async function settledInFlight(limiter, slots) {
  let held = await inFlight(limiter, slots);
  for (let i = 0; i < 200 && held > 0; i++) {
    await sleep(10);
    held = await inFlight(limiter, slots);
  }
  return held;
}

const misplaced = (slots) => new RegExp(`^tollgate: the rate limit middleware takes "${slots}" in limits, which is a concurrency limit of the limiter: its requests are answered 500`);

/** A server's config: the rate limit `rate`, and `slots` as a concurrency limit of `max` 2
 *  (or, `slotsKind: "rate"`, as a token bucket). */
function configOf(rate, slots, slotsKind = "concurrency") {
  return (
    `[limits.${rate}]\nkind = "token bucket"\nrate = 1\nperiod = "1h"\ncapacity = 100\n` +
    (slotsKind === "concurrency"
      ? `[limits.${slots}]\nkind = "concurrency"\nmax = 2\nttl = "30s"\n`
      : `[limits.${slots}]\nkind = "token bucket"\nrate = 1\nperiod = "1h"\ncapacity = 100\n`)
  );
}

test("a concurrency limit in limits, over a server: each request 500, said once, no slot held", async () => {
  const rate = fresh("perUser");
  const slots = fresh("inFlight");
  const server = await startServer({ config: configOf(rate, slots) });
  const limiter = new RateLimiter({ url: server.url });
  try {
    for (const framework of Object.keys(apps)) {
      const errors = await errorsOf(async () => {
        const app = await apps[framework]({ limiter, limits: [rate, slots], key: { header: "x-user" } }, gates());
        try {
          // More requests than the limit's max: none is refused for slots held by the others.
          for (let i = 0; i < 4; i++) {
            const answer = await get(`${app.url}/fast`, user);
            assert.equal(answer.status, 500, `${framework}: ${answer.body}`);
            assert.deepEqual(JSON.parse(answer.body), { error: `Concurrency limit ${slots} is given as a rate limit.` });
          }
        } finally {
          await app.close();
        }
      });
      assert.equal(errors.length, 1, `${framework}: ${errors.join("\n")}`);
      assert.match(errors[0], misplaced(slots));
      assert.equal(await settledInFlight(limiter, slots), 0, framework);
    }
    // Nothing taken of the rate limit either.
    assert.equal(await tokens(limiter, rate), 100);
  } finally {
    await server.stop();
  }
});

test("a concurrency limit in limits, over a server whose limits are not read first: each slot a transaction acquired released at once, 500, said once", async () => {
  const rate = fresh("perUser");
  const slots = fresh("inFlight");
  const server = await startServer({ config: configOf(rate, slots) });
  const limiter = new RateLimiter({ url: server.url });
  // A limiter whose limits cannot be read: the transaction is the first to say it.
  limiter.getServerLimits = undefined;
  const released = releases(limiter);
  try {
    const errors = await errorsOf(async () => {
      const app = await apps.express({ limiter, limits: [rate, slots], key: { header: "x-user" } }, gates());
      try {
        for (let i = 0; i < 3; i++) {
          const answer = await get(`${app.url}/fast`, user);
          assert.equal(answer.status, 500, answer.body);
          assert.deepEqual(JSON.parse(answer.body), { error: `Concurrency limit ${slots} is given as a rate limit.` });
        }
        // Again after the second a failed check holds: a transaction, its slot released.
        await sleep(1_100);
        assert.equal((await get(`${app.url}/fast`, user)).status, 500);
      } finally {
        await app.close();
      }
    });
    assert.equal(errors.length, 1, errors.join("\n"));
    assert.match(errors[0], misplaced(slots));
    // One transaction at the first request, one after the second: each slot let go.
    assert.deepEqual(await released.answers(2), [true, true]);
    assert.equal(await settledInFlight(limiter, slots), 0);
  } finally {
    await server.stop();
  }
});

test("a rate limit a server's reload makes a concurrency limit: the slot its transaction acquired released at once, 500, said once", async () => {
  const rate = fresh("perUser");
  const slots = fresh("inFlight");
  const server = await startServer({ config: configOf(rate, slots, "rate") });
  const limiter = new RateLimiter({ url: server.url });
  const released = releases(limiter);
  try {
    const errors = await errorsOf(async () => {
      const app = await apps.express({ limiter, limits: [rate, slots], key: { header: "x-user" } }, gates());
      try {
        assert.equal((await get(`${app.url}/fast`, user)).status, 200);
        writeFileSync(join(server.dir, "tollgate.toml"), configOf(rate, slots));
        process.kill(server.pid, "SIGHUP");
        for (let i = 0; i < 200 && (await limiter.getServerLimits())[slots]?.kind !== "concurrency"; i++) await sleep(10);
        for (let i = 0; i < 3; i++) {
          const answer = await get(`${app.url}/fast`, user);
          assert.equal(answer.status, 500, answer.body);
        }
      } finally {
        await app.close();
      }
    });
    assert.equal(errors.length, 1, errors.join("\n"));
    assert.match(errors[0], misplaced(slots));
    assert.deepEqual(await released.answers(1), [true]);
    assert.equal(await settledInFlight(limiter, slots), 0);
  } finally {
    await server.stop();
  }
});
