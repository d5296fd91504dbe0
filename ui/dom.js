// DOM helpers: every piece of text from the API goes in as a text node (never as markup),
// links only to http(s) or this page's own routes, and no attribute is an event handler.

const SAFE_URL = /^(https?:\/\/|#\/|\/ui\b)/i;

/** An element: `h('td', {class: 'num'}, 'text', child)`. Strings become text nodes. */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'on') {
        for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
      } else if (k === 'dataset') {
        Object.assign(el.dataset, v);
      } else if (k.startsWith('on')) {
        throw new Error(`no inline handlers (${k})`);
      } else if (k === 'href') {
        const s = String(v);
        if (SAFE_URL.test(s)) el.setAttribute('href', s);
      } else if (k === 'value') {
        el.value = v;
      } else {
        el.setAttribute(k, v === true ? '' : String(v));
      }
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** Replaces an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A short notice in the corner. */
export function toast(msg, err = false) {
  const box = document.getElementById('toast');
  const d = h('div', { class: err ? 'err' : '' }, msg);
  box.append(d);
  setTimeout(() => d.remove(), err ? 8000 : 3500);
}

export function fmtMs(ms) {
  if (ms === undefined || ms === null) return '—';
  if (ms < 1) return `${ms.toFixed(2)} ms`;
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

export function fmtS(s) {
  if (s === undefined || s === null) return '—';
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function fmtBytes(b) {
  if (b === undefined || b === null) return '—';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${i ? b.toFixed(1) : b} ${u[i]}`;
}

export function fmtPct(f) {
  return typeof f === 'number' ? `${Math.round(f * 100)}%` : '—';
}

/** "in 5 min" / "3 min ago" from an RFC 3339 time. */
export function rel(t) {
  if (!t) return '—';
  const d = (Date.parse(t) - Date.now()) / 1000;
  const a = fmtS(Math.abs(d));
  return d >= 0 ? `in ${a}` : `${a} ago`;
}

export function time(t) {
  if (!t) return '—';
  const d = new Date(t);
  return isNaN(d) ? String(t) : d.toLocaleString();
}
