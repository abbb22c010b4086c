// The header sets a middleware writes, each in a function of its own and each from a
// `Decision` only (tollgate's own IETF fields, `"ietf"`, are ts/middleware.ts's, written as
// the engine writes them): the drafts 6, 7 and 8 as express-rate-limit 8 writes them (6 and 7
// carry one limit: the one that binds), and the legacy `X-RateLimit-*` fields.

import { createHash } from "node:crypto";

import type { Decision, LimitStatus } from "./middleware.js";

/** The versions of the IETF RateLimit header fields a middleware writes (`standardHeaders`). */
export type StandardHeaders = "ietf" | "draft-6" | "draft-7" | "draft-8";

/** `name` as a structured field string (RFC 8941 3.3.3), as the tower layer writes it: in
 *  quotes, `"` and `\` escaped, a character that is not printable ASCII as `?`. */
export function sfString(name: string): string {
  let out = '"';
  for (const c of name) {
    if (c === '"' || c === "\\") out += `\\${c}`;
    else out += c >= " " && c <= "~" ? c : "?";
  }
  return `${out}"`;
}

/** Whole seconds from ms, rounded up and never below 0: a client that waits them is never
 *  early. */
export function seconds(ms: number): number {
  return Math.max(0, Math.ceil(ms / 1_000));
}

/** Draft 6: `RateLimit-Policy: <limit>;w=<s>` and `RateLimit-Limit`, `-Remaining`, `-Reset`
 *  (seconds until the limit is full again) of the limit that binds. */
export function draft6Headers(l: LimitStatus, out: Record<string, string>): void {
  out["RateLimit-Policy"] = `${l.limit};w=${seconds(l.window)}`;
  out["RateLimit-Limit"] = String(l.limit);
  out["RateLimit-Remaining"] = String(Math.floor(l.remaining));
  out["RateLimit-Reset"] = String(seconds(l.resetAfter));
}

/** Draft 7: `RateLimit-Policy: <limit>;w=<s>` and `RateLimit: limit=…, remaining=…, reset=…`
 *  of the limit that binds. */
export function draft7Headers(l: LimitStatus, out: Record<string, string>): void {
  out["RateLimit-Policy"] = `${l.limit};w=${seconds(l.window)}`;
  out["RateLimit"] = `limit=${l.limit}, remaining=${Math.floor(l.remaining)}, reset=${seconds(l.resetAfter)}`;
}

/** Draft 8: one member per limit, named by its identifier (quoted), `RateLimit: "id"; r=…;
 *  t=…` and `RateLimit-Policy: "id"; q=…; w=…; pk=:<partition key>:`; `pk` is left out for a
 *  shared limit (no key). */
export function draft8Headers(
  decision: Decision,
  identifiers: readonly string[],
  key: string | undefined,
  out: Record<string, string>,
): void {
  const pk = key === undefined ? "" : `; pk=:${partitionKey(key)}:`;
  let policy = "";
  let current = "";
  decision.limits.forEach((l, i) => {
    const sep = i === 0 ? "" : ", ";
    policy += `${sep}${identifiers[i]}; q=${l.limit}; w=${seconds(l.window)}${pk}`;
    current += `${sep}${identifiers[i]}; r=${Math.floor(l.remaining)}; t=${seconds(l.resetAfter)}`;
  });
  out["RateLimit-Policy"] = policy;
  out["RateLimit"] = current;
}

/** The draft 8 partition key of `key`, as express-rate-limit writes it: the first 12 hex
 *  digits of its SHA-256, in base64 (the key itself is not shown to the client). */
export function partitionKey(key: string): string {
  const hex = createHash("sha256").update(key).digest("hex").slice(0, 12);
  return Buffer.from(hex).toString("base64");
}

/** The legacy fields of the limit that binds: `X-RateLimit-Limit`, `X-RateLimit-Remaining`
 *  and `X-RateLimit-Reset` (when it is full again, in seconds since the Unix epoch, up). */
export function legacyHeaders(l: LimitStatus, now: number, out: Record<string, string>): void {
  out["X-RateLimit-Limit"] = String(l.limit);
  out["X-RateLimit-Remaining"] = String(Math.floor(l.remaining));
  out["X-RateLimit-Reset"] = String(Math.ceil((now + l.resetAfter) / 1_000));
}
