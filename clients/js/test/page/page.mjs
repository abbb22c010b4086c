// A web page using the hook with a read token, bundled by the browser test (esbuild).
import { createElement as h, useState } from "react";
import { createRoot } from "react-dom/client";
import { RateLimiter } from "../../dist/index.js";
import { useRateLimit } from "../../dist/react.js";

const params = new URLSearchParams(location.search);
const limiter = new RateLimiter({ url: params.get("api"), token: params.get("token") });

function App() {
  const { status, error } = useRateLimit(limiter, { name: "demo", key: "page" });
  const [write, setWrite] = useState("");
  const text = error
    ? `error: ${error.message}`
    : status === undefined
      ? "loading"
      : status.ok
        ? "ok"
        : `refused until ${status.retryAt}`;
  const tryWrite = () =>
    limiter.limit("demo", { key: "page" }).then(
      () => setWrite("written"),
      (e) => setWrite(`${e.name} ${e.status}`),
    );
  return h(
    "div",
    null,
    h("p", { id: "status" }, text),
    h("button", { id: "write", onClick: tryWrite }, "take a token"),
    h("p", { id: "written" }, write),
  );
}

createRoot(document.getElementById("root")).render(h(App));
