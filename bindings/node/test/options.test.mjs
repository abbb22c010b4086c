// The options of express-rate-limit 8, @fastify/rate-limit 11 and hono-rate-limiter under
// their names, each through real HTTP requests to a real listening app of each framework
// where the option exists: skip, allowList, handler / message / statusCode,
// requestPropertyName, standardHeaders (drafts 6, 7 and 8 beside express-rate-limit's own),
// legacyHeaders, passOnStoreError, skipFailedRequests / skipSuccessfulRequests (exact under
// concurrency), Hono's trustProxy, Express's proxy warnings, Fastify's per-route limits, and
// TollgateStore with every option express-rate-limit hands a store.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { serve } from "@hono/node-server";
import express from "express";
import { rateLimit as expressRateLimit } from "express-rate-limit";
import Fastify from "fastify";
import { Hono } from "hono";

import { MINUTE, RateLimiter } from "../dist/index.js";
import { TollgateStore, rateLimit } from "../dist/express.js";
import { rateLimitHook, rateLimitPlugin } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { listening } from "./listening.mjs";
import { fresh } from "./stores.mjs";

/**
 * An app of `framework` with the middleware of `options` on every route: `/` answers "hello",
 * `/fail` 500, `/info` the decision the handler sees (as JSON), `/health` "ok".
 */
const apps = {
  async express(options) {
    const app = express();
    app.use(rateLimit(options));
    app.get("/", (_req, res) => res.send("hello"));
    app.get("/fail", (_req, res) => res.status(500).send("failed"));
    app.get("/info", (req, res) => res.json(req[options.requestPropertyName ?? "rateLimit"]));
    app.get("/health", (_req, res) => res.send("ok"));
    return listening(createServer(app));
  },
  async fastify(options) {
    const app = Fastify();
    app.addHook("onRequest", rateLimitHook(options));
    app.get("/", async () => "hello");
    app.get("/fail", async (_req, reply) => reply.code(500).send("failed"));
    app.get("/info", async (req) => req[options.requestPropertyName ?? "rateLimit"]);
    app.get("/health", async () => "ok");
    const url = await app.listen({ port: 0, host: "127.0.0.1" });
    return { url, close: () => app.close() };
  },
  async hono(options) {
    const app = new Hono();
    app.use("*", rateLimiter(options));
    app.get("/", (c) => c.text("hello"));
    app.get("/fail", (c) => c.text("failed", 500));
    app.get("/info", (c) => c.json(c.get(options.requestPropertyName ?? "rateLimit")));
    app.get("/health", (c) => c.text("ok"));
    return new Promise((resolve) => {
      const server = serve({ fetch: app.fetch, port: 0, hostname: "127.0.0.1" }, (info) => {
        resolve({ url: `http://127.0.0.1:${info.port}`, close: () => new Promise((done) => server.close(done)) });
      });
    });
  },
};
const frameworks = Object.keys(apps);

async function get(url, headers = {}) {
  const response = await fetch(url, { headers });
  return { status: response.status, headers: response.headers, body: await response.text() };
}

/** A fixed window of `rate` a minute that starts now: no test ends one by chance. */
function windowConfig(rate) {
  return { kind: "fixed window", rate, period: MINUTE, start: Date.now() };
}

/** A limiter with one fixed window of `rate` a minute, and its name. */
function windowOf(rate, prefix) {
  const name = fresh(prefix);
  return { name, limiter: new RateLimiter("memory", { [name]: windowConfig(rate) }) };
}

/** Runs `body(app)` with an app of `framework` made of `options`, then closes it. */
async function withApp(framework, options, body) {
  const app = await apps[framework](options);
  try {
    await body(app);
  } finally {
    await app.close();
  }
}

const alice = { "x-user": "alice" };

/** Waits (a bounded while) until `name`'s limit for `key` has `value` tokens: a give-back is
 *  made after the response is sent. */
async function tokensBack(limiter, name, key, value) {
  let seen;
  for (let i = 0; i < 200; i++) {
    seen = (await limiter.getValue(name, { key })).value;
    if (seen === value) return;
    await new Promise((r) => setTimeout(r, 10));
  }
  assert.fail(`${name} ${key}: ${seen} tokens, not ${value}`);
}

for (const framework of frameworks) {
  test(`${framework}: skip passes a request untouched: nothing taken, no field written`, async () => {
    const { name, limiter } = windowOf(1, "skip");
    const skip = (req) => (req.url ?? req.req?.url ?? "").endsWith("/health");
    await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, skip }, async (app) => {
      for (let i = 0; i < 3; i++) {
        const health = await get(`${app.url}/health`, alice);
        assert.equal(health.status, 200);
        assert.equal(health.headers.get("ratelimit"), null);
      }
      assert.equal((await get(`${app.url}/`, alice)).status, 200);
      assert.equal((await get(`${app.url}/`, alice)).status, 429);
    });
  });

  test(`${framework}: statusCode and message (a string, an object, a function), and handler`, async () => {
    for (const [message, type, body] of [
      ["Too many requests, please try again later.", /text\/plain/, "Too many requests, please try again later."],
      [{ error: "slow down" }, /application\/json/, '{"error":"slow down"}'],
      [(req) => `no more for ${req.get?.("x-user") ?? req.headers?.["x-user"] ?? req.req.header("x-user")}`, /text\/plain/, "no more for alice"],
    ]) {
      const { name, limiter } = windowOf(1, "msg");
      await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, statusCode: 503, message }, async (app) => {
        await get(`${app.url}/`, alice);
        const refused = await get(`${app.url}/`, alice);
        assert.equal(refused.status, 503);
        assert.match(refused.headers.get("content-type"), type);
        assert.equal(refused.body, body);
        assert.match(refused.headers.get("retry-after"), /^\d+$/);
      });
    }
    const { name, limiter } = windowOf(1, "handler");
    const handler = {
      express: (_req, res, _next, info) => res.status(418).json({ mine: true, remaining: info.remaining }),
      fastify: (_req, reply, info) => reply.code(418).send({ mine: true, remaining: info.remaining }),
      hono: (c, _next, info) => c.json({ mine: true, remaining: info.remaining }, 418),
    }[framework];
    await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, handler }, async (app) => {
      await get(`${app.url}/`, alice);
      const refused = await get(`${app.url}/`, alice);
      assert.equal(refused.status, 418);
      assert.deepEqual(JSON.parse(refused.body), { mine: true, remaining: 0 });
      assert.ok(refused.headers.get("ratelimit"), "the fields are written before the handler");
    });
  });

  test(`${framework}: the decision for handlers, under requestPropertyName`, async () => {
    const { name, limiter } = windowOf(5, "info");
    for (const requestPropertyName of [undefined, "quota"]) {
      await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, requestPropertyName }, async (app) => {
        const before = Date.now();
        const info = JSON.parse((await get(`${app.url}/info`, { "x-user": `u${requestPropertyName}` })).body);
        assert.equal(info.limit, 5);
        assert.equal(info.used, 1);
        assert.equal(info.remaining, 4);
        assert.equal(info.key, `u${requestPropertyName}`);
        const reset = Date.parse(info.resetTime);
        assert.ok(reset > before && reset <= before + MINUTE + 1_000, info.resetTime);
        assert.deepEqual(info.limits.map((l) => [l.name, l.limit, l.remaining, l.window]), [[name, 5, 4, MINUTE]]);
      });
    }
  });

  test(`${framework}: standardHeaders and legacyHeaders`, async () => {
    const cases = [
      [true, { "ratelimit-policy": "3;w=60", "ratelimit-limit": "3", "ratelimit-remaining": "2", "ratelimit-reset": /^\d+$/, ratelimit: null }],
      ["draft-6", { "ratelimit-policy": "3;w=60", "ratelimit-limit": "3", "ratelimit-remaining": "2", "ratelimit-reset": /^\d+$/ }],
      ["draft-7", { "ratelimit-policy": "3;w=60", ratelimit: /^limit=3, remaining=2, reset=\d+$/, "ratelimit-limit": null }],
      ["draft-8", { "ratelimit-policy": /^"N"; q=3; w=60; pk=:[A-Za-z0-9+/=]+:$/, ratelimit: /^"N"; r=2; t=\d+$/ }],
      [false, { "ratelimit-policy": null, ratelimit: null }],
    ];
    for (const [standardHeaders, expected] of cases) {
      for (const legacyHeaders of [false, true]) {
        const { name, limiter } = windowOf(3, "headers");
        await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, standardHeaders, legacyHeaders }, async (app) => {
          const answer = await get(`${app.url}/`, alice);
          for (const [field, value] of Object.entries(expected)) {
            const got = answer.headers.get(field);
            const want = typeof value === "string" ? value.replace('"N"', `"${name}"`) : value;
            if (want instanceof RegExp) assert.match(got ?? "", new RegExp(want.source.replace('"N"', `"${name}"`)), `${standardHeaders} ${field}`);
            else assert.equal(got, want, `${standardHeaders} ${field}`);
          }
          if (legacyHeaders) {
            assert.equal(answer.headers.get("x-ratelimit-limit"), "3");
            assert.equal(answer.headers.get("x-ratelimit-remaining"), "2");
            const reset = Number(answer.headers.get("x-ratelimit-reset"));
            assert.ok(reset * 1_000 > Date.now() - 1_000 && reset * 1_000 <= Date.now() + MINUTE + 1_000, String(reset));
          } else {
            assert.equal(answer.headers.get("x-ratelimit-limit"), null);
          }
          await get(`${app.url}/`, alice);
          await get(`${app.url}/`, alice);
          const refused = await get(`${app.url}/`, alice);
          assert.equal(refused.status, 429);
          assert.equal(refused.headers.get("retry-after") !== null, standardHeaders !== false || legacyHeaders);
        });
      }
    }
  });

  test(`${framework}: passOnStoreError lets requests pass while the store fails, and tells onStoreError`, async () => {
    const name = fresh("down");
    const limiter = new RateLimiter({ store: "redis://127.0.0.1:1" }, { [name]: { kind: "fixed window", rate: 1, period: MINUTE } });
    const told = [];
    const options = { limiter, limits: name, key: { header: "x-user" }, onStoreError: (e) => told.push(e.message) };
    await withApp(framework, { ...options, passOnStoreError: true }, async (app) => {
      const answer = await get(`${app.url}/`, alice);
      assert.equal(answer.status, 200);
      assert.equal(answer.body, "hello");
      assert.equal(answer.headers.get("ratelimit"), null);
    });
    assert.equal(told.length, 1);
    await withApp(framework, options, async (app) => assert.equal((await get(`${app.url}/`, alice)).status, 503));
  });

  test(`${framework}: skipFailedRequests gives a failed request's token back, skipSuccessfulRequests a successful one's`, async () => {
    const { name, limiter } = windowOf(2, "skipped");
    await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, skipFailedRequests: true }, async (app) => {
      for (let i = 0; i < 5; i++) {
        assert.equal((await get(`${app.url}/fail`, alice)).status, 500);
        await tokensBack(limiter, name, "alice", 2);
      }
      assert.equal((await get(`${app.url}/`, alice)).status, 200);
      assert.equal((await get(`${app.url}/`, alice)).status, 200);
      assert.equal((await get(`${app.url}/`, alice)).status, 429);
    });
    await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, skipSuccessfulRequests: true }, async (app) => {
      for (let i = 0; i < 5; i++) {
        assert.equal((await get(`${app.url}/`, { "x-user": "bob" })).status, 200);
        await tokensBack(limiter, name, "bob", 2);
      }
      assert.equal((await get(`${app.url}/fail`, { "x-user": "bob" })).status, 500);
      assert.equal((await get(`${app.url}/fail`, { "x-user": "bob" })).status, 500);
      assert.equal((await get(`${app.url}/`, { "x-user": "bob" })).status, 429);
    });
  });

  for (const [label, store] of [["memory", "memory"], ["redis", process.env.TOLLGATE_REDIS_URL]]) {
    test(`${framework} on ${label}: with skipFailedRequests on, N concurrent requests against M admit exactly min(N, M)`, { skip: store === undefined && "no TOLLGATE_REDIS_URL" }, async () => {
      for (const [n, m] of [[40, 7], [5, 12]]) {
        const name = fresh("exact");
        const limiter = new RateLimiter({ store }, { [name]: windowConfig(m) });
        await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, skipFailedRequests: true }, async (app) => {
          const answers = await Promise.all(Array.from({ length: n }, () => get(`${app.url}/`, alice)));
          const admitted = answers.filter((a) => a.status === 200).length;
          assert.equal(admitted, Math.min(n, m));
          assert.equal(answers.filter((a) => a.status === 429).length, n - admitted);
        });
      }
      // Half of them failing at once: each failure's token comes back, none twice, so the
      // successes never pass M and the limit ends with M less the successes.
      const name = fresh("mixed");
      const limiter = new RateLimiter({ store }, { [name]: windowConfig(7) });
      await withApp(framework, { limiter, limits: name, key: { header: "x-user" }, skipFailedRequests: true }, async (app) => {
        const answers = await Promise.all(Array.from({ length: 40 }, (_, i) => get(`${app.url}/${i % 2 ? "fail" : ""}`, alice)));
        const succeeded = answers.filter((a) => a.status === 200).length;
        assert.ok(succeeded <= 7, String(succeeded));
        assert.ok(answers.some((a) => a.status === 500));
        await tokensBack(limiter, name, "alice", 7 - succeeded);
      });
    });
  }
}

/**
 * A response over before the middleware's take ended: its client gone (the socket destroyed
 * by a middleware that then waits for the close), or answered by a middleware of its own
 * (503, as a timeout does). Its token comes back with skipFailedRequests: a failed request
 * either way. Before, the middleware listened for `finish`/`close` after both had fired, and
 * the token was never given back.
 */
for (const framework of ["express", "fastify"]) {
  test(`${framework}: skipFailedRequests gives back the token of a request over before the take ended`, async () => {
    for (const ending of ["client gone", "answered by another"]) {
      const { name, limiter } = windowOf(2, "over-first");
      const over = (req, res, done) => {
        if (ending === "answered by another") {
          res.statusCode = 503;
          res.end("busy");
          return done();
        }
        res.once("close", () => done());
        req.socket.destroy();
      };
      const options = { limiter, limits: name, key: { header: "x-user" }, skipFailedRequests: true };
      let server;
      if (framework === "express") {
        const app = express();
        app.use((req, res, next) => over(req, res, () => next()));
        app.use(rateLimit(options));
        app.get("/", (_req, res) => res.send("hello"));
        server = await listening(createServer(app));
      } else {
        const app = Fastify();
        app.addHook("onRequest", (request, reply, done) => over(request.raw, reply.raw, () => done()));
        app.addHook("onRequest", rateLimitHook(options));
        app.get("/", async () => "hello");
        server = { url: await app.listen({ port: 0, host: "127.0.0.1" }), close: () => app.close() };
      }
      try {
        for (let i = 0; i < 3; i++) await get(`${server.url}/`, alice).catch(() => undefined);
        // Three requests against a window of two: each token came back (none refused).
        await tokensBack(limiter, name, "alice", 2);
      } finally {
        await server.close();
      }
    }
  });
}

test("the drafts as express-rate-limit writes them: the same fields, side by side, for the same limit and key", async () => {
  for (const standardHeaders of ["draft-6", "draft-7", "draft-8"]) {
    const { name, limiter } = windowOf(3, "side");
    const theirs = express();
    theirs.use(expressRateLimit({ windowMs: MINUTE, limit: 3, standardHeaders, legacyHeaders: true, keyGenerator: (req) => req.get("x-user") }));
    theirs.get("/", (_req, res) => res.send("hello"));
    const other = await listening(createServer(theirs));
    await withApp("express", { limiter, limits: name, key: { header: "x-user" }, standardHeaders, legacyHeaders: true, ...(standardHeaders === "draft-8" ? { identifier: "3-in-1min" } : {}) }, async (app) => {
      try {
        for (let i = 0; i < 4; i++) {
          const [ours, theirs] = [await get(`${app.url}/`, alice), await get(`${other.url}/`, alice)];
          assert.equal(ours.status, theirs.status);
          // The times differ (tollgate's windows are aligned per key): each is written T.
          const fields = (a) =>
            [...a.headers]
              .filter(([k]) => /^(x-)?ratelimit|^retry-after/.test(k))
              .map(([k, v]) => [k, /^(x-ratelimit-reset|ratelimit-reset|retry-after)$/.test(k) ? "T" : v.replace(/(reset=|\bt=)\d+/, "$1T")]);
          if (i === 0 && standardHeaders === "draft-8") assert.match(fields(ours).flat().join(" "), /"3-in-1min"; q=3; w=60; pk=:\w+/);
          assert.deepEqual(fields(ours), fields(theirs), `${standardHeaders}, request ${i + 1}`);
        }
      } finally {
        await other.close();
      }
    });
  }
});

test("hono: trustProxy keys six clients behind one proxy apart; without it they share the proxy's bucket", async () => {
  for (const [trustProxy, admitted] of [[1, 6], [undefined, 1]]) {
    const { name, limiter } = windowOf(1, "proxy");
    await withApp("hono", { limiter, limits: name, trustProxy }, async (app) => {
      const statuses = [];
      for (let i = 1; i <= 6; i++) statuses.push((await get(`${app.url}/`, { "x-forwarded-for": `203.0.113.${i}` })).status);
      assert.equal(statuses.filter((s) => s === 200).length, admitted, String(statuses));
    });
  }
  // Two proxies: the second address from the right, whatever a client wrote before it.
  const { name, limiter } = windowOf(1, "proxies");
  await withApp("hono", { limiter, limits: name, trustProxy: 2 }, async (app) => {
    assert.equal((await get(`${app.url}/info`, { "x-forwarded-for": "6.6.6.6, 203.0.113.9, 10.0.0.1" })).status, 200);
    const again = await get(`${app.url}/info`, { "x-forwarded-for": "7.7.7.7, 203.0.113.9, 10.0.0.1" });
    assert.equal(again.status, 429);
  });
  assert.throws(() => rateLimiter({ limiter, limits: name, trustProxy: true }), /trustProxy must be the number of proxies/);
});

test("express: X-Forwarded-For without trust proxy, and trust proxy true, are each warned of once", async () => {
  const warned = [];
  const warn = console.warn;
  console.warn = (line) => warned.push(line);
  try {
    for (const trust of [false, true]) {
      const { name, limiter } = windowOf(100, "warn");
      const app = express();
      app.set("trust proxy", trust);
      app.use(rateLimit({ limiter, limits: name }));
      app.get("/", (_req, res) => res.send("hello"));
      const server = await listening(createServer(app));
      try {
        for (let i = 0; i < 3; i++) await get(`${server.url}/`, { "x-forwarded-for": "203.0.113.1" });
      } finally {
        await server.close();
      }
    }
  } finally {
    console.warn = warn;
  }
  assert.equal(warned.length, 2, warned.join("\n"));
  assert.match(warned[0], /X-Forwarded-For but Express's trust proxy setting is off.*app\.set\("trust proxy", 1\)/);
  assert.match(warned[1], /trust proxy setting is true.*any client can write/);
});

test("fastify: the plugin's limits on every route, a route's own config.rateLimit, and rateLimit: false", async () => {
  const perIp = fresh("perIp");
  const uploads = fresh("uploads");
  const limiter = new RateLimiter("memory", {
    [perIp]: windowConfig(2),
    [uploads]: windowConfig(1),
  });
  const app = Fastify();
  await app.register(rateLimitPlugin, { limiter, limits: perIp, key: { header: "x-user" }, allowList: ["root"] });
  app.get("/", async () => "hello");
  app.post("/upload", { config: { rateLimit: { limits: uploads } } }, async () => "stored");
  app.get("/health", { config: { rateLimit: false } }, async () => "ok");
  const url = await app.listen({ port: 0, host: "127.0.0.1" });
  try {
    const post = (headers) => fetch(`${url}/upload`, { method: "POST", headers }).then((r) => r.status);
    assert.deepEqual([await post(alice), await post(alice)], [200, 429]);
    const statuses = [];
    for (let i = 0; i < 3; i++) statuses.push((await get(`${url}/`, alice)).status);
    assert.deepEqual(statuses, [200, 200, 429]);
    for (let i = 0; i < 3; i++) {
      const health = await get(`${url}/health`, alice);
      assert.equal(health.status, 200);
      assert.equal(health.headers.get("ratelimit"), null);
    }
    // allowList: the key "root" passes untouched.
    for (let i = 0; i < 3; i++) assert.equal((await get(`${url}/`, { "x-user": "root" })).status, 200);
  } finally {
    await app.close();
  }
  // A route's bad options fail when the route is registered.
  const bad = Fastify();
  await bad.register(rateLimitPlugin, { limiter, limits: perIp });
  assert.throws(() => bad.get("/x", { config: { rateLimit: { standardHeaders: "draft-9" } } }, async () => "x"), /standardHeaders must be/);
  await bad.close();
});

test("misconfiguration fails when the middleware is made, naming the option and the fix", () => {
  const { name, limiter } = windowOf(1, "bad");
  const cases = [
    [{ windowMs: 60_000 }, /no option "windowMs": a limit's window is its config/],
    [{ keyGenerator: () => "k" }, /no option "keyGenerator": give the function as `key`/],
    [{ limit: 5 }, /no option "limit": did you mean `limits`/],
    [{ standardHeaders: "draft-9" }, /standardHeaders must be "ietf".*got draft-9/],
    [{ statusCode: 4290 }, /statusCode must be an HTTP status/],
    [{ skip: true }, /skip must be a function/],
    [{ skipFailedRequests: "yes" }, /skipFailedRequests must be true or false/],
    [{ identifier: "x" }, /identifier names the limits in draft 8's fields/],
    [{ requestPropertyName: "" }, /requestPropertyName must be a property name/],
  ];
  for (const make of [rateLimit, rateLimitHook, rateLimiter]) {
    for (const [extra, message] of cases) assert.throws(() => make({ limiter, limits: name, ...extra }), message);
  }
  assert.throws(() => rateLimit({ limiter, limits: name, allowList: ["x"] }), /no option "allowList"/);
  assert.throws(() => rateLimit({ limiter: {}, limits: name }), /limiter must be a RateLimiter/);
});

test("TollgateStore: a limit function, limit 0, skipFailedRequests through decrement, get, resetKey, a name per store", async () => {
  const limiter = new RateLimiter("memory");
  const [a, b] = [new TollgateStore({ limiter }), new TollgateStore({ limiter })];
  assert.notEqual(a.prefix, b.prefix);
  const app = express();
  const stores = { a, b, c: new TollgateStore({ limiter }) };
  const keyGenerator = (req) => req.get("x-user");
  // A limit per user: 2 for alice, 1 for the others.
  app.use("/fn", expressRateLimit({ windowMs: MINUTE, limit: (req) => (req.get("x-user") === "alice" ? 2 : 1), keyGenerator, store: a }));
  app.use("/zero", expressRateLimit({ windowMs: MINUTE, limit: 0, keyGenerator, store: b }));
  app.use("/failing", expressRateLimit({ windowMs: MINUTE, limit: 1, keyGenerator, store: stores.c, skipFailedRequests: true }));
  app.get("/fn", (_req, res) => res.send("hello"));
  app.get("/zero", (_req, res) => res.send("hello"));
  app.get("/failing", (_req, res) => res.status(500).send("failed"));
  const server = await listening(createServer(app));
  try {
    const statuses = async (path, user, n) => {
      const out = [];
      for (let i = 0; i < n; i++) out.push((await get(`${server.url}${path}`, { "x-user": user })).status);
      return out;
    };
    assert.deepEqual(await statuses("/fn", "alice", 3), [200, 200, 429]);
    assert.deepEqual(await statuses("/fn", "bob", 2), [200, 429]);
    assert.deepEqual(await statuses("/zero", "alice", 2), [429, 429]);
    // Each failed answer's hit is given back (decrement), so a limit of 1 never refuses.
    for (let i = 0; i < 4; i++) {
      assert.equal((await get(`${server.url}/failing`, { "x-user": "carol" })).status, 500);
      for (let j = 0; j < 200 && (await stores.c.get("carol"))?.totalHits; j++) await new Promise((r) => setTimeout(r, 10));
    }
    assert.equal(await stores.c.get("carol"), undefined);
    const hits = await a.get("alice");
    assert.equal(hits.totalHits, 3);
    assert.ok(hits.resetTime.getTime() > Date.now() && hits.resetTime.getTime() <= Date.now() + MINUTE);
    await a.resetKey("alice");
    assert.equal(await a.get("alice"), undefined);
    assert.deepEqual(await statuses("/fn", "alice", 1), [200]);
  } finally {
    await server.close();
  }
  assert.throws(() => new TollgateStore({ limiter }).init({ limit: 3 }), /windowMs that is a positive number/);
});

test("a limit the limiter does not define: in process, an error when the middleware is made; over a server, said once in the log with the fix, and its requests answered 500, not 404", async () => {
  const { name, limiter } = windowOf(1, "defined");
  for (const framework of frameworks) {
    await assert.rejects(
      withApp(framework, { limiter, limits: [name, "perIP"], key: { header: "x-user" } }, async () => {}),
      new RegExp(`"perIP" is not a limit of the limiter; it has "${name}"`),
    );
  }
  const { startServer } = await import("../../../clients/js/test/server.mjs");
  const server = await startServer({ config: `[limits.${name}]\nkind = "fixed window"\nrate = 1\nperiod = "1m"\n` });
  const served = new RateLimiter({ url: server.url });
  const said = [];
  const error = console.error;
  console.error = (line) => said.push(line);
  try {
    for (const framework of frameworks) {
      await withApp(framework, { limiter: served, limits: [name, "perIP"], key: { header: "x-user" } }, async (app) => {
        for (let i = 0; i < 2; i++) {
          const answer = await get(`${app.url}/`, alice);
          assert.equal(answer.status, 500);
          assert.deepEqual(JSON.parse(answer.body), { error: "Rate limit perIP is not defined." });
        }
      });
    }
  } finally {
    console.error = error;
    await served.close();
    await server.stop();
  }
  assert.equal(said.length, 3, said.join("\n"));
  assert.match(said[0], /takes "perIP", which the limiter does not define.*Define it in the limiter's limits/);
});

test("over a server, nine limits with skipFailedRequests: a failed response gives back what the fields list (the 8 tightest), and nothing throws", async () => {
  const names = Array.from({ length: 9 }, (_, i) => fresh(`nine${i}`));
  // The ninth is the roomiest: the fields list the other eight, and it gets nothing back.
  const config = names.map((n, i) => `[limits.${n}]\nkind = "fixed window"\nrate = ${i < 8 ? 5 : 50}\nperiod = "1m"\n`).join("");
  const { startServer } = await import("../../../clients/js/test/server.mjs");
  const server = await startServer({ config });
  const served = new RateLimiter({ url: server.url });
  try {
    for (const framework of frameworks) {
      const user = { "x-user": `u-${framework}` };
      await withApp(framework, { limiter: served, limits: names, key: { header: "x-user" }, skipFailedRequests: true }, async (app) => {
        assert.equal((await get(`${app.url}/fail`, user)).status, 500);
        assert.equal((await get(`${app.url}/`, user)).status, 200);
      });
      // The failed one's tokens came back to the eight listed: each has 4 of 5 left (the
      // second request's), the ninth 48 of 50.
      for (let i = 0; i < 9; i++) {
        const want = i < 8 ? 4 : 48;
        for (let t = 0; t < 50; t++) {
          if ((await served.getValue(names[i], { key: user["x-user"] })).value === want) break;
          await new Promise((r) => setTimeout(r, 20));
        }
        assert.equal((await served.getValue(names[i], { key: user["x-user"] })).value, want, `${framework}: ${names[i]}`);
      }
    }
  } finally {
    await served.close();
    await server.stop();
  }
});

test("per-route limits: Express's route middleware and Hono's path use, each route its own limit", async () => {
  const perIp = fresh("perIp");
  const uploads = fresh("uploads");
  const limiter = new RateLimiter("memory", { [perIp]: windowConfig(3), [uploads]: windowConfig(1) });
  const key = { header: "x-user" };
  const app = express();
  app.post("/upload", rateLimit({ limiter, limits: uploads, key }), (_req, res) => res.send("stored"));
  app.get("/", rateLimit({ limiter, limits: perIp, key }), (_req, res) => res.send("hello"));
  const hono = new Hono();
  hono.use("/upload", rateLimiter({ limiter, limits: uploads, key: (c) => `h${c.req.header("x-user")}` }));
  hono.use("/", rateLimiter({ limiter, limits: perIp, key: (c) => `h${c.req.header("x-user")}` }));
  hono.post("/upload", (c) => c.text("stored"));
  hono.get("/", (c) => c.text("hello"));
  const servers = [await listening(createServer(app))];
  servers.push(
    await new Promise((resolve) => {
      const server = serve({ fetch: hono.fetch, port: 0, hostname: "127.0.0.1" }, (info) => {
        resolve({ url: `http://127.0.0.1:${info.port}`, close: () => new Promise((done) => server.close(done)) });
      });
    }),
  );
  try {
    for (const { url } of servers) {
      const post = () => fetch(`${url}/upload`, { method: "POST", headers: alice }).then((r) => r.status);
      assert.deepEqual([await post(), await post()], [200, 429]);
      const statuses = [];
      for (let i = 0; i < 4; i++) statuses.push((await get(`${url}/`, alice)).status);
      assert.deepEqual(statuses, [200, 200, 200, 429]);
    }
  } finally {
    for (const s of servers) await s.close();
  }
});
