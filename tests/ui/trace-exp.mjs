import { chromium } from 'playwright-core';
import { writeFileSync } from 'node:fs';
const url = process.env.LOCKER_URL, key = process.env.KEY;
const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox'] });
for (let i = 0; i < 2; i++) {
  const ctx = await browser.newContext();
  await ctx.addInitScript((k) => sessionStorage.setItem('locker.api_key', k), key);
  const page = await ctx.newPage();
  if (i === 1) await browser.startTracing(page, { path: '/tmp/ui-trace.json', categories: ['devtools.timeline', 'blink', 'loading', 'v8', 'disabled-by-default-devtools.timeline', 'toplevel'] });
  await page.goto(`${url}/ui/#/sandboxes`);
  await page.waitForSelector('#sandboxes tr');
  await page.waitForLoadState('load');
  if (i === 1) await browser.stopTracing();
  console.log(JSON.stringify(await page.evaluate(() => { const n = performance.getEntriesByType('navigation')[0]; return { resp: n.responseEnd, di: n.domInteractive, dcl: n.domContentLoadedEventEnd, load: n.loadEventEnd, res: performance.getEntriesByType('resource').map((r) => [r.name.slice(-20), Math.round(r.startTime), Math.round(r.responseEnd)]) }; })));
  await ctx.close();
}
await browser.close();
