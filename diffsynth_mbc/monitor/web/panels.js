// The dashboard's panels that are no uPlot chart: the LoRA health heat map and flags, the run's recipe and each
// catalogue's progress this epoch. Pure drawing from the data dashboard.js hands over (no requests, no state of
// the run); inlined into dashboard.html before dashboard.js, which calls them through window.Panels.
"use strict";
window.Panels = (function () {
  // A perceptually even ramp (viridis' stops) for log10 of a block's update; 0 and non-finite values apart.
  const RAMP = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"];
  const ZERO_COLOUR = "#0b0e13", NONFINITE_COLOUR = "#ff6b6b", FLAG_COLOUR = "#f2c94c";
  const MARGIN = {left: 52, right: 8, top: 14, bottom: 30};   // CSS pixels around the cells
  const RECIPE_ITEMS = 200;   // values written at most per top-level recipe entry (a hostile file's recipe is huge)

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const k in (attrs || {})) node.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  const num = (v) => typeof v === "number" && isFinite(v);
  const sci = (v) => (num(v) ? (v === 0 ? "0" : v.toExponential(2)) : "not finite");

  function rampColour(t) {
    // t in [0, 1] -> a colour between the ramp's stops
    const x = Math.max(0, Math.min(1, t)) * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(x));
    const a = parseInt(RAMP[i].slice(1), 16), b = parseInt(RAMP[i + 1].slice(1), 16), f = x - i;
    const mix = (shift) => Math.round((a >> shift & 255) * (1 - f) + (b >> shift & 255) * f);
    return "rgb(" + mix(16) + ", " + mix(8) + ", " + mix(0) + ")";
  }

  function logRange(records) {
    // [lo, hi] of the positive finite updates (log10), at least a decade apart; null when there is none.
    let lo = Infinity, hi = -Infinity;
    for (const r of records) {
      for (const v of r.updates) if (num(v) && v > 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    if (!(hi > 0)) return null;
    let l = Math.log10(lo), h = Math.log10(hi);
    if (h - l < 1) l = h - 1;
    return [l, h];
  }

  function cellColour(v, range) {
    if (v === null || v === undefined || !num(v)) return NONFINITE_COLOUR;
    if (v <= 0 || !range) return ZERO_COLOUR;
    return rampColour((Math.log10(v) - range[0]) / (range[1] - range[0]));
  }

  function columnEdges(steps, left, width) {
    // Each record's column spans from half-way to the previous record's step to half-way to the next one's, so
    // columns stand where their steps are (a thinned, older part of a long run: wider columns).
    const n = steps.length;
    if (n === 1) return [[left, left + width]];
    const half = (i) => (steps[i + 1] - steps[i]) / 2;
    const lo = steps[0] - half(0), hi = steps[n - 1] + half(n - 2);
    const at = (s) => left + (s - lo) / (hi - lo || 1) * width;
    return steps.map((s, i) => [at(i ? s - half(i - 1) : lo), at(i < n - 1 ? s + half(i) : hi)]);
  }

  function stepTicks(ctx, steps, edges) {
    // [index] of the columns labelled under the map: evenly chosen, never overlapping, the last always.
    const chosen = [], gap = 12;
    let free = -Infinity;
    const want = Math.max(1, Math.floor(steps.length / 10));
    for (let i = 0; i < steps.length; i++) {
      if (i % want && i !== steps.length - 1) continue;
      const mid = (edges[i][0] + edges[i][1]) / 2, w = ctx.measureText(String(steps[i])).width;
      if (mid - w / 2 < free) { if (i === steps.length - 1 && chosen.length) chosen.pop(); else continue; }
      chosen.push(i);
      free = mid + w / 2 + gap;
    }
    return chosen;
  }

  function drawHeat(map) {
    // The cells, block labels, step labels and flag marks on the map's canvas, at the container's width.
    const {canvas, records, box} = map;
    const blocks = Math.max(0, ...records.map((r) => r.updates.length));
    const cellH = Math.max(5, Math.min(14, Math.floor(300 / Math.max(1, blocks))));
    const width = Math.max(280, map.area.clientWidth), height = MARGIN.top + blocks * cellH + MARGIN.bottom;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const plotW = width - MARGIN.left - MARGIN.right, steps = records.map((r) => r.step);
    const edges = columnEdges(steps, MARGIN.left, plotW), range = logRange(records);
    let cells = 0;
    records.forEach((r, i) => {
      const [x0, x1] = edges[i];
      r.updates.forEach((v, b) => {
        ctx.fillStyle = cellColour(v, range);
        const w = Math.max(1, x1 - x0 - (x1 - x0 > 4 ? 1 : 0)), h = cellH - (cellH > 6 ? 1 : 0);   // a 1 px gap
        ctx.fillRect(x0, MARGIN.top + b * cellH, w, h);
        cells++;
      });
      if (r.flags.length) {   // a flag raised at this record: a mark above its column
        const mid = (x0 + x1) / 2;
        ctx.fillStyle = FLAG_COLOUR;
        ctx.beginPath(); ctx.moveTo(mid - 5, 2); ctx.lineTo(mid + 5, 2); ctx.lineTo(mid, MARGIN.top - 2); ctx.fill();
      }
    });
    ctx.fillStyle = "#8a96a8"; ctx.font = "11px sans-serif"; ctx.textBaseline = "middle"; ctx.textAlign = "right";
    const every = Math.max(1, Math.ceil(14 / cellH));   // a label every few blocks where cells are thin
    for (let b = 0; b < blocks; b += every) ctx.fillText(String(b), MARGIN.left - 6, MARGIN.top + (b + 0.5) * cellH);
    ctx.save(); ctx.translate(10, MARGIN.top + blocks * cellH / 2); ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center"; ctx.fillText("block", 0, 0); ctx.restore();
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    const ticks = stepTicks(ctx, steps, edges), bottom = MARGIN.top + blocks * cellH;
    for (const i of ticks) ctx.fillText(String(steps[i]), (edges[i][0] + edges[i][1]) / 2, bottom + 4);
    ctx.fillText("step", MARGIN.left + plotW / 2, bottom + 17);
    Object.assign(map, {edges: edges, cellH: cellH, blocks: blocks, range: range});
    box.dataset.blocks = String(blocks);
    box.dataset.steps = JSON.stringify(steps);
    box.dataset.cells = String(cells);
    box.dataset.values = JSON.stringify(records.map((r) => r.updates));
    box.dataset.range = JSON.stringify(range ? range.map((v) => Math.pow(10, v)) : null);
    box.dataset.stepLabels = JSON.stringify(ticks.map((i) => steps[i]));
    // where the cells lie on the canvas (CSS pixels): each column's [left, right], the first block's top, a block's
    // height
    box.dataset.columns = JSON.stringify(edges.map((e) => [Math.round(e[0] * 10) / 10, Math.round(e[1] * 10) / 10]));
    box.dataset.cellTop = String(MARGIN.top);
    box.dataset.cellHeight = String(cellH);
    drawLegend(map);
  }

  function drawLegend(map) {
    // log10 ramp from the smallest to the largest update shown, then the swatches for 0 and not finite.
    const legend = map.legend;
    legend.replaceChildren();
    if (map.range) {
      const ramp = el("span", {"class": "ramp"});
      ramp.style.background = "linear-gradient(to right, " + RAMP.join(", ") + ")";
      legend.append(el("span", null, "log scale: " + sci(Math.pow(10, map.range[0]))), ramp,
                    el("span", null, sci(Math.pow(10, map.range[1]))));
    }
    for (const [colour, text] of [[ZERO_COLOUR, "0"], [NONFINITE_COLOUR, "not finite"]]) {
      const swatch = el("span", {"class": "swatch"});
      swatch.style.background = colour;
      legend.append(swatch, el("span", null, text));
    }
    const mark = el("span", {"class": "flagmark"});
    legend.append(mark, el("span", null, "a flag"));
  }

  function heatTip(map, event) {
    // The hovered cell: its step, block, update and gradient norm, and the record's flags.
    const rect = map.canvas.getBoundingClientRect(), x = event.clientX - rect.left, y = event.clientY - rect.top;
    const i = (map.edges || []).findIndex((e) => x >= e[0] && x < e[1]);
    const b = Math.floor((y - MARGIN.top) / map.cellH), r = map.records[i];
    if (!r || b < 0 || b >= r.updates.length) { map.tip.hidden = true; return; }
    const grad = r.grads && b < r.grads.length ? r.grads[b] : undefined;
    map.tip.replaceChildren(el("b", null, "step " + r.step + " · block " + b),
      el("div", null, "update |ΔW|/|W|: " + sci(r.updates[b])),
      el("div", null, "gradient norm: " + (grad === undefined ? "not measured" : sci(grad))));
    if (r.flags.length) map.tip.appendChild(el("div", {"class": "flagged"}, "flags: " + r.flags.join(", ")));
    map.tip.dataset.step = String(r.step); map.tip.dataset.block = String(b);
    map.tip.hidden = false;
    const box = map.box.getBoundingClientRect();
    map.tip.style.left = Math.min(rect.left - box.left + x + 14, box.width - map.tip.offsetWidth - 4) + "px";
    map.tip.style.top = (rect.top - box.top + y + 10) + "px";
  }

  function heatMap(box) {
    // A heat map in ``box`` (a .chartbox): call .draw(records) with [{step, updates, grads, flags}] in step order.
    const area = el("div", {"class": "heat"}), canvas = el("canvas"), legend = el("div", {"class": "heat-legend"});
    const tip = el("div", {"class": "tip"});
    tip.hidden = true;
    area.appendChild(canvas);
    box.append(area, legend, tip);
    const map = {box: box, area: area, canvas: canvas, legend: legend, tip: tip, records: []};
    canvas.addEventListener("mousemove", (e) => heatTip(map, e));
    canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
    map.draw = (records) => { map.records = records || map.records; if (map.records.length) drawHeat(map); };
    return map;
  }

  function flagList(container, flags, rankText) {
    // Each flag as a box: its name, step and ranks, what it means and what to do.
    container.replaceChildren();
    for (const f of flags) {
      const item = el("div", {"class": "flag f-" + f.flag, "data-flag": f.flag});
      const head = el("div", {"class": "head"});
      head.append(el("b", null, f.flag), el("span", {"class": "muted"},
        " at step " + (num(f.step) ? f.step : "-") + " · " + rankText(f.ranks || [])));
      item.append(head, el("div", {"class": "what"}, f.what || ""));
      if (f.do) {
        const todo = el("div", {"class": "do"});
        todo.append(el("b", null, "What to do: "), document.createTextNode(f.do));
        item.appendChild(todo);
      }
      container.appendChild(item);
    }
  }

  const objectList = (v) => Array.isArray(v) && v.some((x) => x && typeof x === "object");

  function valueNode(value, budget) {
    // A recipe value, generically: a scalar as written ('""' for an empty text), a list of scalars comma-separated,
    // an object as "key value · key value" (nested ones in braces), a list of objects one per line.
    const span = el("span");
    const add = (text, cls) => { if (budget.n-- > 0) span.appendChild(el("span", cls ? {"class": cls} : null, text)); };
    const scalar = (v) => (v === null || v === undefined ? "none" : v === "" ? '""'
      : typeof v === "object" ? null : String(v));
    const walk = (v, inner) => {
      if (scalar(v) !== null) { add(scalar(v), "x"); return; }
      if (Array.isArray(v)) {
        if (!v.length) { add("[]", "x"); return; }
        const lines = objectList(v) && !inner;   // a top-level list of objects: one per line, without braces
        v.forEach((x, i) => {
          if (i) add(lines ? "\n" : ", ", "sep");
          walk(x, !lines);
        });
        return;
      }
      const keys = Object.keys(v);
      if (inner) add("{", "sep");
      keys.forEach((k, i) => {
        if (i) add(" · ", "sep");
        add(k + " ", "kk");
        walk(v[k], true);
      });
      if (inner) add("}", "sep");
    };
    walk(value, false);
    if (budget.n < 0) span.appendChild(el("span", {"class": "sep"}, " …"));
    return span;
  }

  function recipe(container, value) {
    // One row per top-level key: the key, then its value (see valueNode); data-key on each row.
    container.replaceChildren();
    for (const [key, v] of Object.entries(value || {})) {
      const row = el("div", {"class": "kv" + (objectList(v) ? " wide" : ""), "data-key": key});
      const val = el("div", {"class": "v"});
      val.appendChild(valueNode(v, {n: RECIPE_ITEMS}));
      row.append(el("div", {"class": "k"}, key.replace(/_/g, " ")), val);
      container.appendChild(row);
    }
  }

  function catalogues(container, ranks) {
    // Per rank ([{rank, items: [{name, seen, per_epoch}]}]): each catalogue's samples this epoch, with a bar.
    container.replaceChildren();
    for (const r of ranks) {
      const card = el("div", {"class": "card cats", "data-rank": r.rank});
      card.appendChild(el("div", {"class": "k"}, "rank " + r.rank));
      for (const c of r.items) {
        const row = el("div", {"class": "cat", "data-name": c.name, "data-seen": c.seen,
                               "data-per-epoch": c.per_epoch});
        const share = num(c.seen) && num(c.per_epoch) && c.per_epoch > 0 ? Math.min(1, c.seen / c.per_epoch) : 0;
        const bar = el("div", {"class": "bar"}), fill = el("div");
        fill.style.width = (100 * share).toFixed(1) + "%";
        bar.appendChild(fill);
        row.append(el("span", {"class": "name", dir: "auto"}, c.name + ":"),
                   el("span", {"class": "count"},
                      (num(c.seen) ? c.seen : "-") + " / " + (num(c.per_epoch) ? c.per_epoch : "-")),
                   bar);
        card.appendChild(row);
      }
      container.appendChild(card);
    }
  }

  // el and num serve dashboard.js too (this file is inlined before it)
  return {heatMap: heatMap, flagList: flagList, recipe: recipe, catalogues: catalogues, el: el, num: num};
})();
