// Names checked by the compiler: a misspelled limit's name fails `tsc --noEmit`, the same file
// spelled right passes; names the server defines come from `tollgate types`.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { binary } from "./server.mjs";

const pkg = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");
const tsc = join(pkg, "node_modules", "typescript", "bin", "tsc");

/** A project that installed this package (a link to it), with `files` written in it. */
function project(files) {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-types-"));
  mkdirSync(join(dir, "node_modules"));
  symlinkSync(pkg, join(dir, "node_modules", "tollgate-client"), "dir");
  const tsconfig = {
    compilerOptions: {
      target: "ES2022",
      module: "NodeNext",
      moduleResolution: "NodeNext",
      lib: ["ES2022", "DOM"],
      strict: true,
      noEmit: true,
      types: [],
    },
    include: ["*.ts"],
  };
  writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
  writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(tsconfig));
  for (const [name, text] of Object.entries(files)) writeFileSync(join(dir, name), text);
  const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
  rmSync(dir, { recursive: true, force: true });
  return { status: run.status, output: run.stdout + run.stderr };
}

/** A program using the limits named in code, one named by the server, and an inline one. */
const program = (inCode, byServer) => `
import { RateLimiter, MINUTE, isRateLimitError } from "tollgate-client";
import { useRateLimit } from "tollgate-client/react";

const limiter = new RateLimiter({ url: "http://127.0.0.1:8787" }, {
  sendMessage: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 },
});

export async function run(): Promise<boolean> {
  const { ok, retryAfter } = await limiter.limit("${inCode}", { key: "alice" });
  await limiter.check("${inCode}");
  await limiter.reset("${inCode}", { key: "alice" });
  const value: number = (await limiter.getValue("${inCode}")).value;
  await limiter.limit("${byServer}", { count: 2 });
  await limiter.limit("oneOff", { config: { kind: "fixed window", rate: 1, period: 1000 } });
  await limiter.transaction([{ name: "${inCode}" }, { name: "${byServer}", count: 2 }]);
  try {
    await limiter.limit("${inCode}", { throws: true });
  } catch (e) {
    if (isRateLimitError(e)) return e.retryAfter > 0;
  }
  return ok && retryAfter === undefined && value > 0;
}

export function useStatus() {
  return useRateLimit(limiter, { name: "sendMessage", key: "alice" }).status?.retryAt;
}
`;

/** The declaration `tollgate types` prints for a config that defines `example`. */
function serverTypes() {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-types-config-"));
  const config = join(dir, "tollgate.toml");
  writeFileSync(config, '[limits.example]\nkind = "token bucket"\nrate = 10\nperiod = "1m"\ncapacity = 3\n');
  const run = spawnSync(binary(), ["types", "--config", config], { encoding: "utf8" });
  rmSync(dir, { recursive: true, force: true });
  assert.equal(run.status, 0, run.stderr);
  assert.match(run.stdout, /declare module "tollgate-client"/);
  assert.match(run.stdout, /"example": \{ readonly capacity: 3; readonly kind: "token bucket"; readonly period: 60000; readonly rate: 10; readonly shards: 1 \};/);
  return run.stdout;
}

test("names spelled right compile; a misspelled one does not", () => {
  const declaration = serverTypes();
  const good = project({ "app.ts": program("sendMessage", "example"), "server-limits.d.ts": declaration });
  assert.equal(good.status, 0, good.output);

  const misspelled = project({ "app.ts": program("sendMesage", "example"), "server-limits.d.ts": declaration });
  assert.notEqual(misspelled.status, 0);
  assert.match(misspelled.output, /app\.ts\(10,/, misspelled.output);
  assert.match(misspelled.output, /error TS2345: .*\n\s+Property 'config' is missing/);

  // A name the server defines is known only through the declaration.
  const serverMisspelled = project({ "app.ts": program("sendMessage", "exmple"), "server-limits.d.ts": declaration });
  assert.notEqual(serverMisspelled.status, 0);
  assert.match(serverMisspelled.output, /app\.ts\(14,/, serverMisspelled.output);
  const undeclared = project({ "app.ts": program("sendMessage", "example") });
  assert.notEqual(undeclared.status, 0);
  assert.match(undeclared.output, /app\.ts\(14,/, undeclared.output);
});

test("tollgate types --url reads a running server's limits", async () => {
  const { startServer } = await import("./server.mjs");
  const server = await startServer({
    config: '[server]\ntokens = ["w"]\nreadTokens = ["r"]\n[limits.daily]\nkind = "fixed window"\nrate = 3\nperiod = "1d"\n',
  });
  try {
    const run = spawnSync(binary(), ["types", "--url", server.url], {
      encoding: "utf8",
      env: { ...process.env, TOLLGATE_TOKEN: "r" },
    });
    assert.equal(run.status, 0, run.stderr);
    assert.match(run.stdout, /"daily": \{ readonly capacity: 3; readonly kind: "fixed window"; readonly period: 86400000; readonly rate: 3; readonly shards: 1 \};/);
    const refused = spawnSync(binary(), ["types", "--url", server.url], {
      encoding: "utf8",
      env: { ...process.env, TOLLGATE_TOKEN: "" },
    });
    assert.notEqual(refused.status, 0);
    assert.match(refused.stderr, /answered 401/);
  } finally {
    await server.stop();
  }
});
