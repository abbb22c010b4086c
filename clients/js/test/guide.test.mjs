// The guide's TypeScript (every ```ts block of docs/src and of the README) compiles against
// this package, as a project that installed it would compile it: `tsc --noEmit`, strict. A
// line the guide says does not compile carries `// @ts-expect-error`, so tsc checks that it
// does not.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative, resolve } from "node:path";
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

/** Every ```ts block: its page, its line, its text. */
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
      // The tollgate package's blocks (In-process in Node) compile in its own tests
      // (bindings/node/test/guide.test.mjs), against it.
      if (/from "tollgate(\/[a-z]+)?"/.test(text)) continue;
      found.push({ page: relative(root, page), line: start, text });
    }
  }
  return found;
}

test("every TypeScript block of the guide compiles against the package", () => {
  const found = blocks();
  assert.ok(found.length >= 3, `only ${found.length} blocks found`);
  const dir = mkdtempSync(join(tmpdir(), "tollgate-guide-"));
  try {
    mkdirSync(join(dir, "node_modules"));
    symlinkSync(pkg, join(dir, "node_modules", "tollgate-client"), "dir");
    const tsconfig = {
      compilerOptions: {
        target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", lib: ["ES2022", "DOM"],
        strict: true, noEmit: true, types: [],
      },
      include: ["*.ts"],
    };
    writeFileSync(join(dir, "package.json"), JSON.stringify({ type: "module" }));
    writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(tsconfig));
    const names = new Map();
    found.forEach((block, i) => {
      const name = `block${i}.ts`;
      names.set(name, `${block.page}:${block.line}`);
      // Each block a module of its own (top-level await, names of its own).
      writeFileSync(join(dir, name), `${block.text}\nexport {};\n`);
    });
    const run = spawnSync(process.execPath, [tsc, "-p", dir], { encoding: "utf8" });
    const output = (run.stdout + run.stderr).replace(/block\d+\.ts/g, (n) => names.get(n) ?? n);
    assert.equal(run.status, 0, output);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
