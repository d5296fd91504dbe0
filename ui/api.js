// The API client: the key lives in sessionStorage only (gone when the tab closes) and
// travels in the Authorization header, never in a URL. Live events are read from
// `GET /v1/events` with fetch and a streamed body rather than EventSource, because
// EventSource cannot send a header: so the stream carries the key the same way as every
// other call, and no ticket or key has to go into its URL. Nothing polls.

const KEY = 'locker.api_key';

export const auth = {
  get key() { return sessionStorage.getItem(KEY); },
  set(k) { sessionStorage.setItem(KEY, k); },
  clear() { sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(extra) {
  const h = new Headers(extra || {});
  const k = auth.key;
  if (k) h.set('Authorization', `Bearer ${k}`);
  return h;
}

/** A JSON call: `api('POST', '/v1/sandboxes', {json: {...}})`; `raw: true` returns the Response. */
export async function api(method, path, opts = {}) {
  const init = { method, headers: headers(opts.headers), cache: 'no-store', credentials: 'omit' };
  if (opts.json !== undefined) {
    init.headers.set('Content-Type', 'application/json');
    init.body = JSON.stringify(opts.json);
  } else if (opts.body !== undefined) {
    init.body = opts.body;
  }
  if (opts.signal) init.signal = opts.signal;
  const r = await fetch(path, init);
  if (!r.ok) {
    let code = 'error';
    let msg = `${r.status} ${r.statusText}`;
    try {
      const e = (await r.json()).error;
      if (e) { code = e.code; msg = e.message; }
    } catch { /* not JSON */ }
    if (r.status === 401 && !opts.signingIn) window.dispatchEvent(new CustomEvent('locker-unauthorized'));
    throw new ApiError(r.status, code, msg);
  }
  if (opts.raw) return r;
  if (r.status === 204) return null;
  const t = await r.text();
  return t ? JSON.parse(t) : null;
}

export const get = (p) => api('GET', p);
export const post = (p, json) => api('POST', p, { json: json ?? {} });
export const del = (p) => api('DELETE', p);

/** A query string of the set values. */
export function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== '') u.set(k, v);
  const s = u.toString();
  return s ? `?${s}` : '';
}

/** Downloads a file of a sandbox or volume (fetched with the key, saved from a blob). */
export async function download(path, name) {
  const r = await api('GET', path, { raw: true });
  const blob = await r.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  a.href = url;
  a.download = name || 'download';
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

/**
 * Reads `path` as NDJSON, calling `onLine(object)` for each line until the body ends or
 * `signal` aborts (a template build's log with `?follow=true`).
 */
export async function followLines(path, onLine, signal) {
  const r = await api('GET', path, { raw: true, signal });
  const rest = await splitStream(r.body, '\n', (line) => {
    if (line.trim()) onLine(JSON.parse(line));
  });
  if (rest.trim()) onLine(JSON.parse(rest));
}

/**
 * Reads a response body as text, calling `onPart(part)` for each piece ended by `sep`;
 * resolves with what is left after the last separator when the body ends.
 */
async function splitStream(body, sep, onPart) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return buf;
    buf += value;
    let i;
    while ((i = buf.indexOf(sep)) >= 0) {
      const part = buf.slice(0, i);
      buf = buf.slice(i + sep.length);
      onPart(part);
    }
  }
}

/**
 * Follows the event stream, calling `onEvent(event)` for each and `onState('live' |
 * 'offline')`. After a cut it reconnects (1 s, doubling up to 15 s) with `Last-Event-ID`,
 * so the server sends what happened meanwhile: no gap, no duplicate. Returns a function
 * that stops it.
 */
export function followEvents(onEvent, onState) {
  let stopped = false;
  let ctrl = null;
  let last = null;
  (async function loop() {
    let delay = 1000;
    while (!stopped) {
      ctrl = new AbortController();
      try {
        const h = { Accept: 'text/event-stream' };
        if (last) h['Last-Event-ID'] = last;
        const r = await fetch('/v1/events', { headers: headers(h), signal: ctrl.signal, cache: 'no-store', credentials: 'omit' });
        if (r.status === 401) { window.dispatchEvent(new CustomEvent('locker-unauthorized')); return; }
        if (!r.ok || !r.body) throw new Error(`events: ${r.status}`);
        onState('live');
        delay = 1000;
        await splitStream(r.body, '\n\n', (block) => {
          let data = '';
          let id = null;
          for (const line of block.split('\n')) {
            if (line.startsWith('data:')) data += line.slice(5).trimStart();
            else if (line.startsWith('id:')) id = line.slice(3).trim();
          }
          if (id) last = id;
          if (data) {
            try { onEvent(JSON.parse(data)); } catch { /* not JSON: skipped */ }
          }
        });
      } catch (e) {
        if (stopped) return;
      }
      onState('offline');
      await new Promise((res) => setTimeout(res, delay));
      delay = Math.min(delay * 2, 15000);
    }
  })();
  return () => { stopped = true; ctrl?.abort(); };
}
