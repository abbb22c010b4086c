// The transport on Node's http and https modules (see transport.ts): one keep-alive agent per
// scheme and limiter, sockets reused for as long as the server keeps them open.

import * as http from "node:http";
import * as https from "node:https";

import { NoAnswer, declaresMore, fieldsOf, type Send } from "./transport.js";

export function httpSend(): Send {
  const agents = {
    "http:": new http.Agent({ keepAlive: true }),
    "https:": new https.Agent({ keepAlive: true }),
  };
  // The URLs a limiter calls are few (one per operation): parsed once each.
  const parsed = new Map<string, URL>();
  const send: Send = (method, url, headers, body, timeoutMs, maxBytes) =>
    new Promise((resolve, reject) => {
      let target = parsed.get(url);
      if (target === undefined) {
        target = new URL(url);
        parsed.set(url, target);
      }
      const secure = target.protocol === "https:";
      let request: http.ClientRequest;
      try {
        request = (secure ? https : http).request(target, {
          method,
          agent: secure ? agents["https:"] : agents["http:"],
          headers: body === undefined ? headers : { ...headers, "content-length": Buffer.byteLength(body) },
        });
      } catch (e) {
        // Refused before anything was sent: a header value Node will not send, say.
        return reject(new NoAnswer(`cannot send to ${url}: ${(e as Error).message}`, false));
      }
      // Once connected (with TLS, once its handshake is done), the request goes out at once:
      // from then on a write may be applied.
      let connected = false;
      let settled = false;
      // Every way out goes through here, once: the timer, an error of the request or of the
      // answer, a close before the answer's end, an answer too large. Node does not always
      // report a failure on the request once its answer has begun, so none is waited for.
      const fail = (error: NoAnswer) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        request.destroy();
        reject(error);
      };
      const timer = setTimeout(() => fail(NoAnswer.timeout(url, connected)), timeoutMs);
      request.on("socket", (socket) => {
        if (socket.connecting) socket.once(secure ? "secureConnect" : "connect", () => (connected = true));
        else connected = true; // a kept-alive connection
      });
      request.on("error", (e: Error & { code?: string }) =>
        fail(NoAnswer.failed(url, e.code, e.code ?? e.message, connected)),
      );
      request.on("response", (response) => {
        const status = response.statusCode ?? 0;
        if (declaresMore(response.headers["content-length"], maxBytes)) {
          return fail(NoAnswer.tooLarge(url, status, maxBytes));
        }
        const chunks: Buffer[] = [];
        let size = 0;
        response.on("data", (chunk: Buffer) => {
          size += chunk.length;
          if (size > maxBytes) return fail(NoAnswer.tooLarge(url, status, maxBytes));
          chunks.push(chunk);
        });
        response.on("error", (e: Error & { code?: string }) =>
          fail(NoAnswer.failed(url, e.code, e.code ?? e.message, true)),
        );
        response.on("close", () => {
          if (!response.complete) fail(NoAnswer.cut(url));
        });
        response.on("end", () => {
          if (settled) return;
          if (!response.complete) return fail(NoAnswer.cut(url));
          settled = true;
          clearTimeout(timer);
          const text = Buffer.concat(chunks, size).toString("utf8");
          const fields = fieldsOf((name) => {
            const value = response.headers[name];
            return Array.isArray(value) ? value.join(", ") : value;
          });
          resolve({ status, text, fields });
        });
      });
      request.end(body);
    });
  send.close = () => {
    agents["http:"].destroy();
    agents["https:"].destroy();
  };
  return send;
}
