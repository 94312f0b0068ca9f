// Calls exported functions of an ES module for the pytest suite (tests/test_web_extension.py).
// Usage: node call.mjs <module.js>  with stdin = JSON [[functionName, [args...]], ...]
// Prints JSON [{"value": result} | {"error": message}, ...] on stdout.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const module = await import(pathToFileURL(process.argv[2]).href);
const calls = JSON.parse(readFileSync(0, "utf8"));
const results = calls.map(([name, args]) => {
  try {
    if (typeof module[name] !== "function") throw new Error(`${name} is not an exported function`);
    return { value: module[name](...args) };
  } catch (error) {
    return { error: String(error?.message ?? error) };
  }
});
process.stdout.write(JSON.stringify(results));
