// The training dashboard: polls the monitor's JSON API and draws every metric with uPlot, all ranks
// overlaid. Served inlined into dashboard.html (with uPlot), so the page needs nothing from outside.
"use strict";
(function () {
  const STATUS_URL = "api/training/status";
  const METRICS_URL = "api/training/metrics";
  const SAMPLES_URL = "api/training/samples";
  const POLL_MS = 2000;
  const MAX_POINTS = 2000;   // per rank and series kept in the page
  const FIRST_POINTS = 1000; // down-sampled points asked for on the first load
  const PAGE = 2000;         // raw records per rank per incremental poll
  // val_gain: the base model's validation loss minus the LoRA's (above 0: the LoRA does better)
  const FIELDS = ["loss", "val_loss", "val_loss_ema", "val_gain", "lr", "grad_norm", "step_time_s", "samples_per_s"];
  const PALETTE = ["#4cc38a", "#5aa2ff", "#f2c94c", "#ff6b6b", "#d67bff", "#56d4e0", "#ff9f43", "#a3e635"];
  // Training modes (an image; a video on its first frame; a video unconditioned), in the monitor's order, each
  // in its own colour in the charts per mode (where the line's style, not its colour, tells the rank).
  const MODE_ORDER = ["t2i", "i2v", "t2v"];
  const MODE_COLORS = {t2i: "#f2c94c", i2v: "#ff6b6b", t2v: "#56d4e0"};
  const MAX_MODES = 8, MAX_MODE_NAME = 12, MAX_QUANTILES = 16;   // as the monitor keeps them
  const MAX_BUCKETS = 64, MAX_SIDE = 1 << 20;   // as the monitor's buckets.py
  const MAX_HEALTH = 400, MAX_BLOCKS = 1024, MAX_FLAGS = 16;   // as the monitor's health.py and status.py
  // kind: how the chart's values are written in its legend and tooltip, as the same figure in the cards and table
  const CHARTS = [
    {id: "loss", title: "Training loss", field: "loss", kind: "loss", smoothing: true, logToggle: true},
    {id: "val_loss", title: "Validation loss (mean of the fixed timesteps t, each t, and each mode)",
     field: "val_loss", kind: "loss", points: true, quantiles: true, emaField: "val_loss_ema", valModes: true},
    {id: "val_gain",
     title: "Validation gain over the base model: base loss − LoRA loss (above 0: the LoRA beats the base)",
     note: "per fixed timestep t and their mean; the base model (the LoRA off) on the same samples, noise and "
           + "timesteps, measured once", kind: "loss", points: true, gain: true},
    {id: "lr", title: "Learning rate", field: "lr", kind: "lr", once: true},
    {id: "grad_norm", title: "Gradient norm", field: "grad_norm", kind: "grad_norm"},
    {id: "step_time", title: "Step time (s)", field: "step_time_s", kind: "seconds", highlightSlow: true},
    {id: "samples_per_s", title: "Samples / s", field: "samples_per_s", kind: "rate"},
    {id: "loss_by_mode", title: "Loss by mode (mean of the mode's samples per step; smoothed as the training loss)",
     kind: "loss", byMode: true, smoothed: true},
    {id: "loss_by_timestep", title: "Loss by timestep (each bin's average of its last ~20 samples)",
     note: "faint: the same average ~100 of the bin's samples earlier (where the line is below it, the loss fell "
           + "there); bars: samples per bin; hover for the counts",
     kind: "loss", byTimestep: true, points: true, xLabel: "timestep", split: true},
  ];
  // as the monitor's (timestep_bins.py): 20 bins, the average's alpha, its earlier value's lag and marks
  const TIMESTEP_BINS = {edges: Array.from({length: 21}, (_, i) => i * 50), alpha: 0.05, lag: 100, every: 10};

  const history = {};  // rank -> {fields: {name: {x: [], y: []}}, epochs: Map(step -> epoch), since, loaded}
  const charts = {};   // chart id -> {spec, plot, signature, zoomed, box, tip}
  const options = {smoothing: 0.6, logLoss: false, timestepSplit: "all"};
  let runId = null;
  let status = null;
  let draws = 0;
  let gallerySignature = null;
  let recipeSignature = null;
  let healthMap = null;   // the LoRA health heat map (Panels.heatMap), made on the first draw

  const $ = (id) => document.getElementById(id);
  const el = Panels.el, num = Panels.num;   // panels.js, inlined before this file
  function fmt(v, digits) {
    if (!num(v)) return "-";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return Number(v.toPrecision(digits || 4)).toString();
  }
  function lossText(v) {
    // Every loss on the page (cards, rank table, legends, tooltips), as the terminal writes it (view.fmt_loss):
    // 4 significant digits, zeros kept (0.4100 beside 0.4123); 0.001 <= |v| < 10000 plain, else 4.123e-5.
    if (!num(v)) return "-";
    if (v === 0) return "0";
    const parts = v.toExponential(3).split("e"), e = Number(parts[1]);
    return e >= -3 && e < 4 ? v.toFixed(3 - e) : parts[0] + "e" + e;
  }
  // One text per kind of figure, the same in the cards, the rank table and the charts' legends and tooltips.
  const FORMATS = {
    loss: lossText,
    lr: (v) => fmt(v, 3),
    grad_norm: (v) => fmt(v, 4),
    seconds: (v) => (num(v) ? v.toFixed(2) + " s" : "-"),
    rate: (v) => fmt(v, 3),
  };
  function dur(s) {
    if (!num(s)) return "-";
    s = Math.max(0, Math.round(s));
    const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), x = s % 60;
    const p = (n) => String(n).padStart(2, "0");
    if (d) return d + "d" + p(h) + "h" + p(m) + "m";
    if (h) return h + "h" + p(m) + "m" + p(x) + "s";
    if (m) return m + "m" + p(x) + "s";
    return x + "s";
  }
  function clock(ts) { return num(ts) ? new Date(ts * 1000).toLocaleTimeString() : "-"; }
  function badge(state, text) { return el("span", {"class": "badge s-" + state}, text || state.replace("_", " ")); }
  function rankColor(rank) {
    return rank < PALETTE.length ? PALETTE[rank] : "hsl(" + Math.round(rank * 137.508 % 360) + ", 70%, 62%)";
  }
  function modeColor(mode) {
    if (MODE_COLORS[mode]) return MODE_COLORS[mode];
    let hash = 0;
    for (const c of mode) hash = (hash * 31 + c.charCodeAt(0)) % 360;
    return "hsl(" + hash + ", 65%, 65%)";
  }
  function orderedModes(names) {
    const rank = (m) => (MODE_ORDER.indexOf(m) < 0 ? MODE_ORDER.length : MODE_ORDER.indexOf(m));
    return Array.from(new Set(names)).sort((a, b) => rank(a) - rank(b) || (a < b ? -1 : a > b ? 1 : 0));
  }
  function fade(color, alpha) {
    if (color[0] !== "#") return color.replace("hsl(", "hsla(").replace(")", ", " + alpha + ")");
    const n = parseInt(color.slice(1), 16);
    return "rgba(" + (n >> 16) + ", " + (n >> 8 & 255) + ", " + (n & 255) + ", " + alpha + ")";
  }

  async function getJSON(url) {
    const resp = await fetch(url, {cache: "no-store"});
    const body = await resp.json();
    if (!resp.ok) throw new Error((body && body.error) || ("HTTP " + resp.status));
    return body;
  }

  // ---- status -------------------------------------------------------------------------------
  function renderSummary(s) {
    const b = $("run-status");
    b.className = "badge s-" + s.status;
    b.textContent = s.status.replace("_", " ");
    $("run-id").textContent = s.run_id ? "run " + s.run_id : "";
    $("sum-step").textContent = (num(s.step) ? s.step : "-") + " / " + (num(s.total_steps) ? s.total_steps : "-");
    const stage = ((s.ranks || []).find((r) => r.rank === 0) || {}).stage;   // --resolution_stages
    $("sum-stage").textContent = stage ? "stage " + stage.stage + "/" + stage.of + ": " + stage.size : "";
    $("sum-progress").textContent = num(s.progress) ? s.progress.toFixed(1) + " %" : "-";
    $("sum-bar").style.width = (num(s.progress) ? Math.min(100, s.progress) : 0) + "%";
    $("sum-elapsed").textContent = dur(s.elapsed_s);
    $("sum-eta").textContent = dur(s.eta_s);
    $("sum-rate").textContent = FORMATS.rate(s.samples_per_s);
    cacheLabels(s);
    $("sum-loss").textContent = FORMATS.loss(s.loss);
    let ranksText = s.world_size === null || s.world_size === undefined ? "-" : String(s.world_size);
    if (s.missing_ranks && s.missing_ranks.length) ranksText += " (missing " + s.missing_ranks.join(", ") + ")";
    if (s.stalled_ranks && s.stalled_ranks.length) ranksText += " (stalled " + s.stalled_ranks.join(", ") + ")";
    if (s.slow_ranks && s.slow_ranks.length) ranksText += " (slow " + s.slow_ranks.join(", ") + ")";
    $("sum-ranks").textContent = ranksText;
    $("sum-overheads").replaceChildren(...overheadLines(s.overheads).map((t) => el("div", null, t)));
    if (!$("sum-overheads").childNodes.length) $("sum-overheads").textContent = "-";
  }

  // While the latent cache is built (no rank loading or training), the step and rate cards count rows.
  function cacheLabels(s) {
    const rows = !!s.caching && s.status !== "training" && s.status !== "loading";
    const step = $("sum-step").previousElementSibling, rate = $("sum-rate").previousElementSibling;
    if (step) step.textContent = rows ? "Cache rows" : "Step";
    if (rate) rate.textContent = rows ? "Rows / s" : "Samples / s";
  }

  const OVERHEAD_LABELS = {checkpoint: "checkpoints", lora: "LoRA files", validation: "validation", samples: "samples"};
  function overheadLines(overheads) {
    // "checkpoints 3 × 4.6 s": count and mean duration of each kind of work between steps
    const lines = [];
    for (const [kind, t] of Object.entries(overheads || {})) {
      if (!t || !num(t.count) || !t.count) continue;
      lines.push((OVERHEAD_LABELS[kind] || kind) + " " + t.count + " × " + (num(t.mean_s) ? t.mean_s.toFixed(1) + " s" : "-"));
    }
    return lines;
  }

  function rankRow(rank, r, slow) {
    const tr = el("tr", {"data-rank": rank});
    if (!r) {
      tr.appendChild(el("td", null, rank)); tr.appendChild(el("td", {"class": "l"}, "-"));
      const td = el("td", {"class": "l"}); td.appendChild(badge("missing")); tr.appendChild(td);
      tr.appendChild(el("td", {"class": "l muted", colspan: 9}, "no status file from this rank"));
      return tr;
    }
    if (r.stalled) tr.className = "stalled"; else if (r.status === "failed") tr.className = "failed";
    else if (slow) tr.className = "slow";
    const st = el("td", {"class": "l"});
    if (r.stalled) {
      st.appendChild(badge("stalled"));
      st.appendChild(el("span", {"class": "muted"}, " " + dur(r.age_s) + " (since " + clock(r.stalled_since) + ", was " + r.status + ")"));
    } else {
      st.appendChild(badge(r.status || "unknown"));
      if (slow) st.appendChild(el("span", {"class": "muted"}, " slow"));
    }
    const gpu = r.gpu || null;
    const mem = gpu && num(gpu.mem_used_mb)
      ? (gpu.mem_used_mb / 1024).toFixed(1) + (num(gpu.mem_total_mb) ? "\u00a0/\u00a0" + (gpu.mem_total_mb / 1024).toFixed(0) : "")
        + "\u00a0GB" + (num(gpu.peak_allocated_mb) ? " (peak\u00a0" + (gpu.peak_allocated_mb / 1024).toFixed(1) + ")" : "")
      : "-";
    // epoch is 0-based in the run files; people count from 1
    const epoch = num(r.epoch) ? ((r.epoch + 1) + (num(r.num_epochs) ? " / " + r.num_epochs : "")) : "-";
    const cells = [
      [null, rank], ["l wrap", r.hostname || "-"], null, ["l wrap", (r.phase || "-") + (r.waiting_text ? ": " + r.waiting_text : "")], [null, epoch],
      [null, (num(r.step) ? r.step : "-") + " / " + (num(r.total_steps) ? r.total_steps : "-")],
      [null, FORMATS.loss(r.loss)], [null, FORMATS.lr(r.lr)], [null, FORMATS.seconds(r.step_time_s)],
      [null, gpu ? (num(gpu.util_pct) ? Math.round(gpu.util_pct) + " %" : "-") : "cpu"], ["wrap", mem],
      [null, num(r.age_s) ? dur(r.age_s) + " ago" : "-"],
    ];
    for (const c of cells) {
      if (c === null) { tr.appendChild(st); continue; }
      tr.appendChild(el("td", c[0] ? {"class": c[0]} : null, c[1]));
    }
    return tr;
  }

  function bestOf(s) {
    // The best validation so far and the early stop, from rank 0's status (every rank says the same).
    const first = (s && s.ranks || []).find((r) => r.rank === 0) || (s && s.ranks || [])[0] || {};
    return {best: first.best || null, earlyStop: first.early_stop || null, count: first.early_stop_count || null};
  }

  function earlyStopText(earlyStop, count) {
    // Where --early_stop's count stands, in the words of the validation lines and the run's summary.
    const delta = (e) => (num(e.min_delta) ? (100 * e.min_delta).toFixed(2) + "%" : "-");
    const many = (n) => n + (n === 1 ? " validation" : " validations");
    if (earlyStop) return "stopped early at step " + earlyStop.step + ": "
      + many(earlyStop.validations_without_improvement) + " in a row since step " + earlyStop.since_step + " without the " + delta(earlyStop)
      + " improvement that resets the count (--early_stop " + earlyStop.patience + ")";
    if (!count) return null;
    const why = {"earlier stage": "before the final stage, not counted: the count runs from step "
                   + count.counts_from_step,
                 "warm-up": "in the warm-up, not counted", "first": "the count starts from it",
                 "no finite one yet": "not finite, not counted"}[count.not_counted];
    if (why) return "early stop: " + count.count + " of " + count.patience + " (step " + count.step + ": " + why + ")";
    return "early stop: " + count.count + " of " + many(count.patience) + " since step " + count.since_step
      + " without the " + delta(count) + " improvement that resets the count";
  }

  function renderBest(s) {
    const {best, earlyStop, count} = bestOf(s);
    $("best-card").hidden = !best;
    if (!best) return;
    $("best-step").textContent = "step " + best.step;
    const lines = ["val_loss " + FORMATS.loss(best.val_loss) + (num(best.gain)
      ? " (" + (100 * best.gain).toFixed(2) + "% below the base)" : "")];
    if (best.file) lines.push(best.file);
    if (best.stage) lines.push("trained at stage " + best.stage.stage + "/" + best.stage.of + " (" + best.stage.size
      + (best.stage.final ? ", the final size)" : "), not the final size"));
    const said = earlyStopText(earlyStop, count);
    if (said) lines.push(said);
    $("best-detail").replaceChildren(...lines.map((t) => el("div", null, t)));
  }

  function renderStatus(s) {
    renderSummary(s);
    renderBest(s);
    renderPanels(s);
    const body = $("ranks-body");
    body.replaceChildren();
    const rows = {};
    for (const r of s.ranks || []) rows[r.rank] = r;
    const all = Object.keys(rows).map(Number).concat(s.missing_ranks || []).sort((a, b) => a - b);
    if (!all.length) {
      const tr = el("tr"); tr.appendChild(el("td", {"class": "l muted", colspan: 12},
        s.status === "no_data" ? "No training files yet: waiting for training_gpu*.json…" : "-"));
      body.appendChild(tr);
    }
    const slow = new Set(s.slow_ranks || []);
    for (const rank of all) body.appendChild(rankRow(rank, rows[rank], slow.has(rank)));

    const errors = $("errors");
    errors.replaceChildren();
    for (const group of errorGroups(s.errors || [])) {
      const e = group.error, hosts = Array.from(new Set(group.hosts.filter(Boolean)));
      const box = el("div", {"class": "error", "data-ranks": group.ranks.join(",")});
      box.appendChild(el("h2", null, rankList(group.ranks) + " failed" + (hosts.length ? " on " + hosts.join(", ") : "")
        + ": " + (e.type || "Error") + ": " + (e.message || "")));
      if (e.traceback_tail) box.appendChild(el("pre", null, e.traceback_tail));
      errors.appendChild(box);
    }
    for (const pre of errors.querySelectorAll("pre")) pre.scrollTop = pre.scrollHeight;  // the last lines matter most
    for (const [box, list, items] of [["notes-box", "notes", s.notes], ["events-box", "events", s.events]]) {
      $(list).replaceChildren(...(items || []).map((n) => el("li", null, n)));
      $(box).hidden = !(items && items.length);
    }
  }

  function errorGroups(errors) {
    // The same error on several ranks (the usual way a DDP run fails) is said once, naming its ranks.
    const groups = new Map();
    for (const e of errors) {
      const key = JSON.stringify([e.type, e.message, e.traceback_tail]);
      if (!groups.has(key)) groups.set(key, {error: e, ranks: [], hosts: []});
      groups.get(key).ranks.push(e.rank);
      groups.get(key).hosts.push(e.hostname);
    }
    return Array.from(groups.values());
  }

  function rankList(ranks) {
    // [0, 1, 2, 5] -> "Ranks 0-2, 5"; [3] -> "Rank 3"
    const sorted = ranks.slice().sort((a, b) => a - b), parts = [];
    for (let i = 0; i < sorted.length; i++) {
      let j = i;
      while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
      parts.push(j > i ? sorted[i] + "-" + sorted[j] : String(sorted[i]));
      i = j;
    }
    return (sorted.length > 1 ? "Ranks " : "Rank ") + parts.join(", ");
  }

  // ---- history ------------------------------------------------------------------------------
  function emptyRank() {
    const fields = {};
    for (const f of FIELDS) fields[f] = {x: [], y: []};
    // quantiles: validation loss at each fixed timestep quantile ("0.5"), the same on every rank (reduced over
    // ranks); modes: the mean training loss of each mode's samples per step; valModes: validation loss per mode;
    // modeBins: the loss per timestep bin of each mode's samples; buckets: bucket -> {samples, sum of their losses}
    // gainQuantiles: the base model's validation loss minus the LoRA's at each quantile; health: the LoRA health
    // records ({step, updates, grads, flags}), thinned past MAX_HEALTH as the monitor does
    return {fields: fields, quantiles: new Map(), modes: new Map(), valModes: new Map(), modeBins: new Map(),
            buckets: new Map(), epochs: new Map(), since: null, loaded: false, byTimestep: null,
            gainQuantiles: new Map(), health: []};
  }

  function emptyBins() {
    const n = TIMESTEP_BINS.edges.length - 1;
    return {edges: TIMESTEP_BINS.edges, alpha: TIMESTEP_BINS.alpha, lag: TIMESTEP_BINS.lag, every: TIMESTEP_BINS.every,
            ema: new Array(n).fill(null), count: new Array(n).fill(0), marks: Array.from({length: n}, () => [])};
  }

  function addSample(b, k, v) {
    // One sample in bin k, as the monitor's LossByTimestep.add_pair: the bin's average and count, and a mark
    // (count, average) every b.every samples, of which only the newest at least b.lag samples old is kept.
    b.ema[k] = b.ema[k] === null ? v : b.ema[k] + b.alpha * (v - b.ema[k]);
    const n = ++b.count[k], marks = b.marks[k];
    if (n % b.every === 0) marks.push([n, b.ema[k]]);
    while (marks.length > 1 && marks[1][0] <= n - b.lag) marks.shift();
  }

  function earlierOf(b, k) {
    // [count, average] of bin k at least b.lag of its samples ago; null while the bin is younger.
    const mark = b.marks[k][0];
    return mark && mark[0] <= b.count[k] - b.lag ? mark : null;
  }

  function timestepBins(h, mode) {
    // The loss per timestep bin (of every sample, or of one mode's), an EMA per bin over the run: from the
    // monitor, then carried on record by record.
    if (mode === undefined) {
      if (!h.byTimestep) h.byTimestep = emptyBins();
      return h.byTimestep;
    }
    if (!h.modeBins.has(mode) && h.modeBins.size < MAX_MODES) h.modeBins.set(mode, emptyBins());
    return h.modeBins.get(mode) || emptyBins();
  }

  function modeOf(rec, i) {
    // The mode of a record's i-th sample as the monitor keeps it; null for none.
    const m = Array.isArray(rec.modes) ? rec.modes[i] : null;
    return typeof m === "string" && m ? m.slice(0, MAX_MODE_NAME) : null;
  }

  function addTimesteps(h, rec) {
    if (!Array.isArray(rec.timesteps) || !Array.isArray(rec.timestep_losses)) return;
    const all = timestepBins(h), n = all.ema.length, top = all.edges[n];
    rec.timesteps.forEach((t, i) => {
      const v = rec.timestep_losses[i];
      if (!num(t) || !num(v) || t < 0 || t > top) return;
      const k = Math.min(n - 1, Math.floor(t * n / top)), mode = modeOf(rec, i);
      for (const b of mode === null ? [all] : [all, timestepBins(h, mode)]) addSample(b, k, v);
    });
  }

  function addModeLosses(h, rec) {
    // One point per mode present in the record: the mean loss of its samples (no point for a mode absent).
    if (!Array.isArray(rec.modes) || !Array.isArray(rec.timestep_losses)) return;
    const sums = new Map();
    rec.timestep_losses.forEach((v, i) => {
      const mode = modeOf(rec, i);
      if (mode === null || !num(v)) return;
      const s = sums.get(mode) || [0, 0];
      s[0] += v; s[1]++;
      sums.set(mode, s);
    });
    for (const [mode, [total, n]] of sums) push(keyedLine(h.modes, mode, MAX_MODES), rec.step, total / n);
  }

  function bucketName(shape) {
    // [frames, height, width] -> "1280x704" ("960x960 image" for one frame), as the monitor names it; null if none.
    if (!Array.isArray(shape) || shape.length !== 3) return null;
    if (!shape.every((v) => num(v) && Number.isInteger(v) && v > 0 && v <= MAX_SIDE)) return null;
    return shape[2] + "x" + shape[1] + (shape[0] === 1 ? " image" : "");
  }

  function addBucketLosses(h, rec) {
    // Each sample in its shape's bucket, as the monitor's BucketLosses.add: a record whose shapes are not aligned
    // with its losses (and timesteps and modes, where it has them) is left out whole.
    const shapes = rec.shapes, losses = rec.timestep_losses;
    if (!Array.isArray(shapes) || !Array.isArray(losses) || shapes.length !== losses.length) return;
    for (const other of [rec.timesteps, rec.modes]) {
      if (other !== undefined && other !== null && (!Array.isArray(other) || other.length !== shapes.length)) return;
    }
    shapes.forEach((shape, i) => {
      const name = bucketName(shape), v = losses[i];
      if (name === null || !num(v) || (!h.buckets.has(name) && h.buckets.size >= MAX_BUCKETS)) return;
      const b = h.buckets.get(name) || {samples: 0, sum: 0};
      b.samples++; b.sum += v;
      h.buckets.set(name, b);
    });
  }

  function keyedLine(map, key, most) {
    // The line of one quantile or mode; of a file naming absurdly many, the first ``most`` are drawn.
    if (!map.has(key) && map.size < most) map.set(key, {x: [], y: []});
    return map.get(key) || {x: [], y: []};
  }

  function push(line, x, y) {
    // A resumed run repeats steps it had logged before its last checkpoint: the newer values win.
    while (line.x.length && line.x[line.x.length - 1] >= x) { line.x.pop(); line.y.pop(); }
    line.x.push(x); line.y.push(y);
  }

  function bound(line) {
    // Merge neighbours in pairs (mean) until the series fits; the newest point is kept as is.
    while (line.x.length > MAX_POINTS) {
      const xs = [], ys = [], n = line.x.length;
      for (let i = 0; i + 1 < n - 1; i += 2) { xs.push(line.x[i + 1]); ys.push((line.y[i] + line.y[i + 1]) / 2); }
      xs.push(line.x[n - 1]); ys.push(line.y[n - 1]);
      line.x = xs; line.y = ys;
    }
  }

  function binsFrom(bins) {
    // The monitor's loss by timestep bin ({edges, alpha, ema, count}) as the page carries it on; null if malformed.
    if (!bins || !Array.isArray(bins.edges) || !Array.isArray(bins.ema) || bins.ema.length !== bins.edges.length - 1) {
      return null;
    }
    const marks = (m) => (Array.isArray(m) ? m.filter((p) => Array.isArray(p) && num(p[0]) && num(p[1])) : []);
    return {edges: bins.edges, alpha: num(bins.alpha) ? bins.alpha : TIMESTEP_BINS.alpha,
            lag: num(bins.lag) ? bins.lag : TIMESTEP_BINS.lag,
            every: num(bins.mark_every) && bins.mark_every > 0 ? bins.mark_every : TIMESTEP_BINS.every,
            ema: bins.ema.map((v) => (num(v) ? v : null)), count: bins.ema.map((v, i) => (bins.count || [])[i] || 0),
            marks: bins.ema.map((v, i) => marks((bins.marks || [])[i]))};
  }

  async function loadFull(rank) {
    const data = await getJSON(METRICS_URL + "?rank=" + rank + "&points=" + FIRST_POINTS);
    const d = data.ranks[String(rank)];
    const h = history[rank] = emptyRank();
    const fill = (line, points) => {
      for (const p of Array.isArray(points) ? points : []) if (num(p.step) && num(p.value)) push(line, p.step, p.value);
    };
    for (const f of FIELDS) fill(h.fields[f], d[f]);
    for (const [q, points] of Object.entries(d.val_loss_by_quantile || {})) {
      fill(keyedLine(h.quantiles, q, MAX_QUANTILES), points);
    }
    for (const [q, points] of Object.entries(d.val_gain_by_quantile || {})) {
      fill(keyedLine(h.gainQuantiles, q, MAX_QUANTILES), points);
    }
    for (const rec of Array.isArray(d.lora_health) ? d.lora_health : []) if (rec && num(rec.step)) addHealth(h, rec);
    for (const [m, points] of Object.entries(d.loss_by_mode || {})) fill(keyedLine(h.modes, m, MAX_MODES), points);
    for (const [m, points] of Object.entries(d.val_loss_by_mode || {})) {
      fill(keyedLine(h.valModes, m, MAX_MODES), points);
    }
    for (const e of d.epochs || []) h.epochs.set(e.step, e.epoch);
    h.byTimestep = binsFrom(d.loss_by_timestep);
    for (const [name, b] of Object.entries(d.loss_by_bucket || {})) {
      if (b && num(b.samples) && b.samples > 0 && num(b.loss) && h.buckets.size < MAX_BUCKETS) {
        h.buckets.set(name, {samples: b.samples, sum: b.loss * b.samples});
      }
    }
    for (const [m, bins] of Object.entries(d.loss_by_timestep_by_mode || {})) {
      const b = binsFrom(bins);
      if (b && h.modeBins.size < MAX_MODES) h.modeBins.set(m, b);
    }
    h.since = num(d.last_step) ? d.last_step : null;
    h.loaded = true;
  }

  function addRecord(h, rec) {
    const kind = String(rec.kind || "").toLowerCase();
    if (kind === "val" || kind === "validation" || kind === "eval") {
      const v = num(rec.val_loss) ? rec.val_loss : rec.loss;
      if (num(v)) push(h.fields.val_loss, rec.step, v);
      if (num(rec.val_loss_ema)) push(h.fields.val_loss_ema, rec.step, rec.val_loss_ema);
      const byQuantile = rec.val_loss_by_quantile;
      if (byQuantile && typeof byQuantile === "object") {
        for (const [q, value] of Object.entries(byQuantile)) {
          if (num(value)) push(keyedLine(h.quantiles, q, MAX_QUANTILES), rec.step, value);
        }
      }
      const byMode = rec.val_loss_by_mode;
      if (byMode && typeof byMode === "object") {
        for (const [m, value] of Object.entries(byMode)) {
          if (m && num(value)) push(keyedLine(h.valModes, m.slice(0, MAX_MODE_NAME), MAX_MODES), rec.step, value);
        }
      }
      addGain(h, rec, v);
      return;
    }
    if (kind) {   // no training step (overhead, samples, lora_health): none of a step's figures, nor its step
      if (kind === "lora_health") addHealth(h, rec);
      return;
    }
    if (num(rec.val_loss)) push(h.fields.val_loss, rec.step, rec.val_loss);
    for (const f of ["loss", "lr", "grad_norm", "step_time_s"]) if (num(rec[f])) push(h.fields[f], rec.step, rec[f]);
    if (num(rec.samples) && num(rec.step_time_s) && rec.step_time_s > 0) {
      push(h.fields.samples_per_s, rec.step, rec.samples / rec.step_time_s);
    }
    addTimesteps(h, rec);
    addModeLosses(h, rec);
    addBucketLosses(h, rec);
    if (Number.isInteger(rec.epoch)) {
      if (num(h.lastEpoch) && rec.epoch !== h.lastEpoch) h.epochs.set(rec.step, rec.epoch);
      h.lastEpoch = rec.epoch;
    }
    h.since = rec.step;
  }

  function addGain(h, rec, val) {
    // A validation record with the base model's loss: base - LoRA, of the headline loss and of each quantile.
    if (!num(rec.val_loss_base)) return;
    if (num(val)) push(h.fields.val_gain, rec.step, rec.val_loss_base - val);
    const base = rec.val_loss_base_by_quantile, lora = rec.val_loss_by_quantile;
    if (!base || typeof base !== "object" || !lora || typeof lora !== "object") return;
    for (const [q, value] of Object.entries(base)) {
      if (num(value) && num(lora[q])) push(keyedLine(h.gainQuantiles, q, MAX_QUANTILES), rec.step, value - lora[q]);
    }
  }

  function addHealth(h, rec) {
    // A LoRA health record ({step, update_norm_by_block, grad_norm_by_block, flags}), as the monitor keeps it.
    if (!Array.isArray(rec.update_norm_by_block)) return;
    const norms = (list) => (Array.isArray(list) ? list.slice(0, MAX_BLOCKS).map((v) => (num(v) ? v : null)) : null);
    const flags = (Array.isArray(rec.flags) ? rec.flags : []).slice(0, MAX_FLAGS)
      .map((f) => (typeof f === "string" ? f : f && typeof f.flag === "string" ? f.flag : "")).filter((f) => f);
    const list = h.health;
    while (list.length && list[list.length - 1].step >= rec.step) list.pop();   // a resumed run's: the newer wins
    list.push({step: rec.step, updates: norms(rec.update_norm_by_block), grads: norms(rec.grad_norm_by_block),
               flags: flags});
    if (list.length > MAX_HEALTH) {
      h.health = [list[0]].concat(list.slice(2, -1).filter((_, i) => i % 2 === 0), list.slice(-1));
    }
  }

  async function loadNew(rank) {
    const h = history[rank];
    let url = METRICS_URL + "?rank=" + rank + "&limit=" + PAGE;
    if (h.since !== null) url += "&since=" + h.since;
    const data = await getJSON(url);
    const d = data.ranks[String(rank)];
    if (d.truncated) { await loadFull(rank); return; }  // far behind: take the down-sampled view
    for (const rec of d.records) if (num(rec.step)) addRecord(h, rec);
    for (const f of FIELDS) bound(h.fields[f]);
    for (const map of [h.quantiles, h.modes, h.valModes, h.gainQuantiles]) for (const line of map.values()) bound(line);
  }

  // ---- charts -------------------------------------------------------------------------------
  function ema(ys, weight) {
    // TensorBoard's debiased exponential moving average: the first points are not pulled towards 0.
    const out = new Array(ys.length);
    let last = 0, n = 0;
    for (let i = 0; i < ys.length; i++) {
      const y = ys[i];
      if (!num(y)) { out[i] = null; continue; }
      last = last * weight + (1 - weight) * y;
      n++;
      out[i] = weight > 0 ? last / (1 - Math.pow(weight, n)) : y;
    }
    return out;
  }

  function tickTexts(splits) {
    // One format for all the ticks of an axis (never "0.001" beside "8.0e-4"): exponents with one mantissa
    // precision when the values are tiny or huge, else one number of decimals; zero is "0" either way.
    const values = splits.filter(num);
    const big = Math.max(0, ...values.map(Math.abs));
    const show = (texts) => splits.map((v, i) => (num(v) ? texts[i] : ""));
    const distinct = (texts) => new Set(values.map((v) => texts[splits.indexOf(v)])).size === new Set(values).size;
    if (big >= 1e6 || (big > 0 && big < 1e-2)) {   // steps up to 999999 stay whole numbers
      for (let digits = 1; ; digits++) {
        const texts = splits.map((v) => (!num(v) ? "" : v === 0 ? "0" : v.toExponential(digits)));
        if (distinct(texts) || digits >= 6) return show(texts);
      }
    }
    for (let decimals = 0; ; decimals++) {
      const texts = splits.map((v) => (num(v) ? v.toFixed(decimals) : ""));
      if ((distinct(texts) && values.every((v) => Math.abs(Number(v.toFixed(decimals)) - v) <= 1e-9 * Math.max(1, big)))
          || decimals >= 8) return show(texts);
    }
  }

  function axisValues(chart, key) {
    // The tick labels as drawn, kept on the chart's box for the browser tests.
    return (u, splits) => {
      const texts = tickTexts(splits);
      chart.box.dataset[key] = JSON.stringify(texts);
      return texts;
    };
  }

  function rankStyle(rank, ranks) {
    // Later ranks are drawn over earlier ones: the first rank's line is solid and wider, the others dashed
    // and narrower, so where ranks agree (often: the same loss on every rank) each line still shows.
    const first = rank === ranks[0];
    return {width: first ? 3 : 1.5, dash: first ? undefined : [6, 6]};
  }

  function modeLines(ranks, mapOf) {
    // One line per mode and rank, mode after mode: the mode's colour and the rank's style; the legend names the
    // mode (and the rank, when there are several).
    const lines = [];
    const names = [];
    for (const rank of ranks) names.push(...mapOf(history[rank]).keys());
    for (const mode of orderedModes(names)) {
      for (const rank of ranks) {
        if (!mapOf(history[rank]).has(mode)) continue;
        const style = rankStyle(rank, ranks);
        lines.push({rank: rank, mode: mode, label: ranks.length > 1 ? mode + " · rank " + rank : mode,
                    stroke: modeColor(mode), width: style.width, dash: style.dash});
      }
    }
    return lines;
  }

  function splitByMode(spec, ranks) {
    // The loss by timestep chart, split by mode when asked and the run has modes.
    return !!spec.split && options.timestepSplit === "mode" && ranks.some((r) => history[r].modeBins.size > 0);
  }

  function lineSpecs(spec, ranks, slowSet) {
    // One line per rank (lr: once); the loss adds a faint raw line per rank, all of them under the smoothed ones.
    // Per mode: a line per mode and rank.
    if (spec.byMode) return modeLines(ranks, (h) => h.modes);
    if (spec.gain) return gainLines(ranks);
    if (splitByMode(spec, ranks)) return withEarlier(modeLines(ranks, (h) => h.modeBins));
    const lines = [], raw = [];
    for (const rank of spec.once ? ranks.slice(0, 1) : ranks) {
      const color = rankColor(rank);
      const tag = spec.highlightSlow && slowSet.has(rank) ? " · " + slowSet.get(rank) : "";
      const label = spec.once ? "lr" : "rank " + rank + tag;
      if (spec.smoothing && options.smoothing > 0) {
        raw.push({rank: rank, raw: true, label: label + " raw", stroke: fade(color, 0.3), width: 1});
      }
      const highlighted = spec.highlightSlow && slowSet.has(rank), style = rankStyle(rank, ranks);
      lines.push({rank: rank, raw: false, label: label, stroke: color,
                  width: highlighted ? 3 : spec.once ? 1.5 : style.width,
                  dash: highlighted ? [6, 3] : spec.once ? undefined : style.dash});
    }
    lines.unshift(...raw);
    if (spec.emaField) {
      // --validate_with both: the EMA of the LoRA's validation loss beside the trained weights', per rank, dotted.
      for (const rank of ranks) {
        if (!history[rank].fields[spec.emaField].x.length) continue;
        lines.push({rank: rank, field: spec.emaField, label: "rank " + rank + " EMA", stroke: rankColor(rank),
                    width: 2, dash: [2, 4]});
      }
    }
    if (spec.quantiles && ranks.length) {
      const first = ranks[0];
      const keys = Array.from(history[first].quantiles.keys()).sort((a, b) => Number(a) - Number(b));
      keys.forEach((q, i) => {
        const shade = Math.round(40 + 50 * (keys.length > 1 ? i / (keys.length - 1) : 0.5));
        lines.push({rank: first, quantile: q, label: "t=" + q, stroke: "hsl(280, 60%, " + shade + "%)", width: 1,
                    dash: [3, 3]});
      });
    }
    if (spec.valModes && ranks.length) {   // per mode, once too: the samples of each mode, reduced over ranks
      const first = ranks[0];
      for (const mode of orderedModes(history[first].valModes.keys())) {
        lines.push({rank: first, mode: mode, label: mode, stroke: modeColor(mode), width: 1.5, dash: [8, 3, 2, 3]});
      }
    }
    return spec.byTimestep ? withEarlier(lines) : lines;
  }

  function gainLines(ranks) {
    // The gain over the base model: its mean, then each quantile (blue for the smallest t to orange for the
    // largest), a line per rank in the rank's style; only the lines with points (none: the chart is hidden).
    const keys = new Set();
    for (const rank of ranks) for (const q of history[rank].gainQuantiles.keys()) keys.add(q);
    const quantiles = Array.from(keys).sort((a, b) => Number(a) - Number(b) || (a < b ? -1 : a > b ? 1 : 0));
    const entries = [["mean", "mean", "#e4e9f0"]].concat(quantiles.map((q, i) => [q, "t=" + q,
      "hsl(" + Math.round(205 - 175 * (quantiles.length > 1 ? i / (quantiles.length - 1) : 0.5)) + ", 80%, 62%)"]));
    const lines = [];
    for (const [key, label, colour] of entries) {
      for (const rank of ranks) {
        const h = history[rank], series = key === "mean" ? h.fields.val_gain : h.gainQuantiles.get(key);
        if (!series || !series.x.length) continue;
        const style = rankStyle(rank, ranks);
        lines.push({rank: rank, field: key === "mean" ? "val_gain" : undefined,
                    gainQuantile: key === "mean" ? undefined : key,
                    label: ranks.length > 1 ? label + " · rank " + rank : label, stroke: colour, width: style.width,
                    dash: style.dash});
      }
    }
    return lines;
  }

  function lineBins(line) {
    // The bins a line of the loss by timestep chart draws (all samples', or one mode's); null once its rank is gone.
    const h = history[line.rank];
    return !h ? null : line.mode === undefined ? timestepBins(h) : timestepBins(h, line.mode);
  }

  function withEarlier(lines) {
    // The loss by timestep chart: under each line with an earlier average in some bin, that earlier average,
    // faint and thin.
    const faint = lines.filter((line) => {
      const b = lineBins(line);
      return b.ema.some((_, i) => earlierOf(b, i) !== null);
    }).map((line) => Object.assign({}, line, {earlier: true, label: line.label + " earlier",
                                              stroke: fade(line.stroke, 0.4), width: 1}));
    return faint.concat(lines);
  }

  function chartData(spec, lines) {
    const tables = lines.map((line) => {
      const h = history[line.rank];
      if (spec.byTimestep) {   // x: the middle of each timestep bin; y: each bin's average, or its earlier one
        const b = lineBins(line);
        const ys = line.earlier ? b.ema.map((_, i) => (earlierOf(b, i) || [0, null])[1]) : b.ema.slice();
        return [b.ema.map((_, i) => (b.edges[i] + b.edges[i + 1]) / 2), ys];
      }
      const f = line.gainQuantile !== undefined ? h.gainQuantiles.get(line.gainQuantile)
        : line.quantile !== undefined ? h.quantiles.get(line.quantile)
        : line.mode !== undefined ? (spec.byMode ? h.modes : h.valModes).get(line.mode)
        : h.fields[line.field || spec.field];
      let ys = f.y;
      if ((spec.smoothing || spec.smoothed) && options.smoothing > 0 && !line.raw) ys = ema(ys, options.smoothing);
      if (spec.logToggle && options.logLoss) ys = ys.map((v) => (num(v) && v > 0 ? v : null));
      return [f.x, ys];
    });
    return tables.length ? uPlot.join(tables) : [[]];
  }

  function epochMarks(ranks) {
    const marks = new Map();
    for (const rank of ranks) for (const [step, epoch] of history[rank].epochs) marks.set(step, epoch);
    return Array.from(marks.entries()).sort((a, b) => a[0] - b[0]);
  }

  function epochPlugin(chart) {
    // A dashed line where each epoch starts; labels only where they fit, so that none overlaps the one before
    // (at 20 epochs on a narrow chart: "epoch 1", "epoch 5", "epoch 9", ...), and never past the plot's right edge.
    return {hooks: {draw: (u) => {
      const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height, right = u.bbox.left + u.bbox.width;
      const pad = 4 * devicePixelRatio, gap = 8 * devicePixelRatio;
      const drawn = [];
      ctx.save();
      ctx.strokeStyle = "rgba(138, 150, 168, .55)"; ctx.fillStyle = "#8a96a8";
      ctx.setLineDash([4, 4]); ctx.lineWidth = 1; ctx.textAlign = "left";
      ctx.font = Math.round(10 * devicePixelRatio) + "px sans-serif";
      let free = -Infinity;   // where the next label may start
      for (const [step, epoch] of chart.epochs) {
        if (step < u.scales.x.min || step > u.scales.x.max) continue;
        const x = Math.round(u.valToPos(step, "x", true)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
        const text = "epoch " + (epoch + 1), width = ctx.measureText(text).width;
        if (x + pad < free || x + pad + width > right) continue;
        ctx.fillText(text, x + pad, top + 12 * devicePixelRatio);
        free = x + pad + width + gap;
        drawn.push([text, (x + pad) / devicePixelRatio, (x + pad + width) / devicePixelRatio]);
      }
      ctx.restore();
      chart.box.dataset.epochLabels = JSON.stringify(drawn);   // [text, left, right] in CSS pixels
    }}};
  }

  function zeroPlugin(chart) {
    // The gain chart: a line at 0, where the LoRA and the base model score alike (above it the LoRA is better).
    return {hooks: {drawAxes: (u) => {
      if (!chart.spec.gain) return;
      const y = Math.round(u.valToPos(0, "y", true)) + 0.5, box = u.bbox;
      if (!(y >= box.top && y <= box.top + box.height)) return;
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "rgba(228, 233, 240, .5)"; ctx.lineWidth = devicePixelRatio;
      ctx.beginPath(); ctx.moveTo(box.left, y); ctx.lineTo(box.left + box.width, y); ctx.stroke();
      ctx.restore();
    }}};
  }

  function gainRange(u, min, max) {
    // The gain chart's y range always holds 0, so that which side of it a line lies on shows at a glance.
    if (!num(min) || !num(max)) return [-1, 1];
    return uPlot.rangeNum(Math.min(0, min), Math.max(0, max), 0.1, true);
  }

  // ---- the loss by timestep chart's bins: what a value stands on ------------------------------
  function binEdges(chart) {
    const b = chart.lines && chart.lines.length ? lineBins(chart.lines[0]) : null;
    return b ? b.edges : TIMESTEP_BINS.edges;
  }

  function binRange(chart, idx) {
    // "450-500": the timesteps of bin idx (the chart's x values are the bins' middles, one per bin).
    const edges = binEdges(chart);
    return idx + 1 < edges.length ? edges[idx] + "-" + edges[idx + 1] : "-";
  }

  function binSpan(chart) {
    // The loss by timestep chart's x range, unzoomed: all the bins, from their first edge to their last.
    const edges = binEdges(chart);
    return [edges[0], edges[edges.length - 1]];
  }

  function binSamples(chart, u, idx) {
    // The samples in bin idx of every line shown (not the earlier ones: the same samples, fewer of them).
    let n = 0;
    chart.lines.forEach((line, i) => {
      const b = lineBins(line);
      if (b && !line.earlier && u.series[i + 1].show) n += b.count[idx] || 0;
    });
    return n;
  }

  function valueText(chart, si, idx, v) {
    // A line's value as the legend and the tooltip write it (its chart's kind of figure); in the loss by timestep
    // chart with the samples behind it: its bin's, or for an earlier average how many samples before now it was.
    const text = FORMATS[chart.spec.kind](v), line = chart.lines[si - 1];
    const b = chart.spec.byTimestep && num(v) && num(idx) && line ? lineBins(line) : null;
    if (!b) return text;
    if (!line.earlier) return text + " (" + b.count[idx] + " samples)";
    const mark = earlierOf(b, idx);
    return mark ? text + " (" + (b.count[idx] - mark[0]) + " samples before)" : text;
  }

  function xText(chart, u, idx, x) {
    // The legend's x value: a step, or the hovered bin's timesteps and samples.
    if (!chart.spec.byTimestep) return x === null || x === undefined ? "-" : String(x);
    return num(idx) ? binRange(chart, idx) + " (" + binSamples(chart, u, idx) + " samples)" : "-";
  }

  function stagePlugin(chart) {
    // --resolution_stages: a dotted line where each stage after the first begins, labelled with its size, on every
    // chart over steps.
    return {hooks: {draw: (u) => {
      const first = (status && status.ranks || []).find((r) => r.rank === 0) || {};
      const starts = (first.stages || []).slice(1);
      delete chart.box.dataset.stageMarks;
      if (chart.spec.byTimestep || !starts.length) return;
      const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height, drawn = [];
      ctx.save();
      ctx.strokeStyle = "rgba(86, 212, 224, .7)"; ctx.fillStyle = "#56d4e0"; ctx.lineWidth = 1;
      ctx.setLineDash([2, 3]); ctx.textAlign = "left"; ctx.font = Math.round(10 * devicePixelRatio) + "px sans-serif";
      for (const stage of starts) {
        const step = stage.from_step - 0.5;   // between the last step of one stage and the first of the next
        if (step < u.scales.x.min || step > u.scales.x.max) continue;
        const x = Math.round(u.valToPos(step, "x", true)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
        ctx.fillText("stage " + stage.stage + ": " + stage.size, x + 4 * devicePixelRatio, top + 24 * devicePixelRatio);
        drawn.push(stage.from_step);
      }
      ctx.restore();
      chart.box.dataset.stageMarks = JSON.stringify(drawn);
    }}};
  }

  function bestPlugin(chart) {
    // The validation loss chart: a ring and "best" at the lowest validation so far (its LoRA: lora-best.safetensors).
    return {hooks: {draw: (u) => {
      const best = bestOf(status).best;
      delete chart.box.dataset.best;
      if (chart.spec.id !== "val_loss" || !best) return;
      if (best.step < u.scales.x.min || best.step > u.scales.x.max) return;
      const x = u.valToPos(best.step, "x", true), y = u.valToPos(best.val_loss, "y", true);
      if (!(y >= u.bbox.top && y <= u.bbox.top + u.bbox.height)) return;
      const ctx = u.ctx, r = 7 * devicePixelRatio;
      ctx.save();
      ctx.strokeStyle = "#f2c94c"; ctx.fillStyle = "#f2c94c"; ctx.lineWidth = 2 * devicePixelRatio;
      ctx.beginPath(); ctx.arc(x, y, r, 0, 2 * Math.PI); ctx.stroke();
      ctx.font = Math.round(11 * devicePixelRatio) + "px sans-serif"; ctx.textAlign = "left";
      ctx.fillText("best", x + r + 3 * devicePixelRatio, y - r);
      ctx.restore();
      chart.box.dataset.best = JSON.stringify([best.step, x / devicePixelRatio, y / devicePixelRatio]);
    }}};
  }

  function countPlugin(chart) {
    // The loss by timestep chart: a faint bar per bin under the lines, as tall as its samples (of the lines
    // shown) are to the fullest bin's, the fullest a fifth of the plot; so a bin of 3 samples looks it.
    return {hooks: {drawAxes: (u) => {
      if (!chart.spec.byTimestep || !chart.lines.length) return;
      const edges = binEdges(chart), counts = edges.slice(1).map((_, i) => binSamples(chart, u, i));
      const most = Math.max(0, ...counts), ctx = u.ctx, box = u.bbox;
      chart.box.dataset.binSamples = JSON.stringify(counts);
      ctx.save();
      ctx.beginPath(); ctx.rect(box.left, box.top, box.width, box.height); ctx.clip();
      ctx.fillStyle = "rgba(138, 150, 168, .16)";
      counts.forEach((n, i) => {
        if (!n) return;
        const x0 = u.valToPos(edges[i], "x", true), x1 = u.valToPos(edges[i + 1], "x", true);
        const tall = Math.max(devicePixelRatio, box.height / 5 * n / most);
        ctx.fillRect(x0 + devicePixelRatio, box.top + box.height - tall, x1 - x0 - 2 * devicePixelRatio, tall);
      });
      ctx.restore();
    }}};
  }

  function showTip(chart, u) {
    const idx = u.cursor.idx;
    const tip = chart.tip;
    if (idx === null || idx === undefined || u.cursor.left < 0) { tip.hidden = true; return; }
    const step = u.data[0][idx];
    tip.replaceChildren(el("b", null, chart.spec.byTimestep
      ? "timestep " + binRange(chart, idx) + " · " + binSamples(chart, u, idx) + " samples" : "step " + step));
    tip.dataset.step = String(step);
    const values = {};
    for (let i = 1; i < u.series.length; i++) {
      const s = u.series[i], v = u.data[i][idx];
      if (!s.show || !num(v)) continue;
      const row = el("div", {"data-label": s.label});
      const mark = el("i"); mark.style.background = chart.lines[i - 1].stroke;
      row.append(mark, s.label + ": " + valueText(chart, i, idx, v));
      tip.appendChild(row);
      values[s.label] = v;
    }
    tip.dataset.values = JSON.stringify(values);
    tip.hidden = false;
    const over = u.over.getBoundingClientRect(), box = chart.box.getBoundingClientRect();
    const left = over.left - box.left + u.cursor.left + 14;
    tip.style.left = Math.min(left, box.width - tip.offsetWidth - 4) + "px";
    tip.style.top = (over.top - box.top + Math.max(0, u.cursor.top - tip.offsetHeight / 2)) + "px";
  }

  function chartControls(spec, box) {
    const head = el("div", {"class": "t"});
    head.appendChild(el("b", null, spec.title));
    if (spec.smoothing) {
      const label = el("label", null, "smoothing ");
      const slider = el("input", {type: "range", min: "0", max: "0.99", step: "0.01", value: String(options.smoothing),
                                  "data-control": "smoothing"});
      const shown = el("span", null, options.smoothing.toFixed(2));
      slider.addEventListener("input", () => {
        options.smoothing = Number(slider.value); shown.textContent = options.smoothing.toFixed(2); drawCharts();
      });
      label.append(slider, shown);
      head.appendChild(label);
    }
    if (spec.split) {   // the loss by timestep of all samples, or of each mode's (shown once the run has modes)
      const label = el("label", {"class": "split", hidden: ""});
      const select = el("select", {"data-control": "split", title: "draw the samples of every mode together, "
                                   + "or a line per mode"});
      select.append(el("option", {value: "all"}, "all samples"), el("option", {value: "mode"}, "by mode"));
      select.value = options.timestepSplit;
      select.addEventListener("change", () => { options.timestepSplit = select.value; drawCharts(); });
      label.appendChild(select);
      head.appendChild(label);
    }
    if (spec.logToggle) {
      const label = el("label", null);
      const box2 = el("input", {type: "checkbox", "data-control": "log"});
      box2.checked = options.logLoss;
      box2.addEventListener("change", () => { options.logLoss = box2.checked; drawCharts(); });
      label.append(box2, "log scale");
      head.appendChild(label);
    }
    box.appendChild(head);
    if (spec.note) box.appendChild(el("div", {"class": "hint"}, spec.note));
  }

  function ensureBox(spec) {
    let chart = charts[spec.id];
    if (chart) return chart;
    const box = el("div", {"class": "chartbox", id: "chart-" + spec.id, "data-chart": spec.id});
    chartControls(spec, box);
    const area = el("div", {"class": "plot"});
    const tip = el("div", {"class": "tip"}); tip.hidden = true;
    const nodata = el("div", {"class": "nodata"}, "nothing logged yet");
    box.append(area, tip, nodata);
    $("charts").appendChild(box);
    chart = charts[spec.id] = {spec: spec, box: box, area: area, tip: tip, nodata: nodata, plot: null, signature: null,
                               zoomed: false, epochs: []};
    return chart;
  }

  function makePlot(chart, lines, data) {
    const spec = chart.spec;
    const width = Math.max(300, chart.area.clientWidth || 500);
    const opts = {
      width: width, height: 220,
      scales: {x: spec.byTimestep ? {time: false, range: () => binSpan(chart)} : {time: false},
               y: spec.logToggle && options.logLoss ? {distr: 3} : spec.gain ? {range: gainRange} : {}},
      axes: [
        {stroke: "#8a96a8", grid: {stroke: "#2b3443"}, ticks: {stroke: "#2b3443"}, values: axisValues(chart, "xTicks"),
         label: spec.xLabel || "step", labelSize: 18, font: "11px sans-serif", labelFont: "11px sans-serif"},
        {stroke: "#8a96a8", grid: {stroke: "#2b3443"}, ticks: {stroke: "#2b3443"}, values: axisValues(chart, "yTicks"),
         size: 60, font: "11px sans-serif"},
      ],
      series: [{label: spec.xLabel || "step", value: (u, v, si, idx) => xText(chart, u, idx, v)}].concat(lines.map(
        (line) => ({
          label: line.label, stroke: line.stroke, width: line.width, dash: line.dash, spanGaps: true,
          points: {show: spec.points ? true : false, size: line.earlier ? 3 : 5},
          value: (u, v, si, idx) => (v === null ? "-" : valueText(chart, si, idx, v)),
        }))),
      cursor: {drag: {x: true, y: false, setScale: true}},
      legend: {live: true},
      plugins: [epochPlugin(chart), countPlugin(chart), zeroPlugin(chart), bestPlugin(chart), stagePlugin(chart)],
      hooks: {
        setSelect: [() => { chart.zoomed = true; }],
        setScale: [(u, key) => {
          if (key !== "x") return;
          chart.box.dataset.xMin = String(u.scales.x.min); chart.box.dataset.xMax = String(u.scales.x.max);
        }],
        setCursor: [(u) => showTip(chart, u)],
        setSeries: [(u, idx, opts) => pairSeries(chart, u, idx, opts)],
      },
    };
    if (chart.plot) chart.plot.destroy();
    chart.area.replaceChildren();
    chart.lines = lines;
    chart.plot = new uPlot(opts, data, chart.area);
    chart.plot.over.addEventListener("dblclick", () => { chart.zoomed = false; });
    chart.plot.over.addEventListener("mouseleave", () => { chart.tip.hidden = true; });
  }

  function pairSeries(chart, u, idx, opts) {
    // Hiding a rank in the loss legend hides its raw line too (and the other way round); in the loss by timestep
    // chart a line and its earlier average go together.
    const paired = chart.spec.smoothing || chart.spec.byTimestep;
    if (!paired || chart.pairing || !opts || opts.show === undefined || !chart.lines || !chart.lines[idx - 1]) return;
    const rank = chart.lines[idx - 1].rank, mode = chart.lines[idx - 1].mode;
    chart.pairing = true;
    try {
      chart.lines.forEach((line, i) => {
        if (i + 1 === idx || line.rank !== rank || line.mode !== mode || u.series[i + 1].show === opts.show) return;
        u.setSeries(i + 1, {show: opts.show});
      });
    } finally { chart.pairing = false; }
  }

  function describe(chart, lines, data) {
    // What the chart holds, for people reading the page source and for the browser tests.
    const counts = lines.map((line, i) => data[i + 1] ? data[i + 1].filter(num).length : 0);
    chart.box.dataset.series = lines.map((l) => l.label).join("|");
    chart.box.dataset.styles = JSON.stringify(lines.map((l) => [l.width, l.dash || null]));
    chart.box.dataset.points = counts.join(",");
    chart.box.dataset.epochMarks = String(chart.epochs.length);
    chart.box.dataset.scale = chart.spec.logToggle && options.logLoss ? "log" : "linear";
    if (chart.spec.byTimestep || chart.spec.gain) chart.box.dataset.values = JSON.stringify(data.slice(1));
    if (chart.spec.gain) chart.box.dataset.steps = JSON.stringify(data[0]);
    chart.nodata.hidden = counts.some((c) => c > 0);
  }

  function drawCharts() {
    const ranks = Object.keys(history).map(Number).filter((r) => history[r].loaded).sort((a, b) => a - b);
    const slowSet = new Map();
    for (const r of (status && status.slow_ranks) || []) slowSet.set(r, "slow");
    for (const r of (status && status.stalled_ranks) || []) slowSet.set(r, "stalled");
    const epochs = epochMarks(ranks);
    const modesSeen = ranks.some((r) => history[r].modes.size > 0);
    for (const spec of CHARTS) {
      const chart = ensureBox(spec);
      const lines = lineSpecs(spec, ranks, slowSet);
      // a history without modes or without the base model's validation loss (an older run's): no chart
      chart.box.hidden = (!!spec.byMode || !!spec.gain) && !lines.length;
      for (const split of chart.box.querySelectorAll("label.split")) split.hidden = !modesSeen;
      const data = chartData(spec, lines);
      chart.epochs = spec.byTimestep ? [] : epochs;
      const signature = JSON.stringify([lines.map((l) => [l.label, l.width, l.dash]), options.logLoss]);
      if (!chart.plot || signature !== chart.signature) {
        makePlot(chart, lines, data);
        chart.signature = signature;
        chart.zoomed = false;
      } else if (chart.zoomed) {
        const min = chart.plot.scales.x.min, max = chart.plot.scales.x.max;
        chart.plot.setData(data, false);
        chart.plot.setScale("x", {min: min, max: max});
      } else {
        chart.plot.setData(data);
      }
      describe(chart, lines, data);
    }
  }

  function resizeCharts() {
    for (const id in charts) {
      const chart = charts[id];
      if (chart.plot) chart.plot.setSize({width: Math.max(300, chart.area.clientWidth), height: 220});
    }
    if (healthMap && !healthMap.box.hidden) healthMap.draw();
  }

  // ---- LoRA health, recipe, catalogues -------------------------------------------------------
  function drawHealth() {
    // The heat map of the update per DiT block at each health record, of the first rank that has records (every
    // rank holds the same LoRA under DDP and ZeRO-2); hidden while none has.
    const ranks = Object.keys(history).map(Number).filter((r) => history[r].loaded).sort((a, b) => a - b);
    const rank = ranks.find((r) => history[r].health.length);
    if (!healthMap) {
      const box = el("div", {"class": "chartbox", id: "chart-health", "data-chart": "health"});
      const head = el("div", {"class": "t"});
      head.appendChild(el("b", null, "LoRA update per DiT block"));
      box.append(head, el("div", {"class": "hint"}, ""));
      $("charts").appendChild(box);
      healthMap = Panels.heatMap(box);
    }
    healthMap.box.hidden = rank === undefined;
    if (rank === undefined) return;
    healthMap.box.dataset.rank = String(rank);
    healthMap.box.querySelector(".hint").textContent = "|ΔW|/|W| of each block's LoRA layers (summed) at each health "
      + "record, rank " + rank + " (every rank holds the same LoRA); colour on a log scale; hover a cell for its "
      + "value and gradient norm";
    healthMap.draw(history[rank].health);
  }

  function renderPanels(s) {
    // The newest LoRA health flags (each once, with its ranks), each rank's catalogues this epoch, the recipe.
    const flags = Array.isArray(s.health_flags) ? s.health_flags : [];
    $("health-box").hidden = !flags.length;
    Panels.flagList($("health-flags"), flags, rankList);
    const cats = (s.ranks || []).filter((r) => Array.isArray(r.catalogue_progress) && r.catalogue_progress.length)
      .map((r) => ({rank: r.rank, items: r.catalogue_progress})).sort((a, b) => a.rank - b.rank);
    $("catalogues-box").hidden = !cats.length;
    Panels.catalogues($("catalogues"), cats);
    const recipe = s.recipe && typeof s.recipe === "object" && !Array.isArray(s.recipe) ? s.recipe : null;
    const signature = JSON.stringify(recipe);
    if (signature !== recipeSignature) {
      recipeSignature = signature;
      $("recipe-box").hidden = !recipe;
      Panels.recipe($("recipe"), recipe);
    }
  }

  // ---- buckets ------------------------------------------------------------------------------
  function renderBuckets() {
    // One row per bucket (by name), a samples and a mean loss column per rank; hidden while no history has shapes.
    const ranks = Object.keys(history).map(Number).filter((r) => history[r].loaded && history[r].buckets.size)
      .sort((a, b) => a - b);
    const names = Array.from(new Set(ranks.flatMap((r) => Array.from(history[r].buckets.keys())))).sort();
    $("buckets-box").hidden = !names.length;
    const head = el("tr");
    head.appendChild(el("th", {"class": "l"}, "Bucket"));
    for (const r of ranks) head.append(el("th", null, "Rank " + r + " samples"), el("th", null, "Rank " + r + " loss"));
    const body = el("tbody");
    for (const name of names) {
      const tr = el("tr", {"data-bucket": name});
      tr.appendChild(el("td", {"class": "l"}, name));
      for (const r of ranks) {
        const b = history[r].buckets.get(name);
        tr.append(el("td", {"data-rank": r, "data-field": "samples"}, b ? b.samples : "-"),
                  el("td", {"data-rank": r, "data-field": "loss", "data-value": b ? b.sum / b.samples : ""},
                     b ? FORMATS.loss(b.sum / b.samples) : "-"));
      }
      body.appendChild(tr);
    }
    const thead = el("thead");
    thead.appendChild(head);
    $("buckets").replaceChildren(thead, body);
  }

  // ---- samples ------------------------------------------------------------------------------
  function clipKey(clip) {
    // What a clip shows besides its prompt and step: the LoRA's strength and weights (the base model: strength 0).
    return (clip.weights === null || clip.weights === undefined ? "base" : clip.weights) + "@" + clip.strength;
  }

  function clipLabel(clip) {
    if (clip.weights === null || clip.weights === undefined) return "base model";
    return "strength " + clip.strength + (clip.weights === "ema" ? " · EMA" : "");
  }

  function clipVideo(clip) {
    const video = el("video", {src: clip.video, muted: "", loop: "", playsinline: "", preload: "metadata"});
    if (clip.still) video.setAttribute("poster", clip.still);
    video.muted = true;
    video.addEventListener("mouseenter", () => { video.play().catch(() => {}); });
    video.addEventListener("mouseleave", () => { video.pause(); });
    video.addEventListener("click", () => { if (video.paused) video.play().catch(() => {}); else video.pause(); });
    return video;
  }

  function galleryKinds(clips) {
    // The kinds of clip among clips, in the gallery's order: by strength, the raw weights before the EMA.
    const order = new Map();
    for (const c of clips) order.set(clipKey(c), [c.strength, c.weights === "ema" ? 1 : 0]);
    return Array.from(order.keys()).sort((a, b) => order.get(a)[0] - order.get(b)[0] || order.get(a)[1] - order.get(b)[1]);
  }

  function galleryCell(step, clips, kinds, labelled) {
    // One cell: the prompt's clips of one step (or the base model's), side by side in the order of the step's
    // kinds, a gap where this prompt has none of a kind the step's other prompts have.
    const cell = el("td", {"data-step": step});
    if (!clips.some((c) => c.video)) {
      cell.appendChild(el("span", {"class": "muted"}, "-"));
      return cell;
    }
    const row = el("div", {"class": "clips"});
    for (const kind of kinds) {
      const clip = clips.find((c) => clipKey(c) === kind);
      const figure = el("figure", {"data-kind": kind});
      if (clip && clip.video) {
        figure.setAttribute("data-strength", clip.strength);
        figure.setAttribute("data-weights", clip.weights === null || clip.weights === undefined ? "base" : clip.weights);
        figure.appendChild(clipVideo(clip));
        if (labelled) figure.appendChild(el("figcaption", null, clipLabel(clip)));
      } else {
        figure.className = "gap";
        figure.appendChild(el("span", {"class": "muted"}, "-"));
      }
      row.appendChild(figure);
    }
    cell.appendChild(row);
    return cell;
  }

  function renderGallery(sets, base) {
    // One row per prompt: the base model's clip (rendered once), then a column per sample step with the clips
    // of each LoRA strength and, where validation asks for both, the EMA's beside the raw weights' (each
    // labelled once there is more than one kind); videos play on hover and toggle on click.
    const signature = JSON.stringify([sets, base]);
    if (signature === gallerySignature) return;
    gallerySignature = signature;
    const table = $("gallery");
    table.replaceChildren();
    $("samples-box").hidden = !sets.length && !base.length;
    if (!sets.length && !base.length) return;
    // Each row says its prompt in full, as written (the newest set's text; a set from before prompts files
    // were kept shows its file name's words instead).
    const prompts = new Map();
    for (const clip of base.concat(...sets.map((set) => set.clips))) {
      const text = typeof clip.prompt === "string" ? clip.prompt : null;
      if (text !== null || !prompts.has(clip.index)) prompts.set(clip.index, text !== null ? text : clip.slug.replace(/-/g, " "));
    }
    const kinds = new Map(sets.map((set) => [set, galleryKinds(set.clips)]));
    const every = galleryKinds([].concat(...sets.map((set) => set.clips)));
    const labelled = every.length > 1 || base.length > 0 || every.some((k) => k !== "raw@1");
    table.classList.toggle("sweep", labelled);   // several clips per cell: each a little narrower
    const head = el("tr");
    head.appendChild(el("th", {"class": "l"}, "prompt"));
    if (base.length) head.appendChild(el("th", {"data-step": "base"}, "base model"));
    for (const set of sets) head.appendChild(el("th", {"data-step": set.step}, "step " + set.step));
    table.appendChild(head);
    for (const [index, text] of Array.from(prompts.entries()).sort((a, b) => a[0] - b[0])) {
      const row = el("tr", {"data-prompt": index});
      const label = el("th", {"class": "l prompt", dir: "auto"});
      label.append(el("span", {"class": "n"}, index + ". "), el("span", {"class": "text"}, text));
      row.appendChild(label);
      if (base.length) {
        const mine = base.filter((c) => c.index === index);
        row.appendChild(galleryCell("base", mine, mine.length ? [clipKey(mine[0])] : [], labelled));
      }
      for (const set of sets) {
        row.appendChild(galleryCell(set.step, set.clips.filter((c) => c.index === index), kinds.get(set), labelled));
      }
      table.appendChild(row);
    }
  }

  async function loadSamples() {
    try {
      const listing = await getJSON(SAMPLES_URL);
      renderGallery(listing.sets || [], listing.base || []);
    } catch (err) {
      // the gallery is optional: a failed listing leaves the last one shown
    }
  }

  // ---- loop ---------------------------------------------------------------------------------
  async function tick() {
    try {
      status = await getJSON(STATUS_URL);
      $("conn").className = "conn";
      $("conn").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      $("conn").className = "conn down";
      $("conn").textContent = "monitor unreachable: " + err.message;
      return;
    }
    if (status.run_id !== runId) {  // another run took over: start the charts again
      runId = status.run_id;
      for (const k of Object.keys(history)) delete history[k];
    }
    renderStatus(status);
    const ranks = (status.ranks || []).map((r) => r.rank).sort((a, b) => a - b);
    for (const k of Object.keys(history)) if (ranks.indexOf(Number(k)) < 0) delete history[k];
    let loaded = 0;
    for (const rank of ranks) {
      try {
        if (!history[rank] || !history[rank].loaded) await loadFull(rank); else await loadNew(rank);
        loaded++;
      } catch (err) {
        $("conn").className = "conn down";
        $("conn").textContent = "history of rank " + rank + ": " + err.message;
      }
    }
    drawCharts();
    drawHealth();
    renderBuckets();
    await loadSamples();
    draws++;
    document.body.dataset.draws = String(draws);
    document.body.dataset.ranksDrawn = String(loaded);
    document.body.dataset.ready = "1";
  }

  async function loop() {
    try { await tick(); } finally { setTimeout(loop, POLL_MS); }
  }
  window.addEventListener("resize", resizeCharts);
  loop();
})();
