// A process whose main thread never loads the package, started by threads.test.mjs:
//   node threads.mjs SEQUENTIAL PARALLEL [REDIS_URL]
// runs SEQUENTIAL worker threads one after another, then PARALLEL at once, each loading the
// package, calling on memory (and on Redis when a URL is given), closing its limiters and
// exiting; prints {"workers": n, "answers": [...]} with each worker's answers, in order.
// (A worker that crashes the addon takes the whole process down: the test sees a signal.)
import { Worker, isMainThread, parentPort, workerData } from "node:worker_threads";

if (isMainThread) {
  const [sequential, parallel, redis] = process.argv.slice(2);
  const run = (i) =>
    new Promise((resolve, reject) => {
      const worker = new Worker(new URL(import.meta.url), { workerData: { i, redis } });
      let answer;
      worker.on("message", (m) => (answer = m));
      worker.on("error", reject);
      worker.on("exit", (code) => (code === 0 ? resolve(answer) : reject(new Error(`worker ${i} exited ${code}`))));
    });
  const answers = [];
  for (let i = 0; i < Number(sequential); i++) answers.push(await run(i));
  const n = Number(sequential);
  answers.push(...(await Promise.all(Array.from({ length: Number(parallel) }, (_, j) => run(n + j)))));
  console.log(JSON.stringify({ workers: answers.length, answers }));
} else {
  const { RateLimiter } = await import("../dist/index.js");
  const { i, redis } = workerData;
  const limits = { x: { kind: "token bucket", rate: 2, period: 60_000 } };
  const key = `w${i}x${process.pid}x${Date.now()}`;
  const answers = [];
  for (const store of redis ? ["memory", redis] : ["memory"]) {
    const limiter = new RateLimiter({ store }, limits);
    for (let j = 0; j < 3; j++) answers.push((await limiter.limit("x", { key })).ok);
    await limiter.close();
  }
  parentPort.postMessage(answers);
}
