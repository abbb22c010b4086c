// The default "ip" key: IPv6 peers grouped by their /56 (ipv6Subnet), IPv4-mapped addresses
// folded to IPv4, zone ids dropped; through each framework over real HTTP on ::1, the peer's
// address given by X-Forwarded-For to a framework told to trust it (a test cannot own the
// addresses of a /64), and the key's text read back from the store.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { serve } from "@hono/node-server";
import express from "express";
import Fastify from "fastify";
import { Hono } from "hono";

import { HOUR, RateLimiter } from "../dist/index.js";
import { ipKey, rateLimit } from "../dist/express.js";
import { rateLimitHook } from "../dist/fastify.js";
import { rateLimiter } from "../dist/hono.js";
import { fresh } from "./stores.mjs";

test("ipKey: RFC 5952's text, the network's first address and its length", () => {
  const cases = [
    ["2001:db8:abcd:1234::1", 56, "2001:db8:abcd:1200::/56"],
    ["2001:db8:abcd:1234:5678:9abc:def0:1", 64, "2001:db8:abcd:1234::/64"],
    ["2001:db8:abcd:1234::1", 60, "2001:db8:abcd:1230::/60"],
    ["2001:db8:abcd:1234::1", 128, "2001:db8:abcd:1234::1"], // the tower layer's text too
    ["2001:db8:abcd:1234::1", 1, "::/1"],
    ["2001:DB8:0:0:1:0:0:1", false, "2001:db8::1:0:0:1"], // the first of two equal runs
    ["2001:db8:0:1:1:1:1:1", false, "2001:db8:0:1:1:1:1:1"], // one zero group stays
    ["2001:0db8:0000:0000:0000:0000:0002:0001", false, "2001:db8::2:1"],
    ["::1", false, "::1"],
    ["::1", 56, "::/56"],
    ["fe80::1%eth0", false, "fe80::1"],
    ["fe80::1%eth0", 56, "fe80::/56"],
    ["::ffff:192.0.2.1", 56, "192.0.2.1"],
    ["::FFFF:c000:0201", false, "192.0.2.1"],
    ["192.0.2.1", 56, "192.0.2.1"],
    ["::192.0.2.1", false, "::c000:201"], // IPv4-compatible (deprecated): an IPv6 address
    ["not an address", 56, "not an address"],
    ["1:2:3:4:5:6:7:8:9", 56, "1:2:3:4:5:6:7:8:9"],
    ["1::2::3", 56, "1::2::3"],
  ];
  for (const [address, subnet, key] of cases) assert.equal(ipKey(address, subnet), key, `${address} /${subnet}`);
  assert.equal(ipKey("2001:db8:abcd:1234::1"), "2001:db8:abcd:1200::/56");
});

/** The apps, each trusting X-Forwarded-For, listening on ::1. */
const apps = {
  async express(options) {
    const app = express();
    app.set("trust proxy", true);
    app.get("/", rateLimit(options), (_req, res) => res.send("hello"));
    const server = createServer(app).listen(0, "::1");
    await new Promise((r) => server.once("listening", r));
    return { url: `http://[::1]:${server.address().port}/`, close: () => new Promise((r) => server.close(r)) };
  },
  async fastify(options) {
    const app = Fastify({ trustProxy: true });
    app.addHook("onRequest", rateLimitHook(options));
    app.get("/", async () => "hello");
    await app.listen({ port: 0, host: "::1" });
    return { url: `http://[::1]:${app.server.address().port}/`, close: () => app.close() };
  },
  async hono(options) {
    const app = new Hono();
    // Hono has no trust-proxy setting: the address is the middleware's `ip` option.
    app.use("*", rateLimiter({ ...options, ip: (c) => c.req.header("x-forwarded-for") }));
    app.get("/", (c) => c.text("hello"));
    const server = serve({ fetch: app.fetch, port: 0, hostname: "::1" });
    await new Promise((r) => server.once("listening", r));
    return { url: `http://[::1]:${server.address().port}/`, close: () => new Promise((r) => server.close(r)) };
  },
};

/** 20 addresses of 2001:db8:abcd:1234::/64, random past its prefix. */
function oneNetwork() {
  const hex = () => Math.floor(Math.random() * 0x10000).toString(16);
  return Array.from({ length: 20 }, () => `2001:db8:abcd:1234:${hex()}:${hex()}:${hex()}:${hex()}`);
}

async function statuses(url, addresses) {
  const out = [];
  for (const address of addresses) {
    const answer = await fetch(url, { headers: { "x-forwarded-for": address } });
    await answer.text();
    out.push(answer.status);
  }
  return out;
}

const config = { kind: "token bucket", rate: 3, period: HOUR, capacity: 3 };
const three = (n) => [200, 200, 200, ...Array(n - 3).fill(429)];

for (const framework of Object.keys(apps)) {
  test(`${framework}: 20 addresses of one /64 share a limit of 3; another /56 is its own; v4-mapped is v4`, async () => {
    const name = fresh("ip");
    const limiter = new RateLimiter("memory", { [name]: config });
    const app = await apps[framework]({ limiter, limits: name });
    try {
      assert.deepEqual(await statuses(app.url, oneNetwork()), three(20));
      // Another /64 of the same /56 shares it; another /56 does not.
      assert.deepEqual(await statuses(app.url, ["2001:db8:abcd:12ff::7"]), [429]);
      assert.deepEqual(await statuses(app.url, ["2001:db8:abcd:1300::1", "2001:db8:abcd:1300::2"]), [200, 200]);
      // An IPv4 peer is one key, however its address is written.
      assert.deepEqual(await statuses(app.url, ["::ffff:203.0.113.9", "203.0.113.9", "::ffff:cb00:7109", "203.0.113.9"]), three(4));
      // The keys as the store has them.
      for (const key of ["2001:db8:abcd:1200::/56", "203.0.113.9"]) {
        const state = await limiter.getValue(name, { key });
        assert.ok(state.ts > 0 && state.value < 1, `${key}: ${JSON.stringify(state)}`);
      }
      assert.equal((await limiter.getValue(name, { key: "2001:db8:abcd:1300::/56" })).value > 0.9, true);
    } finally {
      await app.close();
    }
  });

  test(`${framework}: ipv6Subnet 64 and false`, async () => {
    const name = fresh("ipsubnet");
    const limiter = new RateLimiter("memory", { [name]: config });
    const by64 = await apps[framework]({ limiter, limits: name, ipv6Subnet: 64 });
    try {
      assert.deepEqual(await statuses(by64.url, oneNetwork()), three(20));
      assert.deepEqual(await statuses(by64.url, ["2001:db8:abcd:12ff::7"]), [200]);
    } finally {
      await by64.close();
    }
    const other = fresh("ipwhole");
    const whole = await apps[framework]({
      limiter: new RateLimiter("memory", { [other]: config }),
      limits: other,
      ipv6Subnet: false,
    });
    try {
      assert.deepEqual(await statuses(whole.url, oneNetwork()), Array(20).fill(200));
    } finally {
      await whole.close();
    }
  });
}

test("ipv6Subnet other than 1-128 or false is a TypeError when the middleware is made", () => {
  const limiter = new RateLimiter("memory", { x: config });
  for (const ipv6Subnet of [0, 129, 56.5, "56", true, null, Number.NaN]) {
    for (const make of [rateLimit, rateLimitHook, rateLimiter]) {
      assert.throws(() => make({ limiter, limits: "x", ipv6Subnet }), TypeError, `${make.name} ${String(ipv6Subnet)}`);
    }
  }
});
