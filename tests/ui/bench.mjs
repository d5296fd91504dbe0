// The bench's browser figures (bench/src/ui.rs runs it against a server it filled):
//   LOCKER_URL      the server
//   UI_TENANTS      JSON {"name": "api key", …}: each tenant's sandboxes page is loaded cold
//   UI_LOADS        loads per tenant (default 10)
// Prints one line of JSON: {"chromium", "tenants": {name: coldLoads(…) of that tenant}}.

import { chromium } from 'playwright-core';
import { coldLoads } from './loads.mjs';

const url = process.env.LOCKER_URL;
const tenants = JSON.parse(process.env.UI_TENANTS || '{}');
const n = Number(process.env.UI_LOADS || 10);
if (!url || !Object.keys(tenants).length) throw new Error('set LOCKER_URL and UI_TENANTS');

const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox'] });
try {
  const out = { chromium: browser.version(), tenants: {} };
  // One load first, not counted: Chromium's own first start (its caches, its GPU process).
  const [first] = Object.values(tenants);
  await coldLoads(browser, { url, key: first, route: '/sandboxes', selector: '#sandboxes tr', mark: '__lockerSandboxesFirstScreen', n: 1 });
  for (const [name, key] of Object.entries(tenants)) {
    out.tenants[name] = await coldLoads(browser, { url, key, route: '/sandboxes', selector: '#sandboxes tr', mark: '__lockerSandboxesFirstScreen', n });
  }
  console.log(JSON.stringify(out));
} finally {
  await browser.close();
}
