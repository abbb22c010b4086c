// The client against bare HTTP clients, in one run: 64 calls in flight on keep-alive
// connections to `tollgate serve --store memory` on loopback, in interleaved rounds.
//
//   node bench.mjs [ROUNDS] [CALLS]        (default 6 rounds of 3,000 calls each)
//   BENCH_SERVER_CPU=0 taskset -c 1 node bench.mjs     (each on a core of its own)
//
// Prints calls/s of each (median over rounds) and the client's ratio to each bare client:
// the platform's fetch (Node's built-in undici), Node's http module with a keep-alive agent
// (what the client sends with on Node), and undici's own request API.
import http from "node:http";

import { Agent, request } from "undici";

import { RateLimiter } from "./dist/index.js";
import { startServer } from "./test/server.mjs";

const rounds = Number(process.argv[2] ?? 6);
const calls = Number(process.argv[3] ?? 3_000);
const inFlight = 64;
const config = { kind: "token bucket", rate: 1e9, period: 1_000 };

const server = await startServer({ store: "memory" });
// On a machine of few cores, the server on a core of its own (BENCH_SERVER_CPU) and this
// process on another (taskset -c N node bench.mjs) keep them from taking turns on one.
if (process.env.BENCH_SERVER_CPU !== undefined) {
  const { execFileSync } = await import("node:child_process");
  execFileSync("taskset", ["-a", "-p", "-c", process.env.BENCH_SERVER_CPU, String(server.pid)]);
}
const body = JSON.stringify({ name: "bench", key: "k", config });
const url = `${server.url}/v1/limit`;
const limiter = new RateLimiter({ url: server.url }, { bench: config });
const agent = new Agent({ connections: inFlight, pipelining: 1 });
const httpAgent = new http.Agent({ keepAlive: true });
const target = new URL(url);

const contenders = {
  client: () => limiter.limit("bench", { key: "k" }),
  fetch: async () => {
    const response = await fetch(url, { method: "POST", headers: { "content-type": "application/json" }, body });
    return response.json();
  },
  http: () =>
    new Promise((resolve, reject) => {
      const headers = { "content-type": "application/json", "content-length": Buffer.byteLength(body) };
      const sent = http.request(target, { method: "POST", agent: httpAgent, headers }, (response) => {
        const chunks = [];
        response.on("data", (chunk) => chunks.push(chunk));
        response.on("end", () => resolve(JSON.parse(Buffer.concat(chunks).toString("utf8"))));
      });
      sent.on("error", reject);
      sent.end(body);
    }),
  undici: async () => {
    const response = await request(url, { method: "POST", headers: { "content-type": "application/json" }, body, dispatcher: agent });
    return response.body.json();
  },
};

/** Calls/s of `call` with `inFlight` loops sharing `calls`; every answer must be ok. */
async function run(call) {
  let left = calls;
  const started = performance.now();
  await Promise.all(
    Array.from({ length: inFlight }, async () => {
      while (left-- > 0) {
        const answer = await call();
        if (answer.ok !== true) throw new Error(`refused: ${JSON.stringify(answer)}`);
      }
    }),
  );
  return calls / ((performance.now() - started) / 1_000);
}

const deadline = setTimeout(() => {
  console.error("bench: over 5 minutes; stopped");
  process.exit(1);
}, 300_000);
const rates = Object.fromEntries(Object.keys(contenders).map((name) => [name, []]));
for (const name of Object.keys(contenders)) await run(contenders[name]); // warm up
for (let round = 0; round < rounds; round++) {
  // Each round in another order, so that none always runs first.
  const names = Object.keys(contenders);
  const order = names.map((_, i) => names[(i + round) % names.length]);
  for (const name of order) rates[name].push(await run(contenders[name]));
}
clearTimeout(deadline);
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const m = Object.fromEntries(Object.entries(rates).map(([k, v]) => [k, median(v)]));
console.log(`${rounds} rounds x ${calls} calls, ${inFlight} in flight, node ${process.version}`);
for (const [name, rate] of Object.entries(m)) console.log(`  ${name.padEnd(7)} ${Math.round(rate)} calls/s`);
console.log(`client / fetch:  ${(m.client / m.fetch).toFixed(2)}x`);
console.log(`client / http:   ${(m.client / m.http).toFixed(2)}x`);
console.log(`client / undici: ${(m.client / m.undici).toFixed(2)}x`);
await agent.close();
await server.stop();
