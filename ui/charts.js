// Small SVG charts drawn with DOM calls (no library): stacked bars over time buckets.

const NS = 'http://www.w3.org/2000/svg';

function s(tag, attrs, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

/**
 * Stacked bars: `buckets` = [{label, values: {series: number}}], `series` =
 * [{key, name, color}], `fmt` formats an axis value. Returns an <svg>.
 */
export function stackedBars(buckets, series, fmt = String) {
  const W = 640, H = 200, L = 48, B = 22, T = 8;
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img' });
  const totals = buckets.map((b) => series.reduce((a, sr) => a + (b.values[sr.key] || 0), 0));
  const max = Math.max(1e-9, ...totals);
  const plotH = H - B - T;
  const bw = (W - L) / Math.max(1, buckets.length);
  for (let i = 0; i <= 4; i++) {
    const y = T + plotH - (plotH * i) / 4;
    svg.append(s('line', { x1: L, x2: W, y1: y, y2: y, stroke: '#e2e6ec' }));
    svg.append(s('text', { x: L - 4, y: y + 3, 'text-anchor': 'end' }, fmt((max * i) / 4)));
  }
  buckets.forEach((b, i) => {
    let y = T + plotH;
    const x = L + i * bw + bw * 0.15;
    for (const sr of series) {
      const v = b.values[sr.key] || 0;
      const hgt = (plotH * v) / max;
      if (hgt > 0) {
        const r = s('rect', { x, y: y - hgt, width: bw * 0.7, height: hgt, fill: sr.color, 'data-series': sr.key });
        r.append(s('title', {}, `${b.label} ${sr.name}: ${fmt(v)}`));
        svg.append(r);
      }
      y -= hgt;
    }
    if (buckets.length <= 12 || i % Math.ceil(buckets.length / 12) === 0) {
      svg.append(s('text', { x: x + bw * 0.35, y: H - 6, 'text-anchor': 'middle' }, b.label));
    }
  });
  return svg;
}

/** A legend for `series`. */
export function legend(series) {
  const d = document.createElement('div');
  d.className = 'legend';
  for (const sr of series) {
    const span = document.createElement('span');
    const i = document.createElement('i');
    i.style.background = sr.color;
    span.append(i, document.createTextNode(sr.name));
    d.append(span);
  }
  return d;
}
