// Tiny DOM helpers: elements are built with textContent only, so nothing from the API is ever parsed as HTML.
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else element.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

export function bar(percent) {
  const fill = h("span");
  fill.style.width = `${Math.max(0, Math.min(100, percent || 0))}%`;
  return h("div", { class: "bar", role: "progressbar", "aria-valuenow": Math.round(percent || 0) }, fill);
}

export function setBar(element, percent) {
  element.querySelector("span").style.width = `${Math.max(0, Math.min(100, percent || 0))}%`;
  element.setAttribute("aria-valuenow", Math.round(percent || 0));
}

export function state(value) {
  return h("span", { class: `state ${value}`, dataset: { state: value } }, value);
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "";
}

// Points of each series as an inline SVG line chart (fitness over generations).
export function lineChart(series, { width = 640, height = 240, pad = 32 } = {}) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const points = series.flatMap((s) => s.points);
  if (!points.length) return svg;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs) || 1];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => pad + ((x - x0) / ((x1 - x0) || 1)) * (width - 2 * pad);
  const sy = (y) => height - pad - ((y - y0) / (y1 - y0)) * (height - 2 * pad);
  for (const s of series) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("class", s.name);
    line.setAttribute("points", s.points.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" "));
    svg.append(line);
  }
  const label = (text, x, y) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "11");
    t.textContent = text;
    svg.append(t);
  };
  label(y1.toPrecision(4), 2, pad - 4);
  label(y0.toPrecision(4), 2, height - pad + 12);
  label(`gen ${x0}`, pad, height - 6);
  label(`gen ${x1}`, width - pad - 40, height - 6);
  return svg;
}
