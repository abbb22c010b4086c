// Builds tollgate-client (clients/js) before this package's TypeScript, which imports its
// types and code through the link `npm ci` made (file:../../clients/js): on a fresh checkout
// it has no dist/ yet, and a stale one would type this package against an older client.
// Installs its dependencies first when they are missing. Run by `npm run build` (prebuild).

import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const client = resolve(dirname(dirname(fileURLToPath(import.meta.url))), "../../clients/js");
const npm = (...args) => execFileSync("npm", args, { cwd: client, stdio: "inherit" });
if (!existsSync(resolve(client, "node_modules", "typescript"))) {
  npm("ci", "--no-audit", "--no-fund", "--silent");
}
npm("run", "build", "--silent");
