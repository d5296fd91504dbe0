/*
 * JShellRuntime: the Java language runtime of Locker's code interpreter.
 *
 * WHAT THIS FILE OWNS
 *   Evaluating Java notebook cells with persistent state (variables, methods,
 *   classes, imports) through the jdk.jshell API, in the same JVM (JShell's
 *   "local" execution engine, no second JVM). It is driven by the generic
 *   Python Jupyter wrapper kernel (runtime_kernel.py, same folder), which owns
 *   everything Jupyter-facing; this program only speaks the small line
 *   protocol below. Semantics follow IJava (the Java kernel of E2B's code
 *   interpreter) where E2B's tests look: stdout arrives one event per write
 *   call, String results are given raw (not quoted), env vars are visible as
 *   System properties, runtime errors are named after the exception's simple
 *   class name.
 *
 * HOW TO RUN
 *   java <JVM flags> --source 17 JShellRuntime.java   (fd 3, fd 4 open; see below)
 *   Recommended JVM flags (the wrapper passes them):
 *     -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto
 *     -Dfile.encoding=UTF-8 -Dstdout.encoding=UTF-8 -Dstderr.encoding=UTF-8
 *   Measured launch -> "ready" (Debian bookworm, openjdk 17.0.x, busy 2-CPU
 *   host): no flags ~1.05 s (2.9 s on one CPU); TieredStopAtLevel=1 ~0.75 s
 *   (1.7 s on one CPU); + SerialGC a little less. TieredStopAtLevel=1 (C1
 *   only) costs peak speed of long, hot user loops; drop it if that matters
 *   more than startup. -Xint is much worse (3.5 s). Optional, for slow VMs: a
 *   dynamic AppCDS archive made once per image by one run with
 *   -XX:ArchiveClassesAtExit=/path/jshell.jsa (ready, one cell, EOF), then
 *   -XX:SharedArchiveFile=/path/jshell.jsa: ~1.2 s instead of ~1.7 s on one
 *   CPU. The source launcher's own compile of this file is ~0.5 s of the
 *   total (a precompiled class would save it). -XX:CICompilerCount=1 helps a
 *   bit on one CPU but is an error without TieredStopAtLevel=1.
 *   stdout/stderr of user code are UTF-8 whatever the locale (explicit
 *   PrintStreams); file.encoding only sets the default charset of user code.
 *   This file is pure ASCII on purpose: the source launcher reads it with the
 *   platform charset, which may be POSIX/ASCII in a sandbox. (Never put a
 *   backslash followed by "u" in it, even in a comment.)
 *
 * THE PROTOCOL (runtime side)
 *   cwd: the context's working directory; environment inherited.
 *   fd 0: /dev/null. fd 1 / fd 2: pipes the wrapper streams raw to the current
 *   cell (child processes' output, anything written outside a cell).
 *   fd 3: requests, one JSON object per line:
 *       {"id": N, "code": "...", "silent": false}      (one at a time)
 *   fd 4: events, one JSON object per line, each written atomically:
 *       {"ready": true, "language": "java", "version": "17.0.x"}   once, at start
 *       {"id": N, "stream": "stdout"|"stderr", "text": "..."}     one per write
 *             call by user code on System.out / System.err (so println gives
 *             two events: the text, then the line separator)
 *       {"id": N, "done": true, "result": {"text/plain": "..."} | null,
 *        "error": null | {"ename": "...", "evalue": "...", "traceback": [...]}}
 *             exactly one per request, after all of its stream events.
 *   The wrapper may delete this source file after "ready": it is never re-read.
 *   SIGINT (from the wrapper) stops the running cell (JShell.stop(), i.e.
 *   Thread.stop of the cell's thread group: works for busy loops and sleeps on
 *   Java 17); the cell ends with error KeyboardInterrupt / "interrupted" and
 *   all state is kept. SIGINT never exits the JVM. EOF on fd 3: exit 0.
 *   "silent" is accepted and ignored (the wrapper decides what to publish).
 *
 * EVALUATION
 *   A cell is split into snippets with SourceCodeAnalysis.analyzeCompletion;
 *   each is evaluated in order with JShell.eval, stopping at the first failure
 *   (a trailing incomplete snippet fails after the complete ones ran, as in
 *   IJava). The result is the value of the last snippet when it is a non-void
 *   expression, a bare variable name included; as in IJava, assignments,
 *   declarations and statements give none. Strings and chars are rendered
 *   raw (whatever the static type: the raw value is read from the REPL
 *   variable), null as "null", other values as JShell renders them
 *   (toString; arrays as "int[3] { 1, 2, 3 }", where IJava would print
 *   "[I@1b6d3586").
 *   Errors: compile errors (REJECTED, or RECOVERABLE_NOT_DEFINED) -> ename
 *   CompilationException, evalue = diagnostics, traceback = diagnostics with
 *   the offending line and a caret; exceptions -> ename = simple class name
 *   (ArithmeticException), evalue = message, traceback = "java.lang.X: msg",
 *   tab-"at ..." frames (JShell's own frames cut; snippet frames read
 *   "(#12:1)") and "Caused by:" chains; calls into methods with missing
 *   dependencies -> UnresolvedReferenceException; incomplete input ->
 *   IncompleteSourceException "incomplete statement"; SIGINT ->
 *   KeyboardInterrupt "interrupted".
 *   At start every environment variable is copied into a System property of
 *   the same name unless one exists, and the default imports of the jshell
 *   tool (java.util.*, java.io.*, ...) are evaluated, which also warms up the
 *   compiler before "ready" (first cell then takes ~0.05-0.15 s).
 *   Output written by user code outside any cell (a background thread after
 *   its cell ended) goes raw to fd 1 / fd 2.
 *   System.exit(n) in a cell exits the JVM with n (output written so far is
 *   flushed; no "done" is sent): the wrapper notices the exit.
 *   Known limits: code that catches ThreadDeath in a loop cannot be stopped
 *   (it is re-stopped every 25 ms until the cell ends); uncaught exceptions of
 *   background threads are swallowed by JShell's local engine.
 */

import java.io.BufferedReader;
import java.io.FileDescriptor;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.DeclarationSnippet;
import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.ExpressionSnippet;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.VarSnippet;
import jdk.jshell.execution.LocalExecutionControl;
import jdk.jshell.spi.ExecutionControl;
import jdk.jshell.spi.ExecutionControlProvider;
import jdk.jshell.spi.ExecutionEnv;

public class JShellRuntime {

    // ------------------------------------------------------------------ state

    /** fd 4: the event channel. */
    static OutputStream events;
    static final Object EVENT_LOCK = new Object();

    /** Guards cellRunning / interruptRequested. */
    static final Object STATE_LOCK = new Object();
    static boolean cellRunning = false;
    static volatile boolean interruptRequested = false;
    /** Id of the cell being evaluated (null between cells): stream events carry it. */
    static volatile Object currentId = null;

    static JShell jshell;
    static RawLocalExecutionControl control;
    static CellStream outStream;
    static CellStream errStream;
    static PrintStream userOut;
    static PrintStream userErr;

    static final String[] DEFAULT_IMPORTS = {
        "import java.io.*;",
        "import java.math.*;",
        "import java.net.*;",
        "import java.nio.file.*;",
        "import java.util.*;",
        "import java.util.concurrent.*;",
        "import java.util.function.*;",
        "import java.util.prefs.*;",
        "import java.util.regex.*;",
        "import java.util.stream.*;",
    };

    // ------------------------------------------------------------------- main

    public static void main(String[] args) throws Exception {
        events = new FileOutputStream("/proc/self/fd/4");
        BufferedReader requests = new BufferedReader(new InputStreamReader(
                new FileInputStream("/proc/self/fd/3"), StandardCharsets.UTF_8));

        // Environment variables as System properties (IJava/E2B behaviour).
        for (Map.Entry<String, String> e : System.getenv().entrySet()) {
            if (e.getKey().isEmpty()) continue;
            try {
                if (System.getProperty(e.getKey()) == null) System.setProperty(e.getKey(), e.getValue());
            } catch (RuntimeException ignored) {
                // odd names: skip
            }
        }

        // User-visible System.out / System.err: one event per write call.
        PrintStream rawOut = new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);
        PrintStream rawErr = new PrintStream(new FileOutputStream(FileDescriptor.err), true, StandardCharsets.UTF_8);
        outStream = new CellStream("stdout", rawOut);
        errStream = new CellStream("stderr", rawErr);
        // Anonymous subclasses on purpose: for the exact class PrintStream, Java 17's
        // println(String) writes text and line separator in one write call; a
        // subclass takes the print(s) + newLine() path, i.e. two writes, as IJava.
        userOut = new PrintStream(outStream, true, StandardCharsets.UTF_8) { };
        userErr = new PrintStream(errStream, true, StandardCharsets.UTF_8) { };
        System.setOut(userOut);
        System.setErr(userErr);

        control = new RawLocalExecutionControl();
        jshell = JShell.builder()
                .executionEngine(new ExecutionControlProvider() {
                    @Override public String name() { return "locker-local"; }
                    @Override public ExecutionControl generate(ExecutionEnv env, Map<String, String> params) {
                        return control;
                    }
                }, Map.of())
                .out(rawOut)
                .err(rawErr)
                .build();

        installSigint();
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            // System.exit from a cell: do not lose what was written so far.
            try {
                userOut.flush();
                userErr.flush();
                outStream.flushPending();
                errStream.flushPending();
            } catch (Throwable ignored) {
            }
        }));

        // Default imports of the jshell tool; also warms up the compiler.
        jshell.eval(String.join(" ", DEFAULT_IMPORTS));

        Map<String, Object> ready = new LinkedHashMap<>();
        ready.put("ready", Boolean.TRUE);
        ready.put("language", "java");
        ready.put("version", System.getProperty("java.version"));
        emit(ready);

        String line;
        while ((line = requests.readLine()) != null) {
            if (line.isBlank()) continue;
            Map<String, Object> req;
            try {
                Object parsed = new Json(line).parseTop();
                if (!(parsed instanceof Map)) throw new IllegalArgumentException("not an object");
                @SuppressWarnings("unchecked") Map<String, Object> m = (Map<String, Object>) parsed;
                req = m;
            } catch (RuntimeException e) {
                rawErr.println("JShellRuntime: bad request line: " + e.getMessage());
                continue;
            }
            Object id = req.get("id");
            Object code = req.get("code");
            runRequest(id, code instanceof String ? (String) code : "");
        }
        userOut.flush();
        userErr.flush();
        System.exit(0);
    }

    // ------------------------------------------------------------ one request

    static void runRequest(Object id, String code) {
        synchronized (STATE_LOCK) {
            interruptRequested = false;
            cellRunning = true;
        }
        currentId = id;
        Map<String, Object> result = null;
        Map<String, Object> error = null;
        try {
            Outcome o = evalCell(code);
            result = o.result;
            error = o.error;
        } catch (Throwable t) {
            error = errorOf(t.getClass().getSimpleName(), String.valueOf(t.getMessage()),
                    List.of(t.toString()));
        }
        synchronized (STATE_LOCK) {
            cellRunning = false;
            if (interruptRequested && error == null) {
                error = keyboardInterrupt();
                result = null;
            }
            interruptRequested = false;
        }
        try {
            userOut.flush();
            userErr.flush();
        } catch (Throwable ignored) {
        }
        outStream.flushPending();
        errStream.flushPending();
        currentId = null;

        Map<String, Object> done = new LinkedHashMap<>();
        done.put("id", id);
        done.put("done", Boolean.TRUE);
        done.put("result", result);
        done.put("error", error);
        emit(done);
    }

    static final class Outcome {
        Map<String, Object> result;
        Map<String, Object> error;
    }

    static Outcome evalCell(String code) {
        Outcome out = new Outcome();
        SourceCodeAnalysis sca = jshell.sourceCodeAnalysis();
        String rest = code;
        while (true) {
            if (interruptRequested) {
                out.result = null;
                out.error = keyboardInterrupt();
                return out;
            }
            if (rest.isBlank()) return out;
            SourceCodeAnalysis.CompletionInfo ci = sca.analyzeCompletion(rest);
            String source;
            switch (ci.completeness()) {
                case EMPTY:
                    return out;
                case DEFINITELY_INCOMPLETE:
                case CONSIDERED_INCOMPLETE: {
                    String text = rest.strip();
                    List<String> tb = new ArrayList<>();
                    tb.add("IncompleteSourceException: incomplete statement");
                    for (String l : text.split("\n", -1)) tb.add("    " + l);
                    out.result = null;
                    out.error = errorOf("IncompleteSourceException", "incomplete statement", tb);
                    return out;
                }
                default:
                    source = ci.source();
            }
            rest = ci.remaining() == null ? "" : ci.remaining();
            if (source == null || source.isBlank()) {
                if (rest.isBlank()) return out;
                continue;
            }
            List<SnippetEvent> evs = jshell.eval(source);
            out.result = null;
            for (SnippetEvent ev : evs) {
                if (ev.causeSnippet() != null) continue; // updates of dependents
                if (interruptRequested) {
                    out.error = keyboardInterrupt();
                    return out;
                }
                Map<String, Object> err = errorOfEvent(ev);
                if (err != null) {
                    out.error = err;
                    return out;
                }
                out.result = resultOf(ev);
            }
            if (interruptRequested) {
                out.result = null;
                out.error = keyboardInterrupt();
                return out;
            }
        }
    }

    // ----------------------------------------------------------------- result

    static Map<String, Object> resultOf(SnippetEvent ev) {
        Snippet s = ev.snippet();
        // As IJava: only expressions give a result (not assignments, not declarations).
        if (s == null || !s.subKind().hasValue()
                || s.subKind() == Snippet.SubKind.ASSIGNMENT_SUBKIND) {
            return null;
        }
        String type;
        VarSnippet var = null;
        if (s instanceof VarSnippet) {
            if (s.subKind() != Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND) return null;
            var = (VarSnippet) s;
            type = var.typeName();
        } else if (s instanceof ExpressionSnippet) {
            ExpressionSnippet es = (ExpressionSnippet) s;
            type = es.typeName();
            // bare variable name: fetch the variable's raw value
            String name = es.name();
            if (name != null && s.subKind() == Snippet.SubKind.VAR_VALUE_SUBKIND) {
                var = jshell.variables()
                        .filter(v -> v.name().equals(name) && jshell.status(v).isActive())
                        .reduce((a, b) -> b).orElse(null);
            }
        } else {
            return null;
        }
        if (type == null || type.equals("void")) return null;
        String text = ev.value();
        Object raw = null;
        boolean haveRaw = false;
        if (var != null) {
            try {
                synchronized (control) {
                    control.captured = false;
                    jshell.varValue(var);
                    if (control.captured) {
                        raw = control.capturedValue;
                        haveRaw = true;
                    }
                }
            } catch (Throwable ignored) {
            }
        }
        if (haveRaw) {
            if (raw == null) text = "null";
            else if (raw instanceof String) text = (String) raw;
            else if (raw instanceof Character) text = raw.toString();
        } else if (text != null && (type.equals("String") || type.equals("java.lang.String"))) {
            text = unquoteJavaLiteral(text);
        } else if (text != null && (type.equals("char") || type.equals("Character")
                || type.equals("java.lang.Character"))) {
            text = unquoteJavaLiteral(text);
        }
        if (text == null) text = "null";
        Map<String, Object> bundle = new LinkedHashMap<>();
        bundle.put("text/plain", text);
        return bundle;
    }

    /** Undo DirectExecutionControl.valueString's quoting of a String / char. */
    static String unquoteJavaLiteral(String lit) {
        if (lit.length() < 2) return lit;
        char q = lit.charAt(0);
        if ((q != '"' && q != '\'') || lit.charAt(lit.length() - 1) != q) return lit;
        String body = lit.substring(1, lit.length() - 1);
        StringBuilder sb = new StringBuilder(body.length());
        for (int i = 0; i < body.length(); i++) {
            char c = body.charAt(i);
            if (c != '\\' || i + 1 >= body.length()) {
                sb.append(c);
                continue;
            }
            char n = body.charAt(++i);
            switch (n) {
                case 'b': sb.append('\b'); break;
                case 't': sb.append('\t'); break;
                case 'n': sb.append('\n'); break;
                case 'f': sb.append('\f'); break;
                case 'r': sb.append('\r'); break;
                case 's': sb.append(' '); break;
                case '"': sb.append('"'); break;
                case '\'': sb.append('\''); break;
                case '\\': sb.append('\\'); break;
                case 'u': {
                    int j = i;
                    while (j < body.length() && body.charAt(j) == 'u') j++;
                    if (j + 4 <= body.length()) {
                        try {
                            sb.append((char) Integer.parseInt(body.substring(j, j + 4), 16));
                            i = j + 3;
                            break;
                        } catch (NumberFormatException ignored) {
                        }
                    }
                    sb.append('\\').append(n);
                    break;
                }
                default:
                    if (n >= '0' && n <= '7') {
                        int v = n - '0';
                        int max = n <= '3' ? 2 : 1;
                        for (int k = 0; k < max && i + 1 < body.length()
                                && body.charAt(i + 1) >= '0' && body.charAt(i + 1) <= '7'; k++) {
                            v = v * 8 + (body.charAt(++i) - '0');
                        }
                        sb.append((char) v);
                    } else {
                        sb.append('\\').append(n);
                    }
            }
        }
        return sb.toString();
    }

    // ----------------------------------------------------------------- errors

    static Map<String, Object> errorOf(String ename, String evalue, List<String> traceback) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("ename", ename);
        e.put("evalue", evalue);
        e.put("traceback", new ArrayList<Object>(traceback));
        return e;
    }

    static Map<String, Object> keyboardInterrupt() {
        return errorOf("KeyboardInterrupt", "interrupted", List.of("KeyboardInterrupt: interrupted"));
    }

    static Map<String, Object> errorOfEvent(SnippetEvent ev) {
        JShellException ex = ev.exception();
        if (ex != null) return errorOfException(ex);
        Snippet s = ev.snippet();
        Snippet.Status st = ev.status();
        if (st == Snippet.Status.REJECTED) return compileError(s);
        if (st == Snippet.Status.RECOVERABLE_NOT_DEFINED && s instanceof DeclarationSnippet) {
            Map<String, Object> e = compileError(s);
            String deps = jshell.unresolvedDependencies((DeclarationSnippet) s)
                    .collect(Collectors.joining(", "));
            if (!deps.isEmpty()) {
                String msg = describe(s) + " cannot be defined until " + deps + " is declared";
                @SuppressWarnings("unchecked") List<Object> tb = (List<Object>) e.get("traceback");
                tb.add(0, msg);
                String ev0 = (String) e.get("evalue");
                e.put("evalue", ev0.isEmpty() ? msg : msg + "\n" + ev0);
            }
            return e;
        }
        return null;
    }

    static String describe(Snippet s) {
        String kind;
        switch (s.subKind()) {
            case CLASS_SUBKIND: kind = "class"; break;
            case INTERFACE_SUBKIND: kind = "interface"; break;
            case ENUM_SUBKIND: kind = "enum"; break;
            case RECORD_SUBKIND: kind = "record"; break;
            case ANNOTATION_TYPE_SUBKIND: kind = "@interface"; break;
            case METHOD_SUBKIND: kind = "method"; break;
            default: kind = "variable";
        }
        String name = s instanceof DeclarationSnippet ? ((DeclarationSnippet) s).name() : "";
        return kind + " " + name;
    }

    static Map<String, Object> compileError(Snippet s) {
        List<String> tb = new ArrayList<>();
        List<String> msgs = new ArrayList<>();
        String src = s == null ? "" : s.source();
        List<Diag> diags = s == null ? List.of() : jshell.diagnostics(s).collect(Collectors.toList());
        boolean anyError = diags.stream().anyMatch(Diag::isError);
        for (Diag d : diags) {
            if (anyError && !d.isError()) continue;
            // "location: class " names JShell's anonymous wrapper: drop it
            String msg = d.getMessage(Locale.ENGLISH).lines()
                    .map(String::stripTrailing)
                    .filter(l -> !l.strip().equals("location: class"))
                    .collect(Collectors.joining("\n"));
            msgs.add(msg);
            tb.add((d.isError() ? "Error: " : "Warning: ") + msg.split("\n", -1)[0]);
            String[] more = msg.split("\n", -1);
            for (int i = 1; i < more.length; i++) tb.add(more[i]);
            long pos = d.getPosition();
            if (pos >= 0 && pos <= src.length()) {
                int p = (int) pos;
                int ls = src.lastIndexOf('\n', p - 1) + 1;
                int le = src.indexOf('\n', p);
                if (le < 0) le = src.length();
                String lineText = src.substring(ls, le);
                tb.add(lineText);
                long start = d.getStartPosition();
                long end = d.getEndPosition();
                int col = p - ls;
                StringBuilder caret = new StringBuilder();
                int from = (start >= ls && start <= p) ? (int) (start - ls) : col;
                int to = (end > p && end <= le) ? (int) (end - ls) - 1 : col;
                for (int i = 0; i < from; i++) caret.append(lineText.charAt(i) == '\t' ? '\t' : ' ');
                for (int i = from; i <= Math.max(to, col); i++) {
                    caret.append(i == from || i == to || i == col ? '^' : '-');
                }
                tb.add(caret.toString());
            }
        }
        if (msgs.isEmpty() && s != null && ev0Rejected(s)) {
            msgs.add("compilation failed");
            tb.add("Error: compilation failed");
            tb.add(src);
        }
        return errorOf("CompilationException", String.join("\n", msgs), tb);
    }

    static boolean ev0Rejected(Snippet s) {
        return jshell.status(s) == Snippet.Status.REJECTED;
    }

    static Map<String, Object> errorOfException(JShellException ex) {
        if (ex instanceof UnresolvedReferenceException) {
            DeclarationSnippet ds = ((UnresolvedReferenceException) ex).getSnippet();
            String deps = jshell.unresolvedDependencies(ds).collect(Collectors.joining(", "));
            String msg = "Attempted to use " + describe(ds) + " which cannot be invoked until "
                    + (deps.isEmpty() ? "its dependencies are" : deps + " is") + " declared";
            return errorOf("UnresolvedReferenceException", msg,
                    List.of("UnresolvedReferenceException: " + msg));
        }
        String cls = ex instanceof EvalException
                ? cleanClassName(((EvalException) ex).getExceptionClassName())
                : ex.getClass().getName();
        String message = ex.getMessage();
        List<String> tb = new ArrayList<>();
        appendTrace(tb, ex, cls, message, "");
        String simple = cls.substring(Math.max(cls.lastIndexOf('.'), cls.lastIndexOf('$')) + 1);
        return errorOf(simple, message == null ? "" : message, tb);
    }

    static void appendTrace(List<String> tb, Throwable t, String cls, String message, String prefix) {
        tb.add(prefix + cls + (message == null ? "" : ": " + message));
        StackTraceElement[] st = t.getStackTrace();
        int last = -1;
        for (int i = 0; i < st.length; i++) {
            String c = st[i].getClassName();
            if (c.isEmpty() || c.startsWith("REPL.")) last = i;
        }
        int n = last >= 0 ? last + 1 : st.length;
        for (int i = 0; i < n; i++) {
            StackTraceElement e = st[i];
            String c = e.getClassName();
            if (last < 0 && (c.startsWith("jdk.jshell.") || c.startsWith("jdk.internal.reflect.")
                    || c.startsWith("java.lang.reflect."))) {
                continue;
            }
            tb.add("\tat " + frame(e));
        }
        Throwable cause = t.getCause();
        if (cause != null && cause != t && tb.size() < 1000) {
            String ccls = cause instanceof EvalException
                    ? cleanClassName(((EvalException) cause).getExceptionClassName())
                    : cause.getClass().getName();
            appendTrace(tb, cause, ccls, cause.getMessage(), "Caused by: ");
        }
    }

    static String frame(StackTraceElement e) {
        String c = e.getClassName();
        String m = e.getMethodName();
        String file = e.getFileName();
        int line = e.getLineNumber();
        String loc = (file == null ? "Unknown Source" : file) + (line >= 0 ? ":" + line : "");
        // JShell already maps its wrapper classes to "" (snippet code, file "#<id>").
        c = cleanClassName(c);
        if (m.equals("do_it$")) m = "";
        if (c.isEmpty()) return m + "(" + loc + ")";
        return c + "." + m + "(" + loc + ")";
    }

    /** "REPL.$JShell$12$Foo$Bar" -> "Foo.Bar"; "REPL.$JShell$12" -> "". */
    static String cleanClassName(String cls) {
        if (cls == null) return "";
        if (!cls.startsWith("REPL.$JShell$")) return cls;
        String s = cls.substring("REPL.$JShell$".length());
        int i = 0;
        while (i < s.length() && Character.isDigit(s.charAt(i))) i++;
        if (i < s.length() && s.charAt(i) == '$') i++;
        return s.substring(i).replace('$', '.');
    }

    // -------------------------------------------------------------- interrupt

    static void installSigint() {
        try {
            sun.misc.Signal.handle(new sun.misc.Signal("INT"), sig -> onInterrupt());
        } catch (Throwable t) {
            try {
                System.err.println("JShellRuntime: cannot handle SIGINT: " + t);
            } catch (Throwable ignored) {
            }
        }
    }

    static void onInterrupt() {
        synchronized (STATE_LOCK) {
            if (!cellRunning || interruptRequested) return;
            interruptRequested = true;
        }
        // Keep stopping until the cell is over: the signal may arrive while the
        // snippet is still being compiled, before user code runs.
        Thread stopper = new Thread(() -> {
            while (true) {
                synchronized (STATE_LOCK) {
                    if (!cellRunning || !interruptRequested) return;
                }
                try {
                    jshell.stop();
                } catch (Throwable ignored) {
                }
                try {
                    Thread.sleep(25);
                } catch (InterruptedException e) {
                    return;
                }
            }
        }, "jshell-runtime-stopper");
        stopper.setDaemon(true);
        stopper.start();
    }

    // ------------------------------------------------------ execution control

    /**
     * The local engine, plus a way to read a variable's raw value (so that a
     * String result can be given as it is, whatever its static type).
     */
    static final class RawLocalExecutionControl extends LocalExecutionControl {
        boolean captured;
        Object capturedValue;

        @Override
        public String varValue(String className, String varName)
                throws RunException, EngineTerminationException, InternalException {
            String s = super.varValue(className, varName);
            try {
                Class<?> c = findClass(className);
                Field f = c.getDeclaredField(varName);
                f.setAccessible(true);
                capturedValue = f.get(null);
                captured = true;
            } catch (Throwable t) {
                captured = false;
            }
            return s;
        }
    }

    // ---------------------------------------------------------------- streams

    /**
     * System.out / System.err of user code: each write call becomes one stream
     * event of the current cell (UTF-8 decoded; an incomplete trailing sequence
     * waits for the next write). Outside a cell, bytes go to the real fd 1/2.
     */
    static final class CellStream extends OutputStream {
        final String name;
        final PrintStream fallback;
        final byte[] pending = new byte[4];
        int pendingLen = 0;

        CellStream(String name, PrintStream fallback) {
            this.name = name;
            this.fallback = fallback;
        }

        @Override
        public void write(int b) {
            write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public synchronized void write(byte[] b, int off, int len) {
            if (len <= 0) return;
            Object id = currentId;
            if (id == null) {
                if (pendingLen > 0) {
                    fallback.write(pending, 0, pendingLen);
                    pendingLen = 0;
                }
                fallback.write(b, off, len);
                fallback.flush();
                return;
            }
            byte[] buf;
            int n;
            if (pendingLen > 0) {
                buf = new byte[pendingLen + len];
                System.arraycopy(pending, 0, buf, 0, pendingLen);
                System.arraycopy(b, off, buf, pendingLen, len);
                n = buf.length;
                pendingLen = 0;
                off = 0;
            } else {
                buf = b;
                n = len;
            }
            int end = off + n;
            int complete = completePrefixEnd(buf, off, end);
            String text = complete > off ? new String(buf, off, complete - off, StandardCharsets.UTF_8) : "";
            for (int i = complete; i < end; i++) pending[pendingLen++] = buf[i];
            if (!text.isEmpty()) emitStream(id, text);
        }

        /** Emit an incomplete trailing sequence left by the last write (end of cell). */
        synchronized void flushPending() {
            if (pendingLen == 0) return;
            Object id = currentId;
            String text = new String(pending, 0, pendingLen, StandardCharsets.UTF_8);
            if (id == null) {
                fallback.write(pending, 0, pendingLen);
                fallback.flush();
            } else {
                emitStream(id, text);
            }
            pendingLen = 0;
        }

        void emitStream(Object id, String text) {
            Map<String, Object> ev = new LinkedHashMap<>();
            ev.put("id", id);
            ev.put("stream", name);
            ev.put("text", text);
            emit(ev);
        }

        /** End of the longest prefix of buf[off,end) not ending inside a UTF-8 sequence. */
        static int completePrefixEnd(byte[] buf, int off, int end) {
            int i = end - 1;
            int lim = Math.max(off, end - 4);
            while (i >= lim && (buf[i] & 0xC0) == 0x80) i--;
            if (i < lim) return end; // no lead byte in the last 4: malformed, decode as is
            int lead = buf[i] & 0xFF;
            int need;
            if (lead >= 0xF0 && lead <= 0xF7) need = 4;
            else if (lead >= 0xE0) need = lead <= 0xEF ? 3 : 1;
            else if (lead >= 0xC0) need = 2;
            else need = 1;
            return (end - i < need) ? i : end;
        }
    }

    // ----------------------------------------------------------------- events

    static void emit(Map<String, Object> event) {
        StringBuilder sb = new StringBuilder(64);
        Json.write(sb, event);
        sb.append('\n');
        byte[] bytes = sb.toString().getBytes(StandardCharsets.UTF_8);
        synchronized (EVENT_LOCK) {
            try {
                events.write(bytes);
                events.flush();
            } catch (IOException e) {
                // the wrapper is gone
                Runtime.getRuntime().halt(0);
            }
        }
    }

    // ------------------------------------------------------------------- JSON

    /** Minimal JSON: objects, arrays, strings, numbers, booleans, null. */
    static final class Json {
        final String s;
        int p = 0;

        Json(String s) {
            this.s = s;
        }

        Object parseTop() {
            Object v = value();
            ws();
            if (p != s.length()) throw err("trailing characters");
            return v;
        }

        RuntimeException err(String m) {
            return new IllegalArgumentException(m + " at " + p);
        }

        void ws() {
            while (p < s.length()) {
                char c = s.charAt(p);
                if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p++;
                else break;
            }
        }

        Object value() {
            ws();
            if (p >= s.length()) throw err("unexpected end");
            char c = s.charAt(p);
            switch (c) {
                case '{': {
                    p++;
                    Map<String, Object> m = new LinkedHashMap<>();
                    ws();
                    if (p < s.length() && s.charAt(p) == '}') {
                        p++;
                        return m;
                    }
                    while (true) {
                        ws();
                        if (p >= s.length() || s.charAt(p) != '"') throw err("expected key");
                        String k = string();
                        ws();
                        if (p >= s.length() || s.charAt(p) != ':') throw err("expected ':'");
                        p++;
                        m.put(k, value());
                        ws();
                        if (p >= s.length()) throw err("unexpected end");
                        char d = s.charAt(p++);
                        if (d == '}') return m;
                        if (d != ',') throw err("expected ',' or '}'");
                    }
                }
                case '[': {
                    p++;
                    List<Object> a = new ArrayList<>();
                    ws();
                    if (p < s.length() && s.charAt(p) == ']') {
                        p++;
                        return a;
                    }
                    while (true) {
                        a.add(value());
                        ws();
                        if (p >= s.length()) throw err("unexpected end");
                        char d = s.charAt(p++);
                        if (d == ']') return a;
                        if (d != ',') throw err("expected ',' or ']'");
                    }
                }
                case '"':
                    return string();
                case 't':
                    return literal("true", Boolean.TRUE);
                case 'f':
                    return literal("false", Boolean.FALSE);
                case 'n':
                    return literal("null", null);
                default:
                    return number();
            }
        }

        Object literal(String word, Object v) {
            if (!s.startsWith(word, p)) throw err("bad literal");
            p += word.length();
            return v;
        }

        Object number() {
            int start = p;
            if (p < s.length() && (s.charAt(p) == '-' || s.charAt(p) == '+')) p++;
            boolean frac = false;
            while (p < s.length()) {
                char c = s.charAt(p);
                if (c >= '0' && c <= '9') p++;
                else if (c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+') {
                    frac = true;
                    p++;
                } else break;
            }
            String t = s.substring(start, p);
            if (t.isEmpty()) throw err("unexpected character");
            try {
                if (!frac) return Long.parseLong(t);
            } catch (NumberFormatException ignored) {
                // too big for a long
            }
            try {
                return Double.parseDouble(t);
            } catch (NumberFormatException e) {
                throw err("bad number");
            }
        }

        String string() {
            p++; // opening quote
            StringBuilder sb = new StringBuilder();
            while (true) {
                if (p >= s.length()) throw err("unterminated string");
                char c = s.charAt(p++);
                if (c == '"') return sb.toString();
                if (c != '\\') {
                    sb.append(c);
                    continue;
                }
                if (p >= s.length()) throw err("unterminated escape");
                char e = s.charAt(p++);
                switch (e) {
                    case '"': sb.append('"'); break;
                    case '\\': sb.append('\\'); break;
                    case '/': sb.append('/'); break;
                    case 'b': sb.append('\b'); break;
                    case 'f': sb.append('\f'); break;
                    case 'n': sb.append('\n'); break;
                    case 'r': sb.append('\r'); break;
                    case 't': sb.append('\t'); break;
                    case 'u':
                        if (p + 4 > s.length()) throw err("bad unicode escape");
                        try {
                            // surrogate pairs arrive as two escapes and simply
                            // become two UTF-16 units, which is what they are
                            sb.append((char) Integer.parseInt(s.substring(p, p + 4), 16));
                        } catch (NumberFormatException ex) {
                            throw err("bad unicode escape");
                        }
                        p += 4;
                        break;
                    default:
                        throw err("bad escape");
                }
            }
        }

        static void write(StringBuilder sb, Object v) {
            if (v == null) {
                sb.append("null");
            } else if (v instanceof String) {
                writeString(sb, (String) v);
            } else if (v instanceof Boolean) {
                sb.append(((Boolean) v) ? "true" : "false");
            } else if (v instanceof Double || v instanceof Float) {
                double d = ((Number) v).doubleValue();
                if (Double.isNaN(d) || Double.isInfinite(d)) sb.append("null");
                else if (d == Math.rint(d) && Math.abs(d) < 1e15) sb.append((long) d);
                else sb.append(d);
            } else if (v instanceof Number) {
                sb.append(v.toString());
            } else if (v instanceof Map) {
                sb.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                    if (!first) sb.append(',');
                    first = false;
                    writeString(sb, String.valueOf(e.getKey()));
                    sb.append(':');
                    write(sb, e.getValue());
                }
                sb.append('}');
            } else if (v instanceof List) {
                sb.append('[');
                boolean first = true;
                for (Object o : (List<?>) v) {
                    if (!first) sb.append(',');
                    first = false;
                    write(sb, o);
                }
                sb.append(']');
            } else {
                writeString(sb, v.toString());
            }
        }

        static final char[] HEX = "0123456789abcdef".toCharArray();

        static void hex4(StringBuilder sb, char c) {
            sb.append('\\').append('u')
              .append(HEX[(c >> 12) & 15]).append(HEX[(c >> 8) & 15])
              .append(HEX[(c >> 4) & 15]).append(HEX[c & 15]);
        }

        static void writeString(StringBuilder sb, String s) {
            sb.append('"');
            int n = s.length();
            for (int i = 0; i < n; i++) {
                char c = s.charAt(i);
                switch (c) {
                    case '"': sb.append("\\\""); break;
                    case '\\': sb.append("\\\\"); break;
                    case '\n': sb.append("\\n"); break;
                    case '\r': sb.append("\\r"); break;
                    case '\t': sb.append("\\t"); break;
                    case '\b': sb.append("\\b"); break;
                    case '\f': sb.append("\\f"); break;
                    default:
                        if (c < 0x20 || c == 0x7f || c == 0x2028 || c == 0x2029) {
                            hex4(sb, c);
                        } else if (Character.isHighSurrogate(c)) {
                            if (i + 1 < n && Character.isLowSurrogate(s.charAt(i + 1))) {
                                sb.append(c).append(s.charAt(++i)); // valid pair: raw UTF-8
                            } else {
                                hex4(sb, c); // lone surrogate: keep it, escaped
                            }
                        } else if (Character.isLowSurrogate(c)) {
                            hex4(sb, c);
                        } else {
                            sb.append(c);
                        }
                }
            }
            sb.append('"');
        }
    }
}
