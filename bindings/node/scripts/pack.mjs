// Packs the tollgate npm package as it would be published: dist/, the addon built for this
// platform, README.md, and tollgate-client inside it (a bundled dependency: a copy of its own
// packed tarball, not the repository's link). Prints the tarball's path.
//
//   node scripts/pack.mjs [OUT_DIR]       (default: the package's directory)

import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdtempSync, readFileSync, readdirSync, renameSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(dirname(fileURLToPath(import.meta.url)));
const out = resolve(process.argv[2] ?? here);
const client = resolve(here, "../../clients/js");
const stage = mkdtempSync(join(tmpdir(), "tollgate-pack-"));
const npm = (args, cwd) => execFileSync("npm", args, { cwd, encoding: "utf8" }).trim();
try {
  const addons = readdirSync(here).filter((f) => /^tollgate\..+\.node$/.test(f));
  if (addons.length === 0) throw new Error("no addon: run npm run build:addon first");
  if (!existsSync(join(here, "dist", "index.js"))) throw new Error("no dist/: run npm run build first");
  // tollgate-client as its users get it: its own packed tarball, installed into the stage.
  const clientTarball = join(stage, npm(["pack", "--silent", "--pack-destination", stage], client).split("\n").pop());
  for (const f of ["dist", "README.md", ...addons]) {
    if (existsSync(join(here, f))) cpSync(join(here, f), join(stage, "package", f), { recursive: true });
  }
  const manifest = JSON.parse(readFileSync(join(here, "package.json"), "utf8"));
  const version = JSON.parse(readFileSync(join(client, "package.json"), "utf8")).version;
  delete manifest.devDependencies;
  delete manifest.scripts;
  manifest.dependencies["tollgate-client"] = `file:${clientTarball}`;
  writeFileSync(join(stage, "package", "package.json"), JSON.stringify(manifest, null, 2));
  npm(["install", "--silent", "--omit=dev", "--no-audit", "--no-fund", "--no-package-lock"], join(stage, "package"));
  // Published, the dependency names the version; the copy inside is what installs.
  manifest.dependencies["tollgate-client"] = version;
  writeFileSync(join(stage, "package", "package.json"), JSON.stringify(manifest, null, 2));
  const tarball = npm(["pack", "--silent", "--pack-destination", stage], join(stage, "package")).split("\n").pop();
  renameSync(join(stage, tarball), join(out, tarball));
  console.log(join(out, tarball));
} finally {
  rmSync(stage, { recursive: true, force: true });
}
