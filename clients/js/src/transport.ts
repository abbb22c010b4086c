// How a request reaches the server: Node's own http module on Node (a keep-alive pool per
// limiter: the platform's fetch costs more than twice as much per call there, measured in
// bench.mjs), the platform's fetch everywhere else or when one is given.

/** An answer: its status, its body as text, and its rate limit header fields. */
export interface Reply {
  status: number;
  text: string;
  /** `RateLimit-Policy`, `RateLimit` and `Retry-After`, by their lower-case names, when the
   *  answer has them (a `limit` or `transaction` answer does). */
  fields?: Record<string, string>;
}

/** The header fields kept from an answer (the rest say nothing the API reads). */
export const FIELDS = ["ratelimit-policy", "ratelimit", "retry-after"] as const;

/** The rate limit fields of an answer's headers, read by `get`. */
export function fieldsOf(get: (name: string) => string | null | undefined): Record<string, string> | undefined {
  let fields: Record<string, string> | undefined;
  for (const name of FIELDS) {
    const value = get(name);
    if (typeof value === "string") (fields ??= {})[name] = value;
  }
  return fields;
}

/** Refused, or no such host: errors of a request that never left. */
const UNSENT = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN"]);

/** Why no answer, or none that could be read whole, came. */
export class NoAnswer extends Error {
  /** False when the request is known not to have reached the server (refused, no such
   *  host, or the deadline passed before a connection was made); true otherwise. */
  readonly sent: boolean;
  /** The answer's status, when one began but was too large to read. */
  readonly status: number | undefined;

  constructor(message: string, sent: boolean, status?: number) {
    super(message);
    this.sent = sent;
    this.status = status;
  }

  /** The deadline passed with no (whole) answer from `url`. */
  static timeout(url: string, sent: boolean): NoAnswer {
    return new NoAnswer(`no answer from ${url} in time`, sent);
  }

  /** A request to `url` failed with the system error `code` (`why` says it in words). */
  static failed(url: string, code: string | undefined, why: string, sent: boolean): NoAnswer {
    return new NoAnswer(`cannot reach ${url}: ${why}`, sent && !UNSENT.has(code ?? ""));
  }

  /** The connection to `url` closed before the answer's end. */
  static cut(url: string): NoAnswer {
    return new NoAnswer(`the answer of ${url} was cut short: the connection closed`, true);
  }

  /** `url` answered `status` with a body of more than `max` bytes. */
  static tooLarge(url: string, status: number, max: number): NoAnswer {
    return new NoAnswer(
      `the answer of ${url} is larger than maxAnswerBytes (${max} bytes); raise it if the ` +
        "server's answers are meant to be that large",
      true,
      status,
    );
  }
}

/** Sends one request and reads its answer, all within `timeoutMs`, refusing an answer of more
 *  than `maxBytes` bytes; rejects with `NoAnswer` only. */
export type Send = ((
  method: string,
  url: string,
  headers: Record<string, string>,
  body: string | undefined,
  timeoutMs: number,
  maxBytes: number,
) => Promise<Reply>) & {
  /** Closes what the transport keeps open (a pool's idle connections), if anything. */
  close?: () => void;
};

/** Whether a Content-Length header says more than `maxBytes`. */
export function declaresMore(length: string | null | undefined, maxBytes: number): boolean {
  return length != null && Number(length) > maxBytes;
}

/** A transport on a fetch function. Its timeout signal covers the body's reading too. */
export function fetchSend(fetcher: typeof fetch): Send {
  return async (method, url, headers, body, timeoutMs, maxBytes) => {
    const signal = AbortSignal.timeout(timeoutMs);
    let response: Response;
    try {
      response = await fetcher(url, { method, headers, body, signal });
      if (declaresMore(response.headers.get("content-length"), maxBytes)) {
        await response.body?.cancel().catch(() => {});
        throw NoAnswer.tooLarge(url, response.status, maxBytes);
      }
      const text = await readCapped(response, url, maxBytes);
      return { status: response.status, text, fields: fieldsOf((name) => response.headers.get(name)) };
    } catch (e) {
      if (e instanceof NoAnswer) throw e;
      const error = e as { name?: string; message?: string; cause?: { code?: string; message?: string } };
      if (error?.name === "TimeoutError" || error?.name === "AbortError" || signal.aborted) {
        // fetch does not say whether it had connected: a request may have gone out.
        throw NoAnswer.timeout(url, true);
      }
      const code = error?.cause?.code;
      throw NoAnswer.failed(url, code, error?.cause?.message ?? error?.message ?? String(e), true);
    }
  };
}

/** A fetch answer's body as text, refused once it passes `maxBytes`. */
async function readCapped(response: Response, url: string, maxBytes: number): Promise<string> {
  const stream = response.body as ReadableStream<Uint8Array> | null;
  if (stream === null || typeof stream.getReader !== "function") {
    // A fetch of its own kind without a readable stream: read whole, then measured.
    const text = await response.text();
    if (new TextEncoder().encode(text).length > maxBytes) {
      throw NoAnswer.tooLarge(url, response.status, maxBytes);
    }
    return text;
  }
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let size = 0;
  let text = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return text + decoder.decode();
    size += value.byteLength;
    if (size > maxBytes) {
      await reader.cancel().catch(() => {});
      throw NoAnswer.tooLarge(url, response.status, maxBytes);
    }
    text += decoder.decode(value, { stream: true });
  }
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
  const send: Send = (method, url, headers, body, timeoutMs, maxBytes) => {
    loaded ??= load();
    return loaded.then((send) => send(method, url, headers, body, timeoutMs, maxBytes));
  };
  send.close = () => void loaded?.then((send) => send.close?.());
  return send;
}

async function load(): Promise<Send> {
  const specifier = "./node.js";
  const node = (await import(/* webpackIgnore: true */ /* @vite-ignore */ specifier)) as {
    httpSend: () => Send;
  };
  return node.httpSend();
}
