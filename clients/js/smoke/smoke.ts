// Compiled by tsc in an empty project where only the packed package is installed, then run.
import { RateLimiter, SECOND, TollgateError, calculateRateLimit } from "tollgate-client";

const limiter = new RateLimiter({ url: process.argv[2] ?? "http://127.0.0.1:8787" }, {
  twoPerSecond: { kind: "token bucket", rate: 2, period: SECOND },
});
const key = `smoke-${Date.now()}`;
const answers = [];
for (let i = 0; i < 3; i++) answers.push((await limiter.limit("twoPerSecond", { key })).ok);
const value = await limiter.getValue("twoPerSecond", { key });
const local = calculateRateLimit(value, value.config, await limiter.getServerTime(), 1);
let status: number | undefined;
try {
  await limiter.limit("twoPerSecond", { key, count: 3 });
} catch (e) {
  if (e instanceof TollgateError) status = e.status;
}
console.log(JSON.stringify({ answers, value: value.value, localOk: local.ok, status }));
if (answers.join() !== "true,true,false" || status !== 400) process.exit(1);
