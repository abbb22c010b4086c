// The stores the tests run on: memory and a SQLite file always; Redis, Redis Cluster and
// PostgreSQL from the URLs CI sets (TOLLGATE_REDIS_URL, TOLLGATE_REDIS_CLUSTER_URL,
// TOLLGATE_POSTGRES_URL). Without one the suite skips that store, unless
// TOLLGATE_REQUIRE_BACKENDS=1, where a missing URL fails instead.
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const required = process.env.TOLLGATE_REQUIRE_BACKENDS === "1";

/** [label, store URL or undefined (skipped), reason] per store. */
export function stores() {
  const dir = mkdtempSync(join(tmpdir(), "tollgate-node-"));
  const networked = [
    ["redis", process.env.TOLLGATE_REDIS_URL, "TOLLGATE_REDIS_URL"],
    ["redis cluster", clusterUrl(process.env.TOLLGATE_REDIS_CLUSTER_URL), "TOLLGATE_REDIS_CLUSTER_URL"],
    ["postgres", process.env.TOLLGATE_POSTGRES_URL, "TOLLGATE_POSTGRES_URL"],
  ];
  for (const [label, url, variable] of networked) {
    if (url === undefined && required) {
      throw new Error(`TOLLGATE_REQUIRE_BACKENDS=1 but ${variable} is not set (the ${label} store)`);
    }
  }
  return [
    ["memory", "memory"],
    ["sqlite", `sqlite://${join(dir, "states.db")}`],
    ...networked.map(([label, url]) => [label, url]),
  ];
}

/** The cluster URL as the store takes it: `redis+cluster://…` (CI's is written so). */
function clusterUrl(url) {
  if (url === undefined) return undefined;
  return url.startsWith("redis://") ? url.replace("redis://", "redis+cluster://") : url;
}

/** A name no earlier run used (runs share Redis and PostgreSQL). */
export function fresh(prefix) {
  return `${prefix}${process.pid}x${Date.now().toString(36)}${Math.floor(Math.random() * 1e6)}`;
}
