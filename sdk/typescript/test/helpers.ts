// Shared by the tests: the client of the server under test (LOCKER_URL, LOCKER_API_KEY,
// set by tests/typescript_sdk.rs) and small waits.
import { Client } from "locker-sandbox";

export function client(): Client {
  if (!process.env.LOCKER_URL || !process.env.LOCKER_API_KEY) {
    throw new Error("LOCKER_URL and LOCKER_API_KEY name the server under test (tests/typescript_sdk.rs sets them)");
  }
  return new Client();
}

/** Polls `f` until it returns a truthy value, or fails after `ms`. */
export async function waitFor<T>(what: string, f: () => Promise<T | undefined | null | false>, ms = 15_000): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** A name no other test run uses. */
export function unique(prefix: string): string {
  return `${prefix}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}
