// SVG line charts, drawn from the numbers the API returns (no chart library, no build step).

import {el, fmt, svg} from "./lib.js";

const COLORS = ["#2f6fdf", "#9b4dca", "#e08a1a", "#238a4a", "#c8362f", "#138d90"];

function niceTicks(lo, hi, n = 4) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const step0 = (hi - lo) / n;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

// series: [{name, points: [[x, y], ...], color?, dashed?}]; null y values are gaps
export function lineChart(title, series, {xLabel = "step", id} = {}) {
  const W = 420, H = 180, L = 46, R = 10, T = 8, B = 24;
  const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  const box = el("div", {class: "chart", id, "data-points": String(pts.length)}, el("h3", {text: title}));
  if (!pts.length) {
    box.append(el("p", {class: "muted", text: "no data yet"}));
    return box;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const yt = niceTicks(y0, y1);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": title});
  for (const t of yt) {
    root.append(svg("line", {class: "grid", x1: L, x2: W - R, y1: sy(t), y2: sy(t)}));
    root.append(svg("text", {x: L - 4, y: sy(t) + 3, "text-anchor": "end"}, fmt(t, 3)));
  }
  const integral = pts.every((p) => Number.isInteger(p[0]));    // steps and versions: no 0.5 ticks
  for (const t of niceTicks(x0, x1, 5).filter((t) => t >= x0 && t <= x1 && (!integral || Number.isInteger(t)))) {
    root.append(svg("text", {x: sx(t), y: H - 8, "text-anchor": "middle"}, fmt(t, 1)));
  }
  root.append(svg("line", {class: "axis", x1: L, x2: L, y1: T, y2: H - B}));
  root.append(svg("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  series.forEach((s, i) => {
    const color = s.color || COLORS[i % COLORS.length];
    let d = "", pen = false;
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)} `;
      pen = true;
    }
    if (d) root.append(svg("path", {class: s.dashed ? "line dashed" : "line", d, stroke: color}));
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) continue;
      const dot = svg("circle", {cx: sx(x), cy: sy(y), r: 2.5, fill: color});
      dot.append(svg("title", {}, `${s.name}: ${xLabel} ${fmt(x)} → ${fmt(y, 4)}`));
      root.append(dot);
    }
  });
  box.append(root);
  const keys = el("div", {class: "keys"});
  if (series.length > 1) {
    series.forEach((s, i) => {
      const key = el("span", {text: s.name});
      key.style.setProperty("--c", s.color || COLORS[i % COLORS.length]);
      keys.append(key);
    });
  }
  keys.append(el("em", {class: "muted", text: `x: ${xLabel}`}));
  box.append(keys);
  return box;
}
