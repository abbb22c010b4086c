// Node's two Redis clients, with their defaults, against `tollgate serve --resp-listen`:
// ioredis and node-redis (the `redis` package). Each connects (its handshake: HELLO 3,
// CLIENT SETINFO, INFO for ioredis's ready check), runs redis-cell's CL.THROTTLE and compares
// every integer, pipelines, runs TG.* commands, and authenticates with a token.
// TOLLGATE_BIN names the binary (default: the workspace's debug build).
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import Redis from "ioredis";
import { createClient } from "redis";

const here = dirname(fileURLToPath(import.meta.url));
const bin = process.env.TOLLGATE_BIN ?? join(here, "../../target/debug/tollgate");
const servers = [];

after(() => {
  for (const server of servers) server.kill();
});

const CONFIG = `
[limits.sendMessage]
kind = "token bucket"
rate = 10
period = "1m"
capacity = 3
`;

/** Starts the binary; resolves with its Redis protocol port once its banner says it. */
async function start(env = {}) {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-resp-"));
  writeFileSync(join(dir, "tollgate.toml"), CONFIG);
  const server = spawn(
    bin,
    ["serve", "--store", "memory", "--listen", "127.0.0.1:0", "--resp-listen", "127.0.0.1:0",
      "--config", join(dir, "tollgate.toml")],
    { cwd: dir, env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "inherit"] },
  );
  servers.push(server);
  const lines = createInterface({ input: server.stdout });
  for await (const line of lines) {
    const match = line.match(/resp:\s+redis:\/\/127\.0\.0\.1:(\d+)/);
    if (match) {
      lines.on("line", () => {});
      return Number(match[1]);
    }
  }
  throw new Error("the server did not start");
}

const unique = (label) => `${label}${process.pid}x${Date.now()}x${Math.random().toString(36).slice(2)}`;

test("ioredis, with its defaults (RESP3, ready check)", async () => {
  const port = await start();
  const redis = new Redis({ host: "127.0.0.1", port, maxRetriesPerRequest: 1 });
  try {
    const key = unique("io");
    assert.deepEqual(await redis.call("CL.THROTTLE", key, 15, 30, 60, 1), [0, 16, 15, -1, 2]);
    assert.deepEqual(await redis.call("CL.THROTTLE", key, 15, 30, 60, 0), [0, 16, 15, -1, 2]);
    // Pipelined: 20 in one write against a burst of 16.
    const pipeline = redis.pipeline();
    for (let i = 0; i < 20; i++) pipeline.call("CL.THROTTLE", `${key}p`, 15, 30, 60, 1);
    const replies = await pipeline.exec();
    assert.equal(replies.filter(([, r]) => r[0] === 0).length, 16);
    const taken = await redis.call("TG.LIMIT", "sendMessage", "KEY", key, "COUNT", "2");
    assert.ok(JSON.stringify(taken).includes("ok"), JSON.stringify(taken));
    await assert.rejects(redis.call("CL.THROTTLE", key, "x", 30, 60), /max_burst is "x"/);
    assert.equal(await redis.ping(), "PONG");
  } finally {
    redis.disconnect();
  }
});

test("node-redis, with its defaults (HELLO 3, CLIENT SETINFO)", async () => {
  const port = await start();
  const client = createClient({ url: `redis://127.0.0.1:${port}` });
  client.on("error", () => {});
  await client.connect();
  try {
    const key = unique("node");
    assert.deepEqual(
      await client.sendCommand(["CL.THROTTLE", key, "15", "30", "60", "1"]),
      [0, 16, 15, -1, 2],
    );
    const value = await client.sendCommand(["TG.VALUE", "sendMessage", "KEY", key]);
    const fields = value instanceof Map ? Object.fromEntries(value) : value;
    assert.equal(fields.value ?? fields["value"], 3, JSON.stringify(fields));
    const multi = client.multi();
    for (let i = 0; i < 5; i++) multi.addCommand(["CL.THROTTLE", `${key}m`, "1", "1", "60", "1"]);
    const replies = await multi.execAsPipeline();
    assert.deepEqual(replies.map((r) => r[0]), [0, 0, 1, 1, 1]);
    await assert.rejects(client.sendCommand(["CL.THROTTLE", key, "15"]), /wrong number of arguments/);
  } finally {
    await client.quit();
  }
});

test("ioredis multi() and node-redis multi(): MULTI ... EXEC, each token taken once", async () => {
  const port = await start();
  const redis = new Redis({ host: "127.0.0.1", port, maxRetriesPerRequest: 1 });
  const client = createClient({ url: `redis://127.0.0.1:${port}` });
  client.on("error", () => {});
  await client.connect();
  try {
    const key = unique("multi");
    const take = (multi) => multi.call("CL.THROTTLE", key, 1, 1, 60);
    const replies = await take(take(take(redis.multi()))).exec();
    assert.deepEqual(replies.map(([error, reply]) => [error, reply[0]]), [[null, 0], [null, 0], [null, 1]]);
    assert.deepEqual(await redis.call("CL.THROTTLE", key, 1, 1, 60, 0), [0, 2, 0, -1, 120]);
    // A command refused while queued: EXEC aborts, and nothing is taken.
    const other = unique("abort");
    await assert.rejects(
      redis.multi().call("CL.THROTTLE", other, 1, 1, 60).call("NOPE").exec(),
      /EXECABORT/,
    );
    assert.deepEqual(await redis.call("CL.THROTTLE", other, 1, 1, 60, 0), [0, 2, 2, -1, 0]);
    // node-redis: multi().exec() is MULTI ... EXEC too.
    const multi = client.multi();
    for (let i = 0; i < 3; i++) multi.addCommand(["CL.THROTTLE", `${key}n`, "1", "1", "60"]);
    assert.deepEqual((await multi.exec()).map((r) => r[0]), [0, 0, 1]);
  } finally {
    redis.disconnect();
    await client.quit();
  }
});

test("both clients with a token, and refused without one", async () => {
  const port = await start({ TOLLGATE_TOKENS: "secret-token" });
  const key = unique("auth");
  const io = new Redis({ host: "127.0.0.1", port, password: "secret-token" });
  try {
    assert.deepEqual(await io.call("CL.THROTTLE", key, 1, 1, 60), [0, 2, 1, -1, 60]);
  } finally {
    io.disconnect();
  }
  const client = createClient({ url: `redis://:secret-token@127.0.0.1:${port}` });
  client.on("error", () => {});
  await client.connect();
  try {
    assert.deepEqual(await client.sendCommand(["CL.THROTTLE", key, "1", "1", "60"]), [0, 2, 0, -1, 120]);
  } finally {
    await client.quit();
  }
  const without = new Redis({ host: "127.0.0.1", port, lazyConnect: true, enableReadyCheck: false, protocol: 2 });
  try {
    await without.connect();
    await assert.rejects(without.call("CL.THROTTLE", key, 1, 1, 60), /NOAUTH/);
  } finally {
    without.disconnect();
  }
});
