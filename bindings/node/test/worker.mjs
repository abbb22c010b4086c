// One process of the tests across processes (processes.test.mjs), started by it:
//   node worker.mjs burst STORE NAME CONFIG N AT        N calls at once at AT (ms epoch), then
//                                                     prints {"admitted": k}
//   node worker.mjs flexible REDIS_URL KEY POINTS N AT  the same with rate-limiter-flexible's
//                                                     RateLimiterRedis over ioredis
//   node worker.mjs hammer STORE NAME CONFIG MS         one call after another for MS (at most
//                                                     100,000), leased; "+" per grant, on a
//                                                     pipe that Node writes synchronously
import { RateLimiter } from "../dist/index.js";

const [mode, store, name, third, fourth, fifth] = process.argv.slice(2);
const sleepUntil = (at) => new Promise((done) => setTimeout(done, Math.max(0, at - Date.now())));

if (mode === "burst") {
  const limiter = new RateLimiter({ store }, { [name]: JSON.parse(third) });
  await limiter.getServerTime(); // the store opened before the start
  await sleepUntil(Number(fifth));
  const answers = await Promise.all(
    Array.from({ length: Number(fourth) }, () => limiter.limit(name, { key: "k" })),
  );
  console.log(JSON.stringify({ admitted: answers.filter((a) => a.ok).length }));
} else if (mode === "flexible") {
  const { RateLimiterRedis } = await import("rate-limiter-flexible");
  const { Redis } = await import("ioredis");
  const redis = new Redis(store);
  const limiter = new RateLimiterRedis({ storeClient: redis, keyPrefix: name, points: Number(third), duration: 3600 });
  await redis.ping();
  await sleepUntil(Number(fifth));
  const answers = await Promise.allSettled(
    Array.from({ length: Number(fourth) }, () => limiter.consume("k")),
  );
  console.log(JSON.stringify({ admitted: answers.filter((a) => a.status === "fulfilled").length }));
  redis.disconnect();
} else if (mode === "hammer") {
  const limiter = new RateLimiter({ store, leases: { [name]: { term: 1_000 } } }, { [name]: JSON.parse(third) });
  await limiter.getServerTime();
  process.stdout.write("ready\n");
  const end = Date.now() + Number(fourth);
  for (let i = 0; i < 100_000 && Date.now() < end; i++) {
    if ((await limiter.limit(name, { key: "hot" })).ok) process.stdout.write("+");
  }
  await limiter.close();
  process.stdout.write("\ndone\n");
} else {
  throw new Error(`unknown mode ${mode}`);
}
