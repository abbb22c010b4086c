// Concurrency limits (SPEC §6f) through the client, against the real server: acquire up to
// max, release, renew, hold and `await using` (compiled by tsc, as a project would), and the
// errors of each.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

import { Held, RateLimiter, RateLimitError, TollgateError } from "../dist/index.js";
import { startServer } from "./server.mjs";

const CONFIG = `
[server]
tokens = ["full-token"]
readTokens = ["read-token"]

[limits.exports]
kind = "concurrency"
max = 2
ttl = "1m"

[limits.sendMessage]
kind = "token bucket"
rate = 10
period = 60000
`;

let server;
let limiter;
let unique = 0;
/** A key no other test uses. */
const key = () => `k${++unique}-${Math.random()}`;

before(async () => {
  server = await startServer({ config: CONFIG });
  limiter = new RateLimiter({ url: server.url, token: "full-token" });
});
after(() => server.stop());

const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

test("acquire grants up to max, refuses the next until a release frees a slot", async () => {
  const k = key();
  const now = await limiter.getServerTime();
  const first = await limiter.acquire("exports", { key: k });
  const second = await limiter.acquire("exports", { key: k });
  assert.equal(first.ok, true);
  assert.equal(second.ok, true);
  assert.match(first.ticket, /^\d+$/);
  assert.notEqual(first.ticket, second.ticket);
  assert.deepEqual(Object.keys(first).sort(), ["expiresAt", "ok", "ticket"]);
  // The limit's ttl (1m) from the store's clock.
  assert.ok(first.expiresAt >= now + 60_000 && first.expiresAt < now + 65_000, `${first.expiresAt - now}`);
  assert.deepEqual(await limiter.getSlotsValue("exports", { key: k }), { inFlight: 2, max: 2, holders: 2 });

  const third = await limiter.acquire("exports", { key: k });
  assert.equal(third.ok, false);
  assert.deepEqual(Object.keys(third).sort(), ["ok", "retryAfter"]);
  // Until the earliest holder's expiry.
  assert.ok(third.retryAfter > 55_000 && third.retryAfter <= 60_000, `${third.retryAfter}`);
  assert.equal((await limiter.check("exports", { key: k })).ok, false);
  // Another key has slots of its own.
  assert.equal((await limiter.acquire("exports", { key: key() })).ok, true);

  assert.equal(await limiter.release("exports", first.ticket, { key: k }), true);
  assert.equal(await limiter.release("exports", first.ticket, { key: k }), false, "released twice");
  assert.deepEqual(await limiter.getSlotsValue("exports", { key: k }), { inFlight: 1, max: 2, holders: 1 });
  assert.equal((await limiter.check("exports", { key: k })).ok, true);
  assert.equal((await limiter.acquire("exports", { key: k })).ok, true);

  // reset frees every slot.
  await limiter.reset("exports", { key: k });
  assert.deepEqual(await limiter.getSlotsValue("exports", { key: k }), { inFlight: 0, max: 2, holders: 0 });
});

test("count takes several slots; more than max is a TollgateError (400)", async () => {
  const k = key();
  const both = await limiter.acquire("exports", { key: k, count: 2 });
  assert.equal(both.ok, true);
  assert.deepEqual(await limiter.getSlotsValue("exports", { key: k }), { inFlight: 2, max: 2, holders: 1 });
  assert.equal((await limiter.acquire("exports", { key: k, count: 1 })).ok, false);
  const error = await limiter.acquire("exports", { key: k, count: 3 }).catch((e) => e);
  assert.ok(error instanceof TollgateError, String(error));
  assert.equal(error.status, 400);
  assert.match(error.message, /more than the limit's max of 2/);
  assert.equal(error.mayHaveTaken, false);
});

test("renew moves the expiry; after the expiry it answers ok: false, and release false", async () => {
  const k = key();
  const short = await limiter.acquire("exports", { key: k, ttl: 300 });
  assert.equal(short.ok, true);
  const renewed = await limiter.renew("exports", short.ticket, { key: k, ttl: "2m" });
  assert.equal(renewed.ok, true);
  assert.ok(renewed.expiresAt - short.expiresAt > 100_000, `${renewed.expiresAt - short.expiresAt}`);
  assert.deepEqual(Object.keys(renewed).sort(), ["expiresAt", "ok"]);

  const brief = await limiter.acquire("exports", { key: k, ttl: "150ms" });
  assert.equal(brief.ok, true);
  // Both slots held: the next waits for the brief one, about 150 ms.
  const refused = await limiter.acquire("exports", { key: k });
  assert.equal(refused.ok, false);
  assert.ok(refused.retryAfter <= 150, `${refused.retryAfter}`);
  await sleep(250);
  assert.deepEqual(await limiter.renew("exports", brief.ticket, { key: k }), { ok: false });
  assert.equal(await limiter.release("exports", brief.ticket, { key: k }), false);
  // Its slot came free by itself.
  assert.equal((await limiter.acquire("exports", { key: k })).ok, true);
  // A ticket acquired under another key is not this key's.
  assert.equal(await limiter.release("exports", short.ticket, { key: key() }), false);
  assert.equal(await limiter.release("exports", short.ticket, { key: k }), true);
});

test("throws: a refused acquire or hold rejects with a RateLimitError", async () => {
  const k = key();
  await limiter.acquire("exports", { key: k, count: 2 });
  for (const call of [
    () => limiter.acquire("exports", { key: k, throws: true }),
    () => limiter.hold("exports", { key: k, throws: true }),
  ]) {
    const error = await call().catch((e) => e);
    assert.ok(error instanceof RateLimitError, String(error));
    assert.equal(error.name, "exports");
    assert.equal(error.kind, "RateLimited");
    assert.ok(error.retryAfter > 55_000 && error.retryAfter <= 60_000, `${error.retryAfter}`);
  }
  assert.equal(await limiter.hold("exports", { key: k }), null);
});

test("a Held: release once, renew, and nothing sent after the release", async () => {
  const k = key();
  const slot = await limiter.hold("exports", { key: k, ttl: "30s" });
  assert.ok(slot instanceof Held);
  assert.equal(slot.name, "exports");
  assert.equal(slot.key, k);
  assert.match(slot.ticket, /^\d+$/);
  assert.equal(slot.released, false);
  const before = slot.expiresAt;
  assert.equal(await slot.renew({ ttl: "2m" }), true);
  assert.ok(slot.expiresAt - before > 80_000, `${slot.expiresAt - before}`);
  assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 1);
  assert.equal(await slot.release(), true);
  assert.equal(slot.released, true);
  assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 0);
  assert.equal(await slot.release(), false);
  assert.equal(await slot.renew(), false);
  // Disposing a released slot sends nothing and throws nothing.
  await slot[Symbol.asyncDispose]();

  // A slot whose ticket expired: renew says so.
  const brief = await limiter.hold("exports", { key: k, ttl: 100 });
  await sleep(200);
  assert.equal(await brief.renew(), false);
  assert.equal(await brief.release(), false);
});

test("await using releases at the end of the block, however it ends (compiled by tsc)", async () => {
  const pkg = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");
  const dir = mkdtempSync(join(tmpdir(), "tollgate-using-"));
  try {
    mkdirSync(join(dir, "node_modules"));
    symlinkSync(pkg, join(dir, "node_modules", "tollgate-client"), "dir");
    // A project's own settings: no lib for disposables (the package's declarations bring it).
    const tsconfig = {
      compilerOptions: {
        target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", lib: ["ES2022", "DOM"],
        strict: true, types: [], outDir: "out",
      },
      include: ["*.ts"],
    };
    writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
    writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(tsconfig));
    writeFileSync(
      join(dir, "work.ts"),
      `import { RateLimiter } from "tollgate-client";

export async function work(limiter: RateLimiter, key: string, fail: boolean): Promise<number> {
  await using slot = await limiter.hold("exports", { key });
  if (slot === null) return -1;
  const held = (await limiter.getSlotsValue("exports", { key })).inFlight;
  if (fail) throw new Error("the work failed");
  return held;
}
`,
    );
    const tsc = join(pkg, "node_modules", "typescript", "bin", "tsc");
    const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
    assert.equal(run.status, 0, run.stdout + run.stderr);
    const { work } = await import(pathToFileURL(join(dir, "out", "work.js")).href);

    const k = key();
    // Held inside the block, released after it.
    assert.equal(await work(limiter, k, false), 1);
    assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 0);
    // The block throws: the error comes out as it was, and the slot is released.
    await assert.rejects(work(limiter, k, true), { message: "the work failed" });
    assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 0);
    // Refused: null, which `await using` takes (nothing to release).
    await limiter.acquire("exports", { key: k, count: 2 });
    assert.equal(await work(limiter, k, false), -1);
    assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 2);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a release that fails at the block's end is not thrown; release() says it", async () => {
  const own = await startServer({ config: CONFIG });
  const client = new RateLimiter({ url: own.url, token: "full-token", timeoutMs: 2_000 });
  const slot = await client.hold("exports", { key: key() });
  await own.stop();
  await slot[Symbol.asyncDispose]();
  assert.equal(slot.released, false);
  const error = await slot.release().catch((e) => e);
  assert.ok(error instanceof TollgateError, String(error));
  assert.equal(error.status, undefined);
  await client.close();
});

test("errors: a rate limit's name, an undefined one, a read token, arguments of the wrong type", async () => {
  const rate = await limiter.acquire("sendMessage").catch((e) => e);
  assert.ok(rate instanceof TollgateError);
  assert.equal(rate.status, 400);
  assert.match(rate.message, /is a rate limit/);
  const missing = await limiter.acquire("nope").catch((e) => e);
  assert.equal(missing.status, 404);
  assert.match(missing.message, /Concurrency limit nope not defined/);
  // A concurrency limit's value is read with getSlotsValue, not getValue.
  const value = await limiter.getValue("exports").catch((e) => e);
  assert.ok(value instanceof TollgateError);
  assert.match(value.message, /unexpected answer from \/v1\/value/);
  const rateValue = await limiter.getSlotsValue("sendMessage").catch((e) => e);
  assert.match(rateValue.message, /not a concurrency limit's value/);
  // A ticket that is not one an acquire answered.
  const ticket = await limiter.release("exports", "abc").catch((e) => e);
  assert.equal(ticket.status, 400);
  assert.match(ticket.message, /ticket/);

  // A read token may check and read, not acquire, release or renew.
  const reader = new RateLimiter({ url: server.url, token: "read-token" });
  assert.equal((await reader.check("exports")).ok, true);
  assert.deepEqual(await reader.getSlotsValue("exports", { key: key() }), { inFlight: 0, max: 2, holders: 0 });
  for (const call of [
    () => reader.acquire("exports"),
    () => reader.release("exports", "1"),
    () => reader.renew("exports", "1"),
  ]) {
    const error = await call().catch((e) => e);
    assert.ok(error instanceof TollgateError);
    assert.equal(error.status, 403);
  }

  // Checked before anything is sent: a TypeError.
  for (const [call, pattern] of [
    [() => limiter.acquire("exports", "alice"), /acquire: the options must be an object/],
    [() => limiter.acquire("exports", { key: 5 }), /acquire: key must be a string/],
    [() => limiter.acquire("exports", { count: Number.NaN }), /acquire: count must be a finite number/],
    [() => limiter.acquire("exports", { ttl: Number.POSITIVE_INFINITY }), /acquire: ttl must be milliseconds/],
    [() => limiter.hold("exports", { ttl: "2 minutes" }), /hold: ttl must be milliseconds/],
    [() => limiter.acquire("exports", { throws: "yes" }), /acquire: throws must be true or false/],
    [() => limiter.release("exports", 17), /release: ticket must be the string an acquire answered/],
    [() => limiter.renew("exports", undefined), /renew: ticket must be the string/],
    [() => limiter.renew("exports", "1", { ttl: null }), /renew: ttl must be milliseconds/],
    [() => limiter.getSlotsValue(5), /getSlotsValue: the limit's name must be a string/],
  ]) {
    await assert.rejects(call(), (e) => e instanceof TypeError && pattern.test(e.message));
  }
});

test("a transaction naming a concurrency limit: its result carries the ticket and its expiry, for release", async () => {
  const k = key();
  const now = await limiter.getServerTime();
  const taken = await limiter.transaction([
    { name: "sendMessage", key: k },
    { name: "exports", key: k },
  ]);
  assert.equal(taken.ok, true);
  assert.deepEqual(taken.results[0], { ok: true });
  const slot = taken.results[1];
  assert.deepEqual(Object.keys(slot).sort(), ["expiresAt", "ok", "ticket"]);
  assert.match(slot.ticket, /^\d+$/);
  assert.ok(slot.expiresAt >= now + 60_000 && slot.expiresAt < now + 65_000, `${slot.expiresAt - now}`);
  assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 1);
  assert.equal(await limiter.release("exports", slot.ticket, { key: k }), true);
  assert.equal((await limiter.getSlotsValue("exports", { key: k })).inFlight, 0);
  // Refused (the slots full): no ticket.
  await limiter.acquire("exports", { key: k, count: 2 });
  const refused = await limiter.transaction([{ name: "exports", key: k }]);
  assert.equal(refused.ok, false);
  assert.equal(refused.results[0].ticket, undefined);
});
