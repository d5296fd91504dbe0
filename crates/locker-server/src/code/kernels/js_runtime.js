'use strict';
/**
 * Locker's JavaScript / TypeScript runtime: notebook cells evaluated on the sandbox's Node
 * (18+, with Debian's `node-typescript` for the parser), state kept across cells.
 *
 * It is driven by runtime_kernel.py (a generic Jupyter wrapper kernel) and owns everything
 * language-specific: parsing, rewriting and evaluating cells, formatting results and errors.
 *
 * Start: `node js_runtime.cjs [--typescript]` (the wrapper writes this file under that
 * name, so Node loads it as CommonJS wherever it lies), cwd = the context's working
 * directory. The file is deleted once the runtime is ready: nothing here reads it again.
 *
 * Protocol (see runtime_kernel.py for the other side):
 * - fd 0 is /dev/null; fd 1 and 2 are pipes the wrapper publishes raw as the cell's stdout
 *   and stderr: `console.log` and `process.stdout.write` go there directly. Node writes to
 *   pipes synchronously on Linux only while they have room, so both are made blocking (and
 *   `done` waits for anything still queued): a cell's output precedes its `done`.
 * - fd 3: requests, JSON lines: {"id": N, "code": "...", "silent": bool}, one at a time.
 * - fd 4: events, JSON lines, written synchronously and only by this file:
 *     {"ready": true, "language": "javascript"|"typescript", "version": "<node version>"}
 *     (or {"ready": true, "error": "..."} and exit 3 when `typescript` cannot be loaded);
 *     then per request {"id": N, "display": {mime: data}} (none produced yet) and exactly one
 *     {"id": N, "done": true, "result": {mime: data}|null, "error": null|{ename, evalue, traceback}}.
 *   Both fds are reopened close-on-exec where possible, so that processes the user's code
 *   starts do not hold the protocol's pipes.
 * - SIGINT interrupts the running cell: error {"ename": "KeyboardInterrupt"}, state kept.
 *   The cell's synchronous start (up to its first await) is stopped by vm's
 *   `breakOnSigint`; a pending await ends the cell at once (what it awaited is abandoned).
 *   Not covered: JavaScript that never yields after an await or in a callback (it blocks
 *   the event loop, so no listener runs; only the wrapper's restart ends it). Terminating
 *   it from a watchdog thread (the inspector's Runtime.terminateExecution) was tried: on
 *   Node 18 it aborts the process inside timer callbacks and now and then drops a later
 *   cell's microtasks, which is worse than the restart. SIGINT never ends the runtime.
 *   End of fd 3: exit 0. `process.exit()` in a cell ends the runtime (the wrapper reports it).
 * - Errors that surface after their cell ended (a throwing timer, an unhandled rejection)
 *   are printed to stderr (shown in whatever cell runs then); they never end the runtime.
 *
 * Evaluation: a cell is parsed with the TypeScript compiler API (TypeScript cells are first
 * stripped of types by `ts.transpileModule`, ES2022/ESNext, values imports preserved), then
 * rewritten by text edits at node positions (line numbers kept) and run as the body of an
 * async function in the real global context (`vm.Script#runInThisContext`), so that top-level
 * `await` works and globals are the process's own. Rewriting rules, top-level statements:
 * - `const/let/var` declarations (destructuring included) become assignments to globals,
 *   pre-declared on `globalThis` (so a later cell may simply redeclare them); `var`s in
 *   top-level blocks and `for (var ...)` heads too; `let x;` resets x to undefined.
 * - `function f() {}` stays in place (hoisted) and is copied to `globalThis.f` before the
 *   cell's code runs; `class C {}` becomes `C = class C {}`.
 * - `import d, { a as b } from 'm'`, `import * as ns from 'm'`, `import 'm'` become awaited
 *   loads through this file's `import()` (vm code has no dynamic import on Node 18) of the
 *   module resolved from the cwd (builtins as such; a bare name through its package's
 *   `exports` with ESM conditions where it has some, else `require.resolve`), bound to
 *   globals: the default binding is the module's
 *   `default` (module.exports for CommonJS), named ones fall back to the default's
 *   properties. `import(x)` expressions anywhere call the same loader; `import.meta.url` is
 *   the cwd's URL. `export` keywords are dropped.
 * - The last top-level expression statement (only declarations may follow it) is the
 *   cell's value: undefined gives no result, a string is its own text/plain, anything else
 *   `util.inspect`'s; a promise (thenable) value is awaited first.
 * `require` is a global re-created from the cwd before each cell (module.createRequire).
 * Syntax errors are reported as SyntaxError (V8's message where V8 agrees, else the
 * parser's); thrown errors by their name, message and stack (frames of this file, of
 * node:internal and below the cell's last frame left out; the cell's frames are named
 * `<cell N>`, with the cell's line numbers, for TypeScript those of its transpiled form); a
 * thrown non-Error as ename "Error", evalue String(value).
 * Never any ANSI colour.
 */

const fs = require('fs');
const path = require('path');
const util = require('util');
const vm = require('vm');
const net = require('net');
const Module = require('module');
const { pathToFileURL } = require('url');

const TYPESCRIPT = process.argv.includes('--typescript');
const LANGUAGE = TYPESCRIPT ? 'typescript' : 'javascript';
const SELF = __filename;
// The hidden global through which compiled cells reach this file's helpers.
const HOOK = Symbol.for('locker.js_runtime');
// Local names of the cell wrapper (user code sees them as locals of the cell only).
const RESULT_VAR = '__locker_result__';
const HELPER_VAR = '__locker__';

// ---------------------------------------------------------------------------------------
// Protocol I/O.

/** The fd 4 events go to: a close-on-exec reopening of fd 4 where Linux allows it. */
let eventFd = 4;

/** Reopens a pipe `fd` through /proc (Node opens with O_CLOEXEC), closing the original;
 *  `fd` itself where that fails (not a pipe, no /proc, no reader). */
function reopenCloexec(fd, flags) {
  try {
    const fresh = fs.openSync(`/proc/self/fd/${fd}`, flags);
    fs.closeSync(fd);
    return fresh;
  } catch (_) {
    return fd;
  }
}

function sleepMs(ms) {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/** Writes one event line to fd 4, synchronously and whole. */
function emit(event) {
  const data = Buffer.from(JSON.stringify(event) + '\n', 'utf8');
  let off = 0;
  while (off < data.length) {
    try {
      off += fs.writeSync(eventFd, data, off, data.length - off);
    } catch (e) {
      if (e.code === 'EAGAIN') {
        sleepMs(1);
        continue;
      }
      if (e.code === 'EPIPE' || e.code === 'EBADF') process.exit(0); // the wrapper is gone
      throw e;
    }
  }
}

/** Calls `onLine` for each line of fd 3, `onEnd` at its end. */
function readRequests(onLine, onEnd) {
  let stream;
  // A pipe reopened non-blocking is read as a libuv pipe (close-on-exec, clean EOF);
  // anything else through the fs read stream.
  const fresh = reopenCloexec(3, fs.constants.O_RDONLY | fs.constants.O_NONBLOCK);
  if (fresh !== 3) {
    try {
      stream = new net.Socket({ fd: fresh, readable: true, writable: false });
    } catch (_) {
      stream = fs.createReadStream(null, { fd: fresh });
    }
  } else {
    stream = fs.createReadStream(null, { fd: 3 });
  }
  let partial = '';
  stream.setEncoding('utf8');
  stream.on('data', (chunk) => {
    const lines = (partial + chunk).split('\n');
    partial = lines.pop();
    for (const line of lines) if (line.trim()) onLine(line);
  });
  stream.on('end', () => {
    if (partial.trim()) onLine(partial);
    onEnd();
  });
  stream.on('error', onEnd);
}

// ---------------------------------------------------------------------------------------
// The TypeScript compiler (the parser, for both languages).

function loadTypeScript() {
  try {
    return require('typescript');
  } catch (_) {
    try {
      return Module.createRequire(path.join(process.cwd(), '/'))('typescript');
    } catch (_) {
      return null;
    }
  }
}

const ts = loadTypeScript();
const K = ts && ts.SyntaxKind;

// ---------------------------------------------------------------------------------------
// Module loading for rewritten imports.

const isBuiltin =
  Module.isBuiltin || ((s) => s.startsWith('node:') || Module.builtinModules.includes(s));

function cwdRequire() {
  return Module.createRequire(path.join(process.cwd(), '/'));
}

/** Resolves a package `exports` target for ESM conditions (string, array, conditions). */
function exportsTarget(target, star) {
  if (typeof target === 'string') return star === undefined ? target : target.split('*').join(star);
  if (Array.isArray(target)) {
    for (const t of target) {
      const r = exportsTarget(t, star);
      if (r) return r;
    }
    return null;
  }
  if (target && typeof target === 'object') {
    for (const [cond, t] of Object.entries(target)) {
      if (cond === 'import' || cond === 'node' || cond === 'default') {
        const r = exportsTarget(t, star);
        if (r) return r;
      }
    }
  }
  return null;
}

/** A bare specifier's file through its package's `exports` as Node's ESM resolver would
 *  (import/node/default conditions; exact and single-`*` subpaths), or null. */
function resolveEsmPackage(spec) {
  const parts = spec.split('/');
  const nameLen = spec.startsWith('@') ? 2 : 1;
  const name = parts.slice(0, nameLen).join('/');
  const sub = '.' + (parts.length > nameLen ? '/' + parts.slice(nameLen).join('/') : '');
  for (let dir = process.cwd(); ; dir = path.dirname(dir)) {
    const pkgDir = path.join(dir, 'node_modules', name);
    let pkg = null;
    try {
      pkg = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8'));
    } catch (_) {}
    if (pkg) {
      let exp = pkg.exports;
      if (exp === undefined) return null;
      if (typeof exp === 'string' || Array.isArray(exp) || !Object.keys(exp).some((k) => k.startsWith('.'))) {
        exp = { '.': exp };
      }
      let target = null;
      if (sub in exp) target = exportsTarget(exp[sub]);
      else {
        for (const [key, t] of Object.entries(exp)) {
          const star = key.indexOf('*');
          if (star < 0) continue;
          const pre = key.slice(0, star);
          const post = key.slice(star + 1);
          if (sub.startsWith(pre) && sub.endsWith(post) && sub.length >= pre.length + post.length) {
            target = exportsTarget(t, sub.slice(pre.length, sub.length - post.length));
            if (target) break;
          }
        }
      }
      return target ? path.join(pkgDir, target) : null;
    }
    if (path.dirname(dir) === dir) return null;
  }
}

/** `import(spec)` as if from a module in the cwd. */
async function importFromCwd(spec) {
  spec = String(spec);
  if (isBuiltin(spec) || /^(node|file|data):/.test(spec)) return import(spec);
  const relative = spec.startsWith('.') || path.isAbsolute(spec);
  if (!relative) {
    const file = resolveEsmPackage(spec);
    if (file) return import(pathToFileURL(file).href);
  }
  let file;
  try {
    file = cwdRequire().resolve(spec);
  } catch (e) {
    if (!relative) throw e;
    file = path.resolve(process.cwd(), spec); // an ESM file's own error, then
  }
  return isBuiltin(file) ? import(file) : import(pathToFileURL(file).href);
}

/** What compiled cells call (the wrapper's parameter HELPER_VAR). */
const helpers = {
  import: importFromCwd,
  default: (ns) => (ns && 'default' in ns ? ns.default : ns),
  named(ns, name) {
    if (name in ns) return ns[name];
    const d = ns.default;
    return d !== null && (typeof d === 'object' || typeof d === 'function') ? d[name] : undefined;
  },
  get importMeta() {
    return { url: pathToFileURL(path.join(process.cwd(), '/')).href };
  },
};
Object.defineProperty(globalThis, HOOK, { value: helpers, enumerable: false });

// ---------------------------------------------------------------------------------------
// Compiling a cell.

/** A syntax error in a cell: message and (1-based) line of the code it was found in. */
class CellSyntaxError extends Error {
  constructor({ message, line }) {
    super(message);
    this.line = line;
  }
}

/** Strips a TypeScript cell's types; JavaScript text (line numbers may move). */
function transpileTypeScript(code) {
  const out = ts.transpileModule(code, {
    fileName: 'cell.ts',
    reportDiagnostics: true,
    compilerOptions: {
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext,
      isolatedModules: true,
      preserveValueImports: true, // `import { a } from 'm'` is kept even when a looks unused
      moduleDetection: ts.ModuleDetectionKind.Force, // top-level await everywhere
      removeComments: false,
    },
  });
  const diag = (out.diagnostics || []).find((d) => d.file && d.category === ts.DiagnosticCategory.Error);
  if (diag) throw diagnosticError(diag);
  return out.outputText.replace(/\n\/\/# sourceMappingURL=.*\s*$/, '\n');
}

function diagnosticError(d) {
  const message = ts.flattenDiagnosticMessageText(d.messageText, '\n');
  if (!d.file || d.start === undefined) return new CellSyntaxError({ message, line: null });
  return new CellSyntaxError({ message, line: d.file.getLineAndCharacterOfPosition(d.start).line + 1 });
}

/** The names a binding (identifier or destructuring pattern) declares. */
function boundNames(name, out) {
  if (name.kind === K.Identifier) out.push(name.text);
  else if (name.kind === K.ObjectBindingPattern || name.kind === K.ArrayBindingPattern) {
    for (const el of name.elements) if (el.kind === K.BindingElement) boundNames(el.name, out);
  }
  return out;
}

function isVarList(list) {
  return (list.flags & (ts.NodeFlags.Let | ts.NodeFlags.Const)) === 0;
}

/**
 * Rewrites a cell (JavaScript) into a script for runInThisContext; returns
 * {script, globals}. Throws CellSyntaxError where the parser finds errors.
 */
function compileCell(code, filename) {
  const sf = ts.createSourceFile(
    'cell.js',
    code,
    {
      languageVersion: ts.ScriptTarget.Latest,
      impliedNodeFormat: ts.ModuleKind.ESNext,
      // A module: top-level await is parsed as such everywhere.
      setExternalModuleIndicator: (f) => {
        f.externalModuleIndicator = true;
      },
    },
    true,
    ts.ScriptKind.JS,
  );
  if (sf.parseDiagnostics && sf.parseDiagnostics.length) {
    throw v8SyntaxError(code, filename) || diagnosticError(sf.parseDiagnostics[0]);
  }

  const edits = []; // {start, end, text}, non-overlapping
  const globals = new Set(); // names pre-declared on globalThis
  const functions = []; // top-level function declarations, copied to globalThis first
  const edit = (start, end, text) => edits.push({ start, end, text });
  const newlines = (node) => '\n'.repeat((code.slice(node.getStart(sf), node.end).match(/\n/g) || []).length);
  let importCount = 0;

  // `export` / `export default` modifiers are dropped.
  const dropExport = (node) => {
    for (const m of node.modifiers || []) {
      if (m.kind === K.ExportKeyword || m.kind === K.DefaultKeyword) edit(m.getStart(sf), m.end, '');
    }
  };

  // `const a = 1, {b} = o` → `void ( a = 1, {b} = o);`
  const rewriteDeclarations = (stmt) => {
    const list = stmt.declarationList;
    const decls = list.declarations;
    if (!decls.length) return;
    const resets = !isVarList(list); // `let x;` means x = undefined; `var x;` keeps x
    const kwStart = list.getStart(sf);
    edit(kwStart, decls[0].getStart(sf), 'void (');
    for (const d of decls) {
      boundNames(d.name, []).forEach((n) => globals.add(n));
      if (!d.initializer && resets) edit(d.end, d.end, ' = undefined');
    }
    const last = decls[decls.length - 1];
    edit(last.end, last.end, code[stmt.end - 1] === ';' ? ')' : ');');
  };

  // `for (var i = 0; ...)` / `for (var x of xs)` → `for ( i = 0; ...)` / `for ( x of xs)`
  const rewriteForVar = (list) => {
    if (!list || list.kind !== K.VariableDeclarationList || !isVarList(list)) return;
    if (!list.declarations.length) return;
    for (const d of list.declarations) boundNames(d.name, []).forEach((n) => globals.add(n));
    edit(list.getStart(sf), list.declarations[0].getStart(sf), '');
  };

  // `var`s below the top level that are not in a function are the cell's (global) too.
  const visitBlockVars = (node) => {
    switch (node.kind) {
      case K.VariableStatement:
        if (isVarList(node.declarationList)) rewriteDeclarations(node);
        return;
      case K.ForStatement:
        rewriteForVar(node.initializer);
        break;
      case K.ForInStatement:
      case K.ForOfStatement:
        rewriteForVar(node.initializer);
        break;
      case K.FunctionDeclaration:
      case K.FunctionExpression:
      case K.ArrowFunction:
      case K.ClassDeclaration:
      case K.ClassExpression:
      case K.MethodDeclaration:
        return;
      default:
        break;
    }
    if (
      node.kind === K.Block ||
      node.kind === K.IfStatement ||
      node.kind === K.ForStatement ||
      node.kind === K.ForInStatement ||
      node.kind === K.ForOfStatement ||
      node.kind === K.WhileStatement ||
      node.kind === K.DoStatement ||
      node.kind === K.TryStatement ||
      node.kind === K.CatchClause ||
      node.kind === K.SwitchStatement ||
      node.kind === K.CaseBlock ||
      node.kind === K.CaseClause ||
      node.kind === K.DefaultClause ||
      node.kind === K.LabeledStatement
    ) {
      ts.forEachChild(node, (child) => {
        if (ts.isStatement(child) || ts.isBlock(child) || child.kind === K.CatchClause ||
            child.kind === K.CaseBlock || child.kind === K.CaseClause || child.kind === K.DefaultClause) {
          visitBlockVars(child);
        }
      });
    }
  };

  // `import d, {a as b} from 'm'` → `var __locker_m0__ = await __locker__.import('m'); void (d = ..., b = ...);`
  const rewriteImport = (stmt) => {
    const clause = stmt.importClause;
    const spec = JSON.stringify(stmt.moduleSpecifier.text);
    const tail = newlines(stmt);
    if (clause && clause.isTypeOnly) return edit(stmt.getStart(sf), stmt.end, tail);
    if (!clause) return edit(stmt.getStart(sf), stmt.end, `await ${HELPER_VAR}.import(${spec});${tail}`);
    const ns = `__locker_m${importCount++}__`;
    const binds = [];
    if (clause.name) binds.push([clause.name.text, `${HELPER_VAR}.default(${ns})`]);
    const nb = clause.namedBindings;
    if (nb && nb.kind === K.NamespaceImport) binds.push([nb.name.text, ns]);
    if (nb && nb.kind === K.NamedImports) {
      for (const el of nb.elements) {
        if (el.isTypeOnly) continue;
        const imported = (el.propertyName || el.name).text;
        binds.push([el.name.text, `${HELPER_VAR}.named(${ns}, ${JSON.stringify(imported)})`]);
      }
    }
    binds.forEach(([n]) => globals.add(n));
    const assigns = binds.map(([n, v]) => `${n} = ${v}`).join(', ');
    edit(
      stmt.getStart(sf),
      stmt.end,
      `var ${ns} = await ${HELPER_VAR}.import(${spec});` + (assigns ? ` void (${assigns});` : '') + tail,
    );
  };

  // The statement whose value is the cell's: the last one but trailing declarations.
  const declarationKinds = new Set([
    K.VariableStatement, K.FunctionDeclaration, K.ClassDeclaration, K.ImportDeclaration,
    K.ExportDeclaration, K.EmptyStatement, K.InterfaceDeclaration, K.TypeAliasDeclaration,
  ]);
  let valueStmt = null;
  for (let i = sf.statements.length - 1; i >= 0; i--) {
    const s = sf.statements[i];
    if (declarationKinds.has(s.kind)) continue;
    if (s.kind === K.ExpressionStatement || s.kind === K.ExportAssignment) valueStmt = s;
    break;
  }

  for (const stmt of sf.statements) {
    switch (stmt.kind) {
      case K.ImportDeclaration:
        rewriteImport(stmt);
        break;
      case K.ImportEqualsDeclaration: // `import x = require('m')`
        if (stmt.moduleReference.kind === K.ExternalModuleReference) {
          globals.add(stmt.name.text);
          edit(stmt.getStart(sf), stmt.moduleReference.getStart(sf), `void (${stmt.name.text} = `);
          edit(stmt.end, stmt.end, ');');
        }
        break;
      case K.ExportDeclaration: // `export { a }`, `export * from 'm'`: nothing to run
        edit(stmt.getStart(sf), stmt.end, newlines(stmt));
        break;
      case K.ExportAssignment: // `export default expr`
        edit(stmt.getStart(sf), stmt.expression.getStart(sf), '');
        break;
      case K.VariableStatement:
        dropExport(stmt);
        rewriteDeclarations(stmt);
        break;
      case K.FunctionDeclaration:
        dropExport(stmt);
        if (stmt.name && stmt.body) {
          globals.add(stmt.name.text);
          functions.push(stmt.name.text);
        } else if (!stmt.name) {
          edit(stmt.getStart(sf), stmt.getStart(sf), 'void ');
        }
        break;
      case K.ClassDeclaration:
        dropExport(stmt);
        if (stmt.name) {
          globals.add(stmt.name.text);
          edit(stmt.getStart(sf), stmt.getStart(sf), `void (${stmt.name.text} = `);
        } else {
          edit(stmt.getStart(sf), stmt.getStart(sf), 'void (');
        }
        edit(stmt.end, stmt.end, ');');
        break;
      default:
        visitBlockVars(stmt);
    }
    if (stmt === valueStmt) {
      const e = stmt.expression;
      edit(e.getStart(sf), e.getStart(sf), `${RESULT_VAR} = (`);
      edit(e.end, e.end, ')');
    }
  }

  // `import(x)` anywhere → the helper's; `import.meta` → the cwd's.
  const visitImports = (node) => {
    if (node.kind === K.CallExpression && node.expression.kind === K.ImportKeyword) {
      edit(node.expression.getStart(sf), node.expression.end, `${HELPER_VAR}.import`);
    } else if (node.kind === K.MetaProperty && node.keywordToken === K.ImportKeyword) {
      edit(node.getStart(sf), node.end, `${HELPER_VAR}.importMeta`);
      return;
    }
    ts.forEachChild(node, visitImports);
  };
  visitImports(sf);

  // Apply the edits in order (at one position: insertions first, then in the order made).
  const order = edits
    .map((e, i) => [e, i])
    .sort((a, b) => a[0].start - b[0].start || (a[0].end - a[0].start === 0 ? 0 : 1) - (b[0].end - b[0].start === 0 ? 0 : 1) || a[1] - b[1]);
  let body = '';
  let pos = 0;
  for (const [e] of order) {
    if (e.start < pos) continue; // overlapping: cannot happen with the rules above
    body += code.slice(pos, e.start) + e.text;
    pos = e.end;
  }
  body += code.slice(pos);

  const prologue = functions.map((f) => `globalThis[${JSON.stringify(f)}] = ${f};`).join(' ');
  // Line 1 of the cell is line 2 of the source: lineOffset -1 keeps user line numbers.
  const source =
    `(async function (${HELPER_VAR}) { let ${RESULT_VAR}; ${prologue}\n` +
    body +
    `\n;return { value: ${RESULT_VAR} };\n}).call(globalThis, globalThis[Symbol.for(${JSON.stringify(HOOK.description)})]);`;
  let script;
  try {
    script = new vm.Script(source, { filename, lineOffset: -1, displayErrors: false });
  } catch (e) {
    // The parser accepted the cell but V8 does not (TypeScript syntax in JavaScript, say).
    if (e && e.name === 'SyntaxError') {
      throw v8SyntaxError(code, filename) || new CellSyntaxError({ message: e.message, line: null });
    }
    throw e;
  }
  return { script, globals: [...globals] };
}

/** V8's view of a cell's syntax error (imports aside), or null. */
function v8SyntaxError(code, filename) {
  try {
    new vm.Script(`(async function () {\n${code}\n})`, { filename, lineOffset: -1 });
  } catch (e) {
    if (e && e.name === 'SyntaxError' && !/import|export/.test(e.message)) {
      // displayErrors puts "<filename>:<line>" first in the stack.
      const where = new RegExp(`^${escapeRegExp(filename)}:(\\d+)\n`).exec(e.stack || '');
      return new CellSyntaxError({ message: e.message, line: where ? Number(where[1]) : null });
    }
  }
  return null;
}

// ---------------------------------------------------------------------------------------
// Results and errors.

function formatResult(value) {
  if (value === undefined) return null;
  if (typeof value === 'string') return { 'text/plain': value };
  return { 'text/plain': util.inspect(value, { colors: false }) };
}

/** An error event's body for anything thrown in cell `filename`, of `source` (its code). */
function formatError(err, filename, source) {
  const lines = source.split('\n');
  if (err instanceof CellSyntaxError) {
    const traceback = [];
    if (err.line) traceback.push(`${filename}:${err.line}`, lines[err.line - 1] || '', '');
    traceback.push(`SyntaxError: ${err.message}`);
    return { ename: 'SyntaxError', evalue: err.message, traceback };
  }
  if (!(util.types.isNativeError(err) || err instanceof Error)) {
    let text;
    try {
      text = String(err);
    } catch (_) {
      text = util.inspect(err);
    }
    return { ename: 'Error', evalue: text, traceback: [`Uncaught ${util.inspect(err, { colors: false })}`] };
  }
  let ename = 'Error';
  let evalue = '';
  let stack = '';
  try {
    ename = String(err.name || 'Error');
    evalue = String(err.message === undefined ? '' : err.message);
    stack = typeof err.stack === 'string' ? err.stack : `${ename}: ${evalue}`;
  } catch (_) {}
  // Frames: the cell's (but its wrapper's first and last lines), and those of what it
  // called; not this file's, node:internal's, nor any below the cell's last frame (this
  // runtime's event plumbing).
  const cellFrame = new RegExp(`${escapeRegExp(filename)}:(\\d+):\\d+`);
  let traceback = stack.split('\n');
  const isFrame = (line) => /^\s+at /.test(line);
  let lastCell = -1;
  traceback.forEach((line, i) => {
    if (isFrame(line) && cellFrame.test(line)) lastCell = i;
  });
  traceback = traceback.filter((line, i) => {
    if (!isFrame(line)) return true;
    if (lastCell >= 0 && i > lastCell) return false;
    if (line.includes(SELF) || line.includes('node:internal')) return false;
    const m = cellFrame.exec(line);
    return !(m && (Number(m[1]) < 1 || Number(m[1]) > lines.length));
  });
  return { ename, evalue, traceback };
}

function escapeRegExp(s) {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

// ---------------------------------------------------------------------------------------
// Running cells.

const queue = [];
let current = null; // the running cell: {id, silent, filename, source, finished}
let cellCount = 0;
let requireCwd = null;

function interruptError() {
  return { ename: 'KeyboardInterrupt', evalue: 'interrupted', traceback: ['KeyboardInterrupt: interrupted'] };
}

/** Ends the running cell (once), once its output is out, and starts the next queued one. */
function finish(cell, result, error) {
  if (cell.finished) return;
  cell.finished = true;
  afterOutput(() => {
    emit({ id: cell.id, done: true, result: error || cell.silent ? null : result, error: error || null });
    if (current === cell) current = null;
    setImmediate(pump);
  });
}

/** Calls `then` when stdout and stderr hold nothing unwritten (they are made blocking at
 *  start, so this waits only where that failed). */
function afterOutput(then) {
  for (const stream of [process.stdout, process.stderr]) {
    if (stream.writableLength > 0 && !stream.destroyed) {
      stream.once('drain', () => afterOutput(then));
      return;
    }
  }
  then();
}

function pump() {
  if (current || !queue.length) return;
  const req = queue.shift();
  const cell = { id: req.id, silent: !!req.silent, filename: `<cell ${++cellCount}>`, source: '', finished: false };
  current = cell;
  try {
    runCell(cell, typeof req.code === 'string' ? req.code : '');
  } catch (e) {
    // Not the cell's code: this runtime's own trouble (a cwd that is gone, say).
    finish(cell, null, formatError(e, cell.filename, cell.source));
  }
}

function runCell(cell, code) {
  let compiled;
  cell.source = code; // what error lines refer to: the cell, then its JavaScript
  try {
    if (TYPESCRIPT) cell.source = transpileTypeScript(code);
    compiled = compileCell(cell.source, cell.filename);
  } catch (e) {
    return finish(cell, null, formatError(e, cell.filename, cell.source));
  }
  // Globals the cell binds exist beforehand (assignments work in strict code too).
  for (const name of compiled.globals) {
    if (!(name in globalThis)) globalThis[name] = undefined;
  }
  // `require` from the cwd (which a cell may change).
  const cwd = process.cwd();
  if (!requireCwd || requireCwd.cwd !== cwd) requireCwd = { cwd, require: cwdRequire() };
  globalThis.require = requireCwd.require;

  let promise;
  try {
    promise = compiled.script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  } catch (e) {
    if (e && e.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') return finish(cell, null, interruptError());
    return finish(cell, null, formatError(e, cell.filename, cell.source));
  }
  promise
    .then(async ({ value }) => {
      if (value !== null && (typeof value === 'object' || typeof value === 'function') &&
          typeof value.then === 'function') {
        value = await value;
      }
      if (!cell.finished) finish(cell, formatResult(value), null);
    })
    .catch((e) => {
      if (!cell.finished) finish(cell, null, formatError(e, cell.filename, cell.source));
    });
}

// ---------------------------------------------------------------------------------------
// Start.

function printLate(prefix, err) {
  try {
    const text = util.types.isNativeError(err) || err instanceof Error
      ? err.stack || String(err)
      : util.inspect(err, { colors: false });
    process.stderr.write(`${prefix} ${text}\n`);
  } catch (_) {}
}

function main() {
  eventFd = reopenCloexec(4, fs.constants.O_WRONLY | fs.constants.O_NONBLOCK);
  if (!ts) {
    emit({ ready: true, error: 'the typescript module cannot be loaded (install node-typescript)' });
    process.exit(3);
  }
  // Never colours, whatever the environment says.
  util.inspect.defaultOptions.colors = false;
  // Pipes on Linux are written synchronously only while they have room: blocking writes
  // keep every byte of a cell's output before its `done`.
  for (const stream of [process.stdout, process.stderr]) {
    try {
      if (stream._handle && typeof stream._handle.setBlocking === 'function') stream._handle.setBlocking(true);
    } catch (_) {}
  }

  process.on('uncaughtException', (err) => printLate('Uncaught', err));
  process.on('unhandledRejection', (err) => printLate('Uncaught (in promise)', err));
  process.on('SIGINT', () => {
    // A cell's synchronous start is stopped by breakOnSigint; here: a cell awaiting something.
    if (current && !current.finished) finish(current, null, interruptError());
  });

  readRequests(
    (line) => {
      let req;
      try {
        req = JSON.parse(line);
      } catch (_) {
        return; // not the protocol's
      }
      if (!req || typeof req !== 'object' || req.id === undefined) return;
      queue.push(req);
      pump();
    },
    () => process.exit(0),
  );
  emit({ ready: true, language: LANGUAGE, version: process.versions.node });
}

main();
