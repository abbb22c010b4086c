// Fastify: an onRequest hook taking a request's limits (ts/middleware.ts), and a plugin that
// adds it to every route, as @fastify/rate-limit does, with per-route `config.rateLimit`.

// Fastify's own types, for `config.rateLimit` on its routes (the augmentation below).
import type {} from "fastify";

import {
  decide,
  middleware,
  refusalBody,
  releaseWhenOver,
  settleWhenOver,
  type MiddlewareOptions,
  type NodeResponse,
  type RateLimitInfo,
  type Transacting,
} from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { ConcurrencyRef, Decision, KeySource, LimitRef, LimitStatus, MiddlewareOptions, RateLimitInfo, StandardHeaders } from "./middleware.js";

/** The parts of Fastify's request and reply the hook uses. */
interface FastifyRequest {
  ip?: string;
  ips?: string[];
  socket?: unknown;
  headers: Record<string, string | string[] | undefined>;
}
interface FastifyReply {
  readonly sent: boolean;
  readonly raw?: NodeResponse;
  headers(values: Record<string, string>): FastifyReply;
  code(status: number): FastifyReply;
  type(type: string): FastifyReply;
  send(body?: unknown): FastifyReply;
}

/** The options of Fastify's hook: every middleware's, an allow-list and a handler of refusals. */
export interface FastifyOptions<Req, Limiter extends Transacting = Transacting, Reply = FastifyReply>
  extends MiddlewareOptions<Req, Limiter, Reply> {
  /** Requests that pass untouched, as @fastify/rate-limit's `allowList`: their keys (such as
   *  IP addresses, as the `key` option makes them), or a function of the request and its key. */
  allowList?: string[] | ((request: Req, key: string | undefined) => boolean | Promise<boolean>);
  /** Answers a refusal by the limits instead of the hook (`message` and `statusCode` are not
   *  used): it sends the reply. */
  handler?: (request: Req, reply: Reply, info: RateLimitInfo) => unknown;
}

/**
 * An `onRequest` hook that takes `limits` for each request, keyed as `key` says (default:
 * `request.ip`; set Fastify's `trustProxy` behind a proxy). The decision is on
 * `request.rateLimit` (`requestPropertyName`). With `concurrency`, a request holds a slot of
 * it from before the limits are taken until its reply finishes or its connection closes
 * (`reply.raw`'s `finish` or `close`: after the handler's error is answered too).
 *
 * ```ts
 * app.addHook("onRequest", rateLimitHook({ limiter, limits: "perIp" }));
 * app.addHook("onRequest", rateLimitHook({ limiter, concurrency: "renders" }));
 * ```
 */
export function rateLimitHook<
  Req extends FastifyRequest = FastifyRequest,
  Limiter extends Transacting = Transacting,
  Reply extends FastifyReply = FastifyReply,
>(options: FastifyOptions<Req, Limiter, Reply>): (request: Req, reply: Reply) => Promise<FastifyReply | undefined> {
  const m = middleware<Req, Reply>(options as MiddlewareOptions<Req, Transacting, Reply>, {
    trustProxy: "Fastify({ trustProxy: true }) when only the proxy can reach the socket",
    options: ["allowList", "handler"],
  });
  const handler = options.handler;
  if (handler !== undefined && typeof handler !== "function") {
    throw new TypeError(`handler must be a function (request, reply, info); got ${String(handler)}`);
  }
  const property = m.requestPropertyName;
  return async (request, reply) => {
    const header = (name: string) => {
      const value = request.headers[name];
      return Array.isArray(value) ? value.join(", ") : value;
    };
    // Without trustProxy (then request.ips is undefined), request.ip is the connection's own.
    const socket = request.ips === undefined ? request.socket : undefined;
    const verdict = await decide(m, request, reply, { ip: request.ip, header, socket });
    if (verdict.release !== undefined) {
      // Fastify's reply always has its Node response; a reply without one cannot say when
      // it is over, and a slot held to its ttl would refuse requests for nothing.
      if (reply.raw !== undefined) releaseWhenOver(verdict.release, reply.raw);
      else verdict.release();
    }
    // Settled however the reply ends, this one's or another's.
    if (verdict.pass && reply.raw !== undefined) {
      settleWhenOver(verdict, reply.raw, request, reply, options.requestWasSuccessful);
    }
    // Answered while the limits were taken (a timeout hook): the decision stands, nothing more
    // is written, and the reply returned ends the hooks.
    if (reply.sent) return reply;
    if (verdict.info !== undefined) (request as Record<string, unknown>)[property] = verdict.info;
    reply.headers(verdict.headers);
    if (verdict.pass) return undefined;
    if (verdict.limited && !verdict.busy && handler !== undefined) {
      await handler(request, reply, verdict.info!);
      return reply;
    }
    const { body, type } = await refusalBody(m, request, verdict);
    return reply.code(verdict.status).type(type).send(body);
  };
}

/** A route's own limits (`config: { rateLimit: { limits: "upload" } }`): the plugin's options
 *  with these in their place; or `false`, no limit for the route. */
export type RouteRateLimit = false | Partial<FastifyOptions<FastifyRequest, Transacting, FastifyReply>>;

declare module "fastify" {
  interface FastifyRequest {
    /** The rate limit hook's decision (`requestPropertyName`, default `rateLimit`). */
    rateLimit?: RateLimitInfo;
  }
  interface FastifyContextConfig {
    /** tollgate's limits for this route (see `rateLimitPlugin`). */
    rateLimit?: RouteRateLimit;
  }
}

/** The options of the plugin: the hook's, and whether every route takes them. */
export type PluginOptions<Limiter extends Transacting = Transacting> = FastifyOptions<FastifyRequest, Limiter, FastifyReply> & {
  /** Whether every route takes the limits (default true); false: only routes with a
   *  `config.rateLimit` of their own. */
  global?: boolean;
};

/** The parts of a Fastify instance the plugin uses. */
interface FastifyInstance {
  addHook(name: "onRoute", hook: (route: RouteOptions) => void): unknown;
}
interface RouteOptions {
  url?: string;
  config?: { rateLimit?: RouteRateLimit };
  onRequest?: unknown;
}

/**
 * A Fastify plugin, as @fastify/rate-limit is one: each route registered after it takes the
 * plugin's limits (unless `global: false`), or its own, given in its
 * `config.rateLimit` (the plugin's options with those in their place; `false`: none). Each
 * route's hook is made, and its options checked, when the route is registered.
 *
 * ```ts
 * await app.register(rateLimitPlugin, { limiter, limits: "perIp" });
 * app.post("/upload", { config: { rateLimit: { limits: "uploads" } } }, handler);
 * ```
 */
export function rateLimitPlugin(
  app: FastifyInstance,
  options: PluginOptions,
  done: (error?: Error) => void,
): void {
  const { global = true, ...base } = options;
  let shared: ReturnType<typeof rateLimitHook> | undefined;
  try {
    shared = global ? rateLimitHook(base as FastifyOptions<FastifyRequest, Transacting, FastifyReply>) : undefined;
  } catch (e) {
    return done(e as Error);
  }
  app.addHook("onRoute", (route) => {
    const own = route.config?.rateLimit;
    if (own === false) return;
    const hook = own === undefined ? shared : rateLimitHook({ ...base, ...own } as FastifyOptions<FastifyRequest, Transacting, FastifyReply>);
    if (hook === undefined) return;
    const before = route.onRequest === undefined ? [] : Array.isArray(route.onRequest) ? route.onRequest : [route.onRequest];
    route.onRequest = [...before, hook];
  });
  done();
}
// As fastify-plugin marks a plugin: its hooks apply to the whole app, not a child context.
Object.assign(rateLimitPlugin, { [Symbol.for("skip-override")]: true, [Symbol.for("fastify.display-name")]: "tollgate" });
