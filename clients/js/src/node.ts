// The transport on Node's http and https modules (see transport.ts): one keep-alive agent per
// scheme and limiter, sockets reused for as long as the server keeps them open.

import * as http from "node:http";
import * as https from "node:https";

import { NoAnswer, type Send } from "./transport.js";

export function httpSend(): Send {
  const agents = {
    "http:": new http.Agent({ keepAlive: true }),
    "https:": new https.Agent({ keepAlive: true }),
  };
  // The URLs a limiter calls are few (one per operation): parsed once each.
  const parsed = new Map<string, URL>();
  return (method, url, headers, body, timeoutMs) =>
    new Promise((resolve, reject) => {
      let target = parsed.get(url);
      if (target === undefined) {
        target = new URL(url);
        parsed.set(url, target);
      }
      const secure = target.protocol === "https:";
      const request = (secure ? https : http).request(target, {
        method,
        agent: secure ? agents["https:"] : agents["http:"],
        headers: body === undefined ? headers : { ...headers, "content-length": Buffer.byteLength(body) },
      });
      const timer = setTimeout(() => {
        request.destroy(NoAnswer.timeout(url));
      }, timeoutMs);
      request.on("error", (e: Error & { code?: string }) => {
        clearTimeout(timer);
        if (e instanceof NoAnswer) return reject(e);
        reject(NoAnswer.failed(url, e.code, e.code ?? e.message));
      });
      request.on("response", (response) => {
        const chunks: Buffer[] = [];
        response.on("data", (chunk: Buffer) => chunks.push(chunk));
        response.on("error", (e) => request.destroy(e));
        response.on("end", () => {
          clearTimeout(timer);
          resolve({ status: response.statusCode ?? 0, text: Buffer.concat(chunks).toString("utf8") });
        });
      });
      request.end(body);
    });
}
