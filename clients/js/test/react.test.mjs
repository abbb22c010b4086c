// useRateLimit under React Testing Library (happy-dom), with fake timers and a fake clock.
import { test, mock, after } from "node:test";
import assert from "node:assert/strict";
import { GlobalRegistrator } from "@happy-dom/global-registrator";

GlobalRegistrator.register();
after(() => GlobalRegistrator.unregister());
const { createElement: h } = await import("react");
const { render, screen, act, cleanup } = await import("@testing-library/react");
const { useRateLimit } = await import("../dist/react.js");

const T0 = 1_800_000_000_000;
const bucket = { kind: "token bucket", rate: 1, period: 1_000, capacity: 1, shards: 1 };

/** A source whose clock is `skew` ms ahead of this client's, holding `state`. */
function source(state, skew) {
  const calls = { getValue: [], getServerTime: 0 };
  return {
    calls,
    async getValue(name, options) {
      calls.getValue.push({ name, ...options });
      return { value: state.value, ts: state.ts, shard: 0, config: state.config ?? bucket };
    },
    async getServerTime() {
      calls.getServerTime += 1;
      return Date.now() + skew;
    },
  };
}

function Status({ source, count }) {
  const { status, check } = useRateLimit(source, { name: "sendMessage", key: "alice", count });
  const later = check(Date.now() + 10_000);
  return h(
    "p",
    null,
    status === undefined ? "loading" : status.ok ? "ok" : `retry at ${status.retryAt}`,
    later === undefined ? "" : later.ok ? " (ok later)" : " (refused later)",
  );
}

/** Lets the source's promises settle inside act. */
const settle = () => act(async () => {});

test("a refused status carries retryAt, and the component re-renders at it to show ok", async () => {
  mock.timers.enable({ apis: ["setTimeout", "Date"], now: T0 });
  try {
    // The server's clock is 5 s ahead; its bucket was emptied at its now.
    const fake = source({ value: 0, ts: T0 + 5_000 }, 5_000);
    render(h(Status, { source: fake }));
    assert.equal(screen.getByRole("paragraph").textContent, "loading");
    await settle();
    // One token a second: the next one at the client's T0 + 1000.
    assert.equal(screen.getByRole("paragraph").textContent, `retry at ${T0 + 1_000} (ok later)`);
    assert.deepEqual(fake.calls.getValue, [{ name: "sendMessage", key: "alice", sampleShards: undefined, config: undefined }]);
    assert.equal(fake.calls.getServerTime, 1);
    await act(async () => mock.timers.tick(1_000));
    assert.equal(screen.getByRole("paragraph").textContent, `retry at ${T0 + 1_000} (ok later)`);
    // It re-renders once the clock is past retryAt (at it, a float a hair short of the
    // server's time could refuse again with the same retryAt, and no timer would follow).
    await act(async () => mock.timers.tick(1));
    assert.equal(screen.getByRole("paragraph").textContent, "ok (ok later)");
  } finally {
    cleanup();
    mock.timers.reset();
  }
});

test("the count decides, and a key without a state starts full", async () => {
  mock.timers.enable({ apis: ["setTimeout", "Date"], now: T0 });
  try {
    const window = { kind: "fixed window", rate: 3, period: 60_000, capacity: 3, shards: 1, start: 0 };
    // No state: the value reports capacity and ts 0.
    const fresh = source({ value: 3, ts: 0, config: window }, 0);
    render(h(Status, { source: fresh, count: 3 }));
    await settle();
    assert.equal(screen.getByRole("paragraph").textContent, "ok (ok later)");
    cleanup();
    // One token left in the window that holds T0: four are refused until the next window
    // opens (T0 is a multiple of the period, so the next window is at T0 + 60 s).
    const one = source({ value: 1, ts: T0, config: window }, 0);
    render(h(Status, { source: one, count: 2 }));
    await settle();
    assert.equal(screen.getByRole("paragraph").textContent, `retry at ${T0 + 60_000} (refused later)`);
    await act(async () => mock.timers.tick(60_001));
    assert.equal(screen.getByRole("paragraph").textContent, "ok (ok later)");
  } finally {
    cleanup();
    mock.timers.reset();
  }
});

test("a source that fails gives an error, not an unhandled rejection", async () => {
  const failing = {
    getValue: async () => {
      throw new Error("backend down");
    },
    getServerTime: async () => Date.now(),
  };
  function Shows() {
    const { status, error } = useRateLimit(failing, { name: "x" });
    return h("p", null, error ? `error: ${error.message}` : String(status));
  }
  render(h(Shows));
  await settle();
  assert.equal(screen.getByRole("paragraph").textContent, "error: backend down");
  cleanup();
});
