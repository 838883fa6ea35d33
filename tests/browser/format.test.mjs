// Unit tests of web/lib/format.js (pure functions): `node --test tests/browser/format.test.mjs`.
import assert from "node:assert/strict";
import test from "node:test";

import {
  decisionBadge, decisionLines, entryLines, formatAge, formatBytes, formatSpeedup, isCarnatorNodeType, modelLabel,
  nodeIdPath, savedDecision, statsText,
} from "../../web/lib/format.js";

test("bytes", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1023), "1023 B");
  assert.equal(formatBytes(1536), "1.50 KiB");
  assert.equal(formatBytes(8 * 2 ** 30), "8.00 GiB");
  assert.equal(formatBytes(150 * 2 ** 20), "150 MiB");
  assert.equal(formatBytes(-1), "?");
  assert.equal(formatBytes("x"), "?");
});

test("ages", () => {
  const now = 1_000_000 * 1000;
  assert.equal(formatAge(1_000_000 - 10, now), "just now");
  assert.equal(formatAge(1_000_000 - 300, now), "5 min ago");
  assert.equal(formatAge(1_000_000 - 7200, now), "2 h ago");
  assert.equal(formatAge(1_000_000 - 3 * 86400, now), "3 d ago");
  assert.equal(formatAge(undefined, now), "?");
});

test("entry lines and model label", () => {
  const entry = { model: "", bucket: "0123456789abcdef01234567", steps: 30, latent_shape: [1, 16, 3, 8, 8],
    size_bytes: 2048, hits: 1, steps_saved: 12, created: 1_000_000 - 120 };
  assert.equal(modelLabel(entry), "bucket 01234567");
  assert.equal(modelLabel({ ...entry, model: "wan2.1_t2v_1.3B" }), "wan2.1_t2v_1.3B");
  assert.deepEqual(entryLines(entry, 1_000_000 * 1000), [
    "bucket 01234567 · 30 steps · 3×8×8 · 2.00 KiB",
    "1 hit · 0 exact repeats · 12 steps saved · 2 min ago",
  ]);
  const resumed = { ...entry, reused_from: "fedcba9876543210", decision: { reuse: true, resume_step: 5 } };
  assert.equal(entryLines(resumed, 1_000_000 * 1000)[2], "resumed from entry fedcba98 at step 5");
});

test("stats", () => {
  assert.equal(statsText({ entries: 1, bytes: 1024, size_limit_bytes: 2 ** 30, hits: 0, steps_saved: 0, corrupt: 0 }),
    "1 entry · 1.00 KiB of 1.00 GiB · 0 hits · 0 exact repeats · 0 steps saved");
  // one definition with the store, the CLI's stats and the routes: exact repeats are counted apart from hits
  assert.equal(statsText({ entries: 1, bytes: 0, size_limit_bytes: 0, hits: 2, exact_repeats: 1, steps_saved: 9 }),
    "1 entry · 0 B of 0 B · 2 hits · 1 exact repeat · 9 steps saved");
  assert.match(statsText({ entries: 2, bytes: 0, size_limit_bytes: 0, hits: 3, steps_saved: 9, corrupt: 1 }),
    /2 entries .* 3 hits · 0 exact repeats · 9 steps saved · 1 corrupt$/);
});

test("decision badge and lines", () => {
  const hit = { node: "7", reuse: true, risk: "balanced", resume_step: 12, probe_steps: 3, steps: 30,
    model_calls: 21, expected_speedup: 1.4286, reasons: ["reuse entry abc", "risk 0.40 of the limit"],
    entry_id: "0123456789abcdef" };
  assert.equal(decisionBadge(hit).text, "HIT k=12/30 · 1.43×");
  assert.equal(decisionBadge(hit).bg, "#2e7d32");
  const lines = decisionLines(hit);
  assert.equal(lines[0], "HIT: resume at step 12 of 30 · risk balanced");
  assert.ok(lines.includes("probe 3 steps · 21 model calls · expected 1.43×"));
  assert.deepEqual(lines.slice(-2), ["• reuse entry abc", "• risk 0.40 of the limit"]);

  const miss = { node: "7", reuse: false, risk: "safe", resume_step: 3, probe_steps: 3, steps: 30, model_calls: 30,
    expected_speedup: 1, reasons: ["no earlier generation"] };
  assert.equal(decisionBadge(miss).text, "MISS · 30 steps");
  assert.equal(decisionLines(miss)[0], "MISS: full run of 30 steps · risk safe");
  // the deciding reason comes right under the verdict, as the node's own text gives it (summary "why")
  const refused = { ...miss, steps: 4, why: "nearest entry 0123456789abcdef rejected; resuming at step 2 of 4 would "
    + "save fewer than 2 model calls after a 1-step probe: reuse cannot pay here" };
  assert.deepEqual(decisionLines(refused).slice(0, 2), ["MISS: full run of 4 steps · risk safe", `why: ${refused.why}`]);
  assert.equal(savedDecision(refused).why, refused.why);       // still shown after a page reload
  // a write still under way is "being stored"; one that failed names no entry (its warning says why)
  assert.ok(decisionLines({ ...miss, stored_as: "0123456789abcdef", store_pending: true })
    .includes("being stored as 0123456789abcdef"));
  assert.ok(decisionLines({ ...miss, stored_as: "0123456789abcdef", store_pending: false })
    .includes("stored as 0123456789abcdef"));
  // reuse off for the host or the latent: the one line, and how it was sampled
  const off = { ...miss, plain: true, steps: 10, why: "Carnator: this ComfyUI (0.38.2) lacks X: reuse is off" };
  assert.equal(decisionBadge(off).text, "OFF · sampled as KSampler");
  assert.deepEqual(decisionLines(off), [`OFF: ${off.why}`, "10 steps sampled as a KSampler does, nothing stored"]);
  assert.equal(savedDecision(off).plain, true);
  // how the host shaped the run (dynamic VRAM kept a region's keys and values off the GPU), before any warning
  const paged = { ...hit, notes: ["dynamic VRAM is on"], warnings: ["w"] };
  assert.ok(decisionLines(paged).join("\n").includes("note: dynamic VRAM is on\nwarning: w"));
  // a store fault that made the request a full generation shows on the node, before the gate's reasons
  const faulted = { ...miss, warnings: ["reading entry 0123456789abcdef failed: this request is generated in full"] };
  assert.deepEqual(decisionLines(faulted).slice(-2),
    ["warning: reading entry 0123456789abcdef failed: this request is generated in full", "• no earlier generation"]);
  const repeat = { node: "7", reuse: true, exact_repeat: true, risk: "balanced", resume_step: 30, probe_steps: 0,
    steps: 30, model_calls: 0, expected_speedup: null, entry_id: "0123456789abcdef", reasons: ["exact repeat"] };
  assert.equal(decisionBadge(repeat).text, "REPEAT · 0 model calls");
  assert.equal(decisionLines(repeat)[0], "REPEAT: the stored result of entry 0123456789abcdef, a full generation of the same inputs");
  assert.ok(decisionLines(repeat).includes("probe 0 steps · 0 model calls"));
  assert.equal(decisionBadge({ ...repeat, probe_steps: 3, model_calls: 3 }).text, "REPEAT · 3 model calls");
  // after the run: steps next to model calls counted at the diffusion model, and the step cache inside
  const ran = { ...miss, steps: 10, steps_run: 10, model_calls: 5, step_cache: "EasyCache reuse_threshold=3, start_percent=0.15",
    step_cache_skipped: 5 };
  assert.equal(decisionBadge(ran).text, "MISS · 10 steps · 5 calls · EasyCache");
  assert.ok(decisionLines(ran).includes(
    "probe 3 steps · 10 of 10 steps run · 5 model calls · EasyCache reuse_threshold=3, start_percent=0.15 inside (skipped 5) · expected 1.00×"));
  assert.equal(decisionBadge({ ...hit, steps_run: 21, model_calls: 21 }).text, "HIT k=12/30 · 1.43× · 21 calls");
  // region-only resume: the share it recomputed and its own expected speedup, or why the whole clip was resumed
  const region = { ...hit, expected_speedup: 3.6, region: "region-only on 30% of the clip" };
  assert.equal(decisionBadge(region).text, "HIT k=12/30 · region-only 30% · 3.60×");
  assert.equal(decisionLines(region)[1], "region-only on 30% of the clip");
  const whole = { ...hit, region: "whole clip: not enough GPU memory for region-only resume" };
  assert.equal(decisionBadge(whole).text, "HIT k=12/30 · whole clip · 1.43×");
  assert.equal(decisionLines(whole)[1], "whole clip: not enough GPU memory for region-only resume");
  assert.equal(savedDecision(region).region, region.region);
  const made = { model: "", bucket: "0123456789abcdef", steps: 30, size_bytes: 0, hits: 0, steps_saved: 0, created: 0,
    decision: { steps: 30, steps_run: 30, model_calls: 18, step_cache: "EasyCache x", step_cache_skipped: 12 } };
  assert.equal(entryLines(made, 0)[2], "made with 30 of 30 steps run · 18 model calls · EasyCache x inside (skipped 12)");
  assert.equal(decisionBadge(null).text, "");
  assert.equal(decisionBadge({ error: "boom" }).text, "Carnator: error");
  assert.equal(formatSpeedup(12.345), "12.3×");
});

test("a saved decision keeps what the display reads, and the display reads the same from it", () => {
  const decision = { node: "7", reuse: true, risk: "balanced", resume_step: 12, probe_steps: 3, steps: 30,
    model_calls: 21, steps_run: 30, step_cache: "EasyCache reuse_threshold=0.2", step_cache_skipped: 4,
    expected_speedup: 1.4286, reasons: ["reuse entry abc"], entry_id: "0123456789abcdef",
    stored_as: "fedcba9876543210", warnings: [], numbers: { hidden: 0.01 }, seconds: { probe: 1.5 } };
  const saved = JSON.parse(JSON.stringify(savedDecision(decision)));   // as the workflow's JSON holds it
  assert.equal(saved.numbers, undefined);
  assert.equal(saved.seconds, undefined);
  assert.deepEqual(decisionLines(saved), decisionLines(decision));
  assert.deepEqual(decisionBadge(saved), decisionBadge(decision));
  assert.deepEqual(savedDecision(null), {});
});

test("node ids and types", () => {
  assert.deepEqual(nodeIdPath("12"), ["12"]);
  assert.deepEqual(nodeIdPath(12), ["12"]);
  assert.deepEqual(nodeIdPath("5:12"), ["5", "12"]);
  assert.deepEqual(nodeIdPath(null), []);
  assert.ok(isCarnatorNodeType("CarnatorSampler"));
  assert.ok(!isCarnatorNodeType("KSampler"));
  assert.ok(!isCarnatorNodeType(undefined));
});
