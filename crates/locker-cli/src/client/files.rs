//! `locker files get|put|ls|rm|mkdir|mv|stat`: a sandbox's files over
//! `/v1/sandboxes/{id}/files…`; the same commands serve `locker volume files …` over
//! `/v1/volumes/{id}/files…` (see [`run_on`]).
//!
//! File bodies are streamed both ways, never held whole: a download goes through a
//! temporary file beside its target and is renamed into place only once complete, so a
//! broken transfer never leaves a truncated file under the real name. Directories go both
//! ways with `-r`, as tar archives made and unpacked on the fly (see [`tree`]).

mod tree;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::render::{cell, human_bytes, mode_string, parse_rfc3339, table};
use super::{items, print_json, print_text, seg, Client, ClientError, Conn};

/// `locker files …`.
#[derive(clap::Args, Debug)]
pub struct FilesArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: FilesCmd,
}

/// The files subcommands. Paths inside the sandbox are absolute.
#[derive(clap::Subcommand, Debug)]
pub enum FilesCmd {
    /// Copy a file out: to LOCAL (a file or a directory), or to stdout when LOCAL is `-`
    /// or left out. With -r, copy the directory PATH's whole tree into the local directory
    /// LOCAL (created if missing), or write it to stdout as a tar archive when LOCAL is `-`.
    Get {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The absolute path of the file (with -r: the directory) to copy.
        path: String,
        /// Where to write it: a local file or directory, `-` for stdout (the default; with
        /// -r a local directory is required, or `-` for a tar archive on stdout).
        local: Option<String>,
        /// Copy a directory and everything under it (files, directories, symlinks).
        #[arg(short, long)]
        recursive: bool,
    },
    /// Copy a local file (`-`: standard input) in, creating parent directories; a PATH
    /// ending in `/` keeps the local file's name. With -r, copy the local directory LOCAL's
    /// whole tree into the directory PATH (created if missing).
    Put {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The local file to send, or `-` for standard input (with -r: a local directory,
        /// or `-` for a tar archive on standard input).
        local: String,
        /// The absolute path to write (ending in `/`: a directory to write into; with -r:
        /// the directory to copy the tree into).
        path: String,
        /// Permission bits in octal (default: the local file's; not with -r, where each
        /// file keeps its own).
        #[arg(long, value_parser = parse_mode, conflicts_with = "recursive")]
        mode: Option<u32>,
        /// Copy a directory and everything under it (files, directories, symlinks).
        #[arg(short, long)]
        recursive: bool,
    },
    /// List a directory.
    Ls {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The directory to list (absolute).
        #[arg(default_value = "/")]
        path: String,
        /// How many levels down to list.
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
    /// Delete a file or an empty directory (a directory and all it holds with -r).
    Rm {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The absolute path to delete.
        path: String,
        /// Delete a directory and everything in it (needed for a directory that is not
        /// empty).
        #[arg(short, long)]
        recursive: bool,
    },
    /// Create a directory (and its parents).
    Mkdir {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The directory to create (absolute).
        path: String,
    },
    /// Move or rename a file or directory.
    Mv {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// What to move (absolute).
        from: String,
        /// Where to (absolute).
        to: String,
    },
    /// Show a file's type, size, mode and modification time.
    Stat {
        /// The sandbox (sb_…).
        #[arg(value_name = "SANDBOX")]
        sandbox: String,
        /// The file's absolute path.
        path: String,
    },
}

/// The files commands as `locker volume files` shows them: the first argument is a volume.
pub fn for_volume(cmd: clap::Command) -> clap::Command {
    // In place (not `mut_arg`, which moves the argument last among the positionals).
    cmd.mut_args(|a| {
        if a.get_id() == "sandbox" {
            a.value_name("VOLUME").help("The volume (its name or id).")
        } else {
            a
        }
    })
}

/// Parses an octal mode (`0644`, `755`, `0o600`).
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o7777 && !digits.is_empty() => Ok(m),
        _ => Err(format!("expected an octal mode like 0644, got {s:?}")),
    }
}

/// A mode as the API's query parameter: four octal digits.
pub fn mode_param(mode: u32) -> String {
    format!("{:04o}", mode & 0o7777)
}

/// The last component of a path (`/a/b.txt` → `b.txt`), if it has one.
pub fn basename(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty() && *b != "." && *b != "..")
}

/// Where `files put LOCAL PATH` writes: PATH, or PATH + LOCAL's name when PATH ends in `/`.
pub fn put_target(local: &str, path: &str) -> Result<String, ClientError> {
    if !path.ends_with('/') {
        return Ok(path.to_string());
    }
    match (local, basename(local)) {
        ("-", _) | (_, None) => Err(ClientError::Usage(format!(
            "{path} is a directory: give the file's full path in the sandbox"
        ))),
        (_, Some(name)) => Ok(format!("{path}{name}")),
    }
}

/// Where `files get SB PATH LOCAL` writes: LOCAL, or LOCAL/<name> when LOCAL is a directory.
pub fn get_target(path: &str, local: &Path) -> Result<PathBuf, ClientError> {
    if !local.is_dir() {
        return Ok(local.to_path_buf());
    }
    match basename(path) {
        Some(name) => Ok(local.join(name)),
        None => Err(ClientError::Usage(format!(
            "{path} names no file: give the local file name"
        ))),
    }
}

/// Where the files routes of a sandbox live: `/v1/sandboxes/{id}`.
pub fn sandbox_base(sandbox: &str) -> String {
    format!("/v1/sandboxes/{}", seg(sandbox))
}

fn files_path(base: &str, tail: &str) -> String {
    format!("{base}/files{tail}")
}

/// Copies `r` to `w` in 64 KiB pieces, telling read (the download) from write (the local
/// side) failures apart. Returns the bytes copied.
fn copy_stream(r: &mut impl Read, w: &mut impl Write, what: &str) -> Result<u64, ClientError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(ClientError::Io {
                    what: format!("the download broke after {total} bytes"),
                    source: e,
                })
            }
        };
        w.write_all(&buf[..n])
            .map_err(|e| ClientError::io(format!("cannot write {what}"), e))?;
        total += n as u64;
    }
    w.flush()
        .map_err(|e| ClientError::io(format!("cannot write {what}"), e))?;
    Ok(total)
}

/// Streams the file `path` of the target at `base` (see [`sandbox_base`]) into `out`;
/// returns its size.
pub fn get_file(
    c: &Client,
    base: &str,
    path: &str,
    out: &mut impl Write,
) -> Result<u64, ClientError> {
    let mut r = c.get_stream(&files_path(base, ""), &[("path", path.to_string())])?;
    copy_stream(&mut r, out, "the output")
}

/// Streams the file `path` of the target at `base` into the local file `target` through a
/// temporary file beside it, renamed into place once the whole file arrived.
pub fn get_to_file(c: &Client, base: &str, path: &str, target: &Path) -> Result<u64, ClientError> {
    // Ask first: a missing file must not leave an empty local one behind.
    let mut r = c.get_stream(&files_path(base, ""), &[("path", path.to_string())])?;
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "download".into());
    let tmp = target.with_file_name(format!(".{name}.locker-part"));
    let shown = target.display().to_string();
    let mut f = File::create(&tmp)
        .map_err(|e| ClientError::io(format!("cannot create {}", tmp.display()), e))?;
    let copied = copy_stream(&mut r, &mut f, &shown).and_then(|n| {
        f.sync_all()
            .map_err(|e| ClientError::io(format!("cannot write {shown}"), e))?;
        fs::rename(&tmp, target)
            .map_err(|e| ClientError::io(format!("cannot move the download to {shown}"), e))?;
        Ok(n)
    });
    if copied.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    copied
}

/// Streams the local file `local` (`-`: standard input) to `path` in the target at `base`;
/// returns the Entry the server wrote.
pub fn put_file(
    c: &Client,
    base: &str,
    local: &str,
    path: &str,
    mode: Option<u32>,
) -> Result<Value, ClientError> {
    let url_path = files_path(base, "");
    let mut query = vec![("path", path.to_string())];
    if local == "-" {
        if let Some(m) = mode {
            query.push(("mode", mode_param(m)));
        }
        return c.put_body(&url_path, &query, io::stdin());
    }
    let f = File::open(local).map_err(|e| ClientError::io(format!("cannot open {local}"), e))?;
    let meta = f
        .metadata()
        .map_err(|e| ClientError::io(format!("cannot read {local}"), e))?;
    if meta.is_dir() {
        return Err(ClientError::Usage(format!(
            "{local} is a directory: copy it with `files put -r`"
        )));
    }
    let mode = mode.unwrap_or(meta.permissions().mode() & 0o777);
    query.push(("mode", mode_param(mode)));
    c.put_body(&url_path, &query, f)
}

/// A directory listing for people: mode, size, modification time, path.
pub fn ls_table(entries: &[Value], full_paths: bool) -> String {
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
            let mode = e.get("mode").and_then(Value::as_u64).unwrap_or(0) as u32;
            let size = e.get("size").and_then(Value::as_u64).unwrap_or(0);
            let key = if full_paths { "path" } else { "name" };
            let mut name = cell(e.get(key).or_else(|| e.get("path")));
            if kind == "dir" && !name.ends_with('/') {
                name.push('/');
            }
            vec![
                mode_string(kind, mode),
                human_bytes(size),
                short_time(e),
                name,
            ]
        })
        .collect();
    table(&["MODE", "SIZE", "MODIFIED", "NAME"], &rows)
}

fn short_time(e: &Value) -> String {
    match e.get("mtime").and_then(Value::as_str) {
        Some(t) if parse_rfc3339(t).is_some() && t.len() >= 16 => t[..16].replace('T', " "),
        other => cell(other.map(|s| Value::String(s.to_string())).as_ref()),
    }
}

/// An Entry as `key: value` lines, the mode in octal and as `ls` shows it.
pub fn stat_text(e: &Value) -> String {
    let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
    let mut out = String::new();
    for key in ["path", "type", "size", "mode", "mtime"] {
        let val = match key {
            "size" => match e.get("size").and_then(Value::as_u64) {
                Some(n) if n >= 1024 => format!("{n} ({})", human_bytes(n)),
                Some(n) => n.to_string(),
                None => "-".into(),
            },
            "mode" => match e.get("mode").and_then(Value::as_u64) {
                Some(m) => format!("{} ({})", mode_param(m as u32), mode_string(kind, m as u32)),
                None => "-".into(),
            },
            k => cell(e.get(k)),
        };
        out.push_str(&format!("{:<6} {val}\n", format!("{key}:")));
    }
    out
}

/// Runs `locker files …`.
pub fn run(a: FilesArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    run_on(&c, a.conn.json, a.cmd, sandbox_base)
}

/// Runs a files command on the target that `base_of(id)` names (a sandbox's or a volume's
/// routes); `json_out` prints the server's JSON.
pub fn run_on(
    c: &Client,
    json_out: bool,
    cmd: FilesCmd,
    base_of: fn(&str) -> String,
) -> Result<i32, ClientError> {
    let show = |v: &Value, text: Option<String>| -> Result<(), ClientError> {
        if json_out {
            print_json(v)
        } else if let Some(t) = text {
            print_text(&t)
        } else {
            Ok(())
        }
    };
    match cmd {
        FilesCmd::Get {
            sandbox,
            path,
            local,
            recursive: true,
        } => {
            let url_path = files_path(&base_of(&sandbox), "");
            match local.as_deref() {
                None => {
                    return Err(ClientError::Usage(
                        "`files get -r` needs a local directory to write into (or `-` for a \
                         tar archive on stdout)"
                            .into(),
                    ))
                }
                Some("-") => {
                    let mut r =
                        c.get_stream(&url_path, &[("path", path), ("format", "tar".to_string())])?;
                    copy_stream(&mut r, &mut io::stdout().lock(), "the output")?;
                }
                Some(l) => {
                    let v = tree::fetch_tree(c, &url_path, &path, Path::new(l))?;
                    show(&v, None)?;
                }
            }
        }
        FilesCmd::Get {
            sandbox,
            path,
            local,
            recursive: false,
        } => match local.as_deref() {
            None | Some("-") => {
                let mut out = io::stdout().lock();
                get_file(c, &base_of(&sandbox), &path, &mut out)?;
            }
            Some(l) => {
                let target = get_target(&path, Path::new(l))?;
                get_to_file(c, &base_of(&sandbox), &path, &target)?;
            }
        },
        FilesCmd::Put {
            sandbox,
            local,
            path,
            recursive: true,
            ..
        } => {
            let url_path = files_path(&base_of(&sandbox), "");
            let e = if local == "-" {
                c.put_body(
                    &url_path,
                    &[("path", path), ("format", "tar".to_string())],
                    io::stdin(),
                )?
            } else {
                tree::send_tree(c, &url_path, Path::new(&local), &path)?
            };
            show(&e, None)?;
        }
        FilesCmd::Put {
            sandbox,
            local,
            path,
            mode,
            recursive: false,
        } => {
            let target = put_target(&local, &path)?;
            let e = put_file(c, &base_of(&sandbox), &local, &target, mode)?;
            show(&e, None)?;
        }
        FilesCmd::Ls {
            sandbox,
            path,
            depth,
        } => {
            let v = c.get_json(
                &files_path(&base_of(&sandbox), "/list"),
                &[("path", path), ("depth", depth.to_string())],
            )?;
            show(&v, Some(ls_table(items(&v, "entries")?, depth > 1)))?;
        }
        FilesCmd::Rm {
            sandbox,
            path,
            recursive,
        } => {
            c.delete(
                &files_path(&base_of(&sandbox), ""),
                &[("path", path), ("recursive", recursive.to_string())],
            )?;
        }
        FilesCmd::Mkdir { sandbox, path } => {
            let e = c.post_json(
                &files_path(&base_of(&sandbox), "/mkdir"),
                &json!({ "path": path }),
            )?;
            show(&e, None)?;
        }
        FilesCmd::Mv { sandbox, from, to } => {
            let e = c.post_json(
                &files_path(&base_of(&sandbox), "/move"),
                &json!({ "from": from, "to": to }),
            )?;
            show(&e, None)?;
        }
        FilesCmd::Stat { sandbox, path } => {
            let e = c.get_json(&files_path(&base_of(&sandbox), "/stat"), &[("path", path)])?;
            show(&e, Some(stat_text(&e)))?;
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_as_octal() {
        assert_eq!(parse_mode("0644").unwrap(), 0o644);
        assert_eq!(parse_mode("755").unwrap(), 0o755);
        assert_eq!(parse_mode("0o600").unwrap(), 0o600);
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("").is_err());
        assert!(parse_mode("17777").is_err());
        assert_eq!(mode_param(0o644), "0644");
        assert_eq!(mode_param(0o4755), "4755");
    }

    #[test]
    fn put_into_a_directory_keeps_the_name() {
        assert_eq!(put_target("./a/b.txt", "/root/").unwrap(), "/root/b.txt");
        assert_eq!(put_target("b.txt", "/root/c.txt").unwrap(), "/root/c.txt");
        assert_eq!(put_target("-", "/root/").unwrap_err().exit_code(), 2);
        assert_eq!(basename("/a/b/"), Some("b"));
        assert_eq!(basename("/"), None);
    }

    #[test]
    fn get_into_a_directory_keeps_the_name() {
        let dir = std::env::temp_dir();
        assert_eq!(get_target("/etc/hosts", &dir).unwrap(), dir.join("hosts"));
        let file = dir.join("surely-not-a-dir-locker-test");
        assert_eq!(get_target("/etc/hosts", &file).unwrap(), file);
        assert!(get_target("/", &dir).is_err());
    }

    #[test]
    fn listings_look_like_ls() {
        let entries = vec![
            serde_json::json!({"path": "/root/app", "name": "app", "type": "dir",
                               "size": 4096, "mode": 493, "mtime": "2026-11-30T12:00:00Z"}),
            serde_json::json!({"path": "/root/a.py", "name": "a.py", "type": "file",
                               "size": 12, "mode": 420, "mtime": "2026-11-30T12:05:09Z"}),
        ];
        assert_eq!(
            ls_table(&entries, false),
            "MODE        SIZE  MODIFIED          NAME\n\
             drwxr-xr-x  4.0K  2026-11-30 12:00  app/\n\
             -rw-r--r--  12    2026-11-30 12:05  a.py\n"
        );
        assert!(ls_table(&entries, true).contains("/root/app/"));
    }

    #[test]
    fn stat_shows_the_mode_both_ways() {
        let e = serde_json::json!({"path": "/root/a.py", "name": "a.py", "type": "file",
                                   "size": 2048, "mode": 420, "mtime": "2026-11-30T12:05:09Z"});
        assert_eq!(
            stat_text(&e),
            "path:  /root/a.py\n\
             type:  file\n\
             size:  2048 (2.0K)\n\
             mode:  0644 (-rw-r--r--)\n\
             mtime: 2026-11-30T12:05:09Z\n"
        );
    }
}
