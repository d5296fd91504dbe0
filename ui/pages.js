// The dashboard's list pages: sign-in, sandboxes, calls, volumes, usage, templates, health.
// Each page is `async function(main, params) -> {refresh?, wants?(event), leave?}`: `wants`
// says which live events make the shell call `refresh`.

import { api, auth, get, post, del, qs, followLines, ApiError } from './api.js';
import { h, fill, toast, fmtMs, fmtS, fmtBytes, fmtPct, rel, time } from './dom.js';
import { stackedBars, legend } from './charts.js';

export function pill(state) {
  return h('span', { class: `pill ${state}` }, state);
}

function err(e) {
  toast(e instanceof ApiError ? `${e.code}: ${e.message}` : String(e), true);
}

/** Runs `fn` with the button disabled, reporting errors. */
export async function act(btn, fn) {
  btn.disabled = true;
  try { await fn(); } catch (e) { err(e); } finally { btn.disabled = false; }
}

function idleFraction(sb) {
  const u = sb.usage || {};
  return typeof u.idle_fraction === 'number' ? u.idle_fraction : null;
}

// ---- sign-in ----
export async function signin(main) {
  const input = h('input', { type: 'password', id: 'key', autocomplete: 'off', placeholder: 'lk_…', required: true, size: 40 });
  const msg = h('p', { class: 'bad', id: 'signin-error' });
  const form = h('form', { class: 'card signin', on: { submit: async (ev) => {
    ev.preventDefault();
    auth.set(input.value.trim());
    try {
      await api('GET', '/v1/sandboxes?limit=1', { signingIn: true });
      location.hash = '#/sandboxes';
      window.dispatchEvent(new Event('locker-signed-in'));
    } catch (e) {
      auth.clear();
      fill(msg, e instanceof ApiError && e.status === 401 ? 'That key is unknown or revoked.' : String(e.message || e));
    }
  } } },
    h('h1', null, 'Sign in'),
    h('p', { class: 'muted' }, 'Paste an API key (the line `locker serve` printed at its first start, or `locker key create`). It stays in this tab only and is sent as a header, never in a URL.'),
    h('label', null, 'API key', input),
    h('p', null, h('button', { class: 'primary', type: 'submit', id: 'signin' }, 'Sign in')),
    msg);
  fill(main, form);
  input.focus();
  return {};
}

// ---- sandboxes ----
/** Rows a page of the sandboxes list holds. */
export const PAGE_SIZE = 50;

/** `key=value` as the list's `metadata.key=value` filter; null when there is no `=`. */
function labelFilter(label) {
  const i = label.indexOf('=');
  return i > 0 ? { [`metadata.${label.slice(0, i).trim()}`]: label.slice(i + 1) } : null;
}

export async function sandboxes(main, params) {
  // One page at a time, newest first, read from the server with `limit`/`offset`: the first
  // screen costs the same with 1,000 sandboxes as with 10, and so does each live refresh.
  const filters = { state: params.get('state') || '', label: params.get('label') || '' };
  let pageNo = Math.max(1, Number.parseInt(params.get('page') || '1', 10) || 1);
  let pages = 1;
  const tbody = h('tbody', { id: 'sandboxes' });
  const count = h('span', { class: 'muted', id: 'sandbox-count' });
  const form = createForm(() => { pageNo = 1; return refresh(); });
  const state = h('select', { name: 'state' }, ['', 'running', 'paused', 'starting', 'failed', 'stopped'].map((o) => h('option', { value: o }, o || 'any')));
  state.value = filters.state;
  const label = h('input', { name: 'label', placeholder: 'key=value', size: 16, value: filters.label });
  const filterForm = h('form', { class: 'row filters', id: 'sandbox-filters', on: { submit: (ev) => {
    ev.preventDefault();
    const l = label.value.trim();
    if (l && !labelFilter(l)) { toast('A label filter is key=value.', true); return; }
    const p = new URLSearchParams();
    if (state.value) p.set('state', state.value);
    if (l) p.set('label', l);
    location.hash = `#/sandboxes${p.toString() ? `?${p}` : ''}`;
  } } },
  h('label', null, 'State', state), h('label', null, 'Label', label), h('button', { type: 'submit' }, 'Filter'));
  const btn = (id, text, to) => {
    const b = h('button', { type: 'button', id }, text);
    b.addEventListener('click', () => act(b, async () => { pageNo = to(); await refresh(); }));
    return b;
  };
  const firstBtn = btn('sb-first', '« Newest', () => 1);
  const prevBtn = btn('sb-prev', '← Newer', () => pageNo - 1);
  const nextBtn = btn('sb-next', 'Older →', () => pageNo + 1);
  const lastBtn = btn('sb-last', 'Oldest »', () => pages);
  const pageInfo = h('span', { class: 'muted', id: 'sb-page' });
  fill(main,
    h('h1', null, 'Sandboxes ', count),
    form,
    h('div', { class: 'pager' }, filterForm, firstBtn, prevBtn, nextBtn, lastBtn, pageInfo),
    h('div', { class: 'tablewrap' }, h('table', null,
      h('thead', null, h('tr', null, h('th', null, 'Sandbox'), h('th', null, 'State'), h('th', { class: 'hide-sm' }, 'Runtime'),
        h('th', { class: 'hide-sm' }, 'Template'), h('th', { class: 'hide-sm' }, 'Limits'), h('th', null, 'TTL'),
        h('th', { class: 'num' }, 'Idle'), h('th', { class: 'hide-sm' }, 'Labels'), h('th', null, ''))),
      tbody)));
  async function refresh() {
    const q = { limit: PAGE_SIZE, offset: (pageNo - 1) * PAGE_SIZE, order: 'newest', state: filters.state, ...labelFilter(filters.label) };
    const r = await get(`/v1/sandboxes${qs(q)}`);
    const list = r.sandboxes || [];
    const total = r.total ?? list.length;
    pages = Math.max(1, Math.ceil(total / PAGE_SIZE));
    // The page emptied under us (deletes): show the last one there is.
    if (pageNo > pages) { pageNo = pages; return refresh(); }
    const filtered = filters.state || filters.label;
    fill(count, `(${total}${filtered ? ' matching' : ''})`);
    fill(tbody, list.length ? list.map(row) : h('tr', null, h('td', { colspan: 9, class: 'muted' },
      filtered ? 'No sandboxes match.' : 'No sandboxes yet: create one above.')));
    firstBtn.disabled = prevBtn.disabled = pageNo <= 1;
    nextBtn.disabled = lastBtn.disabled = pageNo >= pages;
    fill(pageInfo, `page ${pageNo} of ${pages}`);
    // A reload stays on this page (no hashchange, so no new route).
    const p = new URLSearchParams();
    if (filters.state) p.set('state', filters.state);
    if (filters.label) p.set('label', filters.label);
    if (pageNo > 1) p.set('page', pageNo);
    const hash = `#/sandboxes${p.toString() ? `?${p}` : ''}`;
    if (location.hash !== hash && location.hash.startsWith('#/sandboxes')) history.replaceState(null, '', hash);
    if (!window.__lockerSandboxesFirstScreen) {
      window.__lockerSandboxesFirstScreen = performance.now();
      performance.mark('locker-sandboxes-first-screen');
    }
    return null;
  }
  function row(sb) {
    const open = () => { location.hash = `#/sandboxes/${encodeURIComponent(sb.id)}`; };
    return h('tr', { dataset: { id: sb.id } },
      h('td', { class: 'mono' }, h('a', { href: `#/sandboxes/${encodeURIComponent(sb.id)}` }, sb.id)),
      h('td', null, pill(sb.state)),
      h('td', { class: 'hide-sm' }, sb.runtime),
      h('td', { class: 'hide-sm' }, sb.template),
      h('td', { class: 'hide-sm' }, `${sb.cpus} cpu · ${sb.memory_mb} MB · ${sb.disk_mb} MB disk`),
      h('td', null, rel(sb.expires_at)),
      h('td', { class: 'num idle' }, fmtPct(idleFraction(sb))),
      h('td', { class: 'hide-sm labels' }, Object.entries(sb.metadata || {}).map(([k, v]) => h('div', { class: 'mono' }, `${k}=${v}`))),
      h('td', null, actions(sb, refresh, open)));
  }
  await refresh();
  return { refresh, wants: (e) => e.type.startsWith('sandbox.') };
}

/** Pause/resume, snapshot, fork, delete buttons for a sandbox. */
export function actions(sb, after, open) {
  const id = encodeURIComponent(sb.id);
  const b = (label, fn, cls) => {
    const btn = h('button', { type: 'button', class: cls, dataset: { act: label.toLowerCase() } }, label);
    btn.addEventListener('click', () => act(btn, async () => { if ((await fn()) !== false) await after(); }));
    return btn;
  };
  const out = h('div', { class: 'row' });
  if (open) out.append(h('button', { type: 'button', on: { click: open } }, 'Open'));
  if (sb.state === 'running') out.append(b('Pause', () => post(`/v1/sandboxes/${id}/pause`)));
  if (sb.state === 'paused') out.append(b('Resume', () => post(`/v1/sandboxes/${id}/resume`)));
  if (sb.state === 'running' || sb.state === 'paused') {
    out.append(b('Snapshot', async () => { const s = await post(`/v1/sandboxes/${id}/snapshots`); toast(`snapshot ${s.id}`); }));
    out.append(b('Fork', async () => { const r = await post(`/v1/sandboxes/${id}/fork`, { count: 1 }); toast(`forked: ${(r.sandboxes || []).map((s) => s.id).join(', ')}`); }));
  }
  out.append(b('Delete', async () => {
    if (!confirm(`Delete ${sb.id}? Everything in it is gone.`)) return false;
    await del(`/v1/sandboxes/${id}`);
    toast(`deleted ${sb.id}`);
    if (location.hash.startsWith(`#/sandboxes/${id}`)) { location.hash = '#/sandboxes'; return false; }
    return true;
  }, 'danger'));
  return out;
}

function createForm(after) {
  const f = (name, attrs) => h('input', { name, ...attrs });
  const template = f('template', { value: 'default', size: 12 });
  const runtime = h('select', { name: 'runtime' }, ['auto', 'jail', 'microvm'].map((r) => h('option', { value: r }, r)));
  const cpus = f('cpus', { type: 'number', min: 1, value: 1, style: 'width:4rem' });
  const mem = f('memory_mb', { type: 'number', min: 64, value: 512, style: 'width:6rem' });
  const ttl = f('ttl_s', { type: 'number', min: 1, value: 1800, style: 'width:6rem' });
  const idle = f('idle_timeout_s', { type: 'number', min: 1, placeholder: 'none', style: 'width:6rem' });
  const label = f('label', { placeholder: 'key=value', size: 14 });
  const btn = h('button', { class: 'primary', type: 'submit', id: 'create' }, 'Create sandbox');
  return h('form', { class: 'card row', id: 'create-form', on: { submit: (ev) => {
    ev.preventDefault();
    act(btn, async () => {
      const body = { template: template.value || 'default', runtime: runtime.value, cpus: +cpus.value, memory_mb: +mem.value, ttl_s: +ttl.value };
      if (idle.value) body.idle_timeout_s = +idle.value;
      if (label.value.includes('=')) {
        const [k, ...v] = label.value.split('=');
        body.metadata = { [k.trim()]: v.join('=') };
      }
      const sb = await post('/v1/sandboxes', body);
      toast(`created ${sb.id}`);
      await after();
    });
  } } },
  h('label', null, 'Template', template), h('label', null, 'Runtime', runtime), h('label', null, 'CPUs', cpus),
  h('label', null, 'Memory MB', mem), h('label', null, 'TTL s', ttl), h('label', null, 'Idle pause s', idle),
  h('label', null, 'Label', label), btn);
}

// ---- calls ----
export function outcome(r) {
  const res = r.result || {};
  if (res.reason === 'exited') return res.exit_code === 0 ? h('span', { class: 'ok' }, 'exit 0') : h('span', { class: 'bad' }, `exit ${res.exit_code}`);
  return h('span', { class: 'bad' }, res.reason === 'signaled' ? `signal ${res.signal || ''}` : String(res.reason));
}

export function callDetail(r) {
  return h('div', { class: 'card', id: 'call-detail' },
    h('h2', null, 'Call ', h('span', { class: 'mono' }, r.id)),
    networkOf(r),
    changesOf(r),
    h('pre', null, JSON.stringify(r, null, 2)));
}

/** A call's network: names refused by its egress policy, secrets used and misused. */
export function networkOf(r) {
  const denied = r.egress_denied || [];
  const used = r.secrets_used || [];
  const misuse = r.secret_misuse || [];
  if (!denied.length && !used.length && !misuse.length) return null;
  const list = (title, cls, items) => (items.length
    ? [h('h3', null, title), h('ul', { class: `net ${cls}` }, items.map((x) => h('li', { class: 'mono' }, x)))]
    : null);
  return h('div', { class: 'net-block' },
    list('Secrets used', 'used', used.map((u) => `${u.name} → ${u.host}`)),
    list('Secret misuse (sent as the placeholder, never the value)', 'misuse bad', misuse.map((m) => `${m.name} → ${m.destination}`)),
    list('Egress denied', 'denied warn', denied));
}

/** The secrets column of a call: names used, and a warning for misuse. */
function secretsCell(r) {
  const used = [...new Set((r.secrets_used || []).map((u) => u.name))];
  const misuse = [...new Set((r.secret_misuse || []).map((m) => m.name))];
  return [used.length ? h('span', { class: 'used' }, used.join(', ')) : null,
    misuse.length ? h('span', { class: 'bad misuse', title: 'a placeholder went where the secret may not' }, ` misuse: ${misuse.join(', ')}`) : null];
}

/** A run's change list: added, modified, deleted, conflicts, and whether it was committed. */
export function changesOf(r) {
  const c = r.changes || r.result?.changes;
  if (!c) return null;
  const list = (cls, items, sign) => (items || []).map((p) => h('li', { class: cls }, `${sign} ${p}`));
  const status = c.committed ? h('span', { class: 'ok' }, 'committed') : h('span', { class: 'bad' }, 'not committed');
  return h('div', { class: 'changes-block' },
    h('p', null, status, c.commit_error ? h('span', { class: 'bad' }, ` (${c.commit_error})`) : null,
      c.conflicts?.length ? h('span', { class: 'warn' }, ` · ${c.conflicts.length} conflict(s)`) : null),
    h('ul', { class: 'changes' }, list('added', c.added, '+'), list('modified', c.modified, '~'), list('deleted', c.deleted, '−'),
      (c.conflicts || []).map((p) => h('li', { class: 'warn' }, `! conflict ${p}`))));
}

export async function calls(main, params) {
  const filters = {
    sandbox_id: params.get('sandbox_id') || '', volume_id: params.get('volume_id') || '',
    key_id: params.get('key_id') || '', kind: params.get('kind') || '', outcome: params.get('outcome') || '',
  };
  const inputs = {};
  const field = (k, label, el) => { inputs[k] = el; el.value = filters[k]; return h('label', null, label, el); };
  const sel = (opts) => h('select', null, opts.map((o) => h('option', { value: o }, o || 'any')));
  const form = h('form', { class: 'card row', id: 'call-filters', on: { submit: (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    for (const [k, el] of Object.entries(inputs)) if (el.value) p.set(k, el.value.trim());
    location.hash = `#/calls${p.toString() ? `?${p}` : ''}`;
  } } },
  field('sandbox_id', 'Sandbox', h('input', { placeholder: 'sb_…', size: 18 })),
  field('volume_id', 'Volume', h('input', { placeholder: 'name or vol_…', size: 14 })),
  field('key_id', 'Key', h('input', { placeholder: 'key_…', size: 14 })),
  field('kind', 'Kind', sel(['', 'exec', 'run', 'process', 'code'])),
  field('outcome', 'Outcome', sel(['', 'ok', 'failed', 'timeout', 'oom', 'killed', 'output_limit', 'signaled'])),
  h('button', { type: 'submit' }, 'Filter'));
  const tbody = h('tbody', { id: 'calls' });
  const detail = h('div');
  const pageInfo = h('span', { class: 'muted' });
  const newer = h('button', { type: 'button', id: 'newer' }, '← Newer');
  const older = h('button', { type: 'button', id: 'older' }, 'Older →');
  const pager = h('div', { class: 'pager' }, newer, older, pageInfo);
  fill(main, h('h1', null, 'Calls'), form, pager,
    h('div', { class: 'tablewrap' }, h('table', null,
      h('thead', null, h('tr', null, h('th', null, 'When'), h('th', null, 'Kind'), h('th', { class: 'hide-sm' }, 'Where'),
        h('th', null, 'Command'), h('th', null, 'Outcome'), h('th', { class: 'num' }, 'Wait'), h('th', { class: 'num' }, 'Duration'),
        h('th', { class: 'num hide-sm' }, 'CPU'), h('th', { class: 'num hide-sm' }, 'Egress denied'), h('th', null, 'Secrets'), h('th', { class: 'hide-sm' }, 'Key'))),
      tbody)), detail);
  const stack = [];
  let cursor = null;
  let next = null;
  async function load() {
    const q = { ...filters, limit: 50, cursor };
    const r = await get(`/v1/calls${qs(q)}`);
    next = r.next_cursor || null;
    const list = r.calls || [];
    fill(tbody, list.length ? list.map(row) : h('tr', null, h('td', { colspan: 11, class: 'muted' }, 'No calls match.')));
    newer.disabled = stack.length === 0;
    older.disabled = !next;
    fill(pageInfo, `page ${stack.length + 1} · ${list.length} calls`);
    if (!window.__lockerCallsFirstScreen) {
      window.__lockerCallsFirstScreen = performance.now();
      performance.mark('locker-calls-first-screen');
    }
  }
  older.addEventListener('click', () => act(older, async () => { stack.push(cursor); cursor = next; await load(); }));
  newer.addEventListener('click', () => act(newer, async () => { cursor = stack.pop() ?? null; await load(); }));
  function row(r) {
    const res = r.result || {};
    const t = res.timings || {};
    const where = r.volume_id ? `volume ${r.volume_id}` : r.sandbox_id || '';
    return h('tr', { class: 'click', dataset: { call: r.id }, on: { click: () => fill(detail, callDetail(r)) } },
      h('td', null, time(r.created_at)),
      h('td', null, r.kind),
      h('td', { class: 'mono hide-sm' }, where),
      h('td', { class: 'mono cmd', title: (r.command || []).join(' ') }, (r.command || []).join(' ')),
      h('td', null, outcome(r)),
      h('td', { class: 'num' }, fmtMs((t.queue_ms || 0) + (t.start_ms || 0))),
      h('td', { class: 'num' }, fmtMs(t.run_ms)),
      h('td', { class: 'num hide-sm' }, fmtMs(res.usage?.cpu_ms)),
      h('td', { class: 'num hide-sm', title: (r.egress_denied || []).join(' ') }, (r.egress_denied || []).length || ''),
      h('td', { class: 'secrets' }, secretsCell(r)),
      h('td', { class: 'mono hide-sm' }, r.key_id));
  }
  await load();
  // Only the first page follows events (a later one stays put while the user reads it).
  return { refresh: () => (cursor === null ? load() : null), wants: (e) => e.type === 'run.committed' };
}

// ---- volumes ----
export async function volumes(main, params) {
  const chosen = params.get('volume');
  const list = (await get('/v1/volumes')).volumes || [];
  const side = h('div', { class: 'tablewrap' }, h('table', null,
    h('thead', null, h('tr', null, h('th', null, 'Volume'), h('th', { class: 'num' }, 'Used'), h('th', { class: 'num hide-sm' }, 'Size'), h('th', { class: 'hide-sm' }, 'Created'))),
    h('tbody', { id: 'volumes' }, list.length ? list.map((v) => h('tr', null,
      h('td', null, h('a', { href: `#/volumes?volume=${encodeURIComponent(v.id)}` }, v.name), ' ', h('span', { class: 'muted mono' }, v.id)),
      h('td', { class: 'num' }, fmtBytes(v.used_bytes)), h('td', { class: 'num hide-sm' }, `${v.size_mb} MB`), h('td', { class: 'hide-sm' }, time(v.created_at))))
      : h('tr', null, h('td', { colspan: 4, class: 'muted' }, 'No volumes (`locker volume create NAME`).')))));
  const detail = h('div', { id: 'volume-detail' });
  fill(main, h('h1', null, 'Volumes'), side, detail);
  async function refresh() {
    if (!chosen) return;
    const v = list.find((x) => x.id === chosen || x.name === chosen) || { id: chosen, name: chosen };
    const id = encodeURIComponent(v.id);
    const [tree, runs] = await Promise.all([
      get(`/v1/volumes/${id}/files/list${qs({ path: '/', depth: 3 })}`).catch((e) => ({ error: e })),
      get(`/v1/calls${qs({ volume_id: v.id, kind: 'run', limit: 20 })}`).catch((e) => ({ error: e })),
    ]);
    fill(detail,
      h('h2', null, 'Tree of ', h('span', { class: 'mono' }, v.name)),
      h('div', { class: 'card' }, tree.error ? h('p', { class: 'bad' }, tree.error.message) : treeOf(tree.entries || [])),
      h('h2', null, 'Runs'),
      (runs.calls || []).length
        ? (runs.calls || []).map((r) => h('div', { class: 'card run', dataset: { call: r.id } },
          h('p', null, h('span', { class: 'mono' }, r.id), ' · ', time(r.created_at), ' · ', outcome(r), ' · ', h('span', { class: 'mono' }, (r.command || []).join(' '))),
          changesOf(r)))
        : h('p', { class: 'muted' }, runs.error ? runs.error.message : 'No runs on this volume yet.'));
  }
  await refresh();
  return { refresh, wants: (e) => e.type === 'run.committed' };
}

function treeOf(entries) {
  const sorted = [...entries].sort((a, b) => a.path.localeCompare(b.path));
  if (!sorted.length) return h('p', { class: 'muted' }, 'Empty.');
  return h('ul', { class: 'tree mono', id: 'volume-tree' }, sorted.map((e) => {
    const depth = e.path.split('/').length - 2;
    return h('li', { style: `padding-left:${depth}rem` }, e.type === 'dir' ? `${e.name}/` : e.name,
      e.type === 'file' ? h('span', { class: 'muted' }, ` ${fmtBytes(e.size)}`) : null);
  }));
}

// ---- usage ----
/**
 * The intervals of `/v1/usage/series` summed into `n` buckets of `step` seconds ending now
 * (each interval goes to the bucket that holds its middle).
 */
export function bucketize(intervals, now, step, n) {
  const keys = ['active_s', 'idle_s', 'paused_s', 'cpu_ms'];
  const start = now - n * step;
  const buckets = Array.from({ length: n }, (_, i) => {
    const d = new Date((start + i * step) * 1000);
    return { label: `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`, values: Object.fromEntries(keys.map((k) => [k, 0])) };
  });
  for (const iv of intervals) {
    const mid = (Date.parse(iv.from) + Date.parse(iv.to)) / 2000;
    const i = Math.floor((mid - start) / step);
    if (i < 0 || i >= n) continue;
    for (const k of keys) buckets[i].values[k] += Math.max(0, iv[k] || 0);
  }
  return buckets;
}

export async function usage(main) {
  const body = h('div');
  fill(main, h('h1', null, 'Usage'), body);
  async function refresh() {
    const now = Math.floor(Date.now() / 1000);
    const step = 300;
    const n = 12;
    const [all, series, list] = await Promise.all([
      get('/v1/usage'),
      get(`/v1/usage/series${qs({ since: now - n * step })}`),
      get(`/v1/sandboxes${qs({ limit: PAGE_SIZE, order: 'newest' })}`),
    ]);
    const buckets = bucketize(series.intervals || [], now, step, n);
    const timeSeries = [{ key: 'active_s', name: 'active', color: '#2b6cb0' }, { key: 'idle_s', name: 'idle', color: '#ecc94b' }, { key: 'paused_s', name: 'paused', color: '#a0aec0' }];
    const sbs = list.sandboxes || [];
    fill(body,
      h('div', { class: 'card grid kv', id: 'usage-totals' },
        kv('Sandbox time', fmtS(all.sandbox_seconds)), kv('CPU of calls', fmtMs(all.cpu_ms)), kv('CPU of machines', fmtMs(all.sandbox_cpu_ms)),
        kv('Runs', all.runs), kv('Execs', all.execs),
        kv('Active', fmtS(all.active_s)), kv('Idle', fmtS(all.idle_s)),
        kv('Paused', fmtS(all.paused_s)), kv('Idle fraction', h('span', { id: 'tenant-idle' }, fmtPct(all.idle_fraction)))),
      h('h2', null, 'Time of your sandboxes, last hour (5 min bars)'),
      h('div', { class: 'card', id: 'usage-time' }, stackedBars(buckets, timeSeries, fmtS), legend(timeSeries)),
      h('h2', null, 'CPU your machines used, last hour'),
      h('div', { class: 'card', id: 'usage-cpu' }, stackedBars(buckets, [{ key: 'cpu_ms', name: 'CPU', color: '#38a169' }], fmtMs)),
      h('p', { class: 'muted' }, `Sampled every ${series.interval_s} s since ${time(series.since)} (the series starts again when the server restarts; the totals above do not).`),
      h('h2', null, 'Per sandbox'),
      (list.total ?? sbs.length) > sbs.length ? h('p', { class: 'muted' }, `The ${sbs.length} newest of ${list.total} sandboxes (each sandbox's page has its own figures).`) : null,
      h('div', { class: 'tablewrap' }, h('table', null,
        h('thead', null, h('tr', null, h('th', null, 'Sandbox'), h('th', { class: 'num' }, 'CPU'), h('th', { class: 'num' }, 'Active'), h('th', { class: 'num' }, 'Idle'), h('th', { class: 'num' }, 'Paused'), h('th', { class: 'num' }, 'Idle fraction'))),
        h('tbody', null, sbs.map((sb) => {
          const u = sb.usage || {};
          return h('tr', null, h('td', { class: 'mono' }, sb.id), h('td', { class: 'num' }, fmtMs(u.cpu_ms)), h('td', { class: 'num' }, fmtS(u.active_s)),
            h('td', { class: 'num' }, fmtS(u.idle_s)), h('td', { class: 'num' }, fmtS(u.paused_s)), h('td', { class: 'num' }, fmtPct(u.idle_fraction)));
        })))));
  }
  await refresh();
  return { refresh, wants: (e) => e.type.startsWith('sandbox.') };
}

function kv(k, v) {
  return h('dl', null, h('dt', null, k), h('dd', null, v));
}

// ---- templates ----
export async function templates(main, params) {
  const chosen = params.get('build');
  const tbody = h('tbody', { id: 'templates' });
  const builds = h('div', { id: 'builds' });
  const log = h('div', { id: 'build-log' });
  fill(main, h('h1', null, 'Templates'),
    h('div', { class: 'tablewrap' }, h('table', null,
      h('thead', null, h('tr', null, h('th', null, 'Name'), h('th', { class: 'hide-sm' }, 'Digest'), h('th', { class: 'num' }, 'Size'), h('th', { class: 'hide-sm' }, 'Created'), h('th', { class: 'hide-sm' }, 'Packages'))),
      tbody)),
    h('h2', null, 'Builds'), builds, log);
  let following = null;
  let shown = null;
  async function refresh() {
    const [list, b] = await Promise.all([get('/v1/templates'), get('/v1/templates/builds?limit=20')]);
    fill(tbody, (list.templates || []).map((t) => h('tr', null, h('td', null, t.name), h('td', { class: 'mono hide-sm' }, (t.digest || '').slice(0, 19)),
      h('td', { class: 'num' }, fmtBytes(t.size_bytes)), h('td', { class: 'hide-sm' }, time(t.created_at)), h('td', { class: 'hide-sm' }, (t.packages || []).join(', ')))));
    const rows = b.builds || [];
    fill(builds, rows.length
      ? h('div', { class: 'tablewrap' }, h('table', null,
        h('thead', null, h('tr', null, h('th', null, 'Build'), h('th', null, 'Template'), h('th', null, 'State'), h('th', { class: 'num' }, 'Step'), h('th', { class: 'hide-sm' }, 'Started'), h('th', { class: 'hide-sm' }, 'Finished'))),
        h('tbody', null, rows.map((x) => h('tr', { class: 'click', dataset: { build: x.build_id }, on: { click: () => { location.hash = `#/templates?build=${encodeURIComponent(x.build_id)}`; } } },
          h('td', { class: 'mono' }, x.build_id), h('td', null, x.name), h('td', null, pill(x.state)),
          h('td', { class: 'num' }, x.steps ? `${x.step}/${x.steps}` : ''), h('td', { class: 'hide-sm' }, time(x.created_at)), h('td', { class: 'hide-sm' }, time(x.finished_at)))))))
      : h('p', { class: 'muted' }, 'No builds yet (`POST /v1/templates`, or `locker template build`).'));
    if (chosen && shown !== chosen) { shown = chosen; await showBuild(chosen); }
  }
  /** A build's log: followed live (NDJSON) while it runs, else its record's last lines. */
  async function showBuild(id) {
    following?.abort();
    following = new AbortController();
    const pre = h('pre', { id: 'build-lines' });
    const state = h('span', { id: 'build-state' }, '…');
    const err = h('p', { class: 'bad', id: 'build-error' });
    fill(log, h('div', { class: 'card' }, h('h2', null, 'Build ', h('span', { class: 'mono' }, id), ' ', state), err, pre));
    const enc = encodeURIComponent(id);
    const b = await get(`/v1/templates/builds/${enc}`);
    fill(state, pill(b.state));
    if (b.state === 'succeeded' || b.state === 'failed') {
      pre.append(`${(b.log || []).join('\n')}\n`);
      if (b.log_dropped) pre.append(`(${b.log_dropped} earlier lines not kept)\n`);
      if (b.error) fill(err, b.error);
      return;
    }
    const signal = following.signal;
    followLines(`/v1/templates/builds/${enc}?follow=true`, (ev) => {
      if (ev.type === 'log') pre.append(`${ev.line}\n`);
      else if (ev.type === 'progress') fill(state, pill('running'), ` step ${ev.step}/${ev.steps}`);
      else if (ev.type === 'result') {
        fill(state, pill(ev.state));
        if (ev.error) fill(err, ev.error);
      }
      pre.scrollTop = pre.scrollHeight;
    }, signal).catch((e) => { if (!signal.aborted) fill(err, String(e.message || e)); });
  }
  await refresh();
  return { refresh, wants: (e) => e.type.startsWith('template.'), leave: () => following?.abort() };
}

// ---- health ----
export async function health(main) {
  const r = await api('GET', '/healthz', { raw: true }).then((x) => x.json()).catch((e) => ({ error: String(e) }));
  const state = (v) => h('span', { class: String(v).startsWith('ok') ? 'ok' : 'bad' }, String(v));
  fill(main, h('h1', null, 'Health'),
    h('div', { class: 'card grid kv', id: 'health' },
      kv('Server', state(r.status || r.error)),
      Object.entries(r.runtimes || {}).map(([k, v]) => kv(`Runtime ${k}`, state(v))),
      kv('Virtualization', r.virtualization ? `${r.virtualization.accel}${r.virtualization.accel === 'tcg' ? ' (emulated: not a security boundary)' : ''}` : '—'),
      kv('Egress enforcement', state(r.egress ?? '—'))),
    r.virtualization?.detail ? h('p', { class: 'muted' }, r.virtualization.detail) : null,
    h('p', { class: 'muted' }, 'More on this host: `locker doctor`.'));
  return {};
}
