// A decision that arrives after the response was sent (a timeout middleware answered first,
// Redis was slow): each framework's middleware writes nothing more, never passes the request
// on, and throws nothing; the tokens it took stay taken. Redis is reached through a forwarder
// that holds every chunk 100 ms each way; the timeouts are 20 ms. Each limit admits half the
// requests, so that half the late decisions are refusals (a 429 the middleware must not write).
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { serve } from "@hono/node-server";
import timeout from "connect-timeout";
import express from "express";
import Fastify from "fastify";
import { Hono } from "hono";
import { timeout as honoTimeout } from "hono/timeout";

import { RateLimiter } from "../dist/index.js";
import { rateLimit } from "../dist/express.js";
import { rateLimitHook } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { forwarder, through } from "./proxy.mjs";
import { fresh } from "./stores.mjs";

const redis = process.env.TOLLGATE_REDIS_URL;
if (process.env.TOLLGATE_REQUIRE_BACKENDS === "1" && redis === undefined) {
  throw new Error("TOLLGATE_REQUIRE_BACKENDS=1 but TOLLGATE_REDIS_URL is not set");
}
/** A limit of `rate` on Redis behind a 100 ms forwarder, and a limiter straight on Redis to
 *  read it. */
async function slowRedis(rate) {
  const slow = await forwarder({ to: redis, delay: 100 });
  const name = fresh("late");
  // A window that began now and lasts a day: no new window while the test runs.
  const limits = { [name]: { kind: "fixed window", rate, period: 86_400_000, start: Date.now() } };
  const limiter = new RateLimiter({ store: through(redis, slow.port), storeDeadline: 5_000 }, limits);
  const direct = new RateLimiter({ store: redis }, limits);
  const taken = async () => rate - (await direct.getValue(name, { key: "k" })).value;
  return { name, limiter, taken, close: () => slow.close() };
}

/** Sends `n` GETs to `url`, 50 at a time; counts the answers by status. */
async function hammer(url, n) {
  const statuses = {};
  let next = 0;
  await Promise.all(
    Array.from({ length: 50 }, async () => {
      while (next < n) {
        next++;
        const answer = await fetch(url);
        await answer.arrayBuffer();
        statuses[answer.status] = (statuses[answer.status] ?? 0) + 1;
      }
    }),
  );
  return statuses;
}

/** The tokens `taken` says, once they reach `n` (waiting at most 20 s for the late ones). */
async function settled(taken, n) {
  let count = await taken();
  for (let i = 0; i < 200 && count < n; i++) {
    await new Promise((r) => setTimeout(r, 100));
    count = await taken();
  }
  return count;
}

test("express after connect-timeout: 1,000 requests answered 503 by the timeout, the process lives, each counted", { skip: !redis && "no TOLLGATE_REDIS_URL" }, async () => {
  const { name, limiter, taken, close } = await slowRedis(500);
  let handled = 0;
  const app = express();
  app.use(timeout("20ms"));
  app.get("/", rateLimit({ limiter, limits: name, key: () => "k" }), (_req, res) => {
    handled++;
    res.send("hello");
  });
  // connect-timeout's error, answered quietly (Express's own handler logs each stack).
  app.use((error, _req, res, _next) => res.status(503).send(error.message));
  const server = createServer(app).listen(0, "127.0.0.1");
  await new Promise((r) => server.once("listening", r));
  try {
    const statuses = await hammer(`http://127.0.0.1:${server.address().port}/`, 1_000);
    assert.deepEqual(statuses, { 503: 1_000 });
    assert.equal(await settled(taken, 500), 500);
    assert.equal(handled, 0, "a request went on to its handler after its response was sent");
  } finally {
    await new Promise((r) => server.close(r));
    await close();
  }
});

test("fastify after a hook that answers in 20 ms: the hook writes nothing more, each counted", { skip: !redis && "no TOLLGATE_REDIS_URL" }, async () => {
  const { name, limiter, taken, close } = await slowRedis(100);
  let handled = 0;
  // Fastify logs a reply sent twice (FST_ERR_REP_ALREADY_SENT) at warn: none may be logged.
  const logged = [];
  const stream = { write: (line) => logged.push(JSON.parse(line)) };
  const app = Fastify({ logger: { level: "warn", stream } });
  app.addHook("onRequest", (_request, reply, done) => {
    setTimeout(() => reply.sent || reply.code(503).send("timeout"), 20);
    done();
  });
  app.addHook("onRequest", rateLimitHook({ limiter, limits: name, key: () => "k" }));
  app.get("/", async () => {
    handled++;
    return "hello";
  });
  await app.listen({ port: 0, host: "127.0.0.1" });
  try {
    const statuses = await hammer(`http://127.0.0.1:${app.server.address().port}/`, 200);
    assert.deepEqual(statuses, { 503: 200 });
    assert.equal(await settled(taken, 100), 100);
    await new Promise((r) => setTimeout(r, 500)); // the last refusals' turn to write
    assert.deepEqual(logged.map((l) => l.err?.code ?? l.msg), []);
    assert.equal(handled, 0);
  } finally {
    await app.close();
    await close();
  }
});

test("hono after hono/timeout: the middleware writes nothing more and throws nothing, each counted", { skip: !redis && "no TOLLGATE_REDIS_URL" }, async () => {
  const { name, limiter, taken, close } = await slowRedis(100);
  let handled = 0;
  const errors = [];
  const app = new Hono();
  app.use("*", honoTimeout(20));
  app.use("*", rateLimiter({ limiter, limits: name, key: () => "k" }));
  app.get("/", (c) => {
    handled++;
    return c.text("hello");
  });
  // The timeout's answer, and any error a middleware throws afterwards (Hono catches those).
  app.onError((error, c) => {
    if (error.message !== "Gateway Timeout") errors.push(error);
    return c.text("timeout", 504);
  });
  const server = serve({ fetch: app.fetch, port: 0, hostname: "127.0.0.1" });
  await new Promise((r) => server.once("listening", r));
  try {
    const statuses = await hammer(`http://127.0.0.1:${server.address().port}/`, 200);
    assert.deepEqual(statuses, { 504: 200 });
    assert.equal(await settled(taken, 100), 100);
    await new Promise((r) => setTimeout(r, 500));
    assert.deepEqual(errors.map(String), []);
    assert.equal(handled, 0);
  } finally {
    await new Promise((r) => server.close(r));
    await close();
  }
});
