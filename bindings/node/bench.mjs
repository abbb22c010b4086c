// tollgate in-process against rate-limiter-flexible, in one run, in interleaved rounds
// (tollgate, peer, tollgate, peer, ...), ops/s as the median over rounds:
//   memory:  limiter.limit(name, { key }) vs RateLimiterMemory.consume(key), one call after
//            another over 1,000 keys (in-process work: more in flight adds nothing)
//   redis:   the same over one Redis (TOLLGATE_REDIS_URL, default 127.0.0.1:6379), 64 calls
//            in flight, vs RateLimiterRedis over ioredis, on the same keys
//   leased:  one hot key, tollgate's limit leased, vs RateLimiterRedis on one key
//   middleware decision (mw memory, mw redis): what a middleware does per request, its
//            limit taken for the key of an `x-user` header and the IETF header fields
//            written (`decide`, without a framework), against the peer's consume as above
//
//   npm run build:addon -- --release && node bench.mjs [ROUNDS] [SCALE]
//
// Nothing is refused in any (the limits are far above what a run takes): each call is a
// granted take, on each side.
import { Redis } from "ioredis";
import { RateLimiterMemory, RateLimiterRedis } from "rate-limiter-flexible";

import { RateLimiter } from "./dist/index.js";
import { decide, middleware } from "./dist/middleware.js";

const rounds = Number(process.argv[2] ?? 5);
const scale = Number(process.argv[3] ?? 1);
const redisUrl = process.env.TOLLGATE_REDIS_URL ?? "redis://127.0.0.1:6379";
const tag = `${process.pid}x${Date.now().toString(36)}`;
const keys = Array.from({ length: 1_000 }, (_, i) => `user${i}`);
const big = { kind: "token bucket", rate: 1e12, period: 1_000 };

/** Ops/s of `calls` calls of `call(i)`, `inFlight` at a time. */
async function measure(call, calls, inFlight) {
  let next = 0;
  const started = process.hrtime.bigint();
  await Promise.all(
    Array.from({ length: inFlight }, async () => {
      while (next < calls) await call(next++);
    }),
  );
  return calls / (Number(process.hrtime.bigint() - started) / 1e9);
}

/** The middleware's decision of a request of user `keys[i % 1000]` (its verdict, with the
 *  header fields), as a framework's middleware asks it. */
function deciding(limiter, name) {
  const m = middleware({ limiter, limits: name, key: { header: "x-user" } }, { trustProxy: "" });
  return (i) => {
    const view = { ip: undefined, header: () => keys[i % 1_000] };
    return decide(m, undefined, undefined, view);
  };
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function compare(label, contenders, calls, inFlight) {
  const results = Object.fromEntries(Object.keys(contenders).map((k) => [k, []]));
  // One warm-up round each, not counted.
  for (const call of Object.values(contenders)) await measure(call, Math.ceil(calls / 5), inFlight);
  for (let r = 0; r < rounds; r++) {
    for (const [name, call] of Object.entries(contenders)) results[name].push(await measure(call, calls, inFlight));
  }
  const [ours, theirs] = Object.keys(contenders);
  const a = median(results[ours]);
  const b = median(results[theirs]);
  console.log(
    `${label.padEnd(9)} ${ours} ${Math.round(a).toLocaleString("en")}/s, ${theirs} ${Math.round(b).toLocaleString("en")}/s: ${(a / b).toFixed(2)}x` +
      `  (rounds: ${results[ours].map((x) => Math.round(x / 1e3)).join(" ")} k vs ${results[theirs].map((x) => Math.round(x / 1e3)).join(" ")} k)`,
  );
}

// Memory.
{
  const name = `mem${tag}`;
  const limiter = new RateLimiter({ store: "memory" }, { [name]: big });
  const peer = new RateLimiterMemory({ points: 1e12, duration: 3_600 });
  await compare(
    "memory",
    {
      tollgate: (i) => limiter.limit(name, { key: keys[i % 1_000] }),
      "rate-limiter-flexible": (i) => peer.consume(keys[i % 1_000]),
    },
    Math.round(200_000 * scale),
    1,
  );
  await compare(
    "mw memory",
    { "tollgate decide": deciding(limiter, name), "rate-limiter-flexible": (i) => peer.consume(keys[i % 1_000]) },
    Math.round(200_000 * scale),
    1,
  );
}

// Redis, and a leased hot key.
{
  const name = `redis${tag}`;
  const hot = `hot${tag}`;
  const limiter = new RateLimiter(
    { store: redisUrl, storeDeadline: 2_000, leases: { [hot]: true } },
    { [name]: big, [hot]: { kind: "token bucket", rate: 1e9, period: 1_000 } },
  );
  const redis = new Redis(redisUrl);
  const peer = new RateLimiterRedis({ storeClient: redis, keyPrefix: `flex${tag}`, points: 1e12, duration: 3_600 });
  await compare(
    "redis",
    {
      tollgate: (i) => limiter.limit(name, { key: keys[i % 1_000] }),
      "rate-limiter-flexible": (i) => peer.consume(keys[i % 1_000]),
    },
    Math.round(30_000 * scale),
    64,
  );
  await compare(
    "mw redis",
    { "tollgate decide": deciding(limiter, name), "rate-limiter-flexible": (i) => peer.consume(keys[i % 1_000]) },
    Math.round(30_000 * scale),
    64,
  );
  await compare(
    "leased",
    {
      tollgate: () => limiter.limit(hot, { key: "hot" }),
      "rate-limiter-flexible": () => peer.consume("hot"),
    },
    Math.round(30_000 * scale),
    64,
  );
  await limiter.close();
  redis.disconnect();
}
