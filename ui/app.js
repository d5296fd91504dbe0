// The dashboard's shell: sign-in state, the router (the URL fragment names the page, so a
// reload stays put and nothing reaches the server's logs), live updates: one event stream
// for the whole tab; a page says which events concern it (`wants`) and is refreshed then.

import { auth, followEvents } from './api.js';
import { h, fill, toast } from './dom.js';
import * as pages from './pages.js';

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const live = document.getElementById('live');
const signout = document.getElementById('signout');

let current = null;
let stopEvents = null;
let token = 0;

function parse() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, query] = raw.split('?');
  return { parts: path.split('/').filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query || '') };
}

async function route() {
  const my = ++token;
  current?.leave?.();
  current = null;
  const signedIn = !!auth.key;
  nav.hidden = !signedIn;
  signout.hidden = !signedIn;
  if (!signedIn) {
    stopEvents?.();
    stopEvents = null;
    fill(live, 'offline');
    live.className = 'live';
    current = await pages.signin(main);
    return;
  }
  startEvents();
  const { parts, params } = parse();
  const page = parts[0] || 'sandboxes';
  for (const a of nav.querySelectorAll('a')) a.classList.toggle('on', a.dataset.page === page);
  fill(main, h('p', { class: 'muted' }, 'Loading…'));
  try {
    let p;
    if (page === 'sandboxes' && parts[1]) {
      const { sandbox } = await import('./detail.js');
      p = await sandbox(main, params, parts[1]);
    } else if (pages[page] && page !== 'signin' && typeof pages[page] === 'function' && ['sandboxes', 'calls', 'volumes', 'usage', 'templates', 'health'].includes(page)) {
      p = await pages[page](main, params);
    } else {
      fill(main, h('p', null, 'No such page. ', h('a', { href: '#/sandboxes' }, 'Sandboxes')));
      p = {};
    }
    if (my === token) current = p; else p?.leave?.();
  } catch (e) {
    if (my !== token) return;
    fill(main, h('div', { class: 'card' }, h('p', { class: 'bad' }, String(e.message || e))));
  }
}

let pending = null;
/**
 * Refreshes the current page 300 ms from now, once however many events arrive meanwhile
 * (the refresh reads the state after them all).
 */
function soon() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; Promise.resolve(current?.refresh?.()).catch(() => {}); }, 300);
}

function startEvents() {
  if (stopEvents) return;
  stopEvents = followEvents(
    (e) => {
      window.__lockerEvents = (window.__lockerEvents || 0) + 1;
      if (current?.refresh && current.wants?.(e)) soon();
    },
    (state) => {
      fill(live, state === 'live' ? 'live' : 'offline');
      live.className = state === 'live' ? 'live on' : 'live';
      // Whatever happened between the page's first read and this stream's start (or, on
      // a first connect, before a Last-Event-ID existed) is read once, not polled for.
      if (state === 'live' && current?.refresh) soon();
    },
  );
}

signout.addEventListener('click', () => {
  auth.clear();
  stopEvents?.();
  stopEvents = null;
  location.hash = '#/';
  route();
});
window.addEventListener('locker-unauthorized', () => {
  if (!auth.key) return;
  auth.clear();
  toast('The key was refused (revoked?): sign in again.', true);
  route();
});
window.addEventListener('hashchange', route);
window.addEventListener('locker-signed-in', route);
route();
