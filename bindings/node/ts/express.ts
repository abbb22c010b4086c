// Express: a middleware taking a request's limits (ts/middleware.ts), and a Store for
// express-rate-limit, so that its users move to tollgate by one line (`store:`).

import type { RateLimiter as Client, RateLimitConfig } from "tollgate-client";

import { decide, middleware, type MiddlewareOptions, type Transacting } from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { KeySource, LimitRef, MiddlewareOptions } from "./middleware.js";

/** The parts of Express's request and response the middleware uses. */
interface ExpressRequest {
  ip?: string | undefined;
  socket?: { remoteAddress?: string | undefined };
  app?: { get(setting: string): unknown };
  get(name: string): string | undefined;
}
interface ExpressResponse {
  readonly headersSent: boolean;
  set(field: Record<string, string>): unknown;
  status(code: number): ExpressResponse;
  type(type: string): ExpressResponse;
  send(body: string): unknown;
}
type Next = (error?: unknown) => void;

/**
 * A middleware that takes `limits` for each request, keyed as `key` says (default: its IP,
 * `req.ip`: set Express's `trust proxy` behind a proxy). Passed requests carry
 * `RateLimit-Policy` and `RateLimit`; refused ones get 429 with `Retry-After`.
 *
 * ```ts
 * app.use(rateLimit({ limiter, limits: "perIp" }));
 * app.post("/send", rateLimit({ limiter, limits: ["perUser", "global"], key: { header: "x-user" } }), handler);
 * ```
 */
export function rateLimit<Req extends ExpressRequest = ExpressRequest>(
  options: MiddlewareOptions<Req>,
): (request: Req, response: ExpressResponse, next: Next) => void {
  const m = middleware(options, { trustProxy: 'app.set("trust proxy", true) when only the proxy can reach the socket' });
  return (request, response, next) => {
    const view = {
      ip: request.ip ?? request.socket?.remoteAddress,
      header: (name: string) => request.get(name),
      // Without "trust proxy", req.ip is the connection's own address.
      socket: request.app?.get("trust proxy") ? undefined : request.socket,
    };
    decide(m, request, view).then(
      (verdict) => {
        // The response went out while the limits were taken (a timeout middleware answered
        // first): the decision stands, taken as it was, and nothing more is written or run.
        if (response.headersSent) return;
        response.set(verdict.headers);
        if (verdict.pass) return next();
        response.status(verdict.status).type("application/json").send(verdict.body ?? "");
      },
      (error: unknown) => {
        if (!response.headersSent) next(error);
      },
    );
  };
}

/** What express-rate-limit hands its store at start. */
interface StoreInit {
  limit?: unknown;
  windowMs?: unknown;
  skipFailedRequests?: boolean;
  skipSuccessfulRequests?: boolean;
}

/**
 * A store for express-rate-limit: its `limit` per `windowMs` becomes a tollgate fixed window,
 * taken atomically in tollgate's store (in-process or on a server), so that every process
 * sharing it admits exactly `limit` per window. `name` (default `express-rate-limit`) is the
 * limit's name; give each rate limiter its own.
 *
 * ```ts
 * app.use(rateLimit({ windowMs: 60_000, limit: 100, store: new TollgateStore({ limiter }) }));
 * ```
 *
 * `skipFailedRequests` and `skipSuccessfulRequests`, which give a hit back after the response,
 * are refused at start: tollgate has no way yet to give tokens back (SPEC §4's `adjust`).
 */
export class TollgateStore {
  readonly localKeys = false;
  readonly prefix: string;
  readonly #limiter: Transacting & Pick<Client, "reset">;
  readonly #name: string;
  #config: RateLimitConfig | undefined;

  constructor(options: { limiter: Transacting & Pick<Client, "reset">; name?: string }) {
    this.#limiter = options.limiter;
    this.#name = options.name ?? "express-rate-limit";
    this.prefix = this.#name;
  }

  init(options: StoreInit): void {
    const { limit, windowMs } = options;
    if (typeof limit !== "number" || !(limit > 0) || typeof windowMs !== "number" || !(windowMs > 0)) {
      throw new TypeError(
        `TollgateStore needs a limit and a windowMs that are positive numbers (a limit that is a function is not supported); got limit ${String(limit)}, windowMs ${String(windowMs)}`,
      );
    }
    if (options.skipFailedRequests || options.skipSuccessfulRequests) {
      throw new TypeError(
        "TollgateStore does not support skipFailedRequests or skipSuccessfulRequests: tollgate cannot give a hit back yet",
      );
    }
    this.#config = { kind: "fixed window", rate: limit, period: windowMs };
  }

  async increment(key: string): Promise<{ totalHits: number; resetTime: Date | undefined }> {
    const config = this.#config;
    if (config === undefined) throw new Error("TollgateStore: init was not called");
    const result = await this.#limiter.transaction([{ name: this.#name, key, config }], { fields: true });
    // `RateLimit: "name";r=<remaining>;t=<seconds until the window ends>`.
    const field = result.fields?.ratelimit ?? "";
    const remaining = Number(/;r=(\d+)/.exec(field)?.[1] ?? 0);
    const seconds = Number(/;t=(\d+)/.exec(field)?.[1] ?? Math.ceil((result.retryAfter ?? 0) / 1_000));
    // Admitted: the hits so far within the limit; refused: one past it, so that
    // express-rate-limit refuses too (the decision is tollgate's).
    const totalHits = result.ok ? Math.max(1, config.rate - remaining) : config.rate + 1;
    return { totalHits, resetTime: new Date(Date.now() + seconds * 1_000) };
  }

  async decrement(_key: string): Promise<void> {
    throw new Error("TollgateStore cannot give a hit back (see init)");
  }

  async resetKey(key: string): Promise<void> {
    const config = this.#config;
    if (config === undefined) throw new Error("TollgateStore: init was not called");
    await this.#limiter.reset(this.#name, { key, config });
  }
}
