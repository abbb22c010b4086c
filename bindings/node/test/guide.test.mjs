// The guide's TypeScript for this package (every ```ts block of docs/src and the README that
// imports "tollgate" or "tollgate/…") compiles against it, as a project that installed it and
// its frameworks would compile it: `tsc --noEmit`, strict.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const pkg = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");
const root = resolve(pkg, "..", "..");
const tsc = join(pkg, "node_modules", "typescript", "bin", "tsc");

function pages(dir, out = []) {
  for (const name of readdirSync(dir)) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) pages(path, out);
    else if (name.endsWith(".md")) out.push(path);
  }
  return out;
}

function blocks() {
  const found = [];
  for (const page of [join(root, "README.md"), ...pages(join(root, "docs", "src"))]) {
    const lines = readFileSync(page, "utf8").split("\n");
    for (let i = 0; i < lines.length; i++) {
      if (lines[i].trim() !== "```ts") continue;
      const start = i + 1;
      const body = [];
      while (++i < lines.length && !lines[i].trim().startsWith("```")) body.push(lines[i]);
      const text = body.join("\n");
      if (/from "tollgate(\/[a-z]+)?"/.test(text)) found.push({ page: relative(root, page), line: start, text });
    }
  }
  return found;
}

test("every TypeScript block of the guide that imports tollgate compiles against it", () => {
  const found = blocks();
  assert.ok(found.length >= 4, `only ${found.length} blocks found`);
  const dir = mkdtempSync(join(tmpdir(), "tollgate-node-guide-"));
  try {
    mkdirSync(join(dir, "node_modules", "@types"), { recursive: true });
    symlinkSync(pkg, join(dir, "node_modules", "tollgate"), "dir");
    // The frameworks and their types, as the project would install them.
    for (const name of ["tollgate-client", "express", "express-rate-limit", "fastify", "hono", "@hono/node-server", "@types/express", "@types/node"]) {
      mkdirSync(join(dir, "node_modules", name, ".."), { recursive: true });
      symlinkSync(join(pkg, "node_modules", name), join(dir, "node_modules", name), "dir");
    }
    const tsconfig = {
      compilerOptions: {
        target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", lib: ["ES2022", "DOM"],
        strict: true, noEmit: true, skipLibCheck: true,
      },
      include: ["*.ts"],
    };
    writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
    writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(tsconfig));
    const names = new Map();
    found.forEach((block, i) => {
      const name = `block${i}.ts`;
      names.set(name, `${block.page}:${block.line}`);
      writeFileSync(join(dir, name), `${block.text}\nexport {};\n`);
    });
    const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
    const output = (run.stdout + run.stderr).replace(/block\d+\.ts/g, (n) => names.get(n) ?? n);
    assert.equal(run.status, 0, output);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
