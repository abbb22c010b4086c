// Concurrency limits (SPEC §6f) in this process on every store: acquire up to max, release,
// renew, hold released by `await using` (a module compiled by tsc, as a project would), the
// same answers and errors as a server's, and the limits' configs checked at the constructor.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath, pathToFileURL } from "node:url";

import { Held, MINUTE, RateLimitError, RateLimiter, TollgateError } from "../dist/index.js";
import { fresh, stores } from "./stores.mjs";

const pkg = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

/** `work(limiter, name, key, fail)`, compiled from TypeScript: holds a slot of `name` with
 *  `await using` and answers the slots in flight inside the block (-1 when refused); throws
 *  inside the block when `fail`. */
let work;
let dir;

before(() => {
  dir = mkdtempSync(join(tmpdir(), "tollgate-node-using-"));
  mkdirSync(join(dir, "node_modules"));
  symlinkSync(pkg, join(dir, "node_modules", "tollgate"), "dir");
  const tsconfig = {
    compilerOptions: {
      target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", lib: ["ES2022"],
      strict: true, skipLibCheck: true, types: [], outDir: "out",
    },
    include: ["*.ts"],
  };
  writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
  writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(tsconfig));
  writeFileSync(
    join(dir, "work.ts"),
    `import { RateLimiter } from "tollgate";

export async function work(limiter: RateLimiter, name: string, key: string, fail: boolean): Promise<number> {
  await using slot = await limiter.hold(name, { key });
  if (slot === null) return -1;
  const held = (await limiter.getSlotsValue(name, { key })).inFlight;
  if (fail) throw new Error("the work failed");
  return held;
}
`,
  );
  const tsc = join(pkg, "node_modules", "typescript", "bin", "tsc");
  const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
  assert.equal(run.status, 0, run.stdout + run.stderr);
});

before(async () => {
  ({ work } = await import(pathToFileURL(join(dir, "out", "work.js")).href));
});

after(() => rmSync(dir, { recursive: true, force: true }));

for (const [label, store] of stores()) {
  test(`a transaction takes a slot and tokens all or nothing on the ${label} store`, { skip: store === undefined && "no URL" }, async () => {
    const exports = fresh("exports");
    const send = fresh("send");
    const limiter = new RateLimiter({ store }, {
      [exports]: { kind: "concurrency", max: 1, ttl: "1m" },
      [send]: { kind: "token bucket", rate: 10, period: MINUTE },
    });
    try {
      // One key's slot and tokens (a hash tag: one slot of a Redis Cluster).
      const key = "{acme}";
      const both = await limiter.transaction([{ name: exports, key }, { name: send, key, count: 6 }]);
      assert.equal(both.ok, true, JSON.stringify(both));
      assert.match(both.ticket, /^\d+$/);
      assert.equal(typeof both.expiresAt, "number");
      assert.equal((await limiter.getSlotsValue(exports, { key })).inFlight, 1);
      // Refused by the tokens: no slot held; by the slots: no token taken.
      assert.equal(await limiter.release(exports, both.ticket, { key }), true);
      const short = await limiter.transaction([{ name: exports, key }, { name: send, key, count: 6 }]);
      assert.equal(short.ok, false);
      assert.equal(short.ticket, undefined);
      assert.deepEqual(short.results.map((r) => r.ok), [true, false]);
      assert.equal((await limiter.getSlotsValue(exports, { key })).inFlight, 0);
      const held = await limiter.acquire(exports, { key });
      const full = await limiter.transaction([{ name: exports, key }, { name: send, key, count: 1 }]);
      assert.deepEqual(full.results.map((r) => r.ok), [false, true]);
      const left = (await limiter.getValue(send, { key })).value;
      assert.ok(left < 5, `${left}`);
      assert.equal(await limiter.release(exports, held.ticket, { key }), true);
      const again = await limiter.transaction([{ name: send, key, count: 1 }, { name: exports, key }]);
      assert.equal(again.ok, true);
      assert.ok((await limiter.getValue(send, { key })).value < left, "the token taken with the slot");
      assert.equal(await limiter.release(exports, again.ticket, { key }), true);
    } finally {
      await limiter.close();
    }
  });

  test(`concurrency limits on the ${label} store`, { skip: store === undefined && "no URL" }, async () => {
    const exports = fresh("exports");
    const send = fresh("send");
    const limiter = new RateLimiter({ store }, {
      [exports]: { kind: "concurrency", max: 2, ttl: "1m" },
      [send]: { kind: "token bucket", rate: 10, period: MINUTE },
    });
    try {
      // Up to max granted, each with a ticket of its own and the limit's ttl.
      const now = await limiter.getServerTime();
      const first = await limiter.acquire(exports, { key: "acme" });
      const second = await limiter.acquire(exports, { key: "acme" });
      assert.equal(first.ok && second.ok, true, JSON.stringify([first, second]));
      assert.match(first.ticket, /^\d+$/);
      assert.notEqual(first.ticket, second.ticket);
      assert.ok(first.expiresAt >= now + 59_000 && first.expiresAt < now + 65_000, `${first.expiresAt - now}`);
      assert.deepEqual(await limiter.getSlotsValue(exports, { key: "acme" }), { inFlight: 2, max: 2, holders: 2 });

      // The next is refused until the earliest expiry, nothing taken; another key is its own.
      const refused = await limiter.acquire(exports, { key: "acme" });
      assert.equal(refused.ok, false);
      assert.ok(refused.retryAfter > 55_000 && refused.retryAfter <= 60_000, `${refused.retryAfter}`);
      assert.equal((await limiter.check(exports, { key: "acme" })).ok, false);
      assert.deepEqual(await limiter.getSlotsValue(exports, { key: "acme" }), { inFlight: 2, max: 2, holders: 2 });
      assert.equal((await limiter.acquire(exports, { key: "globex" })).ok, true);
      await assert.rejects(limiter.acquire(exports, { key: "acme", throws: true }), (e) => {
        assert.ok(e instanceof RateLimitError, String(e));
        assert.equal(e.name, exports);
        assert.ok(e.retryAfter > 55_000);
        return true;
      });
      assert.equal(await limiter.hold(exports, { key: "acme" }), null);

      // A release frees its slot, once.
      assert.equal(await limiter.release(exports, first.ticket, { key: "acme" }), true);
      assert.equal(await limiter.release(exports, first.ticket, { key: "acme" }), false);
      assert.equal((await limiter.getSlotsValue(exports, { key: "acme" })).inFlight, 1);

      // renew moves the expiry; a ticket past its expiry renews to ok: false, releases to
      // false, and its slot is free.
      const renewed = await limiter.renew(exports, second.ticket, { key: "acme", ttl: "2m" });
      assert.equal(renewed.ok, true);
      assert.ok(renewed.expiresAt - second.expiresAt > 50_000, `${renewed.expiresAt - second.expiresAt}`);
      const brief = await limiter.acquire(exports, { key: "acme", ttl: 150 });
      assert.equal(brief.ok, true);
      assert.equal((await limiter.acquire(exports, { key: "acme" })).ok, false);
      await sleep(300);
      assert.deepEqual(await limiter.renew(exports, brief.ticket, { key: "acme" }), { ok: false });
      assert.equal(await limiter.release(exports, brief.ticket, { key: "acme" }), false);
      assert.equal((await limiter.getSlotsValue(exports, { key: "acme" })).inFlight, 1);

      // await using: held inside the block, released after it, however it ends.
      assert.equal(await work(limiter, exports, "acme", false), 2);
      assert.equal((await limiter.getSlotsValue(exports, { key: "acme" })).inFlight, 1);
      await assert.rejects(work(limiter, exports, "acme", true), { message: "the work failed" });
      assert.equal((await limiter.getSlotsValue(exports, { key: "acme" })).inFlight, 1);
      const held = await limiter.hold(exports, { key: "acme" });
      assert.ok(held instanceof Held);
      assert.equal(await work(limiter, exports, "acme", false), -1, "refused: both slots held");
      assert.equal(await held.release(), true);
      assert.equal(await held.release(), false);

      // Several slots at once; more than max is an error.
      assert.equal((await limiter.acquire(exports, { key: "initech", count: 2 })).ok, true);
      assert.deepEqual(await limiter.getSlotsValue(exports, { key: "initech" }), { inFlight: 2, max: 2, holders: 1 });
      await assert.rejects(limiter.acquire(exports, { key: "initech", count: 3 }), (e) => {
        assert.ok(e instanceof TollgateError);
        assert.equal(e.status, 400);
        assert.match(e.message, /more than the limit's max of 2/);
        return true;
      });

      // reset frees every slot of the key.
      await limiter.reset(exports, { key: "initech" });
      assert.deepEqual(await limiter.getSlotsValue(exports, { key: "initech" }), { inFlight: 0, max: 2, holders: 0 });

      // A rate limit's calls do not take a concurrency limit's name, nor the other way.
      await assert.rejects(limiter.limit(exports, { key: "acme" }), (e) => {
        assert.ok(e instanceof TollgateError);
        assert.equal(e.status, 400);
        assert.match(e.message, /is a concurrency limit: take its slots with \/v1\/acquire/);
        return true;
      });
      await assert.rejects(limiter.acquire(send), { status: 400, message: /is a rate limit/ });
      await assert.rejects(limiter.acquire(fresh("nope")), { status: 404 });
      assert.deepEqual((await limiter.getServerLimits())[exports], { kind: "concurrency", max: 2, ttl: 60_000 });
    } finally {
      await limiter.close();
    }
  });
}

test("a concurrency limit's config is checked at the constructor: a TypeError", () => {
  assert.throws(() => new RateLimiter("memory", { gpu: { kind: "concurrency", max: 0 } }), TypeError);
  assert.throws(() => new RateLimiter("memory", { gpu: { kind: "concurrency" } }), /a concurrency limit needs max/);
  assert.throws(() => new RateLimiter("memory", { gpu: { kind: "concurrency", max: 2, ttl: "soon" } }), /ttl/);
  assert.throws(() => new RateLimiter("memory", { gpu: { kind: "concurrency", max: 2, rate: 3 } }), /unknown field `rate`/);
  assert.throws(
    () => new RateLimiter({ store: "memory", failOpen: ["gpu"] }, { gpu: { kind: "concurrency", max: 2 } }),
    /failOpen is not for a concurrency limit/,
  );
});

test("a store that is down fails acquire, release and renew with a TollgateError; await using still ends", async () => {
  const name = fresh("down");
  const limiter = new RateLimiter({ store: "redis://127.0.0.1:1", storeDeadline: 300 }, {
    [name]: { kind: "concurrency", max: 1 },
  });
  try {
    for (const call of [
      () => limiter.acquire(name),
      () => limiter.hold(name),
      () => limiter.release(name, "1"),
      () => limiter.renew(name, "1"),
    ]) {
      await assert.rejects(call(), (e) => {
        assert.ok(e instanceof TollgateError, String(e));
        assert.equal(e.status, 503);
        return true;
      });
    }
  } finally {
    await limiter.close();
  }
});

test("a slot held when its limiter closes: the release at the block's end fails quietly", async () => {
  const name = fresh("closing");
  const limiter = new RateLimiter("memory", { [name]: { kind: "concurrency", max: 1 } });
  const slot = await limiter.hold(name);
  await limiter.close();
  await slot[Symbol.asyncDispose]();
  assert.equal(slot.released, false);
  await assert.rejects(slot.release(), TollgateError);
});
