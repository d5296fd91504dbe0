/**
 * Typed errors: every HTTP error of the Locker API becomes one `LockerError` subclass that
 * carries the server's `status`, `code` and `message`; a server that cannot be reached is
 * a `ConnectionError` (status 0, code `unreachable`). A command that fails inside a sandbox
 * is never an error: it is an `ExecResult` that says so.
 *
 * This module owns the mapping from the API's error shape to classes; it performs no I/O.
 */

/** Any failure of the Locker platform (never of the command you ran). */
export class LockerError extends Error {
  /** The HTTP status, or 0 when no answer arrived. */
  readonly status: number;
  /** The server's machine-readable code (`not_found`, `conflict`, …). */
  readonly code: string;

  constructor(status: number, code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
  }
}

/** 400 `bad_request`: the request is wrong; the message says what to fix. */
export class BadRequest extends LockerError {}
/** 401 `unauthorized`: no API key, or a wrong or revoked one. */
export class Unauthorized extends LockerError {}
/** 403 `forbidden`: the key's tenant may not do this. */
export class Forbidden extends LockerError {}
/** 404 `not_found`: no such resource for this tenant (or it ended; the message says when). */
export class NotFound extends LockerError {}
/** 405 `method_not_allowed`. */
export class MethodNotAllowed extends LockerError {}
/** 409 `conflict`: the resource's state forbids this now (a mounted volume, a failed sandbox…). */
export class Conflict extends LockerError {}
/** 413 `payload_too_large`: a full disk or volume, a listing past its bounds. */
export class PayloadTooLarge extends LockerError {}
/** 422 `unprocessable`: valid, but this host cannot hold it (free disk space). */
export class Unprocessable extends LockerError {}
/** 429 `quota_exceeded`: a tenant quota, or the machine out of processes or memory. */
export class QuotaExceeded extends LockerError {}
/** 500 `internal`. */
export class InternalError extends LockerError {}
/** 502 `bad_gateway`: nothing listens on a sandbox's port, or its answer cannot be relayed. */
export class BadGateway extends LockerError {}
/** 503 `unavailable`: a runtime or the default template is not usable yet; the message says why. */
export class Unavailable extends LockerError {}
/** No answer: the server is down, unreachable, or the connection broke. */
export class ConnectionError extends LockerError {}

const BY_STATUS: Record<number, typeof LockerError> = {
  400: BadRequest,
  401: Unauthorized,
  403: Forbidden,
  404: NotFound,
  405: MethodNotAllowed,
  409: Conflict,
  413: PayloadTooLarge,
  422: Unprocessable,
  429: QuotaExceeded,
  500: InternalError,
  502: BadGateway,
  503: Unavailable,
};

/** The error for an HTTP answer `status` whose body is `raw` (the API's error JSON, or anything). */
export function errorFromResponse(status: number, raw: string): LockerError {
  const Cls = BY_STATUS[status] ?? LockerError;
  try {
    const e = (JSON.parse(raw) as { error?: { code?: unknown; message?: unknown } }).error;
    if (e && typeof e === "object") {
      return new Cls(status, String(e.code ?? "http_error"), String(e.message ?? `HTTP ${status}`));
    }
  } catch {
    // Not the API's JSON (a proxy's page, say): its text is the message.
  }
  return new Cls(status, "http_error", raw.slice(0, 500) || `HTTP ${status}`);
}

/** The error an NDJSON stream ended with (`{"type":"error","error":{…}}`), after a 200. */
export function errorFromEvent(status: number, e: { code?: unknown; message?: unknown } | undefined): LockerError {
  const code = String(e?.code ?? "internal");
  const byCode: Record<string, number> = {
    bad_request: 400, unauthorized: 401, forbidden: 403, not_found: 404, conflict: 409,
    payload_too_large: 413, unprocessable: 422, quota_exceeded: 429, internal: 500,
    bad_gateway: 502, unavailable: 503,
  };
  const Cls = BY_STATUS[byCode[code] ?? status] ?? LockerError;
  return new Cls(byCode[code] ?? status, code, String(e?.message ?? "the stream failed"));
}
