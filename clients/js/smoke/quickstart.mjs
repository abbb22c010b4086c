// The README's quick start as printed, against the server at argv[2] (default 127.0.0.1:8787),
// run by clients/smoke in an empty project where only the packed package is installed.
import { RateLimiter, MINUTE, HOUR, isRateLimitError } from "tollgate-client";

const url = process.argv[2] ?? "http://127.0.0.1:8787";
const limiter = new RateLimiter({ url }, {
  // Named in code: the config travels with each call.
  sendMessage: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
  freeTrialSignUp: { kind: "fixed window", rate: 100, period: HOUR },
});

const { ok, retryAfter } = await limiter.limit("sendMessage", { key: "alice" });
console.log(ok, retryAfter); // true undefined

// Reject instead of answering { ok: false }:
try {
  await limiter.limit("freeTrialSignUp", { throws: true });
} catch (e) {
  if (isRateLimitError(e)) console.log(`${e.name}: retry in ${e.retryAfter} ms`);
  else throw e;
}
if (ok !== true || retryAfter !== undefined) process.exit(1);
