// The package as a user installs it: packed (scripts/pack.mjs), installed into an empty
// project with npm, and run there, on the memory store and on a SQLite file; nothing of the
// repository is on the path.

import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
const project = mkdtempSync(join(tmpdir(), "tollgate-smoke-"));
try {
  const tarball = execFileSync("node", [join(here, "scripts", "pack.mjs"), project], { encoding: "utf8" }).trim();
  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "smoke", private: true, type: "module" }));
  execFileSync("npm", ["install", "--silent", "--no-audit", "--no-fund", tarball], { cwd: project, stdio: "inherit" });
  writeFileSync(
    join(project, "quickstart.mjs"),
    `import { RateLimiter, MINUTE } from "tollgate";
import { rateLimit } from "tollgate/express";
for (const store of ["memory", "sqlite://limits.db"]) {
  const limiter = new RateLimiter({ store }, { send: { kind: "token bucket", rate: 10, period: MINUTE, capacity: 3 } });
  const answers = [];
  for (let i = 0; i < 4; i++) answers.push((await limiter.limit("send", { key: "alice" })).ok);
  console.log(store, JSON.stringify(answers));
  if (JSON.stringify(answers) !== "[true,true,true,false]") process.exit(1);
}
if (typeof rateLimit !== "function") process.exit(1);
`,
  );
  const output = execFileSync("node", ["quickstart.mjs"], { cwd: project, encoding: "utf8" });
  process.stdout.write(output);
  console.log(`the packed tollgate (${tarball.split("/").pop()}) installs into an empty project and runs`);
} finally {
  rmSync(project, { recursive: true, force: true });
}
