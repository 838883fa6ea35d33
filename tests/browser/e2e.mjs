// End-to-end check of the Carnator web extension in headless Chromium (driven by tests/test_browser_e2e.py).
//
//   node tests/browser/e2e.mjs CONFIG.json
//
// CONFIG: {url, screenshots (dir), userDataDir, chromium (default /usr/bin/chromium), expectPrompt,
//          workflow (optional API-format prompt: loaded into the UI and queued from it),
//          queueCount (how many times to queue it; "control_after_generate" is set to fixed),
//          changesBeforeRun ({run number: [{node, widget, value}, ...]}: widgets set before that run, a new
//          request or only a reason for ComfyUI to run the prompt again rather than answer from its own
//          output cache),
//          entryId (entry to find and delete; default: the entry the first run stored, else the first
//          entry showing expectPrompt),
//          decisionNode (optional node id whose "carnator.decision" badge must appear; with reloadCheck, the
//          page is then reloaded and the node's badge and text read again),
//          clearAll (then try "Clear all": cancel once, confirm once), timeoutMs}
// Prints one JSON line: {entryId, entryText, decision (last, as the node holds it), decisions (all events),
//                        badge, widgetText, afterReload {badge, widgetText}, thumbnail, stats, remaining,
//                        screenshots, deleted, consoleErrors}.
// Needs playwright-core (cd tests/browser && npm install); never downloads a browser.

import fs from "node:fs";
import path from "node:path";
import { chromium } from "playwright-core";

const config = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const timeout = config.timeoutMs || 120000;
const shots = [];
const consoleErrors = [];

function log(message) {
  process.stderr.write(`[e2e] ${message}\n`);
}

async function shot(page, name, options = {}) {
  const file = path.join(config.screenshots, name);
  await page.screenshot({ path: file, ...options });
  shots.push(file);
  log(`screenshot ${file}`);
}

// The sidebar opens at the splitter's default share of the window; drag its gutter to a readable width.
async function widenSidebar(page, width) {
  const gutter = page.locator(".p-splitter-gutter").first();
  if (!(await gutter.count())) return;
  const box = await gutter.boundingBox();
  if (!box || box.x >= width) return;
  await page.mouse.move(box.x + box.width / 2, box.y + box.height / 2);
  await page.mouse.down();
  await page.mouse.move(width, box.y + box.height / 2, { steps: 8 });
  await page.mouse.up();
}

const browser = await chromium.launchPersistentContext(config.userDataDir, {
  executablePath: config.chromium || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1200, height: 640 },
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage"],
});

let result = {};
try {
  const page = browser.pages()[0] || (await browser.newPage());
  page.setDefaultTimeout(timeout);
  page.on("console", (message) => {
    if (message.type() === "error") consoleErrors.push(message.text());
  });
  page.on("pageerror", (error) => consoleErrors.push(`pageerror: ${error.stack || error.message}`));
  page.on("response", (response) => {
    if (response.status() >= 400) consoleErrors.push(`HTTP ${response.status()} ${response.url()}`);
  });

  log(`open ${config.url}`);
  await page.goto(config.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app && window.app.graph && window.app.extensionManager, null, { timeout });
  await page.locator(".carnator-tab-button").first().waitFor({ state: "visible", timeout });
  log("Carnator sidebar button is there");

  let decision = null;
  let badge = null;
  let widgetText = null;
  let decisions = [];
  let afterReload = null;
  const readDecision = (nodeId) => page.evaluate((id) => {
    const node = window.app.graph.getNodeById(id) || window.app.graph.getNodeById(Number(id));
    const widget = (node.widgets || []).find((w) => w.name === "carnator_decision");
    return {
      decision: node.carnatorDecision,
      badge: node.carnatorBadge && node.carnatorBadge.visible ? node.carnatorBadge.spec.text : null,
      widgetText: widget ? widget.element.textContent : null,
    };
  }, nodeId);
  const waitForDecision = (nodeId) => page.waitForFunction((id) => {
    const node = window.app.graph.getNodeById(id) || window.app.graph.getNodeById(Number(id));
    return node && node.carnatorDecision;
  }, nodeId, { timeout });
  if (config.workflow) {
    await page.evaluate(async (workflow) => {
      window.__carnatorDecisions = [];
      window.comfyAPI.api.api.addEventListener("carnator.decision", (event) => {
        window.__carnatorDecisions.push(event.detail);
      });
      await window.app.loadApiJson(workflow, "carnator-e2e");
      for (const node of window.app.graph.nodes) {  // same seed on every run: the repeat must be able to hit
        for (const widget of node.widgets || []) if (widget.name === "control_after_generate") widget.value = "fixed";
      }
    }, config.workflow);
    for (let run = 1; run <= (config.queueCount || 1); run += 1) {
      for (const change of (config.changesBeforeRun || {})[run] || []) {
        await page.evaluate(({ node: id, widget: name, value }) => {
          const node = window.app.graph.getNodeById(id) || window.app.graph.getNodeById(Number(id));
          node.widgets.find((w) => w.name === name).value = value;
        }, change);
      }
      log(`queue run ${run} from the UI`);
      await page.evaluate(() => window.app.queuePrompt(0, 1));
      // a write finishing after the node returned sends an update of its decision (write_done), not a request
      await page.waitForFunction((count) => window.__carnatorDecisions.filter((d) => !d.write_done).length >= count,
        run, { timeout });
    }
    decisions = await page.evaluate(() => window.__carnatorDecisions);
  }
  if (config.decisionNode !== undefined && config.decisionNode !== null) {
    const id = String(config.decisionNode);
    await waitForDecision(id);
    ({ decision, badge, widgetText } = await readDecision(id));
    log(`decision on node ${id}: ${badge}`);
    if (config.reloadCheck) {
      await page.waitForTimeout(500);   // the web app saves the open workflow as it changes
      log("reload the page");
      await page.reload({ waitUntil: "domcontentloaded" });
      await page.waitForFunction(() => window.app && window.app.graph && window.app.graph.nodes.length > 0, null,
        { timeout });
      await waitForDecision(id);
      const { badge: reloadedBadge, widgetText: reloadedText } = await readDecision(id);
      afterReload = { badge: reloadedBadge, widgetText: reloadedText };
      log(`after the reload, node ${id}: ${reloadedBadge}`);
      await page.locator(".carnator-tab-button").first().waitFor({ state: "visible", timeout });
    }
    // frame the node so the badge and the widget are in the picture
    await page.evaluate((nodeId) => {
      const app = window.app;
      const node = app.graph.getNodeById(nodeId) || app.graph.getNodeById(Number(nodeId));
      app.canvas.deselectAll?.();
      app.canvas.ds.scale = 1.0;
      app.canvas.ds.offset[0] = -node.pos[0] + 60;
      app.canvas.ds.offset[1] = -node.pos[1] + 110;
      app.canvas.setDirty(true, true);
    }, id);
    await page.waitForTimeout(500);
    await shot(page, "carnator-node-decision.png", { clip: { x: 0, y: 0, width: 760, height: 640 } });
  }

  await page.locator(".carnator-tab-button").first().click();
  const panel = page.locator('[data-carnator="browser"]');
  await panel.waitFor({ state: "visible", timeout });
  await widenSidebar(page, 380);
  const wanted = config.entryId || (decisions[0] && decisions[0].stored_as);
  const entry = wanted ? panel.locator(`[data-carnator="entry"][data-entry-id="${wanted}"]`)
    : panel.locator('[data-carnator="entry"]', { hasText: config.expectPrompt }).first();
  await entry.waitFor({ state: "visible", timeout });
  const entryId = await entry.getAttribute("data-entry-id");
  const promptText = await entry.locator('[data-carnator="prompt"]').textContent();
  const thumb = entry.locator('img[data-carnator="thumbnail"]');
  await page.waitForFunction((img) => img.complete && img.naturalWidth > 0, await thumb.elementHandle(), { timeout });
  const thumbnail = await thumb.evaluate((img) => ({ width: img.naturalWidth, height: img.naturalHeight, src: img.src }));
  const stats = await panel.locator('[data-carnator="stats"]').textContent();
  const entryText = await entry.textContent();
  log(`entry ${entryId} "${promptText}" thumbnail ${thumbnail.width}x${thumbnail.height}; ${stats}`);
  await shot(page, "carnator-sidebar-entry.png", { clip: { x: 0, y: 0, width: 760, height: 420 } });

  page.once("dialog", (dialog) => dialog.dismiss()); // a per-entry delete asks nothing; fail loudly if it did
  const gone = page.waitForResponse((response) => response.url().includes(`/carnator/entries/${entryId}`) &&
    response.request().method() === "DELETE");
  await entry.locator('[data-carnator="delete"]').click();
  const answer = await gone;
  await panel.locator(`[data-carnator="entry"][data-entry-id="${entryId}"]`).waitFor({ state: "detached", timeout });
  const remaining = await panel.locator('[data-carnator="entry"]').count();
  const listedAfter = await page.evaluate(async () => {
    const response = await window.comfyAPI.api.api.fetchApi("/carnator/entries");
    return (await response.json()).entries.map((e) => e.id);
  });
  const statsAfter = await panel.locator('[data-carnator="stats"]').textContent();
  log(`deleted (HTTP ${answer.status()}); ${remaining} entries left; ${statsAfter}`);
  await page.waitForTimeout(300);
  await shot(page, "carnator-sidebar-deleted.png", { clip: { x: 0, y: 0, width: 760, height: 420 } });

  let cleared = null;
  if (config.clearAll) {
    // clear-all asks first: Cancel keeps everything, Delete empties the store
    const dialog = page.getByRole("dialog");
    await panel.locator('[data-carnator="clear"]').click();
    await dialog.getByRole("button", { name: "Cancel" }).click();
    await dialog.waitFor({ state: "detached", timeout });
    const keptAfterCancel = await panel.locator('[data-carnator="entry"]').count();
    await panel.locator('[data-carnator="clear"]').click();
    await dialog.getByRole("button", { name: "Delete" }).waitFor({ state: "visible", timeout });
    await shot(page, "carnator-clear-confirm.png");
    const clearedAnswer = page.waitForResponse((response) => response.url().includes("/carnator/clear"));
    await dialog.getByRole("button", { name: "Delete" }).click();
    const clearStatus = (await clearedAnswer).status();
    await panel.locator('[data-carnator="empty"]').waitFor({ state: "visible", timeout });
    cleared = { keptAfterCancel, clearStatus, left: await panel.locator('[data-carnator="entry"]').count(),
      stats: await panel.locator('[data-carnator="stats"]').textContent() };
    log(`clear all: ${JSON.stringify(cleared)}`);
  }

  result = {
    cleared,
    entryId, listedAfter, promptText, entryText, thumbnail, stats, statsAfter, remaining, deleteStatus: answer.status(), deleted: true,
    decision, decisions, badge, widgetText, afterReload,
  };
} catch (error) {
  result = { error: String(error && error.stack ? error.stack : error) };
  try {
    const page = browser.pages()[0];
    if (page) await shot(page, "carnator-failure.png");
  } catch {
    // no screenshot of a failure is no reason to hide the failure itself
  }
} finally {
  await browser.close();
}
result.screenshots = shots;
result.consoleErrors = consoleErrors;
process.stdout.write(`${JSON.stringify(result)}\n`);
process.exit(result.error ? 1 : 0);
