// A TCP forwarder on a loopback port, for the tests of a store that is slow or comes up late:
// each connection to it is joined to `to` (HOST:PORT), every chunk held `delay` ms each way.
import { connect, createServer } from "node:net";

/**
 * Listens on 127.0.0.1:`port` (0: a free one) and forwards to `to`; resolves to
 * `{ port, accepted, close }`: `accepted()` counts the connections so far, `close` stops
 * listening and ends every connection.
 */
export function forwarder({ to, port = 0, delay = 0 }) {
  const [host, targetPort] = hostPort(to);
  const sockets = new Set();
  let accepted = 0;
  const server = createServer((client) => {
    accepted++;
    const upstream = connect(targetPort, host);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("close", () => sockets.delete(s));
      s.on("error", () => {
        client.destroy();
        upstream.destroy();
      });
    }
    pipe(client, upstream, delay);
    pipe(upstream, client, delay);
  });
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, "127.0.0.1", () => {
      resolve({
        port: server.address().port,
        accepted: () => accepted,
        close: () =>
          new Promise((done) => {
            for (const s of sockets) s.destroy();
            server.close(() => done());
          }),
      });
    });
  });
}

/** `from`'s bytes to `to`, each chunk `delay` ms late (timers of one delay fire in order). */
function pipe(from, to, delay) {
  from.on("data", (chunk) => {
    if (delay === 0) to.write(chunk);
    else setTimeout(() => to.writable && to.write(chunk), delay);
  });
  from.on("end", () => (delay === 0 ? to.end() : setTimeout(() => to.end(), delay)));
}

/** A free loopback port: one the system gave and took back. */
export function freePort() {
  return new Promise((resolve) => {
    const probe = createServer();
    probe.listen(0, "127.0.0.1", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
}

/** `redis://host:port/…` or `postgres://user@host:port/…` (or HOST:PORT) as [host, port]. */
export function hostPort(url) {
  const parsed = new URL(url.includes("://") ? url : `tcp://${url}`);
  const port = Number(parsed.port || (parsed.protocol.startsWith("postgres") ? 5432 : 6379));
  return [parsed.hostname.replace(/^\[|\]$/g, ""), port];
}

/** `url` with its host and port replaced by 127.0.0.1:`port`. */
export function through(url, port) {
  const parsed = new URL(url);
  parsed.hostname = "127.0.0.1";
  parsed.port = String(port);
  return parsed.toString();
}
