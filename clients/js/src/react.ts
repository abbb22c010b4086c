// tollgate-client/react: a hook that shows a user whether a limit would grant now, and when
// it will if it would not, re-rendering at that moment.

import { useCallback, useEffect, useReducer, useState } from "react";

import { calculateRateLimit, type RateLimitConfig } from "./algebra.js";
import type { RateLimitSource, RateLimitValue } from "./index.js";

/** What the hook shows: whether `count` tokens would be granted now, else when. */
export interface RateLimitStatus {
  ok: boolean;
  /** When a request would be granted, in this client's clock (ms since the epoch, as
   *  `Date.now()`); absent when `ok`. */
  retryAt?: number;
}

/** The options of `useRateLimit`. */
export interface UseRateLimitOptions {
  name: string;
  key?: string;
  /** Tokens the next request would take; default 1. */
  count?: number;
  /** For a sharded limit: shards to sample for the estimate; default 1. */
  sampleShards?: number;
  /** The config, for a name the server does not define. */
  config?: RateLimitConfig;
}

/** What `useRateLimit` returns. */
export interface UseRateLimit {
  /** Undefined until the value and the server's clock have been read. */
  status: RateLimitStatus | undefined;
  /** The status at `ts` (this client's clock, default now) for `count` tokens (default the
   *  hook's); undefined until read. */
  check(ts?: number, count?: number): RateLimitStatus | undefined;
  /** Reads the value again (after the app took tokens, say). */
  refresh(): void;
  /** Why the last read failed, if it did. */
  error: unknown;
}

/**
 * Reads a limit's value and the server's clock from `source` (a `RateLimiter`, or anything
 * with `getValue` and `getServerTime`, such as an object that asks your own backend), computes
 * locally whether a request would be granted, and re-renders when `retryAt` comes.
 *
 * The offset between this client's clock and the server's is estimated from one
 * `getServerTime` as the server's time minus the middle of the round trip. The value is read
 * once (and on `refresh()`): tokens taken elsewhere after that show when it is read again.
 */
export function useRateLimit(source: RateLimitSource, options: UseRateLimitOptions): UseRateLimit {
  const { name, key, count = 1, sampleShards } = options;
  const configText = options.config === undefined ? undefined : JSON.stringify(options.config);
  const [value, setValue] = useState<RateLimitValue>();
  const [offset, setOffset] = useState<number>();
  const [error, setError] = useState<unknown>();
  const [reads, refresh] = useReducer((n: number) => n + 1, 0);
  const [, rerender] = useReducer((n: number) => n + 1, 0);

  useEffect(() => {
    let live = true;
    const config = configText === undefined ? undefined : (JSON.parse(configText) as RateLimitConfig);
    const sent = Date.now();
    source.getServerTime().then(
      (server) => {
        const received = Date.now();
        if (live) setOffset(server - (sent + received) / 2);
      },
      (e: unknown) => live && setError(e),
    );
    source.getValue(name, { key, sampleShards, config }).then(
      (read) => {
        if (live) {
          setValue(read);
          setError(undefined);
        }
      },
      (e: unknown) => live && setError(e),
    );
    return () => {
      live = false;
    };
  }, [source, name, key, sampleShards, configText, reads]);

  const check = useCallback(
    (ts?: number, tokens?: number): RateLimitStatus | undefined => {
      if (value === undefined || offset === undefined) return undefined;
      const at = ts ?? Date.now();
      // A key without a state reports ts 0: evaluate it as fresh.
      const state = value.ts === 0 ? null : { value: value.value, ts: value.ts };
      const result = calculateRateLimit(state, value.config, at + offset, tokens ?? count);
      return result.ok ? { ok: true } : { ok: false, retryAt: at + (result.retryAfter ?? 0) };
    },
    [value, offset, count],
  );

  const status = check();
  const retryAt = status?.retryAt;
  useEffect(() => {
    if (retryAt === undefined) return;
    // Re-render once Date.now() is past retryAt. A timer runs on another clock and may fire
    // a little early by Date.now(); re-rendering then would refuse again with the very same
    // retryAt (retryAt does not depend on when it is computed), so no new timer would be set
    // and the status would stay refused for good. Wait out the rest instead.
    let timer: ReturnType<typeof setTimeout> | undefined;
    const wait = () => {
      const left = retryAt - Date.now();
      if (left >= 0) timer = setTimeout(wait, left + 1);
      else rerender();
    };
    wait();
    return () => clearTimeout(timer);
  }, [retryAt]);

  return { status, check, refresh, error };
}
