// The "Carnator" sidebar tab: stats header, one card per cache entry (thumbnail, prompt, model/bucket,
// hits, steps saved, size, age), delete per entry, clear-all behind a confirmation dialog.
// It talks only to the plugin's routes (nodes/routes.py) through ComfyUI's api.fetchApi (/api/carnator/...).

import { entryLines, formatDate, statsText } from "./format.js";

const STYLE_ID = "carnator-style";
const CSS = `
.carnator-browser { display: flex; flex-direction: column; height: 100%; padding: 8px; gap: 6px;
  box-sizing: border-box; color: var(--fg-color, #ddd); font-size: 13px; min-width: 0; }
.carnator-browser h3 { margin: 0; font-size: 15px; flex: 1 1 auto; white-space: nowrap; }
.carnator-head { display: flex; align-items: center; gap: 6px; flex-wrap: wrap; }
.carnator-stats { color: var(--descrip-text, #999); font-size: 12px; }
.carnator-browser button { cursor: pointer; border: 1px solid var(--border-color, #444); border-radius: 4px;
  background: var(--comfy-input-bg, #222); color: inherit; padding: 3px 8px; font-size: 12px; white-space: nowrap; }
.carnator-browser button:hover { border-color: var(--fg-color, #ddd); }
.carnator-browser button:disabled { opacity: 0.5; cursor: default; }
.carnator-browser button.carnator-danger:hover:enabled { border-color: #e5534b; color: #e5534b; }
.carnator-browser select, .carnator-browser input { background: var(--comfy-input-bg, #222); color: inherit;
  border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 3px 6px; font-size: 12px;
  min-width: 0; flex: 1 1 120px; }
.carnator-list { flex: 1; overflow-y: auto; display: flex; flex-direction: column; gap: 6px; min-height: 0; }
.carnator-entry { display: grid; grid-template-columns: 64px minmax(0, 1fr) auto; gap: 4px 8px; padding: 6px;
  border: 1px solid var(--border-color, #444); border-radius: 6px; background: var(--comfy-menu-bg, #1a1a1a); }
.carnator-entry.carnator-corrupt { border-color: #b3261e; }
.carnator-thumb { width: 64px; height: 64px; border-radius: 4px; object-fit: cover; grid-row: span 2;
  background: var(--comfy-input-bg, #222); image-rendering: pixelated; }
.carnator-prompt { font-weight: 600; overflow: hidden; display: -webkit-box; -webkit-line-clamp: 3;
  -webkit-box-orient: vertical; overflow-wrap: anywhere; }
.carnator-body { grid-column: 2 / 4; display: flex; flex-direction: column; gap: 2px; min-width: 0; }
.carnator-meta { color: var(--descrip-text, #999); font-size: 11px; overflow-wrap: anywhere; }
.carnator-problem { color: #e5534b; font-size: 11px; }
.carnator-empty { color: var(--descrip-text, #999); padding: 16px 4px; text-align: center; }
.carnator-decision { font-size: 11px; line-height: 1.35; white-space: pre-wrap; overflow-y: auto;
  padding: 4px 6px; box-sizing: border-box; border-radius: 4px; color: var(--input-text, #ddd);
  background: var(--comfy-input-bg, #222); }
.carnator-decision[data-outcome="hit"] { border-left: 3px solid #2e7d32; }
.carnator-decision[data-outcome="miss"] { border-left: 3px solid #5f6368; }
.carnator-decision[data-outcome="error"] { border-left: 3px solid #b3261e; }
`;

export function ensureStyle() {
  if (document.getElementById(STYLE_ID)) return;
  const style = document.createElement("style");
  style.id = STYLE_ID;
  style.textContent = CSS;
  document.head.appendChild(style);
}

function element(tag, props = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "on") for (const [event, fn] of Object.entries(value)) node.addEventListener(event, fn);
    else node[key] = value;
  }
  for (const child of [].concat(children)) if (child) node.append(child);
  return node;
}

async function readJson(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    const message = body && body.error ? body.error : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body;
}

export class CacheBrowser {
  constructor(app, api) {
    this.app = app;
    this.api = api;
    this.root = null;
    this.cache = ""; // "" = the default store
    this.stats = null;
    this.entries = [];
    this.filter = "";
    this.loading = null;
  }

  // ---- server --------------------------------------------------------------------------------

  query() {
    return this.cache ? `?cache=${encodeURIComponent(this.cache)}` : "";
  }

  async refresh() {
    if (!this.root) return;
    const pending = (async () => {
      const [stats, listing] = await Promise.all([
        this.api.fetchApi(`/carnator/stats${this.query()}`).then(readJson),
        this.api.fetchApi(`/carnator/entries${this.query()}`).then(readJson),
      ]);
      this.stats = stats;
      this.entries = listing.entries || [];
      this.error = null;
    })();
    this.loading = pending;
    try {
      await pending;
    } catch (error) {
      this.error = error.message;
    }
    if (this.loading === pending) this.draw();
  }

  async deleteEntry(entry, button) {
    button.disabled = true;
    try {
      await readJson(await this.api.fetchApi(`/carnator/entries/${entry.id}${this.query()}`, { method: "DELETE" }));
      this.toast("info", "Entry deleted", entry.prompt || entry.id);
    } catch (error) {
      this.toast("error", "Could not delete the entry", error.message);
    }
    await this.refresh();
  }

  async clearAll() {
    const count = this.stats ? this.stats.entries : this.entries.length;
    const what = count === 1 ? "the only cached generation" : `all ${count} cached generations`;
    const message = `Delete ${what} of this store? Later runs start from scratch until the cache fills again.`;
    if (!(await this.confirm("Clear the Carnator cache", message))) return;
    try {
      const done = await readJson(await this.api.fetchApi(`/carnator/clear${this.query()}`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ confirm: true }),
      }));
      this.toast("info", "Cache cleared", `${done.deleted} entries deleted`);
    } catch (error) {
      this.toast("error", "Could not clear the cache", error.message);
    }
    await this.refresh();
  }

  async confirm(title, message) {
    const dialog = this.app.extensionManager && this.app.extensionManager.dialog;
    if (dialog && typeof dialog.confirm === "function") {
      return (await dialog.confirm({ title, message, type: "delete" })) === true;
    }
    return window.confirm(`${title}\n\n${message}`);
  }

  toast(severity, summary, detail) {
    const toast = this.app.extensionManager && this.app.extensionManager.toast;
    if (toast && typeof toast.add === "function") {
      toast.add({ severity, summary: `Carnator: ${summary}`, detail, life: severity === "error" ? 6000 : 2500 });
    } else if (severity === "error") {
      console.error(`Carnator: ${summary}: ${detail}`);
    }
  }

  // ---- DOM -----------------------------------------------------------------------------------

  mount(root) {
    ensureStyle();
    this.root = root;
    root.replaceChildren();
    root.classList.add("carnator-browser");
    root.dataset.carnator = "browser";
    this.draw();
    this.refresh();
  }

  unmount() {
    this.root = null;
  }

  draw() {
    const root = this.root;
    if (!root) return;
    const head = element("div", { className: "carnator-head" }, [
      element("h3", { textContent: "Carnator cache" }),
      element("button", {
        textContent: "Refresh", title: "Reload the entries", dataset: { carnator: "refresh" },
        on: { click: () => this.refresh() },
      }),
      element("button", {
        className: "carnator-danger", textContent: "Clear all", title: "Delete every entry of this store",
        disabled: !this.entries.length, dataset: { carnator: "clear" }, on: { click: () => this.clearAll() },
      }),
    ]);
    const stats = element("div", {
      className: "carnator-stats", dataset: { carnator: "stats" },
      textContent: this.stats ? statsText(this.stats) : "loading…",
      title: this.stats ? this.stats.directory : "",
    });
    const tools = element("div", { className: "carnator-head" }, [this.storePicker(), this.search()]);
    const list = element("div", { className: "carnator-list", dataset: { carnator: "list" } });
    const shown = this.entries.filter((entry) => !this.filter ||
      String(entry.prompt).toLowerCase().includes(this.filter.toLowerCase()));
    if (this.error) {
      list.append(element("div", { className: "carnator-problem", dataset: { carnator: "error" },
        textContent: `Could not load the cache: ${this.error}` }));
    } else if (!shown.length && this.stats) {
      list.append(element("div", { className: "carnator-empty", dataset: { carnator: "empty" },
        textContent: this.entries.length ? "No entry matches the filter." :
          "The cache is empty: run a workflow with a Carnator node to fill it." }));
    }
    for (const entry of shown) list.append(this.card(entry));
    root.replaceChildren(head, stats, tools, list);
  }

  storePicker() {
    const stores = (this.stats && this.stats.stores) || [];
    if (stores.length < 2) return null;
    const select = element("select", { title: "Cache store", dataset: { carnator: "store" },
      on: { change: (event) => { this.cache = event.target.value; this.refresh(); } } });
    for (const store of stores) {
      const value = store.default ? "" : store.directory;
      select.append(element("option", { value, textContent: store.default ? `${store.directory} (default)` :
        store.directory, selected: value === this.cache }));
    }
    return select;
  }

  search() {
    if (this.entries.length < 2 && !this.filter) return null;
    const input = element("input", { type: "search", placeholder: "Filter by prompt", value: this.filter,
      dataset: { carnator: "filter" } });
    input.addEventListener("input", () => {
      this.filter = input.value;
      const position = input.selectionStart;
      this.draw();
      const again = this.root && this.root.querySelector('[data-carnator="filter"]');
      if (again) { again.focus(); again.setSelectionRange(position, position); }
    });
    return input;
  }

  card(entry) {
    const thumb = element("img", {
      className: "carnator-thumb", alt: "", loading: "lazy", decoding: "async",
      src: this.api.apiURL(`/carnator/entries/${entry.id}/thumbnail${this.query()}`),
      dataset: { carnator: "thumbnail" },
    });
    thumb.addEventListener("error", () => { thumb.style.visibility = "hidden"; }, { once: true });
    const [first, second, origin] = entryLines(entry);
    const prompt = element("div", { className: "carnator-prompt", textContent: entry.prompt || "(no prompt)",
      title: entry.prompt || "", dataset: { carnator: "prompt" } });
    const remove = element("button", { className: "carnator-danger", title: "Delete this entry",
      dataset: { carnator: "delete" }, ariaLabel: `Delete cache entry ${entry.id}` });
    remove.append(element("i", { className: "pi pi-trash" }));
    remove.addEventListener("click", () => this.deleteEntry(entry, remove));
    const body = element("div", { className: "carnator-body" }, [
      element("div", { className: "carnator-meta", textContent: first, title: `bucket ${entry.bucket}` }),
      element("div", { className: "carnator-meta", textContent: second,
        title: `created ${formatDate(entry.created)}, last used ${formatDate(entry.last_used)}, seed ${entry.seed}` }),
      origin ? element("div", { className: "carnator-meta", textContent: origin, title: `entry ${entry.reused_from}` }) : null,
      entry.corrupt ? element("div", { className: "carnator-problem", textContent: `corrupt: ${entry.corrupt}` }) : null,
    ]);
    return element("div", {
      className: `carnator-entry${entry.corrupt ? " carnator-corrupt" : ""}`,
      dataset: { carnator: "entry", entryId: entry.id },
    }, [thumb, prompt, remove, body]);
  }
}
