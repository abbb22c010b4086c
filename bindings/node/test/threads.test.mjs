// Worker threads that load the package, use it and exit, in a process whose main thread
// never loads it (a pool that retires idle workers): the process lives through them all, and
// each worker's calls answer as in the main thread.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const host = fileURLToPath(new URL("threads.mjs", import.meta.url));
const redis = process.env.TOLLGATE_REDIS_URL;
if (process.env.TOLLGATE_REQUIRE_BACKENDS === "1" && redis === undefined) {
  throw new Error("TOLLGATE_REQUIRE_BACKENDS=1 but TOLLGATE_REDIS_URL is not set");
}

test("50 workers in a row, then 8 at once, each loading the package, calling and exiting", () => {
  if (redis === undefined) console.log("no TOLLGATE_REDIS_URL: the workers call on memory only");
  const run = spawnSync(process.execPath, [host, "50", "8", ...(redis ? [redis] : [])], {
    encoding: "utf8",
    timeout: 60_000,
  });
  // A crash in the addon (it was a SIGSEGV in the allocator at the second worker's load)
  // ends the process with a signal.
  assert.equal(run.signal, null, `the process died of ${run.signal}: ${run.stderr}`);
  assert.equal(run.status, 0, run.stderr);
  const { workers, answers } = JSON.parse(run.stdout);
  assert.equal(workers, 58);
  const each = redis ? [true, true, false, true, true, false] : [true, true, false];
  for (const [i, a] of answers.entries()) assert.deepEqual(a, each, `worker ${i}`);
});
