// Each framework's middleware through real HTTP requests to a real listening app, over the
// in-process limiter and over a server's client: the status, the header fields and the body
// as the tower layer writes them (crates/tollgate/src/tower: `"name";q=<rate in the
// window>;w=<window s>`, `"name";r=<remaining, down>;t=<s until full, up>`, `Retry-After` in
// whole seconds up, `{"kind": "RateLimited", "name", "retryAfter"}`).
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { createServer } from "node:http";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { serve } from "@hono/node-server";
import express from "express";
import { rateLimit as expressRateLimit } from "express-rate-limit";
import Fastify from "fastify";
import { Hono } from "hono";

import { MINUTE, RateLimiter } from "../dist/index.js";
import { TollgateStore, rateLimit } from "../dist/express.js";
import { rateLimitHook } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { startServer } from "../../../clients/js/test/server.mjs";
import { listening } from "./listening.mjs";
import { fresh } from "./stores.mjs";

const apps = {
  async express(options) {
    const app = express();
    app.get("/", rateLimit(options), (_req, res) => res.send("hello"));
    // Express's app is a request listener: a node:http server around it.
    return listening(createServer(app));
  },
  async fastify(options) {
    const app = Fastify();
    app.addHook("onRequest", rateLimitHook(options));
    app.get("/", async () => "hello");
    const url = await app.listen({ port: 0, host: "127.0.0.1" });
    return { url, close: () => app.close() };
  },
  async hono(options) {
    const app = new Hono();
    app.use("*", rateLimiter(options));
    app.get("/", (c) => c.text("hello"));
    return new Promise((resolve) => {
      const server = serve({ fetch: app.fetch, port: 0, hostname: "127.0.0.1" }, (info) => {
        resolve({ url: `http://127.0.0.1:${info.port}`, close: () => new Promise((done) => server.close(done)) });
      });
    });
  },
};

async function get(url, headers = {}) {
  const response = await fetch(url, { headers });
  return { status: response.status, headers: response.headers, body: await response.text() };
}

const config = { kind: "token bucket", rate: 10, period: MINUTE, capacity: 2 };

/** Three requests for one user: two pass, the third is refused, as the tower layer says. */
async function threeRequests(framework, limiter, name) {
  const app = await apps[framework]({ limiter, limits: name, key: { header: "x-user" } });
  try {
    const user = { "x-user": "alice" };
    const first = await get(`${app.url}/`, user);
    assert.equal(first.status, 200, first.body);
    assert.equal(first.body, "hello");
    assert.equal(first.headers.get("ratelimit-policy"), `"${name}";q=10;w=60`);
    assert.equal(first.headers.get("ratelimit"), `"${name}";r=1;t=6`);
    const second = await get(`${app.url}/`, user);
    assert.equal(second.status, 200);
    assert.equal(second.headers.get("ratelimit"), `"${name}";r=0;t=12`);
    const third = await get(`${app.url}/`, user);
    assert.equal(third.status, 429);
    assert.equal(third.headers.get("ratelimit-policy"), `"${name}";q=10;w=60`);
    assert.equal(third.headers.get("ratelimit"), `"${name}";r=0;t=12`);
    assert.equal(third.headers.get("retry-after"), "6");
    assert.match(third.headers.get("content-type"), /application\/json/);
    const body = JSON.parse(third.body);
    assert.equal(body.kind, "RateLimited");
    assert.equal(body.name, name);
    assert.ok(body.retryAfter > 5_000 && body.retryAfter <= 6_000, String(body.retryAfter));
    // Another user is not refused; a request without the header is refused with 400, and
    // nothing is taken.
    assert.equal((await get(`${app.url}/`, { "x-user": "bob" })).status, 200);
    const keyless = await get(`${app.url}/`);
    assert.equal(keyless.status, 400);
    assert.match(JSON.parse(keyless.body).error, /no key in the request/);
  } finally {
    await app.close();
  }
}

for (const framework of Object.keys(apps)) {
  test(`${framework}: in-process`, async () => {
    const name = fresh(framework);
    await threeRequests(framework, new RateLimiter({ store: "memory" }, { [name]: config }), name);
  });

  test(`${framework}: over a server's client`, async () => {
    const name = fresh(framework);
    const server = await startServer({
      config: `[limits.${name}]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\ncapacity = 2\n`,
    });
    try {
      await threeRequests(framework, new RateLimiter({ url: server.url }), name);
    } finally {
      await server.stop();
    }
  });
}

test("express: several limits all or nothing, the IP by default, a store down is 503", async () => {
  const perIp = fresh("perIp");
  const global = fresh("global");
  const limiter = new RateLimiter("memory", {
    [perIp]: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 5 },
    [global]: { kind: "fixed window", rate: 1, period: MINUTE, start: 0 },
  });
  const app = await apps.express({ limiter, limits: [perIp, global] });
  try {
    assert.equal((await get(`${app.url}/`)).status, 200);
    const refused = await get(`${app.url}/`);
    assert.equal(refused.status, 429);
    assert.equal(JSON.parse(refused.body).name, global);
    // Refused by the global limit, the per-IP limit kept its token: 4 left, not 3.
    assert.match(refused.headers.get("ratelimit"), new RegExp(`"${perIp}";r=4;t=\\d+, "${global}";r=0;t=\\d+`));
  } finally {
    await app.close();
  }
  const down = new RateLimiter({ store: "redis://127.0.0.1:1" }, { [perIp]: config });
  const failing = await apps.express({ limiter: down, limits: perIp, onStoreError: () => {} });
  try {
    const answer = await get(`${failing.url}/`);
    assert.equal(answer.status, 503);
    assert.equal(JSON.parse(answer.body).mayHaveTaken, false);
  } finally {
    await failing.close();
  }
});

test("express-rate-limit with a TollgateStore: two apps on one Redis admit the limit once", { skip: !process.env.TOLLGATE_REDIS_URL && "no TOLLGATE_REDIS_URL" }, async () => {
  const name = fresh("erl");
  const servers = [];
  for (let i = 0; i < 2; i++) {
    const limiter = new RateLimiter({ store: process.env.TOLLGATE_REDIS_URL });
    const app = express();
    app.use(
      expressRateLimit({
        windowMs: MINUTE,
        limit: 3,
        keyGenerator: (req) => req.get("x-user") ?? "anonymous",
        store: new TollgateStore({ limiter, name }),
        standardHeaders: "draft-6",
        legacyHeaders: false,
      }),
    );
    app.get("/", (_req, res) => res.send("hello"));
    servers.push(await listening(createServer(app)));
  }
  try {
    const statuses = [];
    for (let i = 0; i < 6; i++) statuses.push((await get(`${servers[i % 2].url}/`, { "x-user": "carol" })).status);
    assert.deepEqual(statuses, [200, 200, 200, 429, 429, 429]);
    // express-rate-limit's own fields, from the store's answer.
    const last = await get(`${servers[0].url}/`, { "x-user": "carol" });
    assert.equal(last.headers.get("ratelimit-limit"), "3");
    assert.equal(last.headers.get("ratelimit-remaining"), "0");
    assert.equal((await get(`${servers[1].url}/`, { "x-user": "dave" })).status, 200);
  } finally {
    for (const s of servers) await s.close();
  }
});

test("a store that fails: the 503 body says no more than that, the detail goes to onStoreError or one warning", async () => {
  const secret = fresh("secret");
  const down = [`sqlite:///nonexistent-${secret}/states.db`];
  // A role and database PostgreSQL does not know: its refusal names them both.
  if (process.env.TOLLGATE_POSTGRES_URL) down.push(`postgres://${secret}@127.0.0.1:5432/${secret}db`);
  for (const store of down) {
    for (const framework of Object.keys(apps)) {
      const limiter = new RateLimiter({ store }, { x: config });
      const told = [];
      const app = await apps[framework]({
        limiter,
        limits: "x",
        key: { header: "x-user" },
        onStoreError: (error, request) => told.push([error.message, request !== undefined]),
      });
      try {
        const answer = await get(`${app.url}/`, { "x-user": "alice" });
        assert.equal(answer.status, 503);
        assert.deepEqual(JSON.parse(answer.body), { error: "rate limit store unavailable", mayHaveTaken: false });
        assert.equal(told.length, 1);
        assert.ok(told[0][0].includes(secret), `${framework} ${store}: ${told[0][0]}`);
        assert.equal(told[0][1], true);
      } finally {
        await app.close();
      }
    }
  }
  assert.throws(() => rateLimit({ limiter: new RateLimiter("memory"), limits: "x", onStoreError: "log" }), TypeError);
});

test("by default, the store's failures are one console.warn line per 10 s for the process", () => {
  // In a process of its own: the warnings are counted from its start.
  const secret = fresh("secret");
  const dist = new URL("../dist/", import.meta.url).href;
  const script = `
    import { createServer } from "node:http";
    import express from "express";
    import { RateLimiter } from "${dist}index.js";
    import { rateLimit } from "${dist}express.js";
    import { rateLimitHook } from "${dist}fastify.js";
    const limiter = new RateLimiter({ store: "sqlite:///nonexistent-${secret}/states.db" }, { x: ${JSON.stringify(config)} });
    const app = express();
    app.get("/", rateLimit({ limiter, limits: "x", key: () => "k" }), (_req, res) => res.send("hello"));
    const server = createServer(app).listen(0, "127.0.0.1");
    await new Promise((r) => server.once("listening", r));
    const statuses = [];
    for (let i = 0; i < 20; i++) statuses.push((await fetch("http://127.0.0.1:" + server.address().port)).status);
    // Another middleware of the same process shares the budget.
    const hook = rateLimitHook({ limiter, limits: "x", key: () => "k" });
    const reply = { sent: false, headers() { return this; }, code() { return this; }, type() { return this; }, send() { return this; } };
    await hook({ headers: {} }, reply);
    server.close();
    console.log(JSON.stringify(statuses));`;
  const run = spawnSync(process.execPath, ["--input-type=module", "-e", script], { cwd: fileURLToPath(new URL("..", import.meta.url)), encoding: "utf8", timeout: 30_000 });
  assert.equal(run.status, 0, run.stderr);
  assert.deepEqual(JSON.parse(run.stdout), Array(20).fill(503));
  const lines = run.stderr.trim().split("\n");
  assert.equal(lines.length, 1, run.stderr);
  assert.match(lines[0], new RegExp(`^tollgate: the rate limit store failed, requests answered 503: .*${secret}`));
});

test("a key function's null is no key (400), never the shared value; a key of another type is the app's error", async () => {
  for (const framework of Object.keys(apps)) {
    const name = fresh("nullkey");
    const limiter = new RateLimiter("memory", { [name]: config });
    const app = await apps[framework]({ limiter, limits: name, key: (req) => (seen(req) ? null : 42) });
    try {
      const answer = await get(`${app.url}/`, { "x-null": "1" });
      assert.equal(answer.status, 400, `${framework}: ${answer.body}`);
      assert.match(JSON.parse(answer.body).error, /no key in the request/);
      assert.equal((await limiter.getValue(name)).ts, 0, "the shared value was taken from");
      // 42: the framework's own error answer (500), nothing taken.
      assert.equal((await get(`${app.url}/`)).status, 500, framework);
      assert.equal((await limiter.getValue(name)).ts, 0);
    } finally {
      await app.close();
    }
  }
});

/** Whether a request of any framework has the header x-null. */
function seen(req) {
  const header = req.get?.("x-null") ?? req.headers?.["x-null"] ?? req.req?.header?.("x-null");
  return header !== undefined;
}

test("hono: a handler's own Response (new Response, a fetch's answer) keeps the header fields", async () => {
  const name = fresh("raw");
  const limiter = new RateLimiter("memory", { [name]: config });
  // An answer from fetch: its headers are immutable.
  const upstream = await listening(createServer((_req, res) => res.end("upstream")));
  const app = new Hono();
  app.use("*", rateLimiter({ limiter, limits: name, key: { header: "x-user" } }));
  app.get("/raw", () => new Response("raw", { headers: { "x-own": "kept" } }));
  app.get("/fetched", () => fetch(upstream.url));
  app.get("/own", (c) => new Response("own", { headers: { ratelimit: "the handler's" } }));
  const server = serve({ fetch: app.fetch, port: 0, hostname: "127.0.0.1" });
  await new Promise((r) => server.once("listening", r));
  const url = `http://127.0.0.1:${server.address().port}`;
  try {
    const raw = await get(`${url}/raw`, { "x-user": "a" });
    assert.equal(raw.body, "raw");
    assert.equal(raw.headers.get("x-own"), "kept");
    assert.equal(raw.headers.get("ratelimit-policy"), `"${name}";q=10;w=60`);
    assert.equal(raw.headers.get("ratelimit"), `"${name}";r=1;t=6`);
    const fetched = await get(`${url}/fetched`, { "x-user": "b" });
    assert.equal(fetched.body, "upstream");
    assert.equal(fetched.headers.get("ratelimit"), `"${name}";r=1;t=6`);
    // A field the handler set itself is its own.
    assert.equal((await get(`${url}/own`, { "x-user": "c" })).headers.get("ratelimit"), "the handler's");
  } finally {
    await new Promise((r) => server.close(r));
    await upstream.close();
  }
});
