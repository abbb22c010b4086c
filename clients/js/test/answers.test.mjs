// The client against servers of the test's own, on loopback, that answer what tollgate never
// would: bodies cut short, stalled or too large, answers of the wrong shape, connections
// dropped after the request. Every call must settle with a TollgateError (or a
// RateLimitError for a well-formed 429) within its timeout, on both transports.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";

import { RateLimiter, RateLimitError, TollgateError } from "../dist/index.js";

const WINDOW = { kind: "fixed window", rate: 5, period: 60_000, start: 0 };

/** The two transports: Node's http module (the default on Node), and the platform's fetch. */
const TRANSPORTS = {
  "node:http": {},
  fetch: { fetch: globalThis.fetch },
};

/**
 * A loopback TCP server that reads each request whole (headers and Content-Length body),
 * then hands the socket to `answer(socket, request)`. Resolves to `{ url, requests, close }`.
 */
async function rawServer(answer) {
  const sockets = new Set();
  const requests = [];
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.on("error", () => {});
    socket.on("close", () => sockets.delete(socket));
    let seen = Buffer.alloc(0);
    socket.on("data", (chunk) => {
      seen = Buffer.concat([seen, chunk]);
      // Requests on a keep-alive connection: each one answered once it is whole.
      for (;;) {
        const end = seen.indexOf("\r\n\r\n");
        if (end < 0) return;
        const head = seen.subarray(0, end).toString("latin1");
        const length = Number(/\r\ncontent-length: *(\d+)/i.exec(head)?.[1] ?? 0);
        if (seen.length < end + 4 + length) return;
        const request = {
          head,
          path: head.split(" ")[1],
          body: seen.subarray(end + 4, end + 4 + length).toString("utf8"),
        };
        seen = seen.subarray(end + 4 + length);
        requests.push(request);
        answer(socket, request);
      }
    });
  });
  await new Promise((done) => server.listen(0, "127.0.0.1", done));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    requests,
    close: () =>
      new Promise((done) => {
        sockets.forEach((s) => s.destroy());
        server.close(done);
      }),
  };
}

/** An HTTP/1.1 answer's head. */
function head(status, headers = {}) {
  const lines = Object.entries({ "content-type": "application/json", ...headers }).map(
    ([k, v]) => `${k}: ${v}\r\n`,
  );
  return `HTTP/1.1 ${status} X\r\n${lines.join("")}\r\n`;
}

/** A whole answer with its Content-Length. */
function whole(status, body) {
  return head(status, { "content-length": Buffer.byteLength(body) }) + body;
}

/** The error `promise` rejects with, failing if it resolves or has not settled in `ms`. */
async function settles(promise, ms) {
  let timer;
  const late = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`not settled in ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([
      promise.then(
        (v) => assert.fail(`no error: ${JSON.stringify(v)}`),
        (e) => e,
      ),
      late,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** The TollgateError of `promise`, which must settle within `ms`. */
async function failure(promise, ms = 5_000) {
  const error = await settles(promise, ms);
  assert.ok(error instanceof TollgateError, `${error?.stack ?? error}`);
  return error;
}

for (const [transport, options] of Object.entries(TRANSPORTS)) {
  test(`${transport}: a body cut short before its Content-Length rejects when the connection closes`, async () => {
    const server = await rawServer((socket) => {
      socket.write(head(200, { "content-length": 50 }) + '{"ok":true');
      setTimeout(() => socket.destroy(), 20);
    });
    try {
      const client = new RateLimiter({ url: server.url, timeoutMs: 3_000, ...options });
      const started = Date.now();
      const error = await failure(client.limit("a", { config: WINDOW }), 5_000);
      assert.ok(Date.now() - started < 3_000, "rejected when the connection closed, not at the timeout");
      assert.equal(error.status, undefined);
      assert.equal(error.mayHaveTaken, true, "the write went out: it may have been applied");
      const read = await failure(client.check("a", { config: WINDOW }), 5_000);
      assert.equal(read.mayHaveTaken, false);
    } finally {
      await server.close();
    }
  });

  test(`${transport}: a body that stalls after its headers rejects at timeoutMs`, async () => {
    const server = await rawServer((socket) => {
      socket.write(head(200, { "content-length": 50 }) + '{"ok":true');
    });
    try {
      const client = new RateLimiter({ url: server.url, timeoutMs: 300, ...options });
      const error = await failure(client.getServerTime(), 3_000);
      assert.equal(error.status, undefined);
      assert.match(error.message, /^no answer from http:\/\/127\.0\.0\.1:\d+\/v1\/time in time/);
      assert.equal(error.mayHaveTaken, false);
    } finally {
      await server.close();
    }
  });

  test(`${transport}: a server that trickles its answer a byte at a time is cut off at timeoutMs`, async () => {
    const answer = whole(200, `{"now":5${" ".repeat(100)}}`);
    const timers = new Set();
    const server = await rawServer((socket) => {
      let i = 0;
      const next = () => {
        if (i >= answer.length || socket.destroyed) return;
        socket.write(answer[i++]);
        const timer = setTimeout(next, 20);
        timers.add(timer);
      };
      next();
    });
    try {
      const client = new RateLimiter({ url: server.url, timeoutMs: 400, ...options });
      const started = Date.now();
      await failure(client.getServerTime(), 3_000);
      assert.ok(Date.now() - started < 2_000);
    } finally {
      timers.forEach(clearTimeout);
      await server.close();
    }
  });

  test(`${transport}: an answer larger than maxAnswerBytes is refused, not read whole`, async () => {
    const MiB = 1024 * 1024;
    let mode;
    const server = await rawServer((socket) => {
      if (mode === "declared") {
        // Declares 9 MiB and sends little: refused on its headers, not at the timeout.
        socket.write(head(200, { "content-length": 9 * MiB }) + "[1,");
      } else if (mode === "chunked") {
        // No length: 9 MiB of a JSON array, chunk by chunk, then its end.
        socket.write(head(200, { "transfer-encoding": "chunked" }));
        const chunk = "1,".repeat(MiB / 2);
        let sent = 0;
        const more = () => {
          while (sent < 9 && !socket.destroyed) {
            sent++;
            const ok = socket.write(`${chunk.length.toString(16)}\r\n${chunk}\r\n`);
            if (!ok) return socket.once("drain", more);
          }
          if (!socket.destroyed) socket.end("1\r\n]\r\n0\r\n\r\n");
        };
        socket.write("1\r\n[\r\n");
        more();
      } else {
        socket.write(whole(200, `{"ok":true${" ".repeat(200)}}`));
      }
    });
    try {
      const client = new RateLimiter({ url: server.url, timeoutMs: 5_000, ...options });
      for (mode of ["declared", "chunked"]) {
        const error = await failure(client.getServerLimits(), 4_000);
        assert.equal(error.status, 200, mode);
        assert.match(error.message, /larger than maxAnswerBytes \(8388608 bytes\)/, mode);
        assert.equal(error.mayHaveTaken, false);
      }
      mode = "small";
      const capped = new RateLimiter({ url: server.url, maxAnswerBytes: 100, ...options });
      const error = await failure(capped.limit("a", { config: WINDOW }));
      assert.match(error.message, /larger than maxAnswerBytes \(100 bytes\)/);
      assert.equal(error.mayHaveTaken, true, "a write was answered, but what it did is unknown");
      const roomy = new RateLimiter({ url: server.url, maxAnswerBytes: 1_000, ...options });
      assert.deepEqual(await roomy.limit("a", { config: WINDOW }), { ok: true });
    } finally {
      await server.close();
    }
  });
}

test("maxAnswerBytes must be a positive integer", () => {
  for (const maxAnswerBytes of [0, -1, 1.5, Number.NaN, "10"]) {
    assert.throws(
      () => new RateLimiter({ url: "http://127.0.0.1:1", maxAnswerBytes }),
      /maxAnswerBytes must be a positive integer/,
    );
  }
});

test("an answer of the wrong shape is a TollgateError, for every operation", async () => {
  let answer;
  const server = await rawServer((socket) => socket.write(whole(answer.status ?? 200, answer.body)));
  const client = new RateLimiter({ url: server.url }, { a: WINDOW });
  const two = [{ name: "a" }, { name: "a", key: "k" }];
  const operations = {
    limit: () => client.limit("a"),
    check: () => client.check("a"),
    transaction: () => client.transaction(two),
    reset: () => client.reset("a"),
    getValue: () => client.getValue("a"),
    getServerTime: () => client.getServerTime(),
    getServerLimits: () => client.getServerLimits(),
    acquire: () => client.acquire("slots"),
    hold: () => client.hold("slots").then((held) => held && { ticket: held.ticket, expiresAt: held.expiresAt }),
    release: () => client.release("slots", "7"),
    renew: () => client.renew("slots", "7"),
    getSlotsValue: () => client.getSlotsValue("slots"),
  };
  const value = { value: 1, ts: 2, shard: 0, config: WINDOW };
  const wrong = {
    limit: [
      { ok: "true" },
      { ok: 1 },
      { ok: "false" },
      { ok: null },
      {},
      [],
      null,
      "ok",
      { ok: true, retryAfter: -1 },
      { ok: true, retryAfter: "5" },
      { ok: true, retryAfter: null },
      '{"ok":true,"retryAfter":1e999}',
    ],
    transaction: [
      { ok: true, results: [] },
      { ok: true, results: [{ ok: true }] },
      { ok: true, results: [{ ok: true }, { ok: "true" }] },
      { ok: true, results: [{ ok: true }, { ok: true }, { ok: true }] },
      { ok: true, results: { 0: { ok: true }, 1: { ok: true } } },
      { ok: "true", results: [{ ok: true }, { ok: true }] },
      { ok: false, retryAfter: -5, results: [{ ok: true }, { ok: false, retryAfter: 5 }] },
    ],
    reset: [[], null, "done"],
    getValue: [
      { ...value, value: "1" },
      { ...value, ts: null },
      { ...value, shard: 0.5 },
      { ...value, shard: -1 },
      { ...value, config: "x" },
      { value: 1, ts: 2, shard: 0 },
      '{"value":1e999,"ts":2,"shard":0,"config":{}}',
    ],
    getServerTime: [{ now: "5" }, { now: null }, {}, [5], '{"now":-1e999}'],
    getServerLimits: [[], null, { a: 1 }, { a: [] }, "[".repeat(100_000)],
    acquire: [
      { ok: "true", ticket: "1", expiresAt: 5 },
      { ok: true, expiresAt: 5 },
      { ok: true, ticket: 1, expiresAt: 5 },
      { ok: true, ticket: "1a", expiresAt: 5 },
      { ok: true, ticket: "", expiresAt: 5 },
      { ok: true, ticket: "1" },
      { ok: true, ticket: "1", expiresAt: -5 },
      { ok: false },
      { ok: false, retryAfter: -1 },
      '{"ok":true,"ticket":"1","expiresAt":1e999}',
    ],
    release: [{}, { released: "true" }, { released: 1 }, [true], true],
    renew: [{ ok: true }, { ok: true, expiresAt: "5" }, { ok: 1, expiresAt: 5 }, {}, null],
    getSlotsValue: [
      { inFlight: 1, max: 2 },
      { inFlight: 1.5, max: 2, holders: 1 },
      { inFlight: -1, max: 2, holders: 1 },
      { inFlight: "1", max: 2, holders: 1 },
      { value: 1, ts: 2, shard: 0, config: WINDOW },
    ],
  };
  wrong.check = wrong.limit;
  wrong.hold = wrong.acquire;
  const right = {
    limit: [
      [{ ok: true }, { ok: true }],
      [{ ok: false, retryAfter: 5.5 }, { ok: false, retryAfter: 5.5 }],
      [{ ok: true, retryAfter: 0, later: "a field of a newer server" }, { ok: true, retryAfter: 0 }],
    ],
    transaction: [
      [
        { ok: false, retryAfter: 5, results: [{ ok: true }, { ok: false, retryAfter: 5 }] },
        { ok: false, retryAfter: 5, results: [{ ok: true }, { ok: false, retryAfter: 5 }] },
      ],
    ],
    reset: [[{}, undefined]],
    getValue: [[value, value], [{ ...value, value: -2.5 }, { ...value, value: -2.5 }]],
    getServerTime: [[{ now: 1_700_000_000_000 }, 1_700_000_000_000]],
    getServerLimits: [[{ a: WINDOW }, { a: WINDOW }], [{}, {}]],
    acquire: [
      [{ ok: true, ticket: "12", expiresAt: 5.5, later: 1 }, { ok: true, ticket: "12", expiresAt: 5.5 }],
      [{ ok: false, retryAfter: 250 }, { ok: false, retryAfter: 250 }],
    ],
    hold: [
      [{ ok: true, ticket: "12", expiresAt: 5.5 }, { ticket: "12", expiresAt: 5.5 }],
      [{ ok: false, retryAfter: 250 }, null],
    ],
    release: [[{ released: true }, true], [{ released: false }, false]],
    renew: [[{ ok: true, expiresAt: 9 }, { ok: true, expiresAt: 9 }], [{ ok: false, expiresAt: "x" }, { ok: false }]],
    getSlotsValue: [[{ inFlight: 1, max: 2, holders: 1 }, { inFlight: 1, max: 2, holders: 1 }]],
  };
  right.check = right.limit;
  try {
    for (const [name, call] of Object.entries(operations)) {
      for (const body of wrong[name]) {
        // A string is sent as it is when it is not JSON's own (1e999, a deep nesting).
        const raw = typeof body === "string" && /^[{[]/.test(body);
        answer = { body: raw ? body : JSON.stringify(body) };
        const error = await failure(call());
        assert.equal(error.status, 200, `${name} ${answer.body}`);
        assert.match(error.message, /^unexpected answer from \/v1\/\w+: /, `${name} ${answer.body}`);
      }
      for (const [body, expected] of right[name]) {
        answer = { body: JSON.stringify(body) };
        assert.deepEqual(await call(), expected, `${name} ${answer.body}`);
      }
    }
  } finally {
    await server.close();
  }
});

test("a 429 is a RateLimitError only when it is tollgate's RateLimited; error bodies are read with care", async () => {
  let answer;
  const server = await rawServer((socket) => socket.write(whole(answer.status, answer.body)));
  const client = new RateLimiter({ url: server.url }, { a: WINDOW });
  try {
    answer = { status: 429, body: JSON.stringify({ kind: "RateLimited", name: "a", retryAfter: 1500 }) };
    const refused = await settles(client.limit("a", { throws: true }), 5_000);
    assert.ok(refused instanceof RateLimitError);
    assert.deepEqual([refused.name, refused.retryAfter], ["a", 1500]);
    for (const body of [
      { kind: "RateLimited", name: "a", retryAfter: "soon" },
      { kind: "RateLimited", name: "a", retryAfter: -1 },
      { kind: "RateLimited", name: 5, retryAfter: 1 },
      { kind: "RateLimited", name: "a" },
      { kind: "Other", name: "a", retryAfter: 1 },
    ]) {
      answer = { status: 429, body: JSON.stringify(body) };
      const error = await failure(client.limit("a", { throws: true }));
      assert.equal(error.status, 429);
      assert.equal(error.mayHaveTaken, false);
    }
    // An error body is { error: string }: its message; anything else is quoted, shortened.
    answer = { status: 400, body: JSON.stringify({ error: "Rate limit a count -1 must be a finite number >= 0." }) };
    assert.equal((await failure(client.limit("a"))).message, "Rate limit a count -1 must be a finite number >= 0.");
    answer = { status: 400, body: JSON.stringify({ error: 5 }) + " ".repeat(1_000) };
    const odd = await failure(client.limit("a"));
    assert.equal(odd.status, 400);
    assert.match(odd.message, /^HTTP 400: \{"error":5\}/);
    assert.ok(odd.message.length < 300, odd.message);
    answer = { status: 503, body: JSON.stringify({ error: "the store failed", mayHaveTaken: "yes" }) };
    assert.equal((await failure(client.limit("a"))).mayHaveTaken, false, "only true is true");
  } finally {
    await server.close();
  }
});

for (const [transport, options] of Object.entries(TRANSPORTS)) {
  test(`${transport}: mayHaveTaken is true for a write sent and left unanswered, false for a read or one never sent`, async () => {
    let behaviour;
    const server = await rawServer((socket) => {
      if (behaviour === "drop") socket.destroy(); // the request was read: then the connection is lost
      else if (behaviour === "502") socket.write(whole(502, "<html>Bad Gateway</html>"));
      else if (behaviour === "400") socket.write(whole(400, "<html>Bad Request</html>"));
      else if (behaviour === "garbage") socket.write(whole(200, "<html>hello</html>"));
      // "silent": never answers
    });
    const client = new RateLimiter({ url: server.url, timeoutMs: 200, ...options }, { a: WINDOW });
    const writes = {
      limit: () => client.limit("a"),
      transaction: () => client.transaction([{ name: "a" }]),
      reset: () => client.reset("a"),
      acquire: () => client.acquire("slots"),
      release: () => client.release("slots", "7"),
      renew: () => client.renew("slots", "7"),
    };
    const reads = {
      check: () => client.check("a"),
      getValue: () => client.getValue("a"),
      getSlotsValue: () => client.getSlotsValue("slots"),
      getServerTime: () => client.getServerTime(),
      getServerLimits: () => client.getServerLimits(),
    };
    try {
      for (behaviour of ["silent", "drop", "502", "garbage", "400"]) {
        const taken = behaviour !== "400"; // a 4xx refused the request; anything else may hide a write
        for (const [name, call] of Object.entries(writes)) {
          const error = await failure(call(), 3_000);
          assert.equal(error.mayHaveTaken, taken, `${behaviour} ${name}: ${error.message}`);
        }
        for (const [name, call] of Object.entries(reads)) {
          const error = await failure(call(), 3_000);
          assert.equal(error.mayHaveTaken, false, `${behaviour} ${name}: ${error.message}`);
        }
      }
    } finally {
      await server.close();
    }
    // A port where nothing listens (bound, then closed): refused before a byte was sent.
    const closed = createServer();
    await new Promise((done) => closed.listen(0, "127.0.0.1", done));
    const free = closed.address().port;
    await new Promise((done) => closed.close(done));
    const fresh = new RateLimiter({ url: `http://127.0.0.1:${free}`, timeoutMs: 2_000, ...options }, { a: WINDOW });
    const refused = {
      limit: () => fresh.limit("a"),
      transaction: () => fresh.transaction([{ name: "a" }]),
      reset: () => fresh.reset("a"),
      check: () => fresh.check("a"),
      getServerTime: () => fresh.getServerTime(),
    };
    for (const [name, call] of Object.entries(refused)) {
      const error = await failure(call(), 3_000);
      assert.equal(error.status, undefined);
      assert.equal(error.mayHaveTaken, false, `refused ${name}: ${error.message}`);
    }
  });
}
