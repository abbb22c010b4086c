// Browser tests of the dashboard that `tollgate serve` shows at `/`: Debian's chromium driven
// by playwright-core. Run by .ci/run:
//
//   (cd dashboard && npm ci) && node dashboard/test.mjs target/debug/tollgate
//
// Starts the given binary on loopback (memory store), then checks in the page that the
// configured limits are listed, that tokens taken through the API move the charts and the
// inspector's value, that a refused request shows as refused, that reset refills, that the
// inspector's value moves between polls without polling every frame, that concurrency limits
// are listed (marked, with their max and ttl) and one picked from the list shows its slots in
// flight in the inspector, and that with tokens
// configured nothing shows until one is given. A screenshot of each state goes to
// target/dashboard-screenshots/.
import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import { join, resolve } from "node:path";

import { launch, serve as start, take } from "./harness.mjs";

const binary = resolve(process.argv[2] || "target/debug/tollgate");
const shots = resolve("target/dashboard-screenshots");
mkdirSync(shots, { recursive: true });
const deadline = setTimeout(() => { console.error("dashboard tests: timed out"); process.exit(1); }, 120_000);

const CONFIG = `
[limits.example]
kind = "token bucket"
rate = 10
period = "1m"
capacity = 3

[limits.signup]
kind = "fixed window"
rate = 100
period = "1h"

[limits.gpu]
kind = "concurrency"
max = 2
`;

/** Starts the server on the memory store with `CONFIG` (and `extra` lines in [server]). */
const serve = (extra = "") => start(binary, "memory", `[server]\n${extra}\n${CONFIG}`);

const text = (page, selector) => page.locator(selector).first().textContent();
const value = async (page) => Number(await page.locator("#inspector-value").getAttribute("data-value"));

const browser = await launch();
const servers = [];
let failed = false;
try {
  // ---- without tokens ----
  const open = await serve();
  servers.push(open.child);
  const page = await browser.newPage({ viewport: { width: 1200, height: 800 } });
  const valueRequests = [];
  page.on("request", (r) => { if (r.url().endsWith("/v1/value")) valueRequests.push(Date.now()); });
  await page.goto(open.url + "/");
  await page.locator('.limit[data-name="example"]').waitFor();
  await page.locator('.limit[data-name="signup"]').waitFor();
  assert.equal(await text(page, '.limit[data-name="example"] .words'), "token bucket: 10 a minute, bursts of 3");
  assert.equal(await text(page, '.limit[data-name="signup"] .words'), "fixed window: 100 an hour");
  // The concurrency limit, listed apart from the rate limits (it has no traffic chart).
  await page.locator('#slots .limit[data-name="gpu"]').waitFor();
  assert.ok(await page.locator("#slots-title").isVisible());
  assert.equal(await text(page, '#slots .limit[data-name="gpu"] .kind'), "concurrency");
  assert.equal(await text(page, '#slots .limit[data-name="gpu"] .words'),
    "at most 2 in flight a key, a slot held 1 min unless released");
  assert.equal(await page.locator("#slots .limit").count(), 1, "only concurrency limits there");
  assert.equal(await page.locator('#limits .limit[data-name="gpu"]').count(), 0);
  await page.screenshot({ path: join(shots, "1-limits.png") });

  // The inspector on (example, alice): full, 3 of 3.
  await page.fill("#name", "example");
  await page.fill("#key", "alice");
  await page.click("#watch");
  await page.waitForFunction(() => document.getElementById("inspector-value").textContent === "3.00");
  assert.equal(await text(page, "#inspector-full"), "full");

  // Two tokens taken through the API: the chart counts them, the value falls to about 1.
  for (let i = 0; i < 2; i++) assert.deepEqual(await take(open.url, { name: "example", key: "alice" }), { ok: true });
  await page.waitForFunction(() =>
    document.querySelector('.limit[data-name="example"] .total-granted').textContent === "2");
  assert.equal(await page.locator('.limit[data-name="example"] rect.granted').count(), 1);
  // 1 left when taken, refilling at one token in 6 s: under 1.9 for over 5 s after.
  await page.waitForFunction(() => Number(document.getElementById("inspector-value").dataset.value) < 1.9);
  // It refills between polls: computed in the page, not polled every frame.
  const before = await value(page);
  const polls = valueRequests.length;
  await page.waitForTimeout(1500);
  const after = await value(page);
  assert.ok(after > before, `the value moves between polls: ${before} then ${after}`);
  assert.ok(valueRequests.length - polls <= 2, `at most a poll a second or so: ${valueRequests.length - polls}`);
  assert.match(await text(page, "#inspector-full"), /^full again in [0-9.]+ s$/);
  await page.screenshot({ path: join(shots, "2-taken.png") });

  // Three more through the form: refused, and shown as refused.
  await page.fill("#count", "3");
  await page.click("#take");
  await page.waitForFunction(() => document.getElementById("answer").dataset.status === "200");
  assert.match(await text(page, "#answer"), /"ok":false/);
  await page.waitForFunction(() =>
    document.querySelector('.limit[data-name="example"] .total-refused').textContent === "1");
  assert.equal(await page.locator('.limit[data-name="example"] rect.refused').count(), 1);
  await page.screenshot({ path: join(shots, "3-refused.png") });

  // Reset refills.
  await page.click("#reset");
  await page.waitForFunction(() => document.getElementById("inspector-value").textContent === "3.00");
  assert.equal(await text(page, "#inspector-full"), "full");
  await page.screenshot({ path: join(shots, "4-reset.png") });

  // A concurrency limit picked from the list, for the key given: the inspector shows the
  // slots in flight of its max, and the holders.
  const acquired = await fetch(open.url + "/v1/acquire", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ name: "gpu", key: "acme" }),
  }).then((r) => r.json());
  assert.equal(acquired.ok, true);
  await page.fill("#key", "acme");
  await page.click('#slots .limit[data-name="gpu"] .name');
  assert.equal(await page.inputValue("#name"), "gpu");
  await page.waitForFunction(() => document.getElementById("inspector-value").textContent === "1");
  assert.equal(await text(page, "#inspector-capacity"), "in flight of 2");
  assert.equal(await text(page, "#inspector-full"), "1 holder");
  await page.screenshot({ path: join(shots, "4b-in-flight.png") });
  // A rate limit's name picked from its list opens it as well, for the same key.
  await page.click('#limits .limit[data-name="signup"] .name');
  assert.equal(await page.inputValue("#name"), "signup");
  await page.waitForFunction(() => document.getElementById("inspector-value").textContent === "100.00");
  await page.close();

  // ---- with tokens: nothing until one is given ----
  const locked = await serve('tokens = ["s3cret"]');
  servers.push(locked.child);
  await take(locked.url, { name: "example", key: "bob" }, "s3cret");
  const guarded = await browser.newPage({ viewport: { width: 1200, height: 800 } });
  await guarded.goto(locked.url + "/");
  await guarded.locator("#login").waitFor();
  assert.ok(await guarded.locator("#app").isHidden());
  assert.equal(await guarded.locator(".limit").count(), 0);
  assert.ok(!(await guarded.content()).includes("bursts of 3"), "no limit shows without a token");
  await guarded.screenshot({ path: join(shots, "5-token-asked.png") });
  await guarded.fill("#token", "wrong");
  await guarded.click('#token-form button[type="submit"]');
  await guarded.waitForFunction(() => document.getElementById("login-error").textContent !== "");
  assert.equal(await guarded.locator(".limit").count(), 0);
  await guarded.fill("#token", "s3cret");
  await guarded.click('#token-form button[type="submit"]');
  await guarded.locator('.limit[data-name="example"]').waitFor();
  assert.equal(await text(guarded, '.limit[data-name="example"] .total-granted'), "1");
  await guarded.locator('#slots .limit[data-name="gpu"]').waitFor();
  await guarded.screenshot({ path: join(shots, "6-token-given.png") });
  console.log(`dashboard tests: passed (screenshots in ${shots})`);
} catch (error) {
  failed = true;
  console.error("dashboard tests: FAILED");
  console.error(error);
} finally {
  await browser.close();
  for (const child of servers) child.kill();
  clearTimeout(deadline);
}
process.exit(failed ? 1 : 0);
