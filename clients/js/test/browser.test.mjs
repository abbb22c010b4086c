// The hook in a real browser: Debian's chromium (playwright-core) opens a page of another
// origin that holds a read token, against the real server with corsOrigins.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { createServer } from "node:http";
import { fileURLToPath } from "node:url";

import { build } from "esbuild";

import { RateLimiter } from "../dist/index.js";
import { startServer } from "./server.mjs";

const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const required = process.env.TOLLGATE_REQUIRE_BACKENDS === "1";
const skip = !existsSync(chromiumPath) && !required && `no chromium at ${chromiumPath}`;

/** Serves the bundled page on a loopback port of its own (its own origin). */
async function pageServer(script) {
  const html = `<!doctype html><meta charset="utf-8"><div id="root"></div><script>${script}</script>`;
  const server = createServer((_, response) => {
    response.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    response.end(html);
  });
  await new Promise((done) => server.listen(0, "127.0.0.1", done));
  return { origin: `http://127.0.0.1:${server.address().port}`, close: () => server.close() };
}

let page, stranger, api, browser;

before(async () => {
  if (skip) return;
  const bundle = await build({
    entryPoints: [fileURLToPath(new URL("./page/page.mjs", import.meta.url))],
    bundle: true,
    write: false,
    format: "iife",
    define: { "process.env.NODE_ENV": '"production"' },
    logLevel: "silent",
  });
  const script = bundle.outputFiles[0].text.replaceAll("</script", "<\\/script");
  page = await pageServer(script);
  stranger = await pageServer(script);
  api = await startServer({
    config: `
[server]
tokens = ["full"]
readTokens = ["read"]
corsOrigins = ["${page.origin}"]

[limits.demo]
kind = "token bucket"
rate = 1
period = "3s"
capacity = 1
`,
  });
  const { chromium } = await import("playwright-core");
  browser = await chromium.launch({
    executablePath: chromiumPath,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--no-first-run",
    ],
  });
});

after(async () => {
  await browser?.close();
  page?.close();
  stranger?.close();
  await api?.stop();
});

test("a page of an allowed origin shows refused, then ok at retryAt; it cannot write", { skip }, async () => {
  // The bucket's one token is taken: the page opens on a refusal.
  const server = new RateLimiter({ url: api.url, token: "full" });
  assert.deepEqual(await server.limit("demo", { key: "page" }), { ok: true });
  const tab = await browser.newPage();
  const opened = Date.now();
  await tab.goto(`${page.origin}/?api=${encodeURIComponent(api.url)}&token=read`);
  await tab.waitForFunction(() => document.getElementById("status")?.textContent.startsWith("refused until "), null, { timeout: 10_000 });
  const text = await tab.textContent("#status");
  const retryAt = Number(text.slice("refused until ".length));
  assert.ok(retryAt > opened && retryAt <= opened + 3_500, `${text}, opened at ${opened}`);
  // No poll: the page shows ok when retryAt comes, by the hook's own timer.
  await tab.waitForFunction(() => document.getElementById("status")?.textContent === "ok", null, { timeout: 10_000 });
  assert.ok(Date.now() >= retryAt - 50, "not before retryAt");
  // The read token cannot take: 403, and the token is still there.
  await tab.click("#write");
  await tab.waitForFunction(() => document.getElementById("written")?.textContent !== "", null, { timeout: 10_000 });
  assert.equal(await tab.textContent("#written"), "TollgateError 403");
  assert.deepEqual(await server.check("demo", { key: "page" }), { ok: true });
  await tab.close();
});

test("a page of another origin gets nothing", { skip }, async () => {
  const tab = await browser.newPage();
  await tab.goto(`${stranger.origin}/?api=${encodeURIComponent(api.url)}&token=read`);
  await tab.waitForFunction(() => document.getElementById("status")?.textContent.startsWith("error: "), null, { timeout: 10_000 });
  assert.match(await tab.textContent("#status"), /^error: cannot reach http:\/\/127\.0\.0\.1:\d+\/v1\//);
  await tab.close();
});
