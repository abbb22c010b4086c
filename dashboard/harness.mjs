// What the dashboard's browser tests (test.mjs) and the guide's pictures (pictures.mjs)
// share: the server started on loopback, and Debian's chromium driven by playwright-core.
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

/** Starts `binary` serving on a free loopback port with the config file `config` on `store`;
 *  resolves to its URL and process once its banner says where it listens. */
export function serve(binary, store, config) {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-dashboard-"));
  const path = join(dir, "tollgate.toml");
  writeFileSync(path, config);
  const child = spawn(binary, ["serve", "--listen", "127.0.0.1:0", "--store", store, "--config", path], {
    stdio: ["ignore", "pipe", "inherit"],
  });
  return new Promise((ok, fail) => {
    let out = "";
    child.stdout.on("data", (chunk) => {
      out += chunk;
      const match = out.match(/tollgate listening on (http:\/\/[0-9.:]+)/);
      if (match) ok({ url: match[1], child });
    });
    child.on("exit", (code) => fail(new Error(`the server exited: ${code}`)));
  });
}

/** Debian's chromium (CHROMIUM to change), headless, as CI runs it. */
export function launch() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
      "--disable-component-update", "--no-first-run"],
  });
}

/** `POST /v1/limit` of `body` (with a bearer `token`, if any): the answer's JSON. */
export async function take(url, body, token) {
  const headers = { "content-type": "application/json" };
  if (token) headers.authorization = `Bearer ${token}`;
  const response = await fetch(`${url}/v1/limit`, { method: "POST", headers, body: JSON.stringify(body) });
  return response.json();
}
