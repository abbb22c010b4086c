// The addon (src/lib.rs, built by scripts/build-addon.mjs): tollgate's engine in this process.

import { createRequire } from "node:module";

/** A store opened, with its limits defined. Answers are strings: a three-digit HTTP status,
 *  the JSON body, then `\n` name `\n` value per header field (see src/lib.rs). */
export interface NativeLimiter {
  /** An answer now when no I/O was needed (the memory store, a lease's take), else a promise. */
  run(op: string, body: string): string | Promise<string>;
  /** The function that takes from the limit `name` (a `limit`, or a `check` without flag 8),
   *  or null if no limit has that name: a number for a decision (`-1` granted; `w >= 0`
   *  granted after a wait; `-2 - w` refused, retry in `w` ms), the answer's string for
   *  anything else; null when I/O was needed: the answer then comes to the settler with
   *  `id`. `flags`: 1 a key is given (else `key` is ignored), 2 a count is given (else
   *  `count` is), 4 reserve, 8 writes. Throws a TypeError for an argument of the wrong type
   *  (nothing taken). */
  taker(name: string): NativeTake | null;
  /** The function that takes from every limit of `names` at once, all or nothing, with one
   *  key (`counts[i]` tokens from `names[i]`, 1 where null), or null if a name is not
   *  defined: see `NativeTakeAll`. */
  limitsTaker(names: string[], counts: Array<number | null>, out: Float64Array): NativeTakeAll | null;
  /** Where the answers of the take functions that waited come back, as [id, answer]; once
   *  per limiter. */
  settleWith(settler: (settled: [number, number | string | number[]]) => void): void;
  time(): Promise<string>;
  config(): string;
  close(): Promise<void>;
}

/** A limit's take function (see `NativeLimiter.taker`). */
export type NativeTake = (key: string, count: number, flags: number, id: number) => number | string | null;

/**
 * A middleware's take function (see `NativeLimiter.limitsTaker`): `flags` 1 when a key is
 * given (else `key` is ignored). Its numbers are the transaction's decision (a number, as a
 * `NativeTake`'s), then per limit its decision, the tokens it has left and the ms until it is
 * full (both NaN when not known: granted because the store failed and the limit fails open),
 * and last the time they were written (ms since the Unix epoch, the addon's clock: cheaper
 * than `Date.now()`). Answered now when no I/O was needed: the numbers are written into the
 * `out` given to `limitsTaker` (at least `2 + 3 * limits` of them) and it returns 0; else null, and the numbers come to the settler
 * with `id`, as an array. An error is the answer's string. Throws a TypeError for an argument
 * of the wrong type (nothing taken).
 */
export type NativeTakeAll = (key: string, flags: number, id: number) => number | string | null;

/** A limit's header fields as the engine writes them: its `RateLimit-Policy` member
 *  (`"name";q=10;w=60`) and its capacity. */
export interface NativePolicy {
  member: string;
  capacity: number;
}

interface Addon {
  validate(config: string): void;
  /** The policy of each limit of `config` named in `names`, null for a name not defined. */
  policies(config: string, names: string[]): Array<NativePolicy | null>;
  open(config: string): Promise<NativeLimiter>;
}

/** The addon's file name for this platform: `tollgate.linux-x64-gnu.node` and the like. */
export function addonName(): string {
  let abi = "";
  if (process.platform === "linux") {
    const report = process.report?.getReport?.() as { header?: { glibcVersionRuntime?: string } } | undefined;
    abi = report?.header?.glibcVersionRuntime ? "-gnu" : "-musl";
  } else if (process.platform === "win32") {
    abi = "-msvc";
  }
  return `tollgate.${process.platform}-${process.arch}${abi}.node`;
}

let loaded: Addon | undefined;

/** The addon, loaded on first use; a clear error when this platform has none. */
export function addon(): Addon {
  if (loaded) return loaded;
  const name = addonName();
  try {
    loaded = createRequire(import.meta.url)(`../${name}`) as Addon;
  } catch (e) {
    throw new Error(
      `tollgate: no native addon ${name} for this platform in the package (${(e as Error).message}); ` +
        "build it from the repository with `npm run build:addon` in bindings/node, or use a " +
        "tollgate server with { url } instead of { store }",
    );
  }
  return loaded;
}
