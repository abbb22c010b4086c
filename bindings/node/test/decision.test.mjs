// The middleware's decision (`decide`) on every store and both doors: in-process through the
// addon's function made for the middleware (never the JSON transaction), with the header
// fields the engine writes for the same transaction; admitting exactly min(N, M) of N requests
// at once against a limit of M; its limit names resolved when it is made.
import assert from "node:assert/strict";
import { test } from "node:test";
import { inspect } from "node:util";

import { MINUTE, RateLimiter } from "../dist/index.js";
import { decide, middleware } from "../dist/middleware.js";
import { startServer } from "../../../clients/js/test/server.mjs";
import { fresh, stores } from "./stores.mjs";

const framework = { trustProxy: "" };

/** A request of `user` as the frameworks show it to `decide`. */
const asUser = (user) => ({ ip: undefined, header: (name) => (name === "x-user" ? user : undefined) });

/** The verdict's fields as the engine writes them for a transaction (`fields: true`). */
function engineFields(result) {
  const names = { "ratelimit-policy": "RateLimit-Policy", ratelimit: "RateLimit", "retry-after": "Retry-After" };
  return Object.fromEntries(Object.entries(result.fields ?? {}).map(([name, value]) => [names[name], value]));
}

for (const [label, store] of stores()) {
  test(`${label}: the decision goes the direct path, with the engine's header fields`, { skip: store === undefined && "no URL" }, async () => {
    const a = fresh("a");
    const b = fresh("b");
    const limiter = new RateLimiter({ store, storeDeadline: 2_000 }, {
      [a]: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
      [b]: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 5 },
    });
    try {
      const m = middleware({ limiter, limits: [a, { name: b, count: 2 }], key: { header: "x-user" } }, framework);
      await limiter.getServerTime(); // open
      // The JSON path is the reference, for another user; the middleware may not use it.
      const transaction = limiter.transaction.bind(limiter);
      limiter.transaction = () => Promise.reject(new Error("the middleware went the JSON path"));
      for (let i = 0; i < 4; i++) {
        const verdict = await decide(m, undefined, undefined, asUser("{alice}"));
        const reference = await transaction([{ name: a, key: "{bob}" }, { name: b, count: 2, key: "{bob}" }], { fields: true });
        assert.equal(verdict.pass, reference.ok, `${label} ${i}: ${verdict.body}`);
        assert.deepEqual(verdict.headers, engineFields(reference), `${label} ${i}`);
        if (!verdict.pass) {
          // b has 1 token left of the 2 asked; a kept its token: nothing was taken.
          assert.equal(verdict.status, 429);
          const body = JSON.parse(verdict.body);
          assert.equal(body.name, b);
          assert.ok(body.retryAfter > 5_000 && body.retryAfter <= 6_000, String(body.retryAfter));
          assert.match(verdict.headers.RateLimit, new RegExp(`^"${a}";r=1;t=12, "${b}";r=1;t=24$`));
        }
      }
      assert.deepEqual((await decide(m, undefined, undefined, asUser("{carol}"))).headers.RateLimit, `"${a}";r=2;t=6, "${b}";r=3;t=12`);
    } finally {
      await limiter.close();
    }
  });

  test(`${label}: the handlers' resetTime counts from the decision, its Date made once when read`, { skip: store === undefined && "no URL" }, async () => {
    const name = fresh("reset");
    const limiter = new RateLimiter({ store, storeDeadline: 2_000 }, { [name]: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 } });
    try {
      const m = middleware({ limiter, limits: name, key: { header: "x-user" } }, framework);
      await limiter.getServerTime(); // open
      const before = Date.now();
      const { info } = await decide(m, undefined, undefined, asUser("{dana}"));
      const after = Date.now();
      assert.deepEqual([info.limit, info.used, info.remaining, info.key], [3, 1, 2, "{dana}"]);
      const resetAfter = info.limits[0].resetAfter;
      assert.ok(resetAfter > 0 && resetAfter <= 6_000, String(resetAfter));
      // The addon's clock (the time its numbers were written) against Date.now(): the same
      // wall clock, read another way.
      const reset = info.resetTime.getTime();
      assert.ok(reset >= before + resetAfter - 1_000 && reset <= after + resetAfter + 1_000, `${reset - before} ms after the request`);
      assert.ok(info.resetTime instanceof Date);
      assert.equal(info.resetTime, info.resetTime, "the same Date at each read");
      assert.equal(JSON.parse(JSON.stringify(info)).resetTime, info.resetTime.toISOString());
      assert.deepEqual(Object.keys(JSON.parse(JSON.stringify(info))), ["limit", "used", "remaining", "resetTime", "key", "limits"]);
      assert.match(inspect(info), /resetTime: \d{4}-/);
      const mine = new Date(0);
      info.resetTime = mine;
      assert.equal(info.resetTime, mine, "a handler may set it");
    } finally {
      await limiter.close();
    }
  });

  test(`${label}: 20 requests at once against a limit of 5 admit exactly 5`, { skip: store === undefined && "no URL" }, async () => {
    const name = fresh("five");
    const limiter = new RateLimiter({ store, storeDeadline: 5_000 }, { [name]: { kind: "token bucket", rate: 5, period: MINUTE } });
    try {
      const m = middleware({ limiter, limits: name, key: "global" }, framework);
      await limiter.getServerTime();
      const verdicts = await Promise.all(Array.from({ length: 20 }, () => decide(m, undefined, undefined, asUser(undefined))));
      assert.equal(verdicts.filter((v) => v.pass).length, 5, verdicts.map((v) => v.status).join(" "));
      assert.ok(verdicts.every((v) => v.pass || v.status === 429), verdicts.map((v) => v.body).join(" "));
    } finally {
      await limiter.close();
    }
  });
}

for (const [label, store] of stores().filter(([label]) => label === "redis" || label === "postgres")) {
  test(`${label}: a leased limit through the middleware admits exactly its capacity`, { skip: store === undefined && "no URL" }, async () => {
    const name = fresh("leased");
    const limiter = new RateLimiter({ store, storeDeadline: 5_000, leases: { [name]: true } }, { [name]: { kind: "token bucket", rate: 20, period: MINUTE } });
    try {
      const m = middleware({ limiter, limits: name, key: { header: "x-user" } }, framework);
      await limiter.getServerTime();
      const transaction = limiter.transaction.bind(limiter);
      limiter.transaction = () => Promise.reject(new Error("the middleware went the JSON path"));
      const verdicts = [];
      for (let i = 0; i < 30; i++) verdicts.push(await decide(m, undefined, undefined, asUser("hot")));
      assert.equal(verdicts.filter((v) => v.pass).length, 20, verdicts.map((v) => v.status).join(" "));
      assert.equal(verdicts.at(-1).status, 429);
      // The fields are those of the engine (its leased limit's own numbers).
      limiter.transaction = transaction;
      const reference = await transaction([{ name, key: "hot" }], { fields: true });
      assert.deepEqual(verdicts.at(-1).headers, engineFields(reference));
    } finally {
      await limiter.close();
    }
  });
}

test("over a server: the transaction, 20 requests at once against 5 admit exactly 5, the same fields", async () => {
  const name = fresh("served");
  const server = await startServer({ config: `[limits.${name}]\nkind = "token bucket"\nrate = 5\nperiod = "1m"\n` });
  const limiter = new RateLimiter({ url: server.url });
  try {
    const m = middleware({ limiter, limits: name, key: { header: "x-user" } }, framework);
    const verdicts = await Promise.all(Array.from({ length: 20 }, () => decide(m, undefined, undefined, asUser("dave"))));
    assert.equal(verdicts.filter((v) => v.pass).length, 5);
    const reference = await limiter.transaction([{ name, key: "dave" }], { fields: true });
    const last = await decide(m, undefined, undefined, asUser("dave"));
    assert.deepEqual(last.headers, engineFields(reference));
    // A limit the server does not define: the app's error at the request, naming the ones it does.
    const misspelled = middleware({ limiter, limits: `${name}x` }, framework);
    const view = { ip: "192.0.2.1", header: () => undefined };
    const said = [];
    const error = console.error;
    console.error = (line) => said.push(line);
    try {
      const verdict = await decide(misspelled, undefined, undefined, view);
      assert.equal(verdict.status, 500);
      assert.deepEqual(JSON.parse(verdict.body), { error: `Rate limit ${name}x is not defined.` });
    } finally {
      console.error = error;
    }
    assert.match(said.join("\n"), new RegExp(`takes "${name}x", which the limiter does not define`));
  } finally {
    await limiter.close();
    await server.stop();
  }
});

test("an undefined limit name fails when the middleware is made, with the names defined", () => {
  const name = fresh("perUser");
  const limiter = new RateLimiter("memory", { [name]: { kind: "token bucket", rate: 5, period: MINUTE } });
  assert.throws(
    () => middleware({ limiter, limits: [name, `${name}s`] }, framework),
    (e) => e instanceof TypeError && e.message.includes(`"${name}s" is not a limit of the limiter; it has "${name}"`),
  );
  assert.throws(() => middleware({ limiter: new RateLimiter("memory"), limits: "x" }, framework), /"x" is not a limit of the limiter; it has none/);
});

test("a limit that fails open: granted while the store is down, without fields it cannot know", async () => {
  const name = fresh("open");
  const limiter = new RateLimiter({ store: "redis://127.0.0.1:1", storeDeadline: 200, failOpen: [name] }, { [name]: { kind: "token bucket", rate: 5, period: MINUTE } });
  try {
    const m = middleware({ limiter, limits: name, key: { header: "x-user" } }, framework);
    await limiter.getServerTime().catch(() => {});
    const verdict = await decide(m, undefined, undefined, asUser("erin"));
    assert.equal(verdict.pass, true, verdict.body);
    assert.deepEqual(verdict.headers, {});
  } finally {
    await limiter.close();
  }
});
