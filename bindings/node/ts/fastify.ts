// Fastify: an onRequest hook taking a request's limits (ts/middleware.ts).

import { decide, middleware, type MiddlewareOptions } from "./middleware.js";

export { ipKey } from "./middleware.js";
export type { KeySource, LimitRef, MiddlewareOptions } from "./middleware.js";

/** The parts of Fastify's request and reply the hook uses. */
interface FastifyRequest {
  ip?: string;
  ips?: string[];
  socket?: unknown;
  headers: Record<string, string | string[] | undefined>;
}
interface FastifyReply {
  readonly sent: boolean;
  headers(values: Record<string, string>): FastifyReply;
  code(status: number): FastifyReply;
  type(type: string): FastifyReply;
  send(body: string): FastifyReply;
}

/**
 * An `onRequest` hook that takes `limits` for each request, keyed as `key` says (default:
 * `request.ip`; set Fastify's `trustProxy` behind a proxy).
 *
 * ```ts
 * app.addHook("onRequest", rateLimitHook({ limiter, limits: "perIp" }));
 * ```
 */
export function rateLimitHook<Req extends FastifyRequest = FastifyRequest>(
  options: MiddlewareOptions<Req>,
): (request: Req, reply: FastifyReply) => Promise<FastifyReply | undefined> {
  const m = middleware(options, { trustProxy: "Fastify({ trustProxy: true }) when only the proxy can reach the socket" });
  return async (request, reply) => {
    const header = (name: string) => {
      const value = request.headers[name];
      return Array.isArray(value) ? value.join(", ") : value;
    };
    // Without trustProxy (then request.ips is undefined), request.ip is the connection's own.
    const socket = request.ips === undefined ? request.socket : undefined;
    const verdict = await decide(m, request, { ip: request.ip, header, socket });
    // Answered while the limits were taken (a timeout hook): the decision stands, nothing more
    // is written, and the reply returned ends the hooks.
    if (reply.sent) return reply;
    reply.headers(verdict.headers);
    if (verdict.pass) return undefined;
    return reply.code(verdict.status).type("application/json").send(verdict.body ?? "");
  };
}
