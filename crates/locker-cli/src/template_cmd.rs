//! `locker template …`: build, import and list templates in `LOCKER_CACHE_DIR`; remove one
//! through the server.
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
    Build {
        /// `default`, `code-interpreter`, a template built before, or (with --file) the name
        /// to give the spec.
        name: Option<String>,
        /// A JSON spec: {"name": …, "base": "debian:bookworm", "packages": […], "run": […]}.
        #[arg(long, short)]
        file: Option<PathBuf>,
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
    /// List the templates in the cache.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
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
    let store = TemplateStore::from_env().map_err(one_line)?;
    match cmd {
        TemplateCmd::Build {
            name,
            file,
            verbose,
            json,
        } => {
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
        TemplateCmd::List { json } => {
            let all = store.list().map_err(one_line)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                print_table(&all);
            }
            Ok(())
        }
        TemplateCmd::Rm { .. } => unreachable!("handled above"),
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
