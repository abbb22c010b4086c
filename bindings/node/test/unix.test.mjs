// Behind a proxy on a unix socket, where no request has a peer address: the default "ip" key
// answers 500 and says once, in the log, how to key the requests (the framework's trust of
// X-Forwarded-For, or a key of the middleware's own); with that done, each client is keyed
// by the address its proxy gave. Real apps listening on a unix socket, real requests over it.
import assert from "node:assert/strict";
import { rmSync } from "node:fs";
import { createServer, request } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { createAdaptorServer } from "@hono/node-server";
import express from "express";
import Fastify from "fastify";
import { Hono } from "hono";

import { HOUR, RateLimiter } from "../dist/index.js";
import { rateLimit } from "../dist/express.js";
import { rateLimitHook } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { fresh } from "./stores.mjs";

let sockets = 0;
const socketPath = () => join(tmpdir(), `tollgate-${process.pid}-${sockets++}.sock`);

/** Each framework's app on a new unix socket: `trusted` tells it to read X-Forwarded-For. */
const apps = {
  async express(options, trusted) {
    const app = express();
    if (trusted) app.set("trust proxy", true);
    app.get("/", rateLimit(options), (_req, res) => res.send("hello"));
    return listening(createServer(app));
  },
  async fastify(options, trusted) {
    const app = Fastify(trusted ? { trustProxy: true } : {});
    app.addHook("onRequest", rateLimitHook(options));
    app.get("/", async () => "hello");
    const path = socketPath();
    await app.listen({ path });
    return { path, close: () => app.close().then(() => rmSync(path, { force: true })) };
  },
  async hono(options, trusted) {
    const app = new Hono();
    const ip = trusted ? { ip: (c) => c.req.header("x-forwarded-for") } : {};
    app.use("*", rateLimiter({ ...options, ...ip }));
    app.get("/", (c) => c.text("hello"));
    return listening(createAdaptorServer({ fetch: app.fetch }));
  },
};

async function listening(server) {
  const path = socketPath();
  rmSync(path, { force: true });
  await new Promise((r) => server.listen(path, r));
  return { path, close: () => new Promise((r) => server.close(r)).then(() => rmSync(path, { force: true })) };
}

/** A GET over the unix socket `path`, with X-Forwarded-For `from` if given. */
function get(path, from) {
  return new Promise((resolve, reject) => {
    const headers = from === undefined ? {} : { "x-forwarded-for": from };
    const req = request({ socketPath: path, path: "/", headers }, (res) => {
      let body = "";
      res.on("data", (chunk) => (body += chunk));
      res.on("end", () => resolve({ status: res.statusCode, body }));
    });
    req.on("error", reject);
    req.end();
  });
}

const config = { kind: "token bucket", rate: 2, period: HOUR, capacity: 2 };

for (const framework of Object.keys(apps)) {
  test(`${framework} on a unix socket: the "ip" key is a 500 and one log line saying how to key it`, async () => {
    const name = fresh("unix");
    const app = await apps[framework]({ limiter: new RateLimiter("memory", { [name]: config }), limits: name }, false);
    const logged = [];
    const original = console.error;
    console.error = (...args) => logged.push(args.join(" "));
    try {
      for (let i = 0; i < 3; i++) {
        const answer = await get(app.path, "203.0.113.9");
        assert.equal(answer.status, 500, answer.body);
        assert.match(JSON.parse(answer.body).error, /no peer address on a unix socket/);
      }
    } finally {
      console.error = original;
      await app.close();
    }
    assert.equal(logged.length, 1, logged.join("\n"));
    assert.match(logged[0], new RegExp(`rate limit ${name} .*listens on a unix socket \\(${app.path}\\)`));
    assert.match(logged[0], framework === "hono" ? /ip option/ : /trust ?proxy/i);
  });

  test(`${framework} on a unix socket, told to trust X-Forwarded-For: each client keyed by its address`, async () => {
    const name = fresh("unixok");
    const app = await apps[framework]({ limiter: new RateLimiter("memory", { [name]: config }), limits: name }, true);
    try {
      const statuses = [];
      for (let i = 0; i < 3; i++) statuses.push((await get(app.path, "203.0.113.9")).status);
      statuses.push((await get(app.path, "198.51.100.7")).status);
      assert.deepEqual(statuses, [200, 200, 429, 200]);
      // A request its proxy gave no address: no key, the documented 400.
      assert.equal((await get(app.path)).status, 400);
    } finally {
      await app.close();
    }
  });
}
