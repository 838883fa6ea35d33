// Carnator's ComfyUI frontend extension (served from WEB_DIRECTORY at /extensions/<plugin dir>/).
// - a "Carnator" sidebar tab: the cache browser (lib/cache_browser.js)
// - on Carnator nodes: the last reuse decision of each run (lib/decisions.js), from "carnator.decision"

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { CacheBrowser, ensureStyle } from "./lib/cache_browser.js";
import { DecisionDisplay } from "./lib/decisions.js";

const browser = new CacheBrowser(app, api);
const decisions = new DecisionDisplay(app);

app.registerExtension({
  name: "carnator.ui",

  async setup() {
    ensureStyle();
    const manager = app.extensionManager;
    if (manager && typeof manager.registerSidebarTab === "function") {
      manager.registerSidebarTab({
        id: "carnator",
        icon: "pi pi-database",
        title: "Carnator",
        tooltip: "Carnator cache: earlier generations reused across runs",
        label: "Carnator",
        type: "custom",
        render: (element) => browser.mount(element),
        destroy: () => browser.unmount(),
      });
    } else {
      console.warn("Carnator: this ComfyUI frontend has no sidebar tabs (extensionManager.registerSidebarTab); " +
        "the cache browser is unavailable, the routes under /api/carnator/ still work");
    }

    api.addEventListener("carnator.decision", (event) => {
      decisions.onDecision(event.detail);
      browser.refresh(); // a run may have stored a new entry or hit an old one
    });
    api.addEventListener("execution_success", () => browser.refresh());
  },

  nodeCreated(node) {
    decisions.attach(node);
  },

  loadedGraphNode(node) {
    decisions.attach(node);
  },
});
