// The limit names of a middleware are checked by the compiler (`npm run build` compiles this
// file, with no output): a name the limiter's type does not know does not compile.
import express from "express";
import Fastify from "fastify";
import { Hono } from "hono";

import { MINUTE, RateLimiter } from "../../dist/index.js";
import { rateLimit } from "../../dist/express.js";
import { rateLimitHook, rateLimitPlugin } from "../../dist/fastify.js";
import { rateLimiter } from "../../dist/hono.js";

const limiter = new RateLimiter("memory", {
  perIp: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
  global: { kind: "fixed window", rate: 1_000, period: MINUTE },
});

const app = express();
app.use(rateLimit({ limiter, limits: "perIp" }));
app.use(rateLimit({ limiter, limits: ["perIp", { name: "global", count: 2 }], standardHeaders: "draft-8", legacyHeaders: true }));
// @ts-expect-error: "perIP" is not among the limiter's limits.
app.use(rateLimit({ limiter, limits: "perIP" }));
// @ts-expect-error: nor is "globl", in a list.
app.use(rateLimit({ limiter, limits: ["perIp", "globl"] }));
// @ts-expect-error: "draft-9" is not a version written.
app.use(rateLimit({ limiter, limits: "perIp", standardHeaders: "draft-9" }));
app.get("/", rateLimit({ limiter, limits: "perIp" }), (req, res) => {
  res.send(String(req.rateLimit?.remaining));
});

const fastify = Fastify();
fastify.addHook("onRequest", rateLimitHook({ limiter, limits: "global", allowList: ["127.0.0.1"] }));
// @ts-expect-error: "globl" is not among the limiter's limits.
fastify.addHook("onRequest", rateLimitHook({ limiter, limits: "globl" }));
await fastify.register(rateLimitPlugin, { limiter, limits: "perIp" });
fastify.get("/upload", { config: { rateLimit: { limits: "global" } } }, async () => "ok");
fastify.get("/health", { config: { rateLimit: false } }, async () => "ok");

const hono = new Hono();
hono.use(rateLimiter({ limiter, limits: "perIp", trustProxy: 1 }));
hono.get("/", (c) => c.text(String(c.get("rateLimit").remaining)));
// @ts-expect-error: "perIP" is not among the limiter's limits.
hono.use(rateLimiter({ limiter, limits: "perIP" }));

// A limiter with a concurrency limit: its slots are acquired, held and released by name; a
// rate limit's calls and the middleware do not take its name.
const mixed = new RateLimiter("memory", {
  perIp: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
  exports: { kind: "concurrency", max: 4, ttl: "2m" },
});
await mixed.limit("perIp");
// @ts-expect-error: "exports" is a concurrency limit: acquire its slots.
await mixed.limit("exports");
{
  await using slot = await mixed.hold("exports", { key: "acme", ttl: 30_000 });
  if (slot !== null) {
    const renewed: boolean = await slot.renew({ ttl: "1m" });
    const expiresAt: number = slot.expiresAt;
    void [renewed, expiresAt];
  }
}
const acquired = await mixed.acquire("exports", { key: "acme", count: 2 });
if (acquired.ok) {
  const renewed = await mixed.renew("exports", acquired.ticket, { key: "acme" });
  if (renewed.ok) void renewed.expiresAt;
  const released: boolean = await mixed.release("exports", acquired.ticket, { key: "acme" });
  void released;
} else {
  void acquired.retryAfter;
}
app.use(rateLimit({ limiter: mixed, limits: "perIp" }));
// @ts-expect-error: nor does the middleware (it takes rate limits).
app.use(rateLimit({ limiter: mixed, limits: "exports" }));
// @ts-expect-error: a concurrency limit's max is a number.
new RateLimiter("memory", { exports: { kind: "concurrency", max: "4" } });

// The middleware's `concurrency` takes a concurrency limit's name, with its rate limits or
// alone, in each framework.
app.use(rateLimit({ limiter: mixed, limits: "perIp", concurrency: "exports" }));
app.use(rateLimit({ limiter: mixed, concurrency: { name: "exports", count: 2, ttl: "30s" }, concurrencyStatusCode: 503 }));
fastify.addHook("onRequest", rateLimitHook({ limiter: mixed, concurrency: "exports" }));
fastify.get("/export", { config: { rateLimit: { concurrency: "exports" } } }, async () => "ok");
hono.use(rateLimiter({ limiter: mixed, limits: "perIp", concurrency: { name: "exports" } }));
// @ts-expect-error: "perIp" is a rate limit, not a concurrency limit.
app.use(rateLimit({ limiter: mixed, concurrency: "perIp" }));
// @ts-expect-error: a limiter of rate limits alone has no concurrency limit.
app.use(rateLimit({ limiter, limits: "perIp", concurrency: "exports" }));
// @ts-expect-error: a ttl is milliseconds or a duration's string.
app.use(rateLimit({ limiter: mixed, concurrency: { name: "exports", ttl: true } }));

// A server's limiter whose type knows no names takes any.
const remote = new RateLimiter({ url: "http://127.0.0.1:8787" });
app.use(rateLimit({ limiter: remote, limits: "anything" }));
app.use(rateLimit({ limiter: remote, limits: "anything", concurrency: "slots" }));
