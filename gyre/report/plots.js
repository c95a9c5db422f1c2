// Gyre run report: a small SVG plotting library and the report's plots. Inlined into report.html, so the
// page needs nothing from the network. Every plot container gets data-rendered="true" once drawn
// (or "empty" when the log has nothing for it); the headless-browser test reads those marks.
(function () {
  "use strict";
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"];
  const ROLE_COLORS = { rollout: "#4c9be8", training: "#f28e2b", switching: "#b8b8b8" };
  const W = 560, H = 260, M = { l: 58, r: 16, t: 26, b: 40 };

  function node(tag, attrs, parent, text) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
    return String(Math.round(v * 1000) / 1000);
  }

  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; lo = lo - 1; }
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(s => s * mag).find(s => s >= raw);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.round(v / step) * step);
    return out;
  }

  function extent(values, pad) {
    const v = values.filter(x => x !== null && x !== undefined && isFinite(x));
    if (!v.length) return null;
    let lo = Math.min(...v), hi = Math.max(...v);
    if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 1; hi += Math.abs(hi) * 0.1 || 1; }
    const p = (hi - lo) * (pad || 0);
    return [lo - p, hi + p];
  }

  function frame(box, spec) {
    const svg = node("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img" }, box);
    node("title", {}, svg, spec.title || "");
    const [x0, x1] = spec.x, [y0, y1] = spec.y;
    const sx = v => M.l + (v - x0) / (x1 - x0) * (W - M.l - M.r);
    const sy = v => H - M.b - (v - y0) / (y1 - y0) * (H - M.t - M.b);
    const axes = node("g", { class: "axes", "font-size": 11, fill: "#444" }, svg);
    for (const t of niceTicks(y0, y1, 5)) {
      if (t < y0 || t > y1) continue;
      node("line", { x1: M.l, x2: W - M.r, y1: sy(t), y2: sy(t), stroke: "#e6e6e6" }, axes);
      node("text", { x: M.l - 6, y: sy(t) + 4, "text-anchor": "end" }, axes, fmt(t));
    }
    const xt = spec.xticks || niceTicks(x0, x1, 6);
    for (const t of xt) {
      if (t < x0 || t > x1) continue;
      node("line", { x1: sx(t), x2: sx(t), y1: H - M.b, y2: H - M.b + 4, stroke: "#888" }, axes);
      node("text", { x: sx(t), y: H - M.b + 16, "text-anchor": "middle" }, axes, fmt(t));
    }
    node("line", { x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b, stroke: "#888" }, axes);
    node("line", { x1: M.l, x2: M.l, y1: M.t, y2: H - M.b, stroke: "#888" }, axes);
    node("text", { x: (M.l + W - M.r) / 2, y: H - 6, "text-anchor": "middle" }, axes, spec.xlabel || "");
    node("text", { x: 12, y: (M.t + H - M.b) / 2, "text-anchor": "middle",
                   transform: `rotate(-90 12 ${(M.t + H - M.b) / 2})` }, axes, spec.ylabel || "");
    return { svg, sx, sy };
  }

  function legend(svg, items) {
    let x = M.l;
    const g = node("g", { class: "legend", "font-size": 11 }, svg);
    for (const it of items) {
      node("rect", { x, y: 8, width: 10, height: 10, fill: it.color, opacity: it.opacity || 1 }, g);
      const label = node("text", { x: x + 14, y: 17, fill: "#333" }, g, it.name);
      x += 22 + 6.2 * it.name.length;
      label.setAttribute("data-series", it.name);
    }
  }

  function done(box, state) { box.setAttribute("data-rendered", state || "true"); }

  function empty(box, message) {
    const p = document.createElement("p");
    p.className = "empty";
    p.textContent = message || "no data in this log";
    box.appendChild(p);
    done(box, "empty");
  }

  // series: [{name, x:[], y:[], lo?:[], hi?:[], step?:bool, dash?:bool, points?:bool}]
  function lines(box, spec) {
    const series = spec.series.filter(s => s.y.some(v => v !== null && v !== undefined));
    if (!series.length) return empty(box);
    const xs = extent(series.flatMap(s => s.x)), ys = extent(series.flatMap(s => [...s.y, ...(s.lo || []),
      ...(s.hi || [])]).concat(spec.ymin !== undefined ? [spec.ymin] : []), 0.05);
    const f = frame(box, { x: xs, y: spec.yrange || ys, xlabel: spec.xlabel, ylabel: spec.ylabel,
                           title: spec.title, xticks: spec.xticks });
    const items = [];
    series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      const pts = s.x.map((x, j) => [x, s.y[j]]).filter(p => p[1] !== null && p[1] !== undefined);
      if (s.lo && s.hi) {
        const up = s.x.map((x, j) => `${f.sx(x)},${f.sy(s.hi[j])}`);
        const down = s.x.map((x, j) => `${f.sx(x)},${f.sy(s.lo[j])}`).reverse();
        node("polygon", { points: up.concat(down).join(" "), fill: color, opacity: 0.15 }, f.svg);
      }
      let d = "";
      pts.forEach((p, j) => {
        const X = f.sx(p[0]), Y = f.sy(p[1]);
        if (j === 0) d += `M${X},${Y}`;
        else if (s.step) d += `H${X}V${Y}`;
        else d += `L${X},${Y}`;
      });
      node("path", { d, fill: "none", stroke: color, "stroke-width": 2, "stroke-dasharray": s.dash ? "5,3" : "",
                     class: "series", "data-series": s.name }, f.svg);
      if (s.points !== false && pts.length <= 200) {
        for (const p of pts) {
          const c = node("circle", { cx: f.sx(p[0]), cy: f.sy(p[1]), r: 2.5, fill: color }, f.svg);
          node("title", {}, c, `${s.name}: ${fmt(p[1])} at ${fmt(p[0])}`);
        }
      }
      items.push({ name: s.name, color });
    });
    (spec.vlines || []).forEach((v, i) => {
      node("line", { x1: f.sx(v.x), x2: f.sx(v.x), y1: M.t, y2: H - M.b, stroke: "#555", "stroke-dasharray": "3,3" },
           f.svg);
      const right = f.sx(v.x) > W - 120;
      node("text", { x: f.sx(v.x) + (right ? -3 : 3), y: M.t + 12 + 12 * i, "font-size": 10, fill: "#555",
                     "text-anchor": right ? "end" : "start" }, f.svg, v.label);
    });
    legend(f.svg, items);
    done(box);
  }

  // rows: [{cell, segments: [[t0, t1, role]]}], overlay: [[t, value]] on a right-hand axis
  function timeline(box, spec) {
    if (!spec.rows.length) return empty(box);
    const tmax = Math.max(1e-9, ...spec.rows.flatMap(r => r.segments.map(s => s[1])),
                          ...spec.overlay.map(p => p[0]));
    const n = spec.rows.length, rowH = Math.min(28, (H - M.t - M.b) / n);
    const f = frame(box, { x: [0, tmax], y: [0, 1], xlabel: "time since the run started (s)", ylabel: "",
                           title: spec.title });
    f.svg.querySelectorAll(".axes text[text-anchor=end]").forEach(t => t.remove());
    spec.rows.forEach((r, i) => {
      const y = M.t + 4 + i * rowH;
      node("text", { x: M.l - 6, y: y + rowH / 2 + 3, "text-anchor": "end", "font-size": 10 }, f.svg, r.cell);
      for (const [t0, t1, role] of r.segments) {
        const rect = node("rect", { x: f.sx(t0), y, width: Math.max(0.5, f.sx(t1) - f.sx(t0)), height: rowH - 4,
                                    fill: ROLE_COLORS[role] || "#999", class: "segment", "data-role": role }, f.svg);
        node("title", {}, rect, `${r.cell}: ${role} ${fmt(t0)}–${fmt(t1)} s`);
      }
    });
    const items = Object.keys(ROLE_COLORS).map(k => ({ name: k, color: ROLE_COLORS[k] }));
    if (spec.overlay.length) {
      const top = Math.max(1, ...spec.overlay.map(p => p[1]));
      const wy = v => H - M.b - v / top * (H - M.t - M.b);
      let d = `M${f.sx(0)},${wy(0)}`;
      for (const [t, v] of spec.overlay) d += `H${f.sx(t)}V${wy(v)}`;
      d += `H${f.sx(tmax)}`;
      node("path", { d, fill: "none", stroke: "#222", "stroke-width": 1.5, class: "series",
                     "data-series": "watermark" }, f.svg);
      for (const t of niceTicks(0, top, 4)) {
        if (t > top) continue;
        node("text", { x: W - M.r + 2, y: wy(t) + 4, "font-size": 10, fill: "#222" }, f.svg, fmt(t));
      }
      for (const [t, v] of spec.requested || []) {
        const c = node("circle", { cx: f.sx(t), cy: wy(v), r: 3, fill: "none", stroke: "#222" }, f.svg);
        node("title", {}, c, `watermark ${v} when a switch was requested at ${fmt(t)} s`);
      }
      items.push({ name: "watermark (running + queued)", color: "#222" });
    }
    legend(f.svg, items);
    done(box);
  }

  // bars: [{label, value, color?}] over categories
  function bars(box, spec) {
    if (!spec.bars.length) return empty(box);
    const ys = extent(spec.bars.map(b => b.value).concat([0]), 0.05);
    const n = spec.bars.length;
    const f = frame(box, { x: [-0.5, n - 0.5], y: spec.yrange || ys, xlabel: spec.xlabel, ylabel: spec.ylabel,
                           title: spec.title, xticks: [] });
    const bw = (W - M.l - M.r) / n * 0.7;
    spec.bars.forEach((b, i) => {
      const y = f.sy(Math.max(0, b.value)), y0 = f.sy(0);
      const r = node("rect", { x: f.sx(i) - bw / 2, y: Math.min(y, y0), width: bw, height: Math.abs(y0 - y),
                               fill: b.color || COLORS[0], class: "bar" }, f.svg);
      node("title", {}, r, `${b.label}: ${fmt(b.value)}`);
      if (n <= 40) node("text", { x: f.sx(i), y: H - M.b + 16, "text-anchor": "middle", "font-size": 10 }, f.svg,
                        b.label);
    });
    done(box);
  }

  // ---- the report ------------------------------------------------------------------------------------
  const data = JSON.parse(document.getElementById("gyre-data").textContent);
  const steps = data.steps, col = name => (steps[name] || []);
  const version = col("policy_version").map(v => v - 1); // a step trains on rollouts of the version before

  const plots = {
    reward(box) {
      lines(box, { xlabel: "policy version of the rollouts", ylabel: "reward", series: [
        { name: "mean reward (all scored rollouts) ± std", x: data.rewards.version, y: data.rewards.mean,
          lo: data.rewards.mean.map((m, i) => m - data.rewards.std[i]),
          hi: data.rewards.mean.map((m, i) => m + data.rewards.std[i]) },
        { name: "mean reward (executions trained on)", x: version, y: col("reward_mean"), dash: true },
      ] });
    },
    heldout(box) {
      const h = data.heldout;
      lines(box, { xlabel: "policy version evaluated", ylabel: "held-out", yrange: [0, 1.05], series: [
        { name: "pass rate", x: h.policy_version || [], y: h.pass_rate || [] },
        { name: "mean reward", x: h.policy_version || [], y: h.reward_mean || [], dash: true },
      ] });
    },
    roles(box) {
      timeline(box, { rows: data.cells, overlay: data.watermark, requested: data.requested_watermark });
    },
    cdf(box) {
      const r = data.rollouts;
      const vlines = [["p50", r.p50], ["p90", r.p90], ["p99", r.p99]].filter(v => v[1] !== null)
        .map(([label, x]) => ({ label: `${label} ${fmt(x)} s`, x }));
      lines(box, { xlabel: "rollout duration (s)", ylabel: "share of rollouts ≤ x", yrange: [0, 1.02], vlines,
                   series: [{ name: "CDF", x: r.cdf.map(p => p[0]), y: r.cdf.map(p => p[1]), step: true,
                              points: false }] });
    },
    tail(box) {
      bars(box, { xlabel: "policy version (a batch of rollouts)", ylabel: "tail share", yrange: [0, 1],
                  bars: data.rollouts.tail_share.map(([v, share, n]) => ({ label: `v${v}`, value: share, n })) });
    },
    switches(box) {
      const byDir = {};
      for (const s of data.switches) (byDir[s.direction] = byDir[s.direction] || []).push(s);
      const series = Object.keys(byDir).sort().map(d => {
        const xs = byDir[d], mean = xs.reduce((a, s) => a + s.duration_s, 0) / xs.length;
        return { name: `${d} (mean ${fmt(mean)} s, n=${xs.length})`, x: xs.map(s => s.t),
                 y: xs.map(s => s.duration_s), dash: true };
      });
      lines(box, { xlabel: "time since the run started (s)", ylabel: "switch duration (s)", series, ymin: 0 });
    },
    tokens(box) {
      lines(box, { xlabel: "step", ylabel: "tokens", ymin: 0, xticks: col("step"), series: [
        { name: "forwarded", x: col("step"), y: col("tokens") },
        { name: "forwarded + padding", x: col("step"), y: col("tokens_padded"), dash: true },
        { name: "trained", x: col("step"), y: col("tokens_trained") },
      ] });
    },
  };
  for (const m of data.metrics) {
    plots["metric-" + m.id] = box => lines(box, { xlabel: "step", ylabel: "", xticks: col("step"),
      series: m.columns.map(c => ({ name: c, x: col("step"), y: col(c) })) });
  }
  for (const box of document.querySelectorAll("[data-plot]")) {
    const draw = plots[box.getAttribute("data-plot")];
    try {
      if (!draw) throw new Error("unknown plot " + box.getAttribute("data-plot"));
      draw(box);
    } catch (err) {
      box.setAttribute("data-rendered", "error");
      box.setAttribute("data-error", String(err && err.stack || err));
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = "this plot failed: " + err;
      box.appendChild(p);
    }
  }
  document.body.setAttribute("data-report-ready", "true");
})();
