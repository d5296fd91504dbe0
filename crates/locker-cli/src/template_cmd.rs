//! `locker template …`: build, import and list templates in `LOCKER_CACHE_DIR`; remove one
//! through the server; build from a Dockerfile, list and read templates through the server.
//!
//! A thin shell over `locker_runtime::template`: it parses arguments, draws progress on
//! stderr, and prints results on stdout. Errors become one line that says what to fix.
//! `rm` alone goes through the server (`DELETE /v1/templates/{name}`): only the server
//! knows which sandboxes and snapshots stand on a template, so only it can refuse while
//! one does; deleting the files under a running machine would pull its root away.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context};
use locker_runtime::template::{
    builtin_spec, validate_name, ImageLimits, ImageSource, RegistryAuth, StderrProgress, Template,
    TemplateSpec, TemplateStore,
};

#[derive(clap::Subcommand)]
pub enum TemplateCmd {
    /// Build a template (returns at once if the same content is already built).
    ///
    /// `locker template build default` builds the default Debian bookworm template,
    /// `locker template build code-interpreter` the code interpreter's (default's packages,
    /// Jupyter's Python kernel, numpy, pandas, matplotlib, scipy: about 6 minutes, 1.6 GiB);
    /// `--file spec.json` builds a spec file; NAME alone rebuilds a stored template's spec.
    ///
    /// `locker template build -f Dockerfile [--name N] [--build-arg K=V] DIR` builds a
    /// Dockerfile on the server at LOCKER_URL with DIR (default `.`) as its context, and
    /// follows the build (a progress bar on a terminal, log lines otherwise).
    Build {
        /// `default`, `code-interpreter`, a template built before, or (with --file) the name
        /// to give the spec; with a Dockerfile, the context directory.
        name: Option<String>,
        /// A JSON spec: {"name": …, "base": "debian:bookworm", "packages": […], "run": […]},
        /// or a Dockerfile (a file whose name holds `Dockerfile`, or any file not `*.json`).
        #[arg(long, short)]
        file: Option<PathBuf>,
        /// With a Dockerfile: the template's name [default: the context directory's name].
        #[arg(long = "name", value_name = "NAME")]
        template_name: Option<String>,
        /// With a Dockerfile: a value for one of its ARGs (repeatable).
        #[arg(long = "build-arg", value_name = "KEY=VALUE")]
        build_args: Vec<String>,
        /// With a Dockerfile: the build's network, `none` (default), `all`, or a
        /// comma-separated allowlist of names and CIDRs.
        #[arg(long)]
        network: Option<String>,
        #[command(flatten)]
        endpoint: crate::client::Endpoint,
        /// Print every line of mmdebstrap's and the run steps' output.
        #[arg(long, short)]
        verbose: bool,
        /// Print the template as JSON on stdout when done.
        #[arg(long)]
        json: bool,
    },
    /// Import a root filesystem tarball (plain, gzip, bzip2, xz or zstd) or an image
    /// archive (`docker save`, or an OCI archive) as a template.
    ///
    /// An image archive (told by its content: `manifest.json` or `oci-layout` at its top)
    /// goes to the server when one is named (`--url` or LOCKER_URL, with tenant `default`'s
    /// key), else into the local cache; a tarball always into the local cache.
    Import {
        /// The name to give it.
        name: String,
        /// The tarball or image archive.
        tarball: PathBuf,
        /// Print the template as JSON on stdout when done.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        endpoint: crate::client::Endpoint,
    },
    /// Pull an image from a registry into the local cache as a template.
    Pull {
        /// The name to give it.
        name: String,
        /// `registry/ns/name:tag` or `…@sha256:…` (Docker Hub's short forms allowed).
        reference: String,
        /// A registry (host or host:port) to speak plain HTTP to; repeatable.
        #[arg(long, value_name = "HOST")]
        plain_http: Vec<String>,
        /// The user name for the registry; the password is read from standard input.
        #[arg(long)]
        username: Option<String>,
        /// Print the template as JSON on stdout when done.
        #[arg(long)]
        json: bool,
    },
    /// List the templates in the cache, or the server's (yours and the shared ones) when
    /// LOCKER_URL or --url names one.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        endpoint: crate::client::Endpoint,
    },
    /// Show one template of the server at LOCKER_URL (JSON: digest, size, run config).
    Get {
        /// The template's name.
        name: String,
        #[command(flatten)]
        endpoint: crate::client::Endpoint,
    },
    /// Remove a template, through the server at LOCKER_URL (with tenant `default`'s
    /// LOCKER_API_KEY); refused while a sandbox or snapshot uses it.
    Rm {
        /// The template's name (`locker template list`).
        name: String,
        #[command(flatten)]
        conn: crate::client::Conn,
    },
}

pub fn run(cmd: TemplateCmd) -> anyhow::Result<()> {
    if let TemplateCmd::Rm { name, conn } = &cmd {
        validate_name(name).map_err(one_line)?;
        conn.client()?
            .delete(&format!("/v1/templates/{name}"), &[])?;
        println!("{name}");
        return Ok(());
    }
    if let TemplateCmd::Get { name, endpoint } = &cmd {
        validate_name(name).map_err(one_line)?;
        let v = endpoint
            .client()?
            .get_json(&format!("/v1/templates/{name}"), &[])?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if let TemplateCmd::List { json, endpoint } = &cmd {
        if endpoint.url.is_some() || std::env::var("LOCKER_URL").is_ok_and(|u| !u.trim().is_empty())
        {
            return list_remote(endpoint, *json);
        }
    }
    if let TemplateCmd::Build {
        name,
        file: Some(file),
        template_name,
        build_args,
        network,
        endpoint,
        json,
        ..
    } = &cmd
    {
        if is_dockerfile(file) {
            let dir = PathBuf::from(name.clone().unwrap_or_else(|| ".".into()));
            return build_dockerfile(
                endpoint,
                file,
                &dir,
                template_name.clone(),
                build_args,
                network.as_deref(),
                *json,
            );
        }
    }
    let store = TemplateStore::from_env().map_err(one_line)?;
    match cmd {
        TemplateCmd::Build {
            name,
            file,
            verbose,
            json,
            template_name,
            build_args,
            ..
        } => {
            if template_name.is_some() || !build_args.is_empty() {
                bail!("--name and --build-arg go with a Dockerfile (-f Dockerfile DIR)");
            }
            let spec = spec_to_build(&store, name, file)?;
            let t = store
                .build(&spec, &mut StderrProgress::new(verbose))
                .map_err(one_line)?;
            print_done(&t, json)
        }
        TemplateCmd::Import {
            name,
            tarball,
            json,
            endpoint,
        } => {
            if is_image_archive(&tarball)? {
                return import_image(&store, &name, &tarball, json, &endpoint);
            }
            let t = store
                .import(&name, &tarball, &mut StderrProgress::new(false))
                .map_err(one_line)?;
            print_done(&t, json)
        }
        TemplateCmd::Pull {
            name,
            reference,
            plain_http,
            username,
            json,
        } => pull(&store, &name, reference, plain_http, username, json),
        TemplateCmd::List { json, .. } => {
            let all = store.list().map_err(one_line)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                print_table(&all);
            }
            Ok(())
        }
        TemplateCmd::Rm { .. } | TemplateCmd::Get { .. } => unreachable!("handled above"),
    }
}

/// Whether `path` is an image archive: a plain tar with `manifest.json` (docker save) or
/// `oci-layout` (OCI) at its top. Reads headers only.
fn is_image_archive(path: &std::path::Path) -> anyhow::Result<bool> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut archive = tar::Archive::new(file);
    let Ok(entries) = archive.entries_with_seek() else {
        return Ok(false);
    };
    for entry in entries {
        let Ok(entry) = entry else {
            return Ok(false);
        };
        let name = entry.path_bytes();
        let name = name.strip_prefix(b"./").unwrap_or(&name);
        if name == b"manifest.json" || name == b"oci-layout" {
            return Ok(true);
        }
    }
    Ok(false)
}

/// An image archive into the server's cache when a server is named, else the local one.
fn import_image(
    store: &TemplateStore,
    name: &str,
    archive: &std::path::Path,
    json: bool,
    endpoint: &crate::client::Endpoint,
) -> anyhow::Result<()> {
    validate_name(name).map_err(one_line)?;
    let remote =
        endpoint.url.is_some() || std::env::var("LOCKER_URL").is_ok_and(|u| !u.trim().is_empty());
    if remote {
        let file = std::fs::File::open(archive)
            .with_context(|| format!("cannot open {}", archive.display()))?;
        eprintln!("uploading {} to {}", archive.display(), endpoint.base_url());
        let t = endpoint
            .client()?
            .put_body(&format!("/v1/templates/{name}/image"), &[], file)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&t)?);
        } else {
            let digest = t["digest"].as_str().unwrap_or_default();
            println!(
                "{} {} {}",
                t["name"].as_str().unwrap_or(name),
                short(digest),
                human_size(t["size_bytes"].as_u64().unwrap_or(0))
            );
        }
        return Ok(());
    }
    let t = store
        .import_image_archive(
            name,
            archive,
            ImageLimits::from_env(),
            &mut StderrProgress::new(true),
        )
        .map_err(one_line)?;
    print_done(&t, json)
}

/// `locker template pull`: a registry image into the local cache.
fn pull(
    store: &TemplateStore,
    name: &str,
    reference: String,
    plain_http: Vec<String>,
    username: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let auth = match username {
        Some(username) => {
            let mut password = String::new();
            std::io::stdin()
                .read_line(&mut password)
                .context("cannot read the registry password from standard input")?;
            Some(RegistryAuth {
                username,
                password: password.trim_end_matches(['\r', '\n']).to_string(),
            })
        }
        None => None,
    };
    let source = ImageSource {
        reference,
        auth,
        plain_http,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let t = rt
        .block_on(store.pull_image(
            name,
            &source,
            ImageLimits::from_env(),
            &mut StderrProgress::new(true),
        ))
        .map_err(one_line)?;
    print_done(&t, json)
}

/// Library errors already say what to fix; keep them to their one line.
fn one_line(e: locker_runtime::template::TemplateError) -> anyhow::Error {
    anyhow!("{e}")
}

fn spec_to_build(
    store: &TemplateStore,
    name: Option<String>,
    file: Option<PathBuf>,
) -> anyhow::Result<TemplateSpec> {
    if let Some(file) = file {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("cannot read spec file {}", file.display()))?;
        let mut spec =
            TemplateSpec::from_json(&text).map_err(|e| anyhow!("{}: {e}", file.display()))?;
        if let Some(name) = name {
            validate_name(&name).map_err(one_line)?;
            spec.name = name;
        }
        return Ok(spec);
    }
    let Some(name) = name else {
        bail!("say what to build: `locker template build default`, `locker template build code-interpreter` or `--file spec.json`");
    };
    if let Some(spec) = builtin_spec(&name) {
        return Ok(spec);
    }
    let Some(stored) = store.resolve(&name).map_err(one_line)? else {
        bail!(
            "no template named {name:?}: give its spec with `--file spec.json`, \
             or build `default`"
        );
    };
    match store.spec_of(&stored).map_err(one_line)? {
        Some(mut spec) => {
            spec.name = name;
            Ok(spec)
        }
        None => bail!(
            "template {name:?} was imported from a tarball, not built from a spec: \
             there is nothing to build"
        ),
    }
}

fn print_done(t: &Template, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(t)?);
    } else {
        println!(
            "{} {} {} {}",
            t.name,
            short(&t.digest),
            human_size(t.size_bytes),
            t.rootfs.display()
        );
    }
    Ok(())
}

fn print_table(all: &[Template]) {
    let rows: Vec<[String; 5]> = all
        .iter()
        .map(|t| {
            [
                if t.name.is_empty() {
                    "-".into()
                } else {
                    t.name.clone()
                },
                short(&t.digest).to_string(),
                human_size(t.size_bytes),
                t.created_at.clone(),
                t.packages.len().to_string(),
            ]
        })
        .collect();
    let header = ["NAME", "DIGEST", "SIZE", "CREATED", "PACKAGES"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

fn short(digest: &str) -> &str {
    &digest[..digest.len().min(12)]
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Whether `-f FILE` names a Dockerfile rather than a JSON spec.
fn is_dockerfile(file: &std::path::Path) -> bool {
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    name.contains("dockerfile") || !name.ends_with(".json")
}

/// `locker template list` against a server: name, digest, size, creation.
fn list_remote(endpoint: &crate::client::Endpoint, json: bool) -> anyhow::Result<()> {
    let v = endpoint.client()?.get_json("/v1/templates", &[])?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v["templates"])?);
        return Ok(());
    }
    let all: Vec<Template> = v["templates"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|t| Template {
            name: t["name"].as_str().unwrap_or("").to_string(),
            digest: t["digest"].as_str().unwrap_or("").to_string(),
            rootfs: PathBuf::new(),
            size_bytes: t["size_bytes"].as_u64().unwrap_or(0),
            created_at: t["created_at"].as_str().unwrap_or("").to_string(),
            packages: serde_json::from_value(t["packages"].clone()).unwrap_or_default(),
            config: Default::default(),
        })
        .collect();
    print_table(&all);
    Ok(())
}

/// Uploads `dir` as the context, starts the Dockerfile's build and follows it.
fn build_dockerfile(
    endpoint: &crate::client::Endpoint,
    file: &std::path::Path,
    dir: &std::path::Path,
    name: Option<String>,
    build_args: &[String],
    network: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    use std::io::{BufRead, IsTerminal};
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read the Dockerfile {}", file.display()))?;
    if !dir.is_dir() {
        bail!("the context {} is not a directory", dir.display());
    }
    let name = match name {
        Some(n) => n,
        None => {
            let base = dir
                .canonicalize()
                .ok()
                .and_then(|d| {
                    d.file_name()
                        .map(|n| n.to_string_lossy().to_ascii_lowercase())
                })
                .unwrap_or_default();
            let clean: String = base
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || "._-".contains(c) {
                        c
                    } else {
                        '-'
                    }
                })
                .collect();
            let clean = clean.trim_start_matches(['.', '_', '-']).to_string();
            if clean.is_empty() {
                bail!("give the template a name with --name");
            }
            clean
        }
    };
    validate_name(&name).map_err(one_line)?;
    let mut args = serde_json::Map::new();
    for a in build_args {
        let (k, v) = crate::client::parse_kv(a).map_err(|e| anyhow!("--build-arg {a:?}: {e}"))?;
        args.insert(k, serde_json::Value::String(v));
    }
    let network = match network {
        None | Some("none") => serde_json::json!({"egress": "none"}),
        Some("all") => serde_json::json!({"egress": "all"}),
        Some(list) => {
            serde_json::json!({"egress": "allow", "allow": list.split(',').map(str::trim).collect::<Vec<_>>()})
        }
    };
    let client = endpoint.client()?;
    // The context: DIR as a tar archive in a temporary file, streamed with its length.
    let tar_path = std::env::temp_dir().join(format!("locker-context-{}.tar", std::process::id()));
    let result = (|| -> anyhow::Result<serde_json::Value> {
        let f = std::fs::File::create(&tar_path)
            .with_context(|| format!("cannot create {}", tar_path.display()))?;
        let mut b = tar::Builder::new(f);
        b.follow_symlinks(false);
        b.append_dir_all(".", dir)
            .with_context(|| format!("cannot archive the context {}", dir.display()))?;
        b.into_inner()?.sync_all()?;
        let f = std::fs::File::open(&tar_path)?;
        Ok(client.post_body("/v1/templates/contexts", &[], f)?)
    })();
    let _ = std::fs::remove_file(&tar_path);
    let ctx = result?;
    let body = serde_json::json!({
        "name": name,
        "from": {"dockerfile": text, "context_id": ctx["context_id"]},
        "build_args": args,
        "network": network,
    });
    let started = client.post_json("/v1/templates", &body)?;
    let id = started["build_id"].as_str().unwrap_or_default().to_string();
    let stream = client.get_stream_accept(
        &format!("/v1/templates/builds/{id}"),
        &[("follow", "true".to_string())],
        "application/x-ndjson",
    )?;
    let tty = std::io::stderr().is_terminal();
    let mut bar = String::new();
    let mut result = serde_json::Value::Null;
    for line in std::io::BufReader::new(stream).lines() {
        let line = line.context("reading the build's progress")?;
        let Ok(ev) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        match ev["type"].as_str() {
            Some("log") => {
                let text = ev["line"].as_str().unwrap_or("");
                if tty {
                    eprint!("\r\x1b[K{text}\n{bar}");
                } else {
                    eprintln!("{text}");
                }
            }
            Some("progress") if tty => {
                let (step, steps) = (
                    ev["step"].as_u64().unwrap_or(0),
                    ev["steps"].as_u64().unwrap_or(1),
                );
                let done = (step * 30 / steps.max(1)) as usize;
                bar = format!(
                    "[{}{}] step {step}/{steps} · {}",
                    "#".repeat(done),
                    ".".repeat(30 - done.min(30)),
                    human_size(ev["bytes"].as_u64().unwrap_or(0))
                );
                eprint!("\r\x1b[K{bar}");
            }
            Some("result") => result = ev,
            _ => {}
        }
    }
    if tty {
        eprint!("\r\x1b[K");
    }
    if result["state"] != "succeeded" {
        bail!(
            "build {id} failed: {}",
            result["error"]
                .as_str()
                .unwrap_or("the stream ended without a result")
        );
    }
    let t = &result["template"];
    if json {
        println!("{}", serde_json::to_string_pretty(t)?);
    } else {
        println!(
            "{} {} {}",
            t["name"].as_str().unwrap_or(""),
            short(t["digest"].as_str().unwrap_or("")),
            human_size(t["size_bytes"].as_u64().unwrap_or(0))
        );
    }
    Ok(())
}
