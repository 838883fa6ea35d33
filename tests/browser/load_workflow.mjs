// Loads a UI-format workflow into the real ComfyUI frontend (headless Chromium) and reports how the web
// app read it: the node types it knows, each node's widgets, and the API prompt it would queue.
//
//   node tests/browser/load_workflow.mjs CONFIG.json
//
// CONFIG: {url, workflow (UI-format JSON), userDataDir, chromium (default /usr/bin/chromium), timeoutMs}
// Prints one JSON line: {missing, nodes: {id: {type, widgets: {name: value}}}, prompt, consoleErrors}
// or {error}. Needs playwright-core (cd tests/browser && npm install); never downloads a browser.

import fs from "node:fs";
import { chromium } from "playwright-core";

const config = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const timeout = config.timeoutMs || 120000;
const consoleErrors = [];
const browser = await chromium.launchPersistentContext(config.userDataDir, {
  executablePath: config.chromium || "/usr/bin/chromium",
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"],
});
let result;
try {
  const page = browser.pages()[0] || (await browser.newPage());
  page.setDefaultTimeout(timeout);
  page.on("console", (message) => { if (message.type() === "error") consoleErrors.push(message.text()); });
  page.on("pageerror", (error) => consoleErrors.push(`pageerror: ${error.message}`));
  await page.goto(config.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app && window.app.graph && window.LiteGraph, null, { timeout });
  result = await page.evaluate(async (workflow) => {
    const app = window.app;
    await app.loadGraphData(workflow, true, true, "carnator-workflow-check");
    const known = window.LiteGraph.registered_node_types;
    const nodes = {};
    for (const node of app.graph.nodes) {
      const widgets = {};
      for (const widget of node.widgets || []) widgets[widget.name] = widget.value;
      nodes[node.id] = { type: node.type, widgets };
    }
    const missing = app.graph.nodes.map((n) => n.type).filter((type) => !(type in known));
    const { output } = await app.graphToPrompt();
    return { missing, nodes, prompt: output };
  }, config.workflow);
} catch (error) {
  result = { error: String(error && error.stack || error) };
} finally {
  await browser.close();
}
console.log(JSON.stringify({ ...result, consoleErrors }));
