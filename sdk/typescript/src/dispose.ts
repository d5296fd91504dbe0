/**
 * `Symbol.asyncDispose`, for `await using`: the runtime's, or (before Node 18.18) the
 * registry symbol that TypeScript's downlevel helper also looks for, installed once.
 */
export const asyncDispose: typeof Symbol.asyncDispose =
  (Symbol as { asyncDispose?: typeof Symbol.asyncDispose }).asyncDispose ??
  ((Symbol as { asyncDispose?: symbol }).asyncDispose = Symbol.for("Symbol.asyncDispose") as typeof Symbol.asyncDispose);
