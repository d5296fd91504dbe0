//! Dockerfiles: the text read into instructions ([`parse`]), then planned into the steps a
//! build runs ([`plan`]), with build arguments and environment variables substituted.
//!
//! Everything a client can get wrong in a Dockerfile is found here, before any machine
//! starts, and named by its line: an unsupported or unknown instruction, a flag Locker
//! does not take, a second `FROM`, a bad variable reference, an `ADD` from a URL. What
//! the steps then do to a root filesystem is `steps`'s.
//!
//! Supported: `FROM` (one stage), `RUN` (shell and exec forms), `COPY`/`ADD` (from the
//! uploaded context; `--chown`, `--chmod`), `ENV`, `ARG`, `WORKDIR`, `USER`, `CMD`,
//! `ENTRYPOINT`, `EXPOSE`, `LABEL`; line continuations (`\`), comments, and variable
//! references `$X`, `${X}`, `${X:-word}`, `${X:+word}` outside single quotes.

use std::collections::BTreeMap;

use serde::Serialize;

/// What is wrong with a Dockerfile, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DockerfileError {
    /// 1-based line where the instruction starts.
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for DockerfileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dockerfile line {}: {}", self.line, self.message)
    }
}

/// One instruction as written: its line, keyword (upper case), `--flags` and the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Raw {
    pub line: usize,
    pub keyword: String,
    pub flags: Vec<(String, String)>,
    pub args: String,
}

const SUPPORTED: &[&str] = &[
    "FROM",
    "RUN",
    "COPY",
    "ADD",
    "ENV",
    "ARG",
    "WORKDIR",
    "USER",
    "CMD",
    "ENTRYPOINT",
    "EXPOSE",
    "LABEL",
];
const KNOWN_UNSUPPORTED: &[&str] = &[
    "VOLUME",
    "HEALTHCHECK",
    "ONBUILD",
    "STOPSIGNAL",
    "SHELL",
    "MAINTAINER",
];

/// The most instructions one Dockerfile may hold.
pub const MAX_INSTRUCTIONS: usize = 256;

/// Splits a Dockerfile into instructions: comments and blank lines dropped, continuation
/// lines joined, keywords checked.
pub fn parse(text: &str) -> Result<Vec<Raw>, DockerfileError> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let start = i + 1;
        let mut joined = String::new();
        let mut cur = line.trim_end().to_string();
        loop {
            if let Some(stripped) = cur.strip_suffix('\\') {
                joined.push_str(stripped);
                // Comment and empty lines inside a continuation are dropped, as Docker does.
                loop {
                    match lines.peek() {
                        Some((_, l)) if l.trim().starts_with('#') || l.trim().is_empty() => {
                            lines.next();
                        }
                        _ => break,
                    }
                }
                match lines.next() {
                    Some((_, l)) => cur = l.trim_end().to_string(),
                    None => break,
                }
            } else {
                joined.push_str(&cur);
                break;
            }
        }
        let err = |message: String| DockerfileError {
            line: start,
            message,
        };
        let body = joined.trim();
        let (kw, rest) = body
            .split_once(|c: char| c.is_whitespace())
            .unwrap_or((body, ""));
        let keyword = kw.to_ascii_uppercase();
        if KNOWN_UNSUPPORTED.contains(&keyword.as_str()) {
            return Err(err(format!(
                "{keyword} is not supported by Locker's Dockerfile builds (supported: {})",
                SUPPORTED.join(", ")
            )));
        }
        if !SUPPORTED.contains(&keyword.as_str()) {
            return Err(err(format!(
                "unknown instruction {kw:?} (supported: {})",
                SUPPORTED.join(", ")
            )));
        }
        let mut rest = rest.trim_start();
        let mut flags = Vec::new();
        while let Some(f) = rest.strip_prefix("--") {
            let (flag, after) = f.split_once(|c: char| c.is_whitespace()).unwrap_or((f, ""));
            let (k, v) = flag.split_once('=').unwrap_or((flag, ""));
            flags.push((k.to_string(), v.to_string()));
            rest = after.trim_start();
        }
        if rest.is_empty() {
            return Err(err(format!("{keyword} needs arguments")));
        }
        out.push(Raw {
            line: start,
            keyword,
            flags,
            args: rest.to_string(),
        });
        if out.len() > MAX_INSTRUCTIONS {
            return Err(err(format!(
                "a Dockerfile holds at most {MAX_INSTRUCTIONS} instructions"
            )));
        }
    }
    if out.is_empty() {
        return Err(DockerfileError {
            line: 1,
            message: "the Dockerfile has no instructions: it must start with FROM".into(),
        });
    }
    Ok(out)
}

/// One step of a build, with every variable substituted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Step {
    /// The base: a Locker template name or an image reference.
    From { image: String },
    /// A command run in a machine on the previous step's root filesystem.
    Run {
        argv: Vec<String>,
        /// ENV and the ARGs it sees, in order.
        env: Vec<(String, String)>,
        workdir: String,
        user: Option<String>,
    },
    /// Files of the context copied in (`ADD` without URLs or archives is the same).
    Copy {
        srcs: Vec<String>,
        /// Absolute; ending in `/` means "into this directory".
        dest: String,
        chown: Option<String>,
        chmod: Option<u32>,
    },
    /// The working directory, made if missing.
    Workdir { path: String },
    /// Changes what sandboxes get only (ENV, USER, CMD, ENTRYPOINT, EXPOSE, LABEL, ARG).
    Config { text: String },
}

impl Step {
    /// Whether the step changes the root filesystem.
    pub fn writes(&self) -> bool {
        matches!(
            self,
            Step::Run { .. } | Step::Copy { .. } | Step::Workdir { .. }
        )
    }
}

/// A planned build: its steps (each with the line it came from and how it reads in logs)
/// and what sandboxes made from the result get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<(usize, String, Step)>,
    pub config: locker_runtime::template::RunConfig,
}

/// Plans the instructions: variables substituted (build args override ARG defaults; an
/// ARG not declared is never visible), paths made absolute against WORKDIR, the run
/// config accumulated. Unused build args are fine (Docker warns only).
pub fn plan(raw: &[Raw], build_args: &BTreeMap<String, String>) -> Result<Plan, DockerfileError> {
    let mut steps = Vec::new();
    let mut args: Vec<(String, String)> = Vec::new();
    let mut env: Vec<(String, String)> = Vec::new();
    let mut config = locker_runtime::template::RunConfig::default();
    let mut workdir = "/".to_string();
    let mut entrypoint: Option<Vec<String>> = None;
    let mut cmd: Option<Vec<String>> = None;
    let mut seen_from = false;
    for r in raw {
        let err = |message: String| DockerfileError {
            line: r.line,
            message,
        };
        let vars = |name: &str| -> Option<String> {
            env.iter()
                .rev()
                .chain(args.iter().rev())
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let allowed: &[&str] = match r.keyword.as_str() {
            "COPY" | "ADD" => &["chown", "chmod"],
            "FROM" => &["platform"],
            _ => &[],
        };
        for (k, v) in &r.flags {
            if k == "from" && r.keyword == "COPY" {
                return Err(err(
                    "COPY --from (multi-stage builds) is not supported: build in one stage".into(),
                ));
            }
            if !allowed.contains(&k.as_str()) {
                return Err(err(format!(
                    "{} does not take --{k} in Locker's builds",
                    r.keyword
                )));
            }
            if k == "platform" && v != "linux/amd64" {
                return Err(err(format!(
                    "--platform={v}: Locker builds linux/amd64 only"
                )));
            }
        }
        let flag = |name: &str| -> Result<Option<String>, DockerfileError> {
            r.flags
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| expand(v, &vars).map_err(&err))
                .transpose()
        };
        if !seen_from && r.keyword != "FROM" && r.keyword != "ARG" {
            return Err(err(format!(
                "{} before FROM: a Dockerfile starts with FROM (ARG may come first)",
                r.keyword
            )));
        }
        let text = format!("{} {}", r.keyword, r.args);
        match r.keyword.as_str() {
            "FROM" => {
                if seen_from {
                    return Err(err(
                        "a second FROM: multi-stage builds are not supported, use one stage".into(),
                    ));
                }
                seen_from = true;
                let w = words(&r.args, &vars).map_err(&err)?;
                let image = match w.as_slice() {
                    [image] => image.clone(),
                    [image, as_, _] if as_.eq_ignore_ascii_case("as") => image.clone(),
                    _ => return Err(err("FROM takes one image or template name".into())),
                };
                // ARGs declared before FROM are visible only to FROM itself.
                args.clear();
                steps.push((r.line, format!("FROM {image}"), Step::From { image }));
            }
            "ARG" => {
                let mut declared = Vec::new();
                for w in words(&r.args, &|_| None).map_err(&err)? {
                    let (name, default) = match w.split_once('=') {
                        Some((n, d)) => (n.to_string(), Some(expand(d, &vars).map_err(&err)?)),
                        None => (w.clone(), None),
                    };
                    check_var_name(&name).map_err(&err)?;
                    if let Some(v) = build_args.get(&name).cloned().or(default) {
                        declared.push((name, v));
                    }
                }
                args.extend(declared);
                if seen_from {
                    steps.push((r.line, text.clone(), Step::Config { text }));
                }
            }
            "ENV" | "LABEL" => {
                let pairs = key_values(&r.args, &vars).map_err(&err)?;
                for (k, v) in &pairs {
                    if r.keyword == "ENV" {
                        check_var_name(k).map_err(&err)?;
                        env.retain(|(e, _)| e != k);
                        env.push((k.clone(), v.clone()));
                        config.env.insert(k.clone(), v.clone());
                    } else {
                        config.labels.insert(k.clone(), v.clone());
                    }
                }
                steps.push((r.line, text.clone(), Step::Config { text }));
            }
            "WORKDIR" => {
                let w = expand(r.args.trim(), &vars).map_err(&err)?;
                workdir = absolute(&workdir, &w);
                config.workdir = Some(workdir.clone());
                steps.push((
                    r.line,
                    format!("WORKDIR {workdir}"),
                    Step::Workdir {
                        path: workdir.clone(),
                    },
                ));
            }
            "USER" => {
                let u = expand(r.args.trim(), &vars).map_err(&err)?;
                if u.is_empty() || u.contains(char::is_whitespace) {
                    return Err(err("USER takes one user[:group]".into()));
                }
                config.user = Some(u);
                steps.push((r.line, text.clone(), Step::Config { text }));
            }
            "CMD" | "ENTRYPOINT" => {
                let argv = command_form(&r.args).map_err(&err)?;
                if r.keyword == "CMD" {
                    cmd = Some(argv);
                } else {
                    entrypoint = Some(argv);
                    // Docker: a new ENTRYPOINT resets a CMD inherited before it.
                    cmd = None;
                }
                steps.push((r.line, text.clone(), Step::Config { text }));
            }
            "EXPOSE" => {
                for w in words(&r.args, &vars).map_err(&err)? {
                    let port = w.split('/').next().unwrap_or("");
                    let p: u16 =
                        port.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                            err(format!("EXPOSE {w:?}: give a port number 1-65535"))
                        })?;
                    if !config.exposed_ports.contains(&p) {
                        config.exposed_ports.push(p);
                    }
                }
                steps.push((r.line, text.clone(), Step::Config { text }));
            }
            "RUN" => {
                let argv = command_form(&r.args).map_err(&err)?;
                let mut run_env = args.clone();
                for (k, v) in &env {
                    run_env.retain(|(e, _)| e != k);
                    run_env.push((k.clone(), v.clone()));
                }
                steps.push((
                    r.line,
                    format!("RUN {}", one_line(&r.args)),
                    Step::Run {
                        argv,
                        env: run_env,
                        workdir: workdir.clone(),
                        user: config.user.clone(),
                    },
                ));
            }
            "COPY" | "ADD" => {
                let w = if r.args.trim_start().starts_with('[') {
                    serde_json::from_str::<Vec<String>>(r.args.trim())
                        .map_err(|e| err(format!("{} [..] is not a JSON array: {e}", r.keyword)))?
                        .iter()
                        .map(|s| expand(s, &vars))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(&err)?
                } else {
                    words(&r.args, &vars).map_err(&err)?
                };
                let Some((dest, srcs)) = w.split_last().filter(|(_, s)| !s.is_empty()) else {
                    return Err(err(format!(
                        "{} takes one or more sources and a destination",
                        r.keyword
                    )));
                };
                for s in srcs {
                    if r.keyword == "ADD" && s.contains("://") {
                        return Err(err(format!(
                            "ADD from a URL ({s}) is not supported: download it with RUN in a build with a network policy"
                        )));
                    }
                    if r.keyword == "ADD" && is_archive(s) {
                        return Err(err(format!(
                            "ADD of an archive ({s}) would unpack it, which Locker does not do: COPY it and unpack it with RUN"
                        )));
                    }
                }
                if srcs.len() > 1 && !dest.ends_with('/') {
                    return Err(err(format!(
                        "{} with several sources needs a destination directory ending in /",
                        r.keyword
                    )));
                }
                let mut dest_abs = absolute(&workdir, dest);
                if (dest.ends_with('/') || dest == ".") && !dest_abs.ends_with('/') {
                    dest_abs.push('/');
                }
                let chmod = match flag("chmod")? {
                    None => None,
                    Some(m) => Some(
                        u32::from_str_radix(&m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| err(format!("--chmod={m}: give an octal mode")))?,
                    ),
                };
                steps.push((
                    r.line,
                    format!("{} {}", r.keyword, one_line(&r.args)),
                    Step::Copy {
                        srcs: srcs.to_vec(),
                        dest: dest_abs,
                        chown: flag("chown")?,
                        chmod,
                    },
                ));
            }
            other => unreachable!("parse let {other} through"),
        }
    }
    if !seen_from {
        return Err(DockerfileError {
            line: raw.last().map_or(1, |r| r.line),
            message: "the Dockerfile has no FROM".into(),
        });
    }
    let start: Vec<String> = entrypoint
        .unwrap_or_default()
        .into_iter()
        .chain(cmd.unwrap_or_default())
        .collect();
    config.start_cmd = (!start.is_empty()).then_some(start);
    Ok(Plan { steps, config })
}

fn is_archive(s: &str) -> bool {
    let s = s.to_ascii_lowercase();
    [
        ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst",
    ]
    .iter()
    .any(|e| s.ends_with(e))
}

fn one_line(s: &str) -> String {
    let s: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() > 100 {
        format!("{}…", s.chars().take(100).collect::<String>())
    } else {
        s
    }
}

fn check_var_name(name: &str) -> Result<(), String> {
    let ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a variable name (letters, digits and _, not starting with a digit)"
        ))
    }
}

/// `p` against the working directory `cwd`, normalized (`.` and `..` resolved lexically).
fn absolute(cwd: &str, p: &str) -> String {
    let joined = if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{cwd}/{p}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The exec form (a JSON array of strings) as is, or the shell form as `/bin/sh -c`.
fn command_form(args: &str) -> Result<Vec<String>, String> {
    let t = args.trim();
    if t.starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(t) {
            if v.is_empty() {
                return Err("an empty command".into());
            }
            return Ok(v);
        }
    }
    if t.starts_with("<<") {
        return Err("heredocs are not supported: write the script on the line".into());
    }
    Ok(vec!["/bin/sh".into(), "-c".into(), t.to_string()])
}

/// `k=v` pairs (or the old `KEY value` form of one pair).
fn key_values(
    text: &str,
    vars: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<(String, String)>, String> {
    let first = text.split_whitespace().next().unwrap_or("");
    if !first.contains('=') {
        let (k, v) = text
            .trim()
            .split_once(char::is_whitespace)
            .unwrap_or((text.trim(), ""));
        let v = words(v.trim(), vars)?.join(" ");
        return Ok(vec![(k.to_string(), v)]);
    }
    words(text, vars)?
        .into_iter()
        .map(|w| {
            w.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| format!("{w:?} is not KEY=value"))
        })
        .collect()
}

/// `s` with variables expanded (quotes kept as they are).
fn expand(s: &str, vars: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '\\' if it.peek() == Some(&'$') => {
                out.push('$');
                it.next();
            }
            '$' => out.push_str(&variable(&mut it, vars)?),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Reads a variable reference after `$` and returns its value.
fn variable(
    it: &mut std::iter::Peekable<std::str::Chars<'_>>,
    vars: &dyn Fn(&str) -> Option<String>,
) -> Result<String, String> {
    if it.peek() == Some(&'{') {
        it.next();
        let mut inner = String::new();
        loop {
            match it.next() {
                Some('}') => break,
                Some(c) => inner.push(c),
                None => return Err(format!("unterminated ${{{inner}")),
            }
        }
        let (name, op) = match inner.find(':') {
            Some(i) => (&inner[..i], Some(&inner[i..])),
            None => (inner.as_str(), None),
        };
        check_var_name(name)?;
        let v = vars(name);
        return Ok(match op {
            None => v.unwrap_or_default(),
            Some(o) if o.starts_with(":-") => match v.filter(|v| !v.is_empty()) {
                Some(v) => v,
                None => expand(&o[2..], vars)?,
            },
            Some(o) if o.starts_with(":+") => match v.filter(|v| !v.is_empty()) {
                Some(_) => expand(&o[2..], vars)?,
                None => String::new(),
            },
            Some(o) => return Err(format!("${{{name}{o}}}: only :- and :+ are supported")),
        });
    }
    let mut name = String::new();
    while let Some(&c) = it.peek() {
        if c.is_ascii_alphanumeric() || c == '_' {
            name.push(c);
            it.next();
        } else {
            break;
        }
    }
    if name.is_empty() {
        return Ok("$".into());
    }
    Ok(vars(&name).unwrap_or_default())
}

/// Splits on unquoted whitespace, removing quotes and backslash escapes, expanding
/// variables except inside single quotes.
fn words(s: &str, vars: &dyn Fn(&str) -> Option<String>) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            c if c.is_whitespace() => {
                if has {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            '\'' => {
                has = true;
                loop {
                    match it.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err("unterminated single quote".into()),
                    }
                }
            }
            '"' => {
                has = true;
                loop {
                    match it.next() {
                        Some('"') => break,
                        Some('\\') => match it.next() {
                            Some(c) => cur.push(c),
                            None => return Err("unterminated double quote".into()),
                        },
                        Some('$') => cur.push_str(&variable(&mut it, vars)?),
                        Some(c) => cur.push(c),
                        None => return Err("unterminated double quote".into()),
                    }
                }
            }
            '\\' => {
                has = true;
                if let Some(c) = it.next() {
                    cur.push(c);
                }
            }
            '$' => {
                has = true;
                cur.push_str(&variable(&mut it, vars)?);
            }
            c => {
                has = true;
                cur.push(c);
            }
        }
    }
    if has {
        out.push(cur);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(text: &str) -> Result<Plan, DockerfileError> {
        plan(&parse(text)?, &BTreeMap::new())
    }

    #[test]
    fn continuations_comments_and_forms() {
        let p = planned(
            "# a comment\nFROM default\n\nRUN echo a \\\n  # inside\n  && echo b\nRUN [\"/bin/echo\", \"x\"]\nCMD python3 -m http.server\n",
        )
        .unwrap();
        assert_eq!(p.steps.len(), 4);
        let (line, _, step) = &p.steps[1];
        assert_eq!(*line, 4);
        let Step::Run { argv, .. } = step else {
            panic!("{step:?}")
        };
        assert_eq!(argv[2], "echo a   && echo b");
        let Step::Run { argv, .. } = &p.steps[2].2 else {
            panic!()
        };
        assert_eq!(argv, &["/bin/echo", "x"]);
        assert_eq!(
            p.config.start_cmd.as_deref().unwrap(),
            ["/bin/sh", "-c", "python3 -m http.server"]
        );
    }

    #[test]
    fn unsupported_and_unknown_name_their_line() {
        let e = planned("FROM default\nRUN true\nHEALTHCHECK CMD true\n").unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.message.contains("HEALTHCHECK"), "{e}");
        let e = planned("FROM default\nFROBNICATE x\n").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.to_string().contains("FROBNICATE"));
        let e = planned("FROM default\nFROM default\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = planned("RUN true\n").unwrap_err();
        assert!(e.message.contains("before FROM"));
        let e = planned("FROM default\nADD https://x.org/a.tgz /a\n").unwrap_err();
        assert!(e.message.contains("URL"));
        let e = planned("FROM default\nRUN --network=host true\n").unwrap_err();
        assert!(e.message.contains("--network"));
    }

    #[test]
    fn env_args_and_workdir() {
        let raw = parse(
            "ARG BASE=default\nFROM $BASE\nARG V=1\nENV A=\"x y\" B=${V}z C=${NOPE:-d}\nENV OLD legacy form\nWORKDIR app\nWORKDIR ../srv/$V\nUSER user\nCOPY --chown=user:user a b /dst/\nEXPOSE 8080/tcp 9000\nLABEL k='$V'\n",
        )
        .unwrap();
        let mut args = BTreeMap::new();
        args.insert("V".to_string(), "7".to_string());
        let p = plan(&raw, &args).unwrap();
        assert_eq!(
            p.steps[0].2,
            Step::From {
                image: "default".into()
            }
        );
        assert_eq!(p.config.env["A"], "x y");
        assert_eq!(p.config.env["B"], "7z");
        assert_eq!(p.config.env["C"], "d");
        assert_eq!(p.config.env["OLD"], "legacy form");
        assert_eq!(p.config.workdir.as_deref(), Some("/srv/7"));
        assert_eq!(p.config.user.as_deref(), Some("user"));
        assert_eq!(p.config.exposed_ports, vec![8080, 9000]);
        assert_eq!(p.config.labels["k"], "$V");
        let copy = p.steps.iter().find_map(|(_, _, s)| match s {
            Step::Copy {
                srcs, dest, chown, ..
            } => Some((srcs.clone(), dest.clone(), chown.clone())),
            _ => None,
        });
        assert_eq!(
            copy,
            Some((
                vec!["a".into(), "b".into()],
                "/dst/".into(),
                Some("user:user".into())
            ))
        );
        let e = plan(&parse("FROM default\nCOPY a b /dst\n").unwrap(), &args).unwrap_err();
        assert!(e.message.contains("ending in /"));
    }

    #[test]
    fn run_sees_args_and_env() {
        let p = plan(
            &parse("FROM default\nARG X\nENV Y=2\nRUN echo $X $Y\n").unwrap(),
            &[("X".to_string(), "1".to_string())].into(),
        )
        .unwrap();
        let Step::Run { env, .. } = &p.steps[3].2 else {
            panic!()
        };
        assert_eq!(
            env,
            &[
                ("X".to_string(), "1".to_string()),
                ("Y".to_string(), "2".to_string())
            ]
        );
    }
}
