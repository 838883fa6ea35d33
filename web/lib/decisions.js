// The last decision of each Carnator node, shown on the node: a title badge (HIT k/N · speedup, or MISS)
// and a read-only text widget with the numbers and the gate's reasons (also on hover, as its tooltip).
// Fed by the websocket event "carnator.decision" ({node: unique_id, reuse, risk, resume_step, ...}). The node keeps
// its last decision in its properties (saved with the workflow, which the web app restores after a page reload).
// Made for LiteGraph's canvas renderer; the experimental Vue node renderer is not supported (README).

import { decisionBadge, decisionLines, isCarnatorNodeType, nodeIdPath, savedDecision } from "./format.js";

const WIDGET_NAME = "carnator_decision";
const PROPERTY = "carnator_decision";
const LINE_HEIGHT = 15; // px, 11px text at line-height 1.35 (see .carnator-decision)
const MAX_HEIGHT = 190;

// Drawn like LiteGraph's LGraphBadge (the canvas calls getWidth, draw and reads height); a node's
// `badges` may hold functions returning such an object, so the badge follows the node's decision.
class DecisionBadge {
  constructor(node) {
    this.node = node;
    this.height = 20;
    this.padding = 6;
    this.fontSize = 12;
  }

  get spec() {
    return decisionBadge(this.node.carnatorDecision);
  }

  get visible() {
    return this.spec.text.length > 0;
  }

  getWidth(ctx) {
    if (!this.visible) return 0;
    const font = ctx.font;
    ctx.font = `${this.fontSize}px sans-serif`;
    const width = ctx.measureText(this.spec.text).width + this.padding * 2;
    ctx.font = font;
    return width;
  }

  draw(ctx, x, y) {
    if (!this.visible) return;
    const { text, fg, bg } = this.spec;
    const { font, fillStyle, textBaseline, textAlign } = ctx;
    const width = this.getWidth(ctx);
    ctx.font = `${this.fontSize}px sans-serif`;
    ctx.fillStyle = bg;
    ctx.beginPath();
    if (ctx.roundRect) ctx.roundRect(x, y, width, this.height, 5);
    else ctx.rect(x, y, width, this.height);
    ctx.fill();
    ctx.fillStyle = fg;
    ctx.textBaseline = "middle";
    ctx.textAlign = "left";
    ctx.fillText(text, x + this.padding, y + this.height / 2 + 1);
    Object.assign(ctx, { font, fillStyle, textBaseline, textAlign });
  }
}

function isCarnatorNode(node) {
  return !!node && (isCarnatorNodeType(node.comfyClass) || isCarnatorNodeType(node.type));
}

/** Finds "12" in the root graph, or "5:12" inside the subgraph of node 5. */
export function findNode(graph, id) {
  let node = null;
  let current = graph;
  for (const part of nodeIdPath(id)) {
    if (!current || typeof current.getNodeById !== "function") return null;
    node = current.getNodeById(part) ?? current.getNodeById(Number(part));
    current = node && node.subgraph;
  }
  return node;
}

export class DecisionDisplay {
  constructor(app) {
    this.app = app;
    this.latest = new Map(); // node id (string) -> last decision payload
  }

  /** Called when a node is created and again once a loaded workflow has restored its properties. */
  attach(node) {
    if (!isCarnatorNode(node)) return;
    if (!node.carnatorBadge) {
      node.carnatorBadge = new DecisionBadge(node);
      if (!Array.isArray(node.badges)) node.badges = [];
      node.badges.push(() => node.carnatorBadge);
    }
    const known = this.latest.get(String(node.id));
    const saved = node.properties && node.properties[PROPERTY];
    if (known && node.carnatorDecision !== known) this.show(node, known);
    else if (!known && saved && !node.carnatorDecision) this.show(node, saved, false);
  }

  onDecision(decision) {
    if (!decision || decision.node === undefined || decision.node === null) return;
    this.latest.set(String(decision.node), decision);
    const node = findNode(this.app.graph, decision.node);
    if (node && isCarnatorNode(node)) {
      this.attach(node);
      this.show(node, decision);
    }
  }

  show(node, decision, remember = true) {
    node.carnatorDecision = decision;
    if (remember) this.remember(node, decision);
    const lines = decisionLines(decision);
    const widget = this.widget(node);
    if (widget) {
      widget.carnatorLines = lines.length;
      widget.element.textContent = lines.join("\n");
      widget.element.title = (decision.reasons || []).join("\n");
      widget.element.dataset.outcome = decision.error ? "error" : decision.reuse ? "hit" : "miss";
    }
    const wanted = node.computeSize ? node.computeSize() : node.size;
    if (node.setSize && wanted && wanted[1] > node.size[1]) node.setSize([Math.max(node.size[0], wanted[0]), wanted[1]]);
    (node.graph || this.app.graph)?.setDirtyCanvas?.(true, true);
  }

  remember(node, decision) {
    node.properties = node.properties || {};
    node.properties[PROPERTY] = savedDecision(decision);
    // the web app saves the open workflow (and so this property) when its change tracker sees a change
    this.app.extensionManager?.workflow?.activeWorkflow?.changeTracker?.checkState?.();
  }

  widget(node) {
    const existing = (node.widgets || []).find((w) => w.name === WIDGET_NAME);
    if (existing) return existing;
    if (typeof node.addDOMWidget !== "function") return null;
    const element = document.createElement("div");
    element.className = "carnator-decision";
    element.dataset.carnator = "decision";
    const widget = node.addDOMWidget(WIDGET_NAME, "carnator-decision", element, {
      serialize: false, // neither in the workflow nor in the prompt sent to the server
      hideOnZoom: false,
      getValue: () => element.textContent,
      setValue: () => {},
      // room for every line up to a point; longer reason lists scroll (and show whole on hover)
      getMinHeight: () => Math.min(MAX_HEIGHT, 10 + LINE_HEIGHT * (widget.carnatorLines || 3)),
      getMaxHeight: () => MAX_HEIGHT,
    });
    widget.serialize = false;
    return widget;
  }
}
