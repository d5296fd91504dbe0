// Cold loads of the dashboard in Chromium, shared by the browser test (ui.test.mjs) and the
// bench's `ui` group (bench.mjs, run by bench/src/ui.rs). Each load opens a fresh browser
// context (no cache, no storage) with the key already in sessionStorage, as a signed-in tab
// has it, goes to one page and waits for its data to be shown.

/** Nearest-rank percentile of `xs` (as the bench's own rows). */
export function percentile(xs, p) {
  const s = xs.filter((x) => typeof x === 'number' && Number.isFinite(x)).sort((a, b) => a - b);
  if (!s.length) return null;
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}

/**
 * What one load cost, read in the page from Navigation and Resource Timing (times from the
 * navigation's start, so the browser's own context start-up is not counted):
 * - `load_ms`: the page and every file it loads, parsed and run (the `load` event);
 * - `first_screen_ms`: the page's data shown (`window[mark]`, set by the page when it first
 *   filled its table);
 * - `bytes`: everything of the dashboard's own (`/ui/…`) sent, compressed, and `requests`.
 */
export async function loadFigures(page, mark) {
  return page.evaluate((m) => {
    const nav = performance.getEntriesByType('navigation')[0];
    const all = performance.getEntriesByType('resource');
    const res = all.filter((r) => r.name.includes('/ui/'));
    const bytes = [nav, ...res].reduce((a, r) => a + (r.transferSize || r.encodedBodySize || 0), 0);
    const api = all.filter((r) => r.name.includes('/v1/') && !r.name.includes('/v1/events'));
    return {
      bytes,
      assets: res.length + 1,
      requests: all.length + 1,
      page_request_ms: Math.round(nav.responseEnd - nav.requestStart),
      page_response_end_ms: Math.round(nav.responseEnd),
      dom_interactive_ms: Math.round(nav.domInteractive),
      assets_done_ms: Math.round(Math.max(0, ...res.map((r) => r.responseEnd))),
      dom_content_loaded_ms: Math.round(nav.domContentLoadedEventEnd),
      load_ms: Math.round(nav.loadEventEnd),
      // The page's first data request: when it was sent and how long its answer took.
      data_request_start_ms: api.length ? Math.round(api[0].startTime) : null,
      data_request_ms: api.length ? Math.round(api[0].responseEnd - api[0].startTime) : null,
      first_screen_ms: typeof window[m] === 'number' ? Math.round(window[m]) : null,
      names: res.map((r) => r.name.replace(/^.*\/ui\/v\/[0-9a-f]+\//, '')),
    };
  }, mark);
}

/**
 * `n` cold loads of `#route` with `key`, each waiting for `selector`; returns every load's
 * figures and the p50 of each time. `prepare(context)` may add init scripts.
 */
export async function coldLoads(browser, { url, key, route, selector, mark, n, prepare }) {
  const runs = [];
  for (let i = 0; i < n; i++) {
    const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 }, deviceScaleFactor: 1 });
    if (prepare) await prepare(ctx);
    await ctx.addInitScript((k) => { sessionStorage.setItem('locker.api_key', k); }, key);
    const page = await ctx.newPage();
    const t0 = performance.now();
    await page.goto(`${url}/ui/#${route}`);
    await page.waitForSelector(selector);
    const wall = performance.now() - t0;
    await page.waitForLoadState('load');
    // The mark is set by the same task that filled the table, so it is there now.
    const f = await loadFigures(page, mark);
    runs.push({ ...f, wall_ms: Math.round(wall) });
    await ctx.close();
  }
  const p50 = {};
  for (const k of ['load_ms', 'first_screen_ms', 'dom_content_loaded_ms', 'data_request_ms', 'wall_ms', 'bytes']) {
    p50[k] = percentile(runs.map((r) => r[k]), 50);
  }
  return { n, p50, p99: { load_ms: percentile(runs.map((r) => r.load_ms), 99), first_screen_ms: percentile(runs.map((r) => r.first_screen_ms), 99) }, runs };
}
