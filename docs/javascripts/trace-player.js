// The trace player: plays a recorded run of an all-reduce step by step.
//
// A page holds <div class="trace-player" data-trace="ring"></div> (several names: a menu).
// The site build records each named run (collectives/course/trace_player.py) and writes
// NAME.player.json beside NAME.trace.json under traces/; tools/mkdocs_hooks.py gives the
// div data-base, the path from the page to that folder. Everything shown comes from the
// file: the messages of each step with their payloads, and every rank's buffer after it,
// as the run held them. Nothing is recomputed here.
//
// Rank r's input is 2^r in every element, so a value's bits name the ranks whose inputs
// it sums: a cell draws one stripe per rank, filled when that rank's input is in it.
(function () {
  "use strict";

  const COLORS = ["#3949ab", "#ef6c00", "#2e7d32", "#c2185b", "#00838f", "#6d4c41", "#8e24aa", "#9e9d24"];
  const PLAY_MS = 1300;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function ranksIn(bits, p) {
    const out = [];
    for (let r = 0; r < p; r++) if (bits & (1 << r)) out.push(r);
    return out;
  }

  // One value: p stripes, rank r's filled when its input is summed in.
  function cell(bits, p) {
    const box = el("span", "tp-cell");
    const who = ranksIn(bits, p);
    box.dataset.bits = String(bits);
    box.title = who.length === 0 ? "0 (no rank's input)"
      : who.length === p ? "the sum over every rank" : "the sum over rank" + (who.length > 1 ? "s " : " ") + who.join(", ");
    if (who.length === p) box.classList.add("tp-full");
    for (let r = 0; r < p; r++) {
      const stripe = el("span", "tp-bit");
      if (bits & (1 << r)) stripe.style.background = COLORS[r % COLORS.length];
      box.appendChild(stripe);
    }
    return box;
  }

  function payload(data, p) {
    const box = el("span", "tp-payload");
    if (!data) return box;
    if (data.bits) data.bits.forEach((b) => box.appendChild(cell(b, p)));
    if (data.pairs) {
      if (data.pairs.length === 0) box.appendChild(el("span", "tp-note", "no pairs"));
      data.pairs.forEach(([index, b]) => {
        const pair = el("span", "tp-pair");
        pair.appendChild(el("span", "tp-index", "[" + index + "]"));
        pair.appendChild(cell(b, p));
        box.appendChild(pair);
      });
    }
    if (data.numbers) box.appendChild(el("code", "tp-numbers", "[" + data.numbers.join(", ") + "]"));
    return box;
  }

  class Player {
    constructor(root) {
      this.root = root;
      this.names = (root.dataset.trace || "").split(/\s+/).filter(Boolean);
      this.base = root.dataset.base || "";
      this.step = 0;
      this.timer = null;
      root.tabIndex = 0;
      root.setAttribute("role", "group");
      root.addEventListener("keydown", (ev) => this.key(ev));
      this.load(this.names[0]);
    }

    async load(name) {
      this.stop();
      this.root.dataset.state = "loading";
      try {
        const response = await fetch(this.base + name + ".player.json");
        if (!response.ok) throw new Error("HTTP " + response.status);
        this.doc = await response.json();
      } catch (err) {
        this.root.dataset.state = "error";
        this.root.textContent = "The trace " + name + " could not be loaded (" + err.message + ").";
        return;
      }
      this.name = name;
      this.build();
      this.show(0);
      this.root.dataset.current = name;
      this.root.dataset.state = "ready";
    }

    build() {
      const doc = this.doc, p = doc.world, root = this.root;
      root.textContent = "";
      root.style.setProperty("--tp-cellw", (p * 6 + 2) + "px");   // a 6 px stripe per rank, and the border
      root.setAttribute("aria-label", "Trace player: " + doc.title);
      const head = el("div", "tp-head");
      if (this.names.length > 1) {
        const menu = el("select", "tp-menu");
        menu.setAttribute("aria-label", "Which run");
        this.names.forEach((n) => {
          const option = el("option", "", n.replace(/_p(\d+)$/, ", p = $1").replace(/_/g, " "));
          option.value = n;
          option.selected = n === this.name;
          menu.appendChild(option);
        });
        menu.addEventListener("change", () => this.load(menu.value));
        head.appendChild(menu);
      }
      head.appendChild(el("span", "tp-title", doc.title));
      root.appendChild(head);

      const controls = el("div", "tp-controls");
      const button = (text, label, action) => {
        const b = el("button", "tp-button", text);
        b.type = "button";
        b.setAttribute("aria-label", label);
        b.title = label;
        b.addEventListener("click", () => { action(); root.focus({preventScroll: true}); });
        controls.appendChild(b);
        return b;
      };
      button("« first", "First step (Home)", () => this.go(0));
      button("‹ back", "Back one step (←)", () => this.go(this.step - 1));
      this.playButton = button("play", "Play or pause (space)", () => this.toggle());
      this.playButton.classList.add("tp-play");
      button("next ›", "Forward one step (→)", () => this.go(this.step + 1));
      button("last »", "Last step (End)", () => this.go(doc.steps.length));
      this.slider = el("input", "tp-slider");
      this.slider.type = "range";
      this.slider.min = "0";
      this.slider.max = String(doc.steps.length);
      this.slider.setAttribute("aria-label", "Step");
      this.slider.addEventListener("input", () => this.go(Number(this.slider.value)));
      controls.appendChild(this.slider);
      root.appendChild(controls);
      this.caption = el("div", "tp-caption");
      this.caption.setAttribute("aria-live", "polite");
      root.appendChild(this.caption);

      // every rank's buffer, cells grouped as the algorithm cuts it (chunks, blocks, slices)
      const grid = el("div", "tp-grid");
      this.rows = [];
      for (let r = 0; r < p; r++) {
        const label = el("span", "tp-rank", "rank " + r);
        label.style.borderLeftColor = COLORS[r % COLORS.length];
        const cells = el("span", "tp-cells");
        cells.dataset.rank = String(r);
        grid.appendChild(label);
        grid.appendChild(cells);
        this.rows.push({label, cells});
      }
      if (doc.groups && doc.groups.length) {
        grid.appendChild(el("span", ""));
        const names = el("span", "tp-cells tp-groupnames");
        doc.groups.forEach((g) => {
          const name = el("span", "tp-group", g.name);
          name.style.setProperty("--tp-n", String(g.hi - g.lo));
          names.appendChild(name);
        });
        grid.appendChild(names);
      }
      root.appendChild(grid);
      this.messages = el("ul", "tp-messages");
      root.appendChild(this.messages);

      const legend = el("div", "tp-legend");
      for (let r = 0; r < p; r++) {
        const key = el("span", "tp-key");
        const swatch = el("span", "tp-swatch");
        swatch.style.background = COLORS[r % COLORS.length];
        key.appendChild(swatch);
        key.appendChild(document.createTextNode("rank " + r));
        legend.appendChild(key);
      }
      legend.appendChild(el("span", "tp-note",
        "Each cell is one element; a stripe is filled when that rank's input is summed in it. " +
        "Keys: ← → Home End, space to play."));
      root.appendChild(legend);
      const link = el("a", "tp-download", "This run as a Chrome trace (opens in ui.perfetto.dev)");
      link.href = this.base + doc.trace;
      link.setAttribute("download", "");
      root.appendChild(link);
    }

    state(k) {
      return k === 0 ? this.doc.start : this.doc.steps[k - 1].state;
    }

    show(k) {
      const doc = this.doc, p = doc.world;
      this.step = k;
      this.root.dataset.step = String(k);
      this.slider.value = String(k);
      const now = this.state(k), before = this.state(Math.max(k - 1, 0));
      const step = k > 0 ? doc.steps[k - 1] : null;
      const busy = new Set();
      if (step) {
        step.messages.forEach((m) => { busy.add(m.src); busy.add(m.dst); });
        step.collectives.forEach((c) => c.ranks.forEach((r) => busy.add(r)));
      }
      this.rows.forEach((row, r) => {
        row.cells.textContent = "";
        const groups = doc.groups && doc.groups.length ? doc.groups : [{lo: 0, hi: doc.numel}];
        groups.forEach((g) => {
          const group = el("span", "tp-groupcells");
          for (let i = g.lo; i < g.hi; i++) {
            const c = cell(now[r][i], p);
            if (k > 0 && now[r][i] !== before[r][i]) c.classList.add("tp-changed");
            group.appendChild(c);
          }
          row.cells.appendChild(group);
        });
        row.label.classList.toggle("tp-busy", busy.has(r));
      });
      this.caption.textContent = k === 0
        ? "Start: rank r holds its own input (2^r) in every element. " + doc.steps.length + " steps."
        : "Step " + k + " of " + doc.steps.length + (step.label ? ": " + step.label : "");
      this.messages.textContent = "";
      if (step) {
        step.collectives.forEach((c) => {
          const item = el("li", "tp-message");
          item.appendChild(el("span", "tp-route", c.kind + " among ranks " + c.ranks.join(", ")));
          if (c.label) item.appendChild(el("span", "tp-label", c.label));
          c.ranks.forEach((r) => {
            const part = el("span", "tp-part", "rank " + r + ":");
            part.appendChild(payload(c.payloads[String(r)], p));
            item.appendChild(part);
          });
          this.messages.appendChild(item);
        });
        step.messages.forEach((m) => {
          const item = el("li", "tp-message");
          item.appendChild(el("span", "tp-route", m.src + " → " + m.dst));
          if (m.label) item.appendChild(el("span", "tp-label", m.label));
          item.appendChild(payload(m.payload, p));
          this.messages.appendChild(item);
        });
      } else {
        this.messages.appendChild(el("li", "tp-note", "Nothing sent yet: press → or play."));
      }
      if (k >= doc.steps.length) this.stop();
    }

    go(k) {
      if (!this.doc) return;
      this.show(Math.max(0, Math.min(this.doc.steps.length, k)));
    }

    toggle() {
      if (this.timer) { this.stop(); return; }
      if (this.step >= this.doc.steps.length) this.go(0);
      this.timer = setInterval(() => this.go(this.step + 1), Number(this.root.dataset.interval) || PLAY_MS);
      this.playButton.textContent = "pause";
      this.root.dataset.playing = "true";
    }

    stop() {
      if (this.timer) clearInterval(this.timer);
      this.timer = null;
      if (this.playButton) this.playButton.textContent = "play";
      this.root.dataset.playing = "false";
    }

    key(ev) {
      const tag = ev.target.tagName;
      if (!this.doc || tag === "SELECT" || tag === "INPUT") return;   // the menu and the slider keep their keys
      if (tag === "BUTTON" && (ev.key === " " || ev.key === "Enter")) return;   // a click
      const moves = {ArrowRight: 1, ArrowLeft: -1};
      if (ev.key in moves) this.go(this.step + moves[ev.key]);
      else if (ev.key === "Home") this.go(0);
      else if (ev.key === "End") this.go(this.doc.steps.length);
      else if (ev.key === " " || ev.key === "k") this.toggle();
      else return;
      ev.preventDefault();
    }
  }

  function start() {
    document.querySelectorAll(".trace-player:not([data-state])").forEach((root) => {
      root.tracePlayer = new Player(root);
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
