// Concurrency limits in-process (issue 60's goals), against the peers a Node user has, in one
// run, in interleaved rounds (tollgate, peer, tollgate, peer, ...), pairs/s as the median:
//   memory: an acquire + release pair on the memory store (`limiter.acquire(name, { key })`,
//           then `limiter.release(name, ticket, { key })`) vs bottleneck's local scheduling
//           of a job that does nothing (`new Bottleneck({ maxConcurrent })`,
//           `schedule(() => ...)`: it takes a slot, runs the job, frees the slot)
//   redis:  the same pair on Redis (TOLLGATE_REDIS_URL, default 127.0.0.1:6379) vs
//           redis-semaphore's `Semaphore` over ioredis (`acquire()`, `release()`), on one key
//   64 pairs in flight on each side, on a limit of 64 slots on one key: nothing waits or is
//   refused on either side.
//
//   npm run build && npm run build:addon -- --release && node bench-slots.mjs [ROUNDS] [SCALE]
//   (each round 2 s times SCALE a side)
import Bottleneck from "bottleneck";
import { Redis } from "ioredis";
import { Semaphore } from "redis-semaphore";

import { RateLimiter } from "./dist/index.js";

const rounds = Number(process.argv[2] ?? 5);
const scale = Number(process.argv[3] ?? 1);
const redisUrl = process.env.TOLLGATE_REDIS_URL ?? "redis://127.0.0.1:6379";
const tag = `${process.pid}x${Date.now().toString(36)}`;
const IN_FLIGHT = 64;

/** Pairs/s over `seconds`, `IN_FLIGHT` pairs at a time. */
async function measure(pair, seconds) {
  let done = 0;
  const started = process.hrtime.bigint();
  const until = started + BigInt(Math.round(seconds * 1e9));
  await Promise.all(
    Array.from({ length: IN_FLIGHT }, async () => {
      while (process.hrtime.bigint() < until) {
        await pair();
        done++;
      }
    }),
  );
  return done / (Number(process.hrtime.bigint() - started) / 1e9);
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

/** A pair of tollgate's: acquire a slot of `name` for `key`, then release it. */
function tollgatePair(limiter, name, key) {
  return async () => {
    const acquired = await limiter.acquire(name, { key });
    if (!acquired.ok) throw new Error(`refused: ${JSON.stringify(acquired)}`);
    if (!(await limiter.release(name, acquired.ticket, { key }))) throw new Error("not released");
  };
}

async function scenario(label, ours, theirs, seconds, peer) {
  const a = [];
  const b = [];
  await ours(); // warm-up: the store opened, the scripts loaded
  await theirs();
  for (let r = 0; r < rounds; r++) {
    a.push(await measure(ours, seconds));
    b.push(await measure(theirs, seconds));
  }
  const [x, y] = [median(a), median(b)];
  console.log(
    `${label}: tollgate ${Math.round(x)} pairs/s, ${peer} ${Math.round(y)} pairs/s: ${(x / y).toFixed(2)}x ` +
      `(rounds: ${a.map(Math.round).join(", ")} | ${b.map(Math.round).join(", ")})`,
  );
}

// memory
{
  const limiter = new RateLimiter({ store: "memory" }, { slots: { kind: "concurrency", max: IN_FLIGHT } });
  const bottleneck = new Bottleneck({ maxConcurrent: IN_FLIGHT });
  const job = () => Promise.resolve();
  await scenario(
    "memory",
    tollgatePair(limiter, "slots", "k"),
    () => bottleneck.schedule(job),
    2 * scale,
    "bottleneck",
  );
  await limiter.close();
}

// redis
{
  const limiter = new RateLimiter(
    { store: redisUrl },
    { slots: { kind: "concurrency", max: IN_FLIGHT } },
  );
  const redis = new Redis(redisUrl);
  const semaphore = () =>
    new Semaphore(redis, `bench-slots-${tag}-semaphore`, IN_FLIGHT, { acquireTimeout: 10_000, refreshInterval: 0 });
  const theirs = async () => {
    const s = semaphore();
    await s.acquire();
    await s.release();
  };
  await scenario("redis", tollgatePair(limiter, "slots", `k${tag}`), theirs, 2 * scale, "redis-semaphore");
  await limiter.close();
  redis.disconnect();
}
