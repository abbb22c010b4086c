// Starts the real `tollgate` binary for a test: TOLLGATE_BIN, or the workspace's debug build.
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = fileURLToPath(new URL(".", import.meta.url));

/** The binary the tests run. */
export function binary() {
  const bin = process.env.TOLLGATE_BIN ?? resolve(here, "../../../target/debug/tollgate");
  if (!existsSync(bin)) {
    throw new Error(`no tollgate binary at ${bin}: run cargo build --bin tollgate, or set TOLLGATE_BIN`);
  }
  return bin;
}

/**
 * Starts `tollgate serve` on a free loopback port with `config` (TOML text) and `store`
 * (default memory); resolves to `{ url, dir, log(), stop() }` once it listens.
 */
export async function startServer({ config = "", store = "memory", args = [], env = {} } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-js-"));
  const file = join(dir, "tollgate.toml");
  writeFileSync(file, config);
  const child = spawn(
    binary(),
    ["serve", "--listen", "127.0.0.1:0", "--store", store, "--config", file, ...args],
    { cwd: dir, env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] },
  );
  let output = "";
  const url = await new Promise((resolveUrl, reject) => {
    const timer = setTimeout(() => reject(new Error(`the server did not start:\n${output}`)), 20_000);
    const read = (chunk) => {
      output += chunk;
      const match = /tollgate listening on (http:\/\/\S+)/.exec(output);
      if (match) {
        clearTimeout(timer);
        resolveUrl(match[1]);
      }
    };
    child.stdout.on("data", read);
    child.stderr.on("data", read);
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`the server exited (${code}):\n${output}`));
    });
  });
  return {
    url,
    dir,
    pid: child.pid,
    log: () => output,
    stop: () =>
      new Promise((done) => {
        const clean = () => {
          rmSync(dir, { recursive: true, force: true });
          done();
        };
        if (child.exitCode !== null) return clean();
        child.once("exit", clean);
        child.kill("SIGKILL");
      }),
  };
}
