// The middleware over real HTTP: each app in a process of its own on 127.0.0.1, loaded by
// autocannon (64 connections, a bounded duration) from this one, the apps taking turns round
// after round; requests/s as the median over rounds, and tollgate's against each peer's:
//   Express + tollgate (memory)  vs Express alone, a minimal rate-limiter-flexible middleware
//                                   (RateLimiterMemory), express-rate-limit (its MemoryStore)
//   Express + tollgate (Redis)   vs a minimal rate-limiter-flexible middleware (RateLimiterRedis)
//   Fastify + tollgate (memory)  vs @fastify/rate-limit (its memory store)
// Every limiter keys by the client's IP (one key: every connection is 127.0.0.1) with a limit
// far above what a run takes, so that each request is a granted take and answered 200; a run
// with any other status is reported as such. Redis: TOLLGATE_REDIS_URL (default
// redis://127.0.0.1:6379, which must be a loopback address).
//
//   npm run build:addon -- --release && node bench-http.mjs [ROUNDS] [SECONDS] [WORD]
//
// WORD runs only the apps whose name has it (`redis`, `fastify`), the fewer processes
// sharing the machine.
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { fileURLToPath } from "node:url";

const redisUrl = process.env.TOLLGATE_REDIS_URL ?? "redis://127.0.0.1:6379";
const big = { kind: "token bucket", rate: 1e12, period: 1_000 };
const hello = "hello";

/** Each app: a function that listens on a free loopback port and resolves to it. */
const apps = {
  async express() {
    const { default: express } = await import("express");
    return expressApp(express, []);
  },
  async "express + tollgate memory"() {
    const { default: express } = await import("express");
    const { RateLimiter } = await import("./dist/index.js");
    const { rateLimit } = await import("./dist/express.js");
    const limiter = new RateLimiter("memory", { perIp: big });
    return expressApp(express, [rateLimit({ limiter, limits: "perIp" })]);
  },
  async "express + rate-limiter-flexible memory"() {
    const { default: express } = await import("express");
    const { RateLimiterMemory } = await import("rate-limiter-flexible");
    return expressApp(express, [flexible(new RateLimiterMemory({ points: 1e12, duration: 3_600 }))]);
  },
  async "express + express-rate-limit memory"() {
    const { default: express } = await import("express");
    const { rateLimit } = await import("express-rate-limit");
    return expressApp(express, [rateLimit({ windowMs: 3_600_000, limit: 1e12 })]);
  },
  async "express + tollgate redis"() {
    const { default: express } = await import("express");
    const { RateLimiter } = await import("./dist/index.js");
    const { rateLimit } = await import("./dist/express.js");
    const name = `perIp${process.pid}`;
    const limiter = new RateLimiter({ store: redisUrl, storeDeadline: 2_000 }, { [name]: big });
    return expressApp(express, [rateLimit({ limiter, limits: name })]);
  },
  async "express + rate-limiter-flexible redis"() {
    const { default: express } = await import("express");
    const { Redis } = await import("ioredis");
    const { RateLimiterRedis } = await import("rate-limiter-flexible");
    const storeClient = new Redis(redisUrl);
    return expressApp(express, [flexible(new RateLimiterRedis({ storeClient, keyPrefix: `flex${process.pid}`, points: 1e12, duration: 3_600 }))]);
  },
  async "fastify + tollgate memory"() {
    const { default: Fastify } = await import("fastify");
    const { RateLimiter } = await import("./dist/index.js");
    const { rateLimitHook } = await import("./dist/fastify.js");
    const app = Fastify();
    app.addHook("onRequest", rateLimitHook({ limiter: new RateLimiter("memory", { perIp: big }), limits: "perIp" }));
    app.get("/", async () => hello);
    return fastifyApp(app);
  },
  async "fastify + @fastify/rate-limit memory"() {
    const { default: Fastify } = await import("fastify");
    const { default: rateLimit } = await import("@fastify/rate-limit");
    const app = Fastify();
    await app.register(rateLimit, { max: 1e12, timeWindow: 3_600_000 });
    app.get("/", async () => hello);
    return fastifyApp(app);
  },
};

/** tollgate's against which peer, as the lines the run ends with. */
const ratios = [
  ["express + tollgate memory", "express"],
  ["express + tollgate memory", "express + rate-limiter-flexible memory"],
  ["express + tollgate memory", "express + express-rate-limit memory"],
  ["express + tollgate redis", "express + rate-limiter-flexible redis"],
  ["fastify + tollgate memory", "fastify + @fastify/rate-limit memory"],
];

/** A minimal rate-limiter-flexible middleware, as its README writes one: consume the IP's
 *  point, or answer 429. */
function flexible(limiter) {
  return (req, res, next) => {
    limiter.consume(req.ip).then(
      () => next(),
      () => res.status(429).send("Too Many Requests"),
    );
  };
}

function expressApp(express, middleware) {
  const app = express();
  app.get("/", ...middleware, (_req, res) => res.send(hello));
  const server = createServer(app);
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server.address().port)));
}

async function fastifyApp(app) {
  await app.listen({ port: 0, host: "127.0.0.1" });
  return app.server.address().port;
}

if (process.argv[2] === "--serve") {
  // An app's own process: its port on stdout; it ends with its parent's pipe.
  const port = await apps[process.argv[3]]();
  process.stdout.write(`${port}\n`);
  process.stdin.on("end", () => process.exit(0));
  process.stdin.resume();
} else {
  await main();
}

/** Starts `name`'s app in a process of its own; resolves to { url, stop }. */
function start(name) {
  const child = spawn(process.execPath, [fileURLToPath(import.meta.url), "--serve", name], { stdio: ["pipe", "pipe", "inherit"] });
  return new Promise((resolve, reject) => {
    child.once("exit", (code) => reject(new Error(`${name} exited (${code}) before it listened`)));
    child.stdout.once("data", (data) => {
      resolve({ url: `http://127.0.0.1:${Number(String(data).trim())}/`, stop: () => child.stdin.end() });
    });
  });
}

async function main() {
  const rounds = Number(process.argv[2] ?? 3);
  const seconds = Number(process.argv[3] ?? 5);
  const { default: autocannon } = await import("autocannon");
  const names = Object.keys(apps).filter((name) => name.includes(process.argv[4] ?? ""));
  const running = {};
  for (const name of names) running[name] = await start(name);
  /** Requests/s of one run of `seconds` on `name`'s app, and its answers that were not 200. */
  const load = async (name, duration) => {
    const result = await autocannon({ url: running[name].url, connections: 64, duration });
    const other = result.non2xx + result.errors + result.timeouts;
    return { rate: result.requests.total / duration, other };
  };
  const results = Object.fromEntries(names.map((name) => [name, []]));
  try {
    // A warm-up run each (the JIT, the connections to Redis), not counted.
    for (const name of names) await load(name, 1);
    for (let r = 0; r < rounds; r++) {
      for (const name of names) {
        const { rate, other } = await load(name, seconds);
        if (other > 0) console.log(`${name}: ${other} answers not 200 (or errors) in round ${r + 1}`);
        results[name].push(rate);
      }
    }
  } finally {
    for (const name of names) running[name].stop();
  }
  const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  const fmt = (x) => Math.round(x).toLocaleString("en");
  console.log(`${rounds} rounds of ${seconds} s, 64 connections; requests/s, median (each round):`);
  for (const name of names) console.log(`  ${name.padEnd(40)} ${fmt(median(results[name])).padStart(7)}  (${results[name].map(fmt).join(", ")})`);
  for (const [ours, theirs] of ratios.filter((pair) => pair.every((name) => names.includes(name)))) {
    console.log(`${ours} / ${theirs}: ${(median(results[ours]) / median(results[theirs])).toFixed(2)}x`);
  }
}
