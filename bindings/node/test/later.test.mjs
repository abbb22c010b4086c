// A store that is not reachable when the limiter is made, and comes up later: the calls fail
// with a TollgateError (503, nothing taken) meanwhile, and use the store once it answers,
// without a new limiter. The store's URL points at a free loopback port; later a forwarder to
// the real store starts on that port (the shared servers are never stopped). A store that
// fails to open (a SQLite directory not made yet) is opened again, once a second at most.
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { HOUR, RateLimiter, TollgateError } from "../dist/index.js";
import { forwarder, freePort, through } from "./proxy.mjs";
import { fresh, stores } from "./stores.mjs";

const networked = stores().filter(([label]) => label === "redis" || label === "postgres");

/** `call`'s first answer that is not an error, tried `tries` times 100 ms apart; else the
 *  last error. */
async function firstAnswer(call, tries) {
  let answer;
  for (let i = 0; i < tries; i++) {
    answer = await call().catch((e) => e);
    if (!(answer instanceof Error)) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  return answer;
}

for (const [label, store] of networked) {
  test(`${label}: down when the limiter is made, used once it comes up`, { skip: store === undefined && "no URL" }, async () => {
    const port = await freePort();
    const name = fresh("later");
    const limiter = new RateLimiter({ store: through(store, port), storeDeadline: 500 }, {
      [name]: { kind: "token bucket", rate: 2, period: HOUR },
    });
    const calls = [
      () => limiter.limit(name, { key: "k" }),
      () => limiter.transaction([{ name, key: "k" }]),
      () => limiter.check(name, { key: "k" }),
    ];
    for (const call of calls) {
      await assert.rejects(call(), (e) => {
        assert.ok(e instanceof TollgateError, String(e));
        assert.equal(e.status, 503);
        assert.equal(e.mayHaveTaken, false);
        return true;
      });
    }
    const up = await forwarder({ to: store, port });
    try {
      const started = Date.now();
      const answer = await firstAnswer(() => limiter.check(name, { key: "k" }), 100);
      assert.deepEqual(answer, { ok: true }, String(answer));
      console.log(`${label}: answered ${Date.now() - started} ms after the store came up`);
      const answers = [];
      for (let i = 0; i < 3; i++) answers.push((await limiter.limit(name, { key: "k" })).ok);
      assert.deepEqual(answers, [true, true, false]);
      await limiter.close();
    } finally {
      await up.close();
    }
  });
}

test("sqlite: a file whose directory is made after the limiter is used from then on", async () => {
  const dir = join(mkdtempSync(join(tmpdir(), "tollgate-later-")), "not-yet");
  const name = fresh("later");
  const limiter = new RateLimiter({ store: `sqlite://${join(dir, "states.db")}` }, {
    [name]: { kind: "token bucket", rate: 2, period: HOUR },
  });
  await assert.rejects(limiter.limit(name, { key: "k" }), (e) => {
    assert.ok(e instanceof TollgateError, String(e));
    assert.equal(e.status, 503);
    assert.match(e.message, /could not be opened/);
    return true;
  });
  mkdirSync(dir);
  const started = Date.now();
  const answer = await firstAnswer(() => limiter.limit(name, { key: "k" }), 50);
  assert.deepEqual(answer, { ok: true }, String(answer));
  console.log(`sqlite: opened ${Date.now() - started} ms after its directory was made`);
  assert.deepEqual(await limiter.limit(name, { key: "k" }), { ok: true });
  assert.equal((await limiter.limit(name, { key: "k" })).ok, false);
});

const postgres = process.env.TOLLGATE_POSTGRES_URL;
test("a store that refuses to open is tried again at most once a second, however many calls come", { skip: !postgres && "no TOLLGATE_POSTGRES_URL" }, async () => {
  // A role PostgreSQL does not know: each open is one connection, refused at its login.
  const counted = await forwarder({ to: postgres });
  const url = new URL(through(postgres, counted.port));
  url.username = fresh("nobody");
  const limiter = new RateLimiter({ store: url.toString() }, { x: { kind: "token bucket", rate: 2, period: HOUR } });
  try {
    const started = Date.now();
    let calls = 0;
    while (Date.now() - started < 2_500) {
      await Promise.all(Array.from({ length: 50 }, () => limiter.limit("x", { key: "k" }).catch(() => calls++)));
      await new Promise((r) => setTimeout(r, 5));
    }
    const seconds = (Date.now() - started) / 1_000;
    const opens = counted.accepted();
    console.log(`${calls} calls failed in ${seconds.toFixed(1)} s; connections to PostgreSQL: ${opens}`);
    assert.ok(calls >= 1_000, `only ${calls} calls`);
    assert.ok(opens >= 2, `not tried again (${opens} connections)`);
    assert.ok(opens <= Math.ceil(seconds) + 1, `${opens} connections in ${seconds} s`);
  } finally {
    await counted.close();
  }
});
