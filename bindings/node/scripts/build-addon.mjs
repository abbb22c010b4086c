// Builds the addon (cargo, the workspace's target directory) and puts it beside package.json
// under this platform's name, which ts/native.ts loads. `--release` for an optimized build
// (what benchmarks and a published package use); the default is cargo's dev profile, with its
// debug information stripped from the copy (220 MB with it, about 30 without).

import { execFileSync } from "node:child_process";
import { copyFileSync, existsSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { addonName } from "../dist/native.js";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
const release = process.argv.includes("--release");
const root = resolve(here, "../..");
console.log(`building the addon (cargo build -p tollgate-node${release ? " --release" : ""})`);
execFileSync("cargo", ["build", "-q", "-p", "tollgate-node", ...(release ? ["--release"] : [])], {
  cwd: root,
  stdio: "inherit",
});
const target = process.env.CARGO_TARGET_DIR ? resolve(root, process.env.CARGO_TARGET_DIR) : join(root, "target");
const built = join(target, release ? "release" : "debug", libraryName());
const out = join(here, addonName());
rmSync(out, { force: true });
if (release) {
  copyFileSync(built, out);
} else {
  execFileSync("objcopy", ["--strip-debug", built, out]);
}
if (!existsSync(out)) throw new Error(`no ${out} after the build`);
console.log(`addon: ${out}`);

function libraryName() {
  if (process.platform === "darwin") return "libtollgate_node.dylib";
  if (process.platform === "win32") return "tollgate_node.dll";
  return "libtollgate_node.so";
}
