// Takes the guide's pictures of the dashboard from the real server, with Debian's chromium
// driven by playwright-core (as test.mjs does). Run by scripts/book-pictures:
//
//   node dashboard/pictures.mjs BINARY OUT_DIR
//
// dashboard.png: the server on the memory store with its example limits, after a few
// seconds of traffic, one key followed in the inspector. dashboard-leased.png: a limit
// leased from the Redis at TOLLGATE_REDIS_URL (default redis://127.0.0.1:6379), after a few
// thousand requests. Loopback only; every loop is bounded in count and time.
import { mkdirSync } from "node:fs";
import { join, resolve } from "node:path";

import { launch, serve as start, take } from "./harness.mjs";

const binary = resolve(process.argv[2] || "target/debug/tollgate");
const out = resolve(process.argv[3] || "docs/src/server/images");
mkdirSync(out, { recursive: true });
const redis = process.env.TOLLGATE_REDIS_URL || "redis://127.0.0.1:6379";
const deadline = setTimeout(() => { console.error("book pictures: timed out"); process.exit(1); }, 120_000);

const EXAMPLES = `
[limits.sendMessage]
kind = "token bucket"
rate = 10
period = "1m"
capacity = 3

[limits.freeTrialSignUp]
kind = "fixed window"
rate = 100
period = "1h"
`;

const LEASED = `
[limits.api]
kind = "token bucket"
rate = 600000
period = "1m"
lease = true
`;

const serve = (store, config) => start(binary, store, config);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const browser = await launch();
const servers = [];
try {
  // The example limits: users sending messages (some refused), sign-ups.
  const examples = await serve("memory", EXAMPLES);
  servers.push(examples.child);
  for (let i = 0; i < 40; i++) {
    await take(examples.url, { name: "sendMessage", key: ["alice", "bob", "carol"][i % 3] });
    if (i % 4 === 0) await take(examples.url, { name: "freeTrialSignUp", key: `user-${i}` });
    await sleep(100);
  }
  const page = await browser.newPage({ viewport: { width: 1100, height: 760 } });
  await page.goto(examples.url + "/");
  await page.locator('.limit[data-name="sendMessage"]').waitFor();
  await page.fill("#name", "sendMessage");
  await page.fill("#key", "alice");
  await page.click("#watch");
  await page.waitForFunction(() => document.getElementById("inspector-value").textContent !== "");
  await sleep(1_500);
  await page.screenshot({ path: join(out, "dashboard.png"), fullPage: true });
  console.log(`${join(out, "dashboard.png")}`);

  // A leased limit under load: 4,000 requests, 50 at a time.
  const leased = await serve(redis, LEASED);
  servers.push(leased.child);
  const key = `pictures-${process.pid}`;
  for (let round = 0; round < 80; round++) {
    await Promise.all(Array.from({ length: 50 }, () => take(leased.url, { name: "api", key })));
  }
  const leasedPage = await browser.newPage({ viewport: { width: 1100, height: 420 } });
  await leasedPage.goto(leased.url + "/");
  await leasedPage.locator('.limit[data-name="api"] .lease').waitFor();
  await sleep(500);
  await leasedPage.screenshot({ path: join(out, "dashboard-leased.png"), fullPage: true });
  console.log(`${join(out, "dashboard-leased.png")}`);
} finally {
  for (const child of servers) child.kill("SIGTERM");
  await browser.close();
  clearTimeout(deadline);
}
