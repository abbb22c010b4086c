// How a request reaches the server: Node's own http module on Node (a keep-alive pool per
// limiter: the platform's fetch costs more than twice as much per call there, measured in
// bench.mjs), the platform's fetch everywhere else or when one is given.

/** An answer: its status and its body as text. */
export interface Reply {
  status: number;
  text: string;
}

/** Refused, or no such host: errors of a request that never left. */
const UNSENT = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN"]);

/** Why no answer came. */
export class NoAnswer extends Error {
  /** `timeout`: the deadline passed after the request went out. `unsent`: it never reached
   *  the server (refused, no such host). `lost`: the connection failed midway. */
  readonly why: "timeout" | "unsent" | "lost";
  constructor(why: "timeout" | "unsent" | "lost", message: string) {
    super(message);
    this.why = why;
  }

  /** The deadline passed with no answer from `url`. */
  static timeout(url: string): NoAnswer {
    return new NoAnswer("timeout", `no answer from ${url} in time`);
  }

  /** A request to `url` failed with the system error `code` (`why` says it in words): never
   *  sent when refused or the host is unknown, lost midway otherwise. */
  static failed(url: string, code: string | undefined, why: string): NoAnswer {
    const unsent = UNSENT.has(code ?? "");
    return new NoAnswer(unsent ? "unsent" : "lost", `cannot reach ${url}: ${why}`);
  }
}

/** Sends one request; rejects with `NoAnswer` only. */
export type Send = (
  method: string,
  url: string,
  headers: Record<string, string>,
  body: string | undefined,
  timeoutMs: number,
) => Promise<Reply>;

/** A transport on a fetch function. */
export function fetchSend(fetcher: typeof fetch): Send {
  return async (method, url, headers, body, timeoutMs) => {
    try {
      const response = await fetcher(url, {
        method,
        headers,
        body,
        signal: AbortSignal.timeout(timeoutMs),
      });
      return { status: response.status, text: await response.text() };
    } catch (e) {
      const error = e as { name?: string; message?: string; cause?: { code?: string; message?: string } };
      if (error?.name === "TimeoutError" || error?.name === "AbortError") {
        throw NoAnswer.timeout(url);
      }
      throw NoAnswer.failed(url, error?.cause?.code, error?.cause?.message ?? error?.message ?? String(e));
    }
  };
}

/** Whether this runs on Node (where `node:http` exists). */
export function onNode(): boolean {
  const process = (globalThis as { process?: { versions?: { node?: string } } }).process;
  return typeof process?.versions?.node === "string";
}

/**
 * A transport on Node's `http` and `https` modules, with a keep-alive pool of its own.
 * The modules are loaded on first use, through an import that bundlers for browsers leave
 * alone (this function is never called there).
 */
export function nodeSend(): Send {
  let loaded: Promise<Send> | undefined;
  return (method, url, headers, body, timeoutMs) => {
    loaded ??= load();
    return loaded.then((send) => send(method, url, headers, body, timeoutMs));
  };
}

async function load(): Promise<Send> {
  const specifier = "./node.js";
  const node = (await import(/* webpackIgnore: true */ /* @vite-ignore */ specifier)) as {
    httpSend: () => Send;
  };
  return node.httpSend();
}
