// One sandbox: its settings, actions, preview URLs, a live terminal (xterm.js over the PTY
// WebSocket, opened with a single-use ticket so the key never enters a URL) and a file
// browser with upload and download.

import { api, get, post, qs, download } from './api.js';
import { h, fill, toast, fmtMs, fmtS, fmtPct, rel, time } from './dom.js';
import { pill, actions, act } from './pages.js';
import { stackedBars } from './charts.js';

export async function sandbox(main, params, id) {
  const enc = encodeURIComponent(id);
  const head = h('div');
  const tabsBox = h('div', { class: 'tabs' });
  const body = h('div');
  fill(main, head, tabsBox, body);
  let term = null;
  let first = true;
  async function refresh() {
    let sb;
    try {
      sb = await get(`/v1/sandboxes/${enc}`);
    } catch (e) {
      // Gone while open (its `sandbox.deleted` or `sandbox.expired` event): say why.
      if (first || e.status !== 404) throw e;
      term?.close();
      term = null;
      fill(head, h('h1', null, h('span', { class: 'mono' }, id)), h('p', { class: 'bad', id: 'sandbox-gone' }, e.message));
      fill(tabsBox);
      fill(body);
      return null;
    }
    first = false;
    const u = sb.usage || {};
    fill(head,
      h('h1', null, h('span', { class: 'mono' }, sb.id), ' ', pill(sb.state)),
      actions(sb, refresh),
      h('div', { class: 'card grid kv', id: 'sandbox-info' },
        kv('Runtime', sb.runtime), kv('Template', sb.template), kv('Limits', `${sb.cpus} cpu · ${sb.memory_mb} MB · ${sb.disk_mb} MB disk`),
        kv('Network', JSON.stringify(sb.network)), kv('Created', time(sb.created_at)), kv('Expires', `${rel(sb.expires_at)}`),
        kv('Idle pause', sb.idle_timeout_s ? fmtS(sb.idle_timeout_s) : 'never'), kv('Last active', rel(sb.last_active_at)),
        kv('CPU used', fmtMs(u.cpu_ms)), kv('Idle fraction', h('span', { id: 'idle-fraction' }, fmtPct(u.idle_fraction))),
        kv('Active / idle / paused', u.active_s === undefined ? '—' : `${fmtS(u.active_s)} / ${fmtS(u.idle_s)} / ${fmtS(u.paused_s)}`),
        kv('Labels', h('span', { id: 'labels' }, Object.entries(sb.metadata || {}).map(([k, v]) => h('div', { class: 'mono' }, `${k}=${v}`)))),
        sb.failure ? kv('Failure', h('span', { class: 'bad' }, sb.failure)) : null,
        sb.preview_url ? kv('Preview URL', h('span', { class: 'mono' }, sb.preview_url)) : null),
      gapsOf(u.call_gaps));
    return sb;
  }
  const tabs = {
    Terminal: () => terminal(body, id).then((t) => { term = t; }),
    Files: () => files(body, id, params.get('path') || '/'),
    Ports: () => ports(body, id),
    Calls: () => { location.hash = `#/calls?sandbox_id=${enc}`; },
  };
  function show(name) {
    term?.close();
    term = null;
    for (const b of tabsBox.children) b.classList.toggle('on', b.textContent === name);
    Promise.resolve(tabs[name]()).catch((e) => toast(String(e.message || e), true));
  }
  for (const name of Object.keys(tabs)) {
    tabsBox.append(h('button', { type: 'button', dataset: { tab: name.toLowerCase() }, on: { click: () => show(name) } }, name));
  }
  await refresh();
  show(params.get('tab') === 'files' ? 'Files' : 'Terminal');
  return {
    refresh,
    wants: (e) => e.subject === id,
    leave: () => term?.close(),
  };
}

/** A bound of the call-gap histogram, in seconds, as a short label. */
function gapLabel(le) {
  if (le === null || le === undefined) return 'longer';
  return le < 60 ? `≤${le} s` : `≤${le / 60} min`;
}

/**
 * The histogram of the gaps between this sandbox's calls (`usage.call_gaps`): how long it
 * sat idle between one call and the next, to choose an idle pause from data.
 */
function gapsOf(gaps) {
  if (!Array.isArray(gaps)) return null;
  const n = gaps.reduce((a, g) => a + (g.count || 0), 0);
  const body = n
    ? [stackedBars(gaps.map((g) => ({ label: gapLabel(g.le), values: { count: g.count || 0 } })),
      [{ key: 'count', name: 'gaps', color: '#2b6cb0' }], (v) => String(Math.round(v))),
    h('p', { class: 'muted' }, `${n} gap(s) between calls. An idle pause longer than most of them pauses the sandbox only while the agent is really away.`)]
    : h('p', { class: 'muted' }, 'No gaps yet: the histogram starts with its second call.');
  return h('div', { class: 'card', id: 'call-gaps' }, h('h2', null, 'Gaps between calls'), body);
}

function kv(k, v) {
  return h('dl', null, h('dt', null, k), h('dd', null, v));
}

let xtermLoading = null;
/** Loads xterm.js (served by this server) the first time a terminal opens. */
function loadXterm() {
  if (window.Terminal) return Promise.resolve();
  if (xtermLoading) return xtermLoading;
  const v = document.querySelector('meta[name=locker-version]').content;
  document.head.append(h('link', { rel: 'stylesheet', href: `/ui/v/${v}/xterm.css` }));
  xtermLoading = new Promise((resolve, reject) => {
    const s = document.createElement('script');
    s.src = `/ui/v/${v}/xterm.js`;
    s.onload = () => resolve();
    s.onerror = () => reject(new Error('xterm.js did not load'));
    document.head.append(s);
  });
  return xtermLoading;
}

async function terminal(body, id) {
  if (document.querySelector('meta[name=locker-xterm]').content !== 'yes') {
    fill(body, h('div', { class: 'card' }, h('p', { class: 'bad' }, 'The terminal is not built into this server.'),
      h('p', null, 'Run `npm ci` in ui/ (or `scripts/setup build`, which does), then rebuild locker: `cargo build --release -p locker-cli`.')));
    return null;
  }
  const box = h('div', { class: 'term', id: 'terminal' });
  const status = h('p', { class: 'muted', id: 'terminal-status' }, 'connecting…');
  fill(body, box, status);
  await loadXterm();
  const term = new window.Terminal({ cursorBlink: true, fontSize: 13, convertEol: false, scrollback: 5000 });
  term.open(box);
  const fit = () => {
    // One cell of xterm's DOM renderer, measured, gives the grid that fits the box.
    const cell = box.querySelector('.xterm-char-measure-element');
    const rect = cell?.getBoundingClientRect();
    // The measure element holds a run of one character: its width over their count is a cell.
    const w = rect?.width ? rect.width / Math.max(1, cell.textContent.length) : 8;
    const ht = rect?.height || 17;
    const cols = Math.max(20, Math.floor((box.clientWidth - 8) / w));
    const rows = Math.max(5, Math.floor((box.clientHeight - 8) / ht));
    if (cols !== term.cols || rows !== term.rows) term.resize(cols, rows);
  };
  fit();
  const t = await post(`/v1/sandboxes/${encodeURIComponent(id)}/pty/ticket`);
  const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/sandboxes/${encodeURIComponent(id)}/pty${qs({ cols: term.cols, rows: term.rows })}`;
  const ws = new WebSocket(url, t.protocols);
  ws.binaryType = 'arraybuffer';
  const enc = new TextEncoder();
  ws.onopen = () => { fill(status, 'connected'); term.focus(); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === 'string') {
      // The last frame: how the shell ended. Shown in the status line, as text.
      try {
        const m = JSON.parse(ev.data);
        fill(status, m.type === 'exit' ? `the shell ended (${m.reason}${m.exit_code !== undefined && m.exit_code !== null ? ` ${m.exit_code}` : ''})` : `error: ${m.message || ''}`);
      } catch { /* not a control frame */ }
      return;
    }
    term.write(new Uint8Array(ev.data));
  };
  ws.onclose = () => { if (status.textContent === 'connected') fill(status, 'disconnected'); };
  term.onData((d) => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
  term.onResize(({ cols, rows }) => { if (ws.readyState === 1) ws.send(JSON.stringify({ resize: [cols, rows] })); });
  const onWin = () => fit();
  window.addEventListener('resize', onWin);
  return { close() { window.removeEventListener('resize', onWin); ws.close(); term.dispose(); } };
}

function join(dir, name) {
  return dir.endsWith('/') ? `${dir}${name}` : `${dir}/${name}`;
}

async function files(body, id, start) {
  const enc = encodeURIComponent(id);
  let cwd = start;
  const crumbs = h('div', { class: 'row mono', id: 'files-path' });
  const tbody = h('tbody', { id: 'files' });
  const input = h('input', { type: 'file', id: 'upload', multiple: true });
  const up = h('button', { type: 'button', id: 'upload-btn' }, 'Upload');
  const mk = h('input', { placeholder: 'new folder', size: 12 });
  const mkb = h('button', { type: 'button' }, 'Make folder');
  up.addEventListener('click', () => act(up, async () => {
    for (const f of input.files) {
      await api('PUT', `/v1/sandboxes/${enc}/files${qs({ path: join(cwd, f.name) })}`, { body: f, headers: { 'Content-Type': 'application/octet-stream' } });
    }
    toast(`uploaded ${input.files.length} file(s)`);
    input.value = '';
    await list();
  }));
  mkb.addEventListener('click', () => act(mkb, async () => {
    if (!mk.value) return;
    await post(`/v1/sandboxes/${enc}/files/mkdir`, { path: join(cwd, mk.value) });
    mk.value = '';
    await list();
  }));
  fill(body, crumbs, h('div', { class: 'card row' }, h('label', null, 'Files to upload here', input), up, mk, mkb),
    h('div', { class: 'tablewrap' }, h('table', null,
      h('thead', null, h('tr', null, h('th', null, 'Name'), h('th', { class: 'num' }, 'Size'), h('th', { class: 'hide-sm' }, 'Mode'), h('th', { class: 'hide-sm' }, 'Modified'), h('th', null, ''))),
      tbody)));
  async function list() {
    const r = await get(`/v1/sandboxes/${enc}/files/list${qs({ path: cwd, depth: 1 })}`);
    const parts = cwd.split('/').filter(Boolean);
    fill(crumbs, h('a', { href: '#', on: { click: (e) => { e.preventDefault(); cwd = '/'; list(); } } }, '/'),
      parts.map((p, i) => [h('a', { href: '#', on: { click: (e) => { e.preventDefault(); cwd = `/${parts.slice(0, i + 1).join('/')}`; list(); } } }, p), '/']));
    const entries = (r.entries || []).filter((e) => e.path !== cwd).sort((a, b) => (a.type === 'dir') === (b.type === 'dir') ? a.name.localeCompare(b.name) : a.type === 'dir' ? -1 : 1);
    fill(tbody, entries.map((e) => h('tr', { dataset: { name: e.name } },
      h('td', { class: 'mono' }, e.type === 'dir'
        ? h('a', { href: '#', on: { click: (ev) => { ev.preventDefault(); cwd = e.path; list(); } } }, `${e.name}/`)
        : e.name),
      h('td', { class: 'num' }, e.type === 'file' ? String(e.size) : ''),
      h('td', { class: 'mono hide-sm' }, (e.mode ?? 0).toString(8)),
      h('td', { class: 'hide-sm' }, time(e.mtime)),
      h('td', null, e.type === 'file' ? h('button', { type: 'button', on: { click: (ev) => act(ev.currentTarget, () => download(`/v1/sandboxes/${enc}/files${qs({ path: e.path })}`, e.name)) } }, 'Download') : null))));
  }
  await list();
  return null;
}

async function ports(body, id) {
  const r = await get(`/v1/sandboxes/${encodeURIComponent(id)}/ports`);
  fill(body, h('div', { class: 'tablewrap' }, h('table', null,
    h('thead', null, h('tr', null, h('th', null, 'Port'), h('th', null, 'Process'), h('th', null, 'Public'), h('th', null, 'Preview URL'))),
    h('tbody', { id: 'ports' }, (r.ports || []).length ? r.ports.map((p) => h('tr', null, h('td', { class: 'num' }, p.port), h('td', null, `${p.process || ''} (${p.pid ?? ''})`),
      h('td', null, p.public ? 'yes' : 'no (key or token)'), h('td', { class: 'mono' }, h('a', { href: p.url, target: '_blank', rel: 'noopener noreferrer' }, p.url))))
      : h('tr', null, h('td', { colspan: 4, class: 'muted' }, 'Nothing listens on a TCP port in this sandbox.'))))));
  return null;
}
