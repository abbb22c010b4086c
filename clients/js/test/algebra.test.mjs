// calculateRateLimit against the server's own algebra, through `tollgate simulate` at explicit
// times: equal to the last bit over random configs, states, times and counts.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";

import { calculateRateLimit, nextUp, MINUTE } from "../dist/index.js";
import { binary } from "./server.mjs";

const CASES = 12_000;

/** A small seeded generator (mulberry32), so that a failure can be replayed. */
function random(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function makeCase(u, i) {
  const pick = (xs) => xs[Math.floor(u() * xs.length)];
  const kind = u() < 0.5 ? "token bucket" : "fixed window";
  // Round numbers and awkward ones: both must agree to the bit.
  const rate = pick([1, 3, 10, 0.7, 1 + u() * 999, u() * 5 + 1e-3]);
  const period = pick([1_000, MINUTE, 3_600_000, 7, 1 + u() * 1e6]);
  const capacity = u() < 0.3 ? undefined : pick([rate, rate * 2, 1 + u() * 100, 0.5]);
  const maxReserved = u() < 0.6 ? undefined : pick([0, 1, u() * 50]);
  const config = { kind, rate, period };
  if (capacity !== undefined) config.capacity = capacity;
  if (maxReserved !== undefined) config.maxReserved = maxReserved;
  if (kind === "fixed window" && u() < 0.5) config.start = pick([0, u() * 1e7, -u() * 1e5]);
  const cap = capacity ?? rate;
  const t0 = 1_700_000_000_000 + Math.floor(u() * 1e9) + pick([0, u()]);
  const t1 = t0 + pick([0, u() * period, u() * 10 * period, Math.floor(u() * 5) * period, 1]);
  const reserve = u() < 0.4;
  // Counts the server accepts (SPEC §2's validation): up to capacity without a reservation;
  // with one, up to capacity + maxReserved, or anything without maxReserved.
  const most = reserve ? (maxReserved === undefined ? cap * 3 + 5 : cap + maxReserved) : cap;
  const count = () => pick([0, 1, most, u() * most, Math.floor(u() * (most + 1))]);
  return { name: `c${i}`, config, t0, t1, first: count(), count: Math.min(count(), most), reserve };
}

/**
 * Runs `cases` through `tollgate simulate` (per case: a limit that makes a state, its value,
 * then a check, a limit and the value at t1) and compares each answer with
 * `calculateRateLimit` on the state and config the server reported: equal to the bit, and the
 * cases reaching every branch (refusals, reservations, grants from tokens on hand). Returns
 * the server's answers.
 */
function equalsTheServer(cases) {
  const lines = [];
  for (const c of cases) {
    const body = { name: c.name, config: c.config };
    lines.push({ at: c.t0, op: "limit", ...body, count: c.first, reserve: true });
    lines.push({ at: c.t0, op: "value", ...body });
    lines.push({ at: c.t1, op: "check", ...body, count: c.count, reserve: c.reserve });
    lines.push({ at: c.t1, op: "limit", ...body, count: c.count, reserve: c.reserve });
    lines.push({ at: c.t1, op: "value", ...body });
  }
  const input = lines.map((l) => JSON.stringify(l)).join("\n") + "\n";
  const run = spawnSync(binary(), ["simulate", "--seed", "7"], {
    input,
    maxBuffer: 1 << 30,
    encoding: "utf8",
  });
  assert.equal(run.status, 0, run.stderr);
  const out = run.stdout.trim().split("\n").map((l) => JSON.parse(l));
  assert.equal(out.length, lines.length);

  const failures = [];
  cases.forEach((c, i) => {
    const [, before, check, limit, after] = out.slice(i * 5, i * 5 + 5);
    const problem = (what) => failures.push({ what, case: c, before, check, limit, after });
    if (before.error || check.error || limit.error) return problem("the server refused the request");
    // The value's config has every default filled in, a fixed window's alignment included.
    const state = before.ts === 0 ? null : { value: before.value, ts: before.ts };
    const calc = calculateRateLimit(state, before.config, c.t1, c.count, c.reserve);
    const same = (a, b) => Object.is(a, b);
    for (const [op, answer] of [["check", check], ["limit", limit]]) {
      if (answer.ok !== calc.ok || !same(answer.retryAfter, calc.retryAfter)) {
        return problem(`${op}: server ${JSON.stringify(answer)}, client ${JSON.stringify(calc)}`);
      }
    }
    // A granted limit stores the new state; a full one carries no information and may be
    // dropped (SPEC §5): the value then reports capacity and ts 0.
    const dropped = after.ts === 0 && calc.value === before.config.capacity;
    if (calc.ok && !dropped && (!same(after.value, calc.value) || !same(after.ts, calc.ts))) {
      return problem(`state: server ${after.value}@${after.ts}, client ${calc.value}@${calc.ts}`);
    }
  });
  for (const f of failures.slice(0, 5)) console.log(JSON.stringify(f));
  assert.equal(failures.length, 0, `${failures.length} of ${cases.length} cases differ (first ones above)`);
  // The cases reach every branch: refusals, reservations, and grants from tokens on hand.
  const outcomes = new Set(out.filter((_, j) => j % 5 === 3).map((a) => `${a.ok}/${a.retryAfter !== undefined}`));
  assert.deepEqual([...outcomes].sort(), ["false/true", "true/false", "true/true"]);
  return out;
}

test(`calculateRateLimit equals the server over ${CASES} random cases`, () => {
  const u = random(20261125);
  equalsTheServer(Array.from({ length: CASES }, (_, i) => makeCase(u, i)));
});

test("the SPEC's examples", () => {
  const bucket = { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 };
  // Empty at 0: one token after 6 s.
  assert.deepEqual(calculateRateLimit({ value: 0, ts: 0 }, bucket, 0), {
    ok: false,
    retryAfter: 6_000,
    value: -1,
    ts: 0,
  });
  assert.deepEqual(calculateRateLimit({ value: 0, ts: 0 }, bucket, 6_000), { ok: true, value: 0, ts: 6_000 });
  // A fresh key starts full; a reservation books ahead.
  assert.deepEqual(calculateRateLimit(null, bucket, 5, 3), { ok: true, value: 0, ts: 5 });
  assert.deepEqual(calculateRateLimit(null, bucket, 5, 4, true), { ok: true, retryAfter: 6_000, value: -1, ts: 5 });
  assert.equal(calculateRateLimit(null, { ...bucket, maxReserved: 0 }, 5, 4, true).ok, false);
  // A fixed window of 3 a minute, aligned to 0: its next window at 60 s.
  const window = { kind: "fixed window", rate: 3, period: MINUTE, start: 0 };
  assert.deepEqual(calculateRateLimit({ value: 0, ts: 0 }, window, 45_000), {
    ok: false,
    retryAfter: 15_000,
    value: -1,
    ts: 0,
  });
  assert.deepEqual(calculateRateLimit(null, window, 61_000, 1), { ok: true, value: 2, ts: 60_000 });
  assert.equal(nextUp(1), 1 + Number.EPSILON);
  assert.equal(nextUp(-Number.MIN_VALUE), -0);
  assert.equal(nextUp(0), Number.MIN_VALUE);
});

// Calendar windows: the same comparison over random calendar configs, zones and times around
// the autumn daylight-saving changes of 2026 (Berlin on October 25th, New York on November
// 1st) and month boundaries, with times up to a few windows apart.
const ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"];
const UNITS = ["day", "week", "month", "year"];

function makeCalendarCase(u, i) {
  const pick = (xs) => xs[Math.floor(u() * xs.length)];
  const unit = pick(UNITS);
  const rate = pick([1, 3, 10, 0.7, 1 + u() * 999]);
  const capacity = u() < 0.4 ? undefined : pick([rate, rate * 2, 1 + u() * 100]);
  const maxReserved = u() < 0.6 ? undefined : pick([0, 1, u() * 50]);
  const config = { kind: "fixed window", rate, calendar: unit };
  if (u() < 0.9) config.timeZone = pick(ZONES);
  if (capacity !== undefined) config.capacity = capacity;
  if (maxReserved !== undefined) config.maxReserved = maxReserved;
  const cap = capacity ?? rate;
  const length = { day: 86_400_000, week: 7 * 86_400_000, month: 31 * 86_400_000, year: 366 * 86_400_000 }[unit];
  // From 2026-10-20 over about three weeks, around both changes and the 1st of November.
  const t0 = 1_792_454_400_000 + Math.floor(u() * 21 * 86_400_000) + pick([0, u()]);
  const t1 = t0 + pick([0, u() * length, u() * 4 * length, 1, 3_600_000]);
  const reserve = u() < 0.4;
  const most = reserve ? (maxReserved === undefined ? cap * 3 + 5 : cap + maxReserved) : cap;
  const count = () => pick([0, 1, most, u() * most, Math.floor(u() * (most + 1))]);
  return { name: `k${i}`, config, t0, t1, first: count(), count: Math.min(count(), most), reserve };
}

test("calculateRateLimit equals the server for calendar windows in five zones", () => {
  const u = random(20261127);
  const cases = Array.from({ length: 1_500 }, (_, i) => makeCalendarCase(u, i));
  const out = equalsTheServer(cases);
  // The configs the server reported (and the client computed from) are calendar windows.
  cases.forEach((c, i) => assert.equal(out[i * 5 + 1].config.calendar, c.config.calendar));
});

test("a month in Berlin: refused until November 1st at local midnight, after the autumn change", () => {
  const month = { kind: "fixed window", rate: 1000, calendar: "month", timeZone: "Europe/Berlin" };
  const oct30 = Date.UTC(2026, 9, 30, 12); // 13:00 in Berlin (UTC+1 since the 25th)
  const spent = calculateRateLimit(null, month, oct30, 1000);
  assert.equal(spent.ts, Date.UTC(2026, 8, 30, 22), "October began at 00:00 UTC+2");
  const refused = calculateRateLimit(spent, month, oct30, 1);
  assert.equal(refused.ok, false);
  assert.equal(oct30 + refused.retryAfter, Date.UTC(2026, 9, 31, 23), "November begins at 00:00 UTC+1");
  const day = { kind: "fixed window", rate: 1, calendar: "day", timeZone: "Europe/Berlin" };
  const oct25 = calculateRateLimit(null, day, Date.UTC(2026, 9, 25, 12), 1);
  const next = calculateRateLimit(oct25, day, Date.UTC(2026, 9, 25, 12), 1);
  assert.equal(next.retryAfter + Date.UTC(2026, 9, 25, 12) - oct25.ts, 25 * 3_600_000, "a day of 25 hours");
});
