// Express: a middleware taking a request's limits (ts/middleware.ts), and a Store for
// express-rate-limit, so that its users move to tollgate by one line (`store:`).

import { calculateRateLimit, type RateLimiter as Client, type RateLimitConfig } from "tollgate-client";

import {
  decide,
  decisionOf,
  middleware,
  refusalBody,
  releaseWhenOver,
  settleWhenOver,
  socketPath,
  type MiddlewareOptions,
  type NodeResponse,
  type RateLimitInfo,
  type Transacting,
} from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { ConcurrencyRef, Decision, KeySource, LimitRef, LimitStatus, MiddlewareOptions, RateLimitInfo, StandardHeaders } from "./middleware.js";

declare global {
  // eslint-disable-next-line @typescript-eslint/no-namespace
  namespace Express {
    interface Request {
      /** The rate limit middleware's decision (`requestPropertyName`, default `rateLimit`). */
      rateLimit?: RateLimitInfo;
    }
  }
}

/** The parts of Express's request and response the middleware uses. */
interface ExpressRequest {
  ip?: string | undefined;
  socket?: { remoteAddress?: string | undefined };
  app?: { get(setting: string): unknown };
  get(name: string): string | undefined;
}
interface ExpressResponse extends NodeResponse {
  readonly headersSent: boolean;
  set(field: Record<string, string>): unknown;
  status(code: number): ExpressResponse;
  type(type: string): ExpressResponse;
  send(body: string): unknown;
}
type Next = (error?: unknown) => void;

/** The options of Express's middleware: every middleware's, and a handler of refusals. */
export interface ExpressOptions<Req, Limiter extends Transacting = Transacting, Res = ExpressResponse>
  extends MiddlewareOptions<Req, Limiter, Res> {
  /** Answers a refusal by the limits instead of the middleware (`message` and `statusCode`
   *  are not used): as express-rate-limit's, with the decision as its fourth argument. */
  handler?: (request: Req, response: Res, next: Next, info: RateLimitInfo) => unknown;
}

/**
 * A middleware that takes `limits` for each request, keyed as `key` says (default: its IP,
 * `req.ip`: set Express's `trust proxy` behind a proxy). Passed requests carry
 * `RateLimit-Policy` and `RateLimit` (or the fields `standardHeaders` and `legacyHeaders` ask
 * for) and `req.rateLimit`; refused ones get 429 with `Retry-After`, or what `handler`,
 * `message` and `statusCode` say. With `concurrency`, a request holds a slot of it from before
 * the limits are taken until its response finishes or closes.
 *
 * With the `"ip"` key it warns once, as express-rate-limit does, when a request carries
 * `X-Forwarded-For` while `trust proxy` is off (behind a proxy every client would share its
 * address), and when `trust proxy` is `true` (any client picks its own key).
 *
 * ```ts
 * app.use(rateLimit({ limiter, limits: "perIp" }));
 * app.post("/send", rateLimit({ limiter, limits: ["perUser", "global"], key: { header: "x-user" } }), handler);
 * app.post("/export", rateLimit({ limiter, limits: "perUser", concurrency: "exports", key: { header: "x-user" } }), handler);
 * ```
 */
export function rateLimit<
  Req extends ExpressRequest = ExpressRequest,
  Limiter extends Transacting = Transacting,
  Res extends ExpressResponse = ExpressResponse,
>(options: ExpressOptions<Req, Limiter, Res>): (request: Req, response: Res, next: Next) => void {
  const m = middleware<Req, Res>(options as MiddlewareOptions<Req, Transacting, Res>, {
    trustProxy: 'app.set("trust proxy", true) when only the proxy can reach the socket',
    options: ["handler"],
  });
  const handler = options.handler;
  if (handler !== undefined && typeof handler !== "function") {
    throw new TypeError(`handler must be a function (request, response, next, info); got ${String(handler)}`);
  }
  const proxy = (options.key ?? "ip") === "ip" ? proxyWarnings() : undefined;
  const property = m.requestPropertyName;
  return (request, response, next) => {
    proxy?.(request);
    const view = {
      ip: request.ip ?? request.socket?.remoteAddress,
      header: (name: string) => request.get(name),
      // Without "trust proxy", req.ip is the connection's own address.
      socket: request.app?.get("trust proxy") ? undefined : request.socket,
    };
    decide(m, request, response, view)
      .then(async (verdict) => {
        // First, so that nothing after (a throw included) can leave the slot held.
        if (verdict.release !== undefined) releaseWhenOver(verdict.release, response);
        // Settled however the response ends, this one's or another's.
        if (verdict.pass) settleWhenOver(verdict, response, request, response, options.requestWasSuccessful);
        // The response went out while the limits were taken (a timeout middleware answered
        // first): the decision stands, taken as it was, and nothing more is written or run.
        if (response.headersSent) return;
        if (verdict.info !== undefined) (request as Record<string, unknown>)[property] = verdict.info;
        response.set(verdict.headers);
        if (verdict.pass) return next();
        if (verdict.limited && !verdict.busy && handler !== undefined) return handler(request, response, next, verdict.info!);
        const { body, type } = await refusalBody(m, request, verdict);
        if (!response.headersSent) response.status(verdict.status).type(type).send(body);
      })
      .catch((error: unknown) => {
        if (!response.headersSent) next(error);
      });
  };
}

/**
 * express-rate-limit's two warnings of a proxy misconfigured, each said once for the
 * middleware: `X-Forwarded-For` on a request while Express's `trust proxy` is off, and
 * `trust proxy` set to `true`.
 */
function proxyWarnings(): (request: ExpressRequest) => void {
  let forwarded = false;
  let permissive = false;
  return (request) => {
    if (forwarded && permissive) return;
    const trust = request.app?.get("trust proxy");
    if (!forwarded && trust === false && request.get("x-forwarded-for") !== undefined) {
      forwarded = true;
      console.warn(
        "tollgate: a request carries X-Forwarded-For but Express's trust proxy setting is off, so the \"ip\" key is the " +
          "proxy's address and every client behind it shares one limit. Tell Express how many proxies are in front: " +
          'app.set("trust proxy", 1).',
      );
    }
    // On a unix socket only the proxy reaches the app: trusting it whole is the fix there.
    if (!permissive && trust === true && socketPath(request.socket) === undefined) {
      permissive = true;
      console.warn(
        "tollgate: Express's trust proxy setting is true, so the \"ip\" key is the leftmost X-Forwarded-For address, which " +
          'any client can write: each picks its own limit. Give the number of proxies in front instead: app.set("trust proxy", 1).',
      );
    }
  };
}

/** What express-rate-limit hands its store at start. */
interface StoreInit {
  limit?: unknown;
  windowMs?: unknown;
}

/** What a store counts to in a window: the hits of a window are counted, never refused (the
 *  limit, a number or a function of the request, is express-rate-limit's to compare). */
const COUNTER = 1e12;

/** The stores made in this process without a name, for the next one's. */
let unnamed = 0;

/**
 * A store for express-rate-limit: each key's hits in a window of `windowMs`, counted in
 * tollgate's store (in-process or on a server) atomically, so that every process sharing it
 * counts each hit once and admits exactly `limit` per window. Every option express-rate-limit
 * passes its store works: a `limit` that is a function of the request or 0, `decrement`
 * (`skipFailedRequests`, `skipSuccessfulRequests`, through tollgate's `adjust`), `resetKey`
 * and `get`.
 *
 * ```ts
 * app.use(rateLimit({ windowMs: 60_000, limit: 100, store: new TollgateStore({ limiter }) }));
 * ```
 *
 * `name` is the name of its counts in the store: by default `express-rate-limit` for the
 * first store made in the process, `express-rate-limit-2` for the second, and so on, so that
 * two rate limiters never count into one another. Processes that share a store must make
 * their stores in the same order, or name them.
 */
export class TollgateStore {
  readonly localKeys = false;
  readonly prefix: string;
  readonly #limiter: Transacting & Pick<Client, "reset" | "getValue">;
  readonly #name: string;
  #config: RateLimitConfig | undefined;

  constructor(options: { limiter: Transacting & Pick<Client, "reset" | "getValue">; name?: string }) {
    this.#limiter = options.limiter;
    if (options.name !== undefined && (typeof options.name !== "string" || options.name === "")) {
      throw new TypeError(`TollgateStore: name must be a limit name (a string); got ${String(options.name)}`);
    }
    unnamed += options.name === undefined ? 1 : 0;
    this.#name = options.name ?? (unnamed === 1 ? "express-rate-limit" : `express-rate-limit-${unnamed}`);
    this.prefix = this.#name;
  }

  init(options: StoreInit): void {
    const { windowMs } = options;
    if (typeof windowMs !== "number" || !(windowMs > 0)) {
      throw new TypeError(`TollgateStore needs a windowMs that is a positive number of milliseconds; got ${String(windowMs)}`);
    }
    this.#config = { kind: "fixed window", rate: COUNTER, period: windowMs };
  }

  #configured(): RateLimitConfig {
    if (this.#config === undefined) throw new Error("TollgateStore: init was not called (give the store to express-rate-limit)");
    return this.#config;
  }

  async increment(key: string): Promise<{ totalHits: number; resetTime: Date | undefined }> {
    const config = this.#configured();
    const { ok, limits } = await decisionOf(this.#limiter, [{ name: this.#name, key, config }]);
    const l = limits[0]!;
    return { totalHits: ok ? COUNTER - l.remaining : COUNTER + 1, resetTime: new Date(Date.now() + l.resetAfter) };
  }

  async decrement(key: string): Promise<void> {
    const config = this.#configured();
    await this.#limiter.adjust(this.#name, { key, count: -1, config } as { key: string; count: number });
  }

  async resetKey(key: string): Promise<void> {
    const config = this.#configured();
    await this.#limiter.reset(this.#name, { key, config });
  }

  /** The key's hits in its window, and when it ends; undefined for a key with none. */
  async get(key: string): Promise<{ totalHits: number; resetTime: Date | undefined } | undefined> {
    const config = this.#configured();
    const state = await this.#limiter.getValue(this.#name, { key, config });
    if (state.ts === 0) return undefined;
    const now = Date.now();
    const { value } = calculateRateLimit(state, state.config, now, 0);
    const totalHits = COUNTER - value;
    if (totalHits <= 0) return undefined;
    const start = (state.config as { start?: number }).start ?? 0;
    const period = (state.config as { period: number }).period;
    const end = start + period * (Math.floor((now - start) / period) + 1);
    return { totalHits, resetTime: new Date(end) };
  }
}
