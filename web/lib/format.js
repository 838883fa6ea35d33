// Pure formatting for the Carnator UI: no DOM, no ComfyUI; unit-tested with `node --test` (tests/browser/format.test.mjs).

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function formatBytes(bytes) {
  let value = Number(bytes);
  if (!Number.isFinite(value) || value < 0) return "?";
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${UNITS[unit]}`;
}

/** `created` is a Unix time in seconds (the store's time.time()); nowMs defaults to Date.now(). */
export function formatAge(created, nowMs = Date.now()) {
  const seconds = nowMs / 1000 - Number(created);
  if (!Number.isFinite(seconds)) return "?";
  if (seconds < 45) return "just now";
  const steps = [[60, "min", 60], [3600, "h", 24], [86400, "d", 30], [2592000, "mo", 12]];
  for (const [size, label, limit] of steps) {
    const count = Math.round(seconds / size);
    if (count < limit) return `${Math.max(1, count)} ${label} ago`;
  }
  return `${Math.round(seconds / 31536000)} y ago`;
}

export function formatDate(created) {
  const date = new Date(Number(created) * 1000);
  return Number.isNaN(date.getTime()) ? "?" : date.toLocaleString();
}

export function formatSpeedup(value) {
  const number = Number(value);
  return Number.isFinite(number) ? `${number.toFixed(number >= 10 ? 1 : 2)}×` : "?";
}

/** The model label of an entry: its model name when the host recorded one, else its bucket's head. */
export function modelLabel(entry) {
  if (entry.model) return String(entry.model);
  return entry.bucket ? `bucket ${String(entry.bucket).slice(0, 8)}` : "unknown model";
}

/** Reuses through the gate and exact repeats (answered with a stored result), counted apart as the store, the
 * command line's `stats` and the routes count them. */
export function hitsText(counts) {
  const hits = Number(counts.hits) || 0;
  const repeats = Number(counts.exact_repeats) || 0;
  return `${hits} ${hits === 1 ? "hit" : "hits"} · ${repeats} exact ${repeats === 1 ? "repeat" : "repeats"}`;
}

export function statsText(stats) {
  if (!stats) return "";
  const parts = [
    `${stats.entries} ${stats.entries === 1 ? "entry" : "entries"}`,
    `${formatBytes(stats.bytes)} of ${formatBytes(stats.size_limit_bytes)}`,
    hitsText(stats),
    `${stats.steps_saved} steps saved`,
  ];
  if (stats.corrupt) parts.push(`${stats.corrupt} corrupt`);
  return parts.join(" · ");
}

/** The lines under an entry's prompt: model and size; hits and age; where a hit's trajectory came from. */
export function entryLines(entry, nowMs = Date.now()) {
  const shape = Array.isArray(entry.latent_shape) && entry.latent_shape.length === 5
    ? ` · ${entry.latent_shape.slice(2).join("×")}` : "";
  const lines = [
    `${modelLabel(entry)} · ${entry.steps} steps${shape} · ${formatBytes(entry.size_bytes)}`,
    `${hitsText(entry)} · ${entry.steps_saved} steps saved · ${formatAge(entry.created, nowMs)}`,
  ];
  if (entry.reused_from) {
    const step = entry.decision && Number.isFinite(Number(entry.decision.resume_step))
      ? ` at step ${entry.decision.resume_step}` : "";
    lines.push(`resumed from entry ${String(entry.reused_from).slice(0, 8)}${step}`);
  }
  const made = entry.decision ? costText(entry.decision) : "";
  if (made) lines.push(`made with ${made}`);
  return lines;
}

/** Steps run and model calls counted at the diffusion model, and the step cache that ran inside (EasyCache);
 * empty for a decision not yet run (the Compatibility Gate's). */
export function costText(decision) {
  if (!Number.isFinite(Number(decision.steps_run))) return "";
  const calls = Number(decision.model_calls);
  let text = `${decision.steps_run} of ${decision.steps} steps run · ${calls} model ${calls === 1 ? "call" : "calls"}`;
  if (decision.step_cache) text += ` · ${decision.step_cache} inside (skipped ${decision.step_cache_skipped || 0})`;
  return text;
}

function badgeCalls(decision) {
  if (!Number.isFinite(Number(decision.steps_run))) return "";
  const cache = decision.step_cache ? ` · ${String(decision.step_cache).split(" ")[0]}` : "";
  return ` · ${decision.model_calls} calls${cache}`;
}

// A hit under region-only resume: the share of the clip it recomputed, or that it resumed the whole clip.
function badgeRegion(decision) {
  const region = String(decision.region || "");
  const share = region.match(/^region-only on (\d+%)/);
  if (share) return ` · region-only ${share[1]}`;
  return region ? " · whole clip" : "";
}

/** The badge on a Carnator node: short, read at a glance. */
export function decisionBadge(decision) {
  if (!decision) return { text: "", fg: "#ffffff", bg: "#555555" };
  if (decision.error) return { text: "Carnator: error", fg: "#ffffff", bg: "#b3261e" };
  const steps = Number(decision.steps);
  if (decision.plain) return { text: "OFF · sampled as KSampler", fg: "#ffffff", bg: "#8a5a00" };
  if (decision.exact_repeat) {
    const calls = Number(decision.model_calls) || 0;
    return { text: `REPEAT · ${calls} model ${calls === 1 ? "call" : "calls"}`, fg: "#ffffff", bg: "#1b5e20" };
  }
  if (decision.reuse) {
    return {
      text: `HIT k=${decision.resume_step}/${steps}${badgeRegion(decision)} · ${formatSpeedup(decision.expected_speedup)}`
        + badgeCalls(decision),
      fg: "#ffffff",
      bg: "#2e7d32",
    };
  }
  return { text: `MISS · ${Number.isFinite(steps) ? steps : "?"} steps${badgeCalls(decision)}`, fg: "#ffffff",
    bg: "#5f6368" };
}

// What a node keeps of its last decision (in its properties, saved with the workflow, so that the display
// survives a page reload): what decisionBadge and decisionLines read, nothing else.
const SAVED_DECISION_KEYS = ["node", "reuse", "exact_repeat", "error", "risk", "steps", "probe_steps", "resume_step",
  "refine_step", "model_calls", "steps_run", "step_cache", "step_cache_skipped", "expected_speedup", "entry_id",
  "stored_as", "store_pending", "warnings", "reasons", "why", "region", "plain", "notes"];

export function savedDecision(decision) {
  const saved = {};
  for (const key of SAVED_DECISION_KEYS) if (decision && decision[key] !== undefined) saved[key] = decision[key];
  return saved;
}

/** The longer text of the decision widget; its last lines are the gate's reasons. */
export function decisionLines(decision) {
  if (!decision) return ["No Carnator decision yet: queue the workflow."];
  if (decision.error) return [`Carnator error: ${decision.error}`];
  // reuse off for this host or latent (hosts/contract.py): the one line says what, nothing else applies
  if (decision.plain) return [`OFF: ${decision.why}`, `${decision.steps} steps sampled as a KSampler does, nothing stored`];
  const lines = [];
  const risk = decision.risk ? ` · risk ${decision.risk}` : "";
  if (decision.exact_repeat) {
    lines.push(`REPEAT: the stored result of entry ${decision.entry_id}, a full generation of the same inputs`);
  } else if (decision.reuse) {
    lines.push(`HIT: resume at step ${decision.resume_step} of ${decision.steps}${risk}`);
    if (decision.region) lines.push(decision.region);
    if (decision.entry_id) lines.push(`reused entry ${decision.entry_id}`);
  } else {
    lines.push(`MISS: full run of ${decision.steps} steps${risk}`);
    // what decided it (the node's own text says the same): the input or node that differs, a limit, a refusal
    if (decision.why) lines.push(`why: ${decision.why}`);
  }
  const calls = costText(decision)
    || (Number.isFinite(Number(decision.model_calls)) ? `${decision.model_calls} model calls` : "");
  const probe = Number.isFinite(Number(decision.probe_steps)) ? `probe ${decision.probe_steps} steps` : "";
  const speedup = decision.exact_repeat ? "" : `expected ${formatSpeedup(decision.expected_speedup)}`;
  lines.push([probe, calls, speedup].filter(Boolean).join(" · "));
  if (decision.stored_as) lines.push(`${decision.store_pending ? "being stored" : "stored"} as ${decision.stored_as}`);
  for (const note of decision.notes || []) lines.push(`note: ${note}`);
  for (const warning of decision.warnings || []) lines.push(`warning: ${warning}`);
  for (const reason of decision.reasons || []) lines.push(`• ${reason}`);
  return lines;
}

/** A node's id from the websocket payload: "12", or "5:12" for a node inside a subgraph. */
export function nodeIdPath(id) {
  if (id === undefined || id === null) return [];
  return String(id).split(":").filter((part) => part.length > 0);
}

export function isCarnatorNodeType(type) {
  return typeof type === "string" && type.startsWith("Carnator");
}
