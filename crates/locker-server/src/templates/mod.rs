//! Templates over the API: building them (`POST /v1/templates` from a template, an image,
//! a Dockerfile with an uploaded context, or a package list), following a build
//! (`GET /v1/templates/builds/{id}`), listing, reading and removing them.
//!
//! Templates are per tenant: a tenant sees its own and the shared `default` and
//! `code-interpreter`. The host's cache has one namespace, so another tenant's template
//! `web` is stored as `t<12 hex of its tenant's name's sha256>.web` and shown as `web`;
//! tenant `default` (the host's owner, whose templates the CLI builds) keeps plain
//! names. [`resolve_for`] is how sandboxes and runs find a tenant's template by name.
//!
//! Rooms: `builds` (states, logs, slots, records), `dockerfile` (parse and plan),
//! `steps` (running a plan into cached step templates), `contexts` (uploads).
//! This room never mounts a template and never touches a sandbox; it starts machines
//! only through `steps` (a RUN).

mod builds;
mod contexts;
pub mod dockerfile;
mod steps;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use locker_runtime::template::{
    validate_name, ImageLimits, ImageSource, RegistryAuth, RunConfig, StepCacheLimits, Template,
    TemplateSpec, CODE_INTERPRETER_TEMPLATE, DEFAULT_BASE, DEFAULT_TEMPLATE,
};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::events::Kind;
use crate::extract::{Json, Query};
use crate::state::{new_id, AppState};

pub use builds::{fail_interrupted, Builds};
use dockerfile::Step;

/// Templates every tenant sees.
const SHARED: &[&str] = &[DEFAULT_TEMPLATE, CODE_INTERPRETER_TEMPLATE];
/// The longest name a tenant may give (the cache's 63 less the tenant prefix).
const MAX_NAME: usize = 49;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/templates", get(list).post(create))
        .route(
            "/v1/templates/contexts",
            post(contexts::upload).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/templates/builds", get(list_builds))
        .route("/v1/templates/builds/{id}", get(build_status))
        .route("/v1/templates/{name}", get(get_one).delete(remove))
}

/// A tenant's tag in the cache's names.
pub fn tenant_tag(tenant: &str) -> String {
    let d = Sha256::digest(tenant.as_bytes());
    format!("t{}", &locker_sys::hex::encode(&d)[..12])
}

/// The cache's name of `tenant`'s template `name`.
pub fn store_name(tenant: &str, name: &str) -> String {
    if tenant == locker_store::DEFAULT_TENANT || SHARED.contains(&name) {
        name.to_string()
    } else {
        format!("{}.{name}", tenant_tag(tenant))
    }
}

/// The name `tenant` knows the cache's `stored` by, if it is one of its templates (or a
/// shared one).
fn shown_name(tenant: &str, stored: &str) -> Option<String> {
    if stored.is_empty() {
        return None;
    }
    if SHARED.contains(&stored) {
        return Some(stored.to_string());
    }
    let qualified = is_qualified(stored);
    if tenant == locker_store::DEFAULT_TENANT {
        return (!qualified).then(|| stored.to_string());
    }
    stored
        .strip_prefix(&format!("{}.", tenant_tag(tenant)))
        .map(str::to_string)
}

fn is_qualified(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > 14 && b[0] == b't' && b[13] == b'.' && b[1..13].iter().all(u8::is_ascii_hexdigit)
}

/// Checks a name a tenant gives its template.
fn check_name(name: &str) -> Result<(), ApiError> {
    validate_name(name).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if name.len() > MAX_NAME {
        return Err(ApiError::bad_request(format!(
            "template name {name:?} is longer than {MAX_NAME} characters"
        )));
    }
    if is_qualified(name) {
        return Err(ApiError::bad_request(format!(
            "template name {name:?} has the form of a tenant's stored name (t + 12 hex digits + .): choose another"
        )));
    }
    if SHARED.contains(&name) {
        return Err(ApiError::conflict(format!(
            "{name:?} is a template every tenant shares: give yours another name"
        )));
    }
    Ok(())
}

/// The template of digest `digest`, which `whose` (a sandbox, a snapshot) stands on; 409
/// when this host no longer has it.
pub fn by_digest(app: &AppState, digest: &str, whose: &str) -> Result<Template, ApiError> {
    app.templates
        .resolve(digest)
        .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?
        .ok_or_else(|| {
            ApiError::conflict(format!(
                "the template of {whose} ({digest}) is not on this host"
            ))
        })
}

/// `tenant`'s template `name` (or a shared one), shown under `name`. Tenant `default` may
/// also name a template by digest, as the CLI does.
pub fn resolve_for(app: &AppState, tenant: &str, name: &str) -> Result<Option<Template>, ApiError> {
    let read = |e: locker_runtime::template::TemplateError| {
        ApiError::internal(format!("reading templates: {e}"))
    };
    if tenant == locker_store::DEFAULT_TENANT {
        return app.templates.resolve(name).map_err(read);
    }
    if validate_name(name).is_err() || (!SHARED.contains(&name) && name.len() > MAX_NAME) {
        return Ok(None);
    }
    let stored = store_name(tenant, name);
    Ok(app
        .templates
        .resolve(&stored)
        .map_err(read)?
        .filter(|t| t.name == stored)
        .map(|mut t| {
            t.name = name.to_string();
            t
        }))
}

fn view(name: &str, t: &Template) -> Value {
    json!({
        "name": name,
        "digest": t.digest,
        "size_bytes": t.size_bytes,
        "created_at": t.created_at,
        "packages": t.packages,
        "env": t.config.env,
        "workdir": t.config.workdir,
        "user": t.config.user,
        "start_cmd": t.config.start_cmd,
        "ready_cmd": t.config.ready_cmd,
        "exposed_ports": t.config.exposed_ports,
        "labels": t.config.labels,
    })
}

async fn list(State(app): State<AppState>, caller: Caller) -> Result<impl IntoResponse, ApiError> {
    let store = app.templates.clone();
    let all = tokio::task::spawn_blocking(move || store.list())
        .await
        .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?
        .map_err(|e| ApiError::internal(format!("reading templates: {e}")))?;
    let items: Vec<Value> = all
        .iter()
        .filter_map(|t| shown_name(&caller.tenant, &t.name).map(|n| view(&n, t)))
        .collect();
    Ok(axum::Json(json!({ "templates": items })))
}

async fn get_one(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let t = resolve_for(&app, &caller.tenant, &name)?.ok_or_else(|| not_found(&name))?;
    Ok(axum::Json(view(&name, &t)))
}

fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "template {name:?} does not exist: `locker template list` (GET /v1/templates) lists yours"
    ))
}

/// `DELETE /v1/templates/{name}`: 409 while a sandbox or snapshot of any tenant stands on
/// it or a build makes it; the shared templates only by tenant `default`, and `default`
/// never. The name goes; the files go once no other name points at them.
async fn remove(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    if SHARED.contains(&name.as_str()) && caller.tenant != locker_store::DEFAULT_TENANT {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("{name:?} is shared by every tenant of this host: only tenant `default` (the host's owner) may remove it"),
        ));
    }
    if name == DEFAULT_TEMPLATE {
        return Err(ApiError::conflict(
            "the template `default` is what creates and runs use when they name none, and the warm pools hold it: rebuild it with `locker template build default` rather than remove it",
        ));
    }
    let t = resolve_for(&app, &caller.tenant, &name)?
        .filter(|t| t.name == name)
        .ok_or_else(|| not_found(&name))?;
    if let Some(user) = user_of(&app, &t.digest)? {
        return Err(ApiError::conflict(format!(
            "template {name:?} is in use by {user}: delete that first"
        )));
    }
    if app.builds.building(&caller.tenant, &name) {
        return Err(ApiError::conflict(format!(
            "template {name:?} is being built: wait for the build to end"
        )));
    }
    let (store, stored) = (app.templates.clone(), store_name(&caller.tenant, &name));
    tokio::task::spawn_blocking(move || store.remove(&stored, |_| false))
        .await
        .map_err(|e| ApiError::internal(format!("removing the template: {e}")))?
        .map_err(|e| ApiError::internal(format!("removing the template: {e}")))?
        .ok_or_else(|| not_found(&name))?;
    // Its steps may be all that is left of it.
    tokio::spawn(prune_steps(app.clone()));
    Ok(StatusCode::NO_CONTENT)
}

/// A sandbox or snapshot of any tenant of this server that stands on `digest`.
fn user_of(app: &AppState, digest: &str) -> Result<Option<String>, ApiError> {
    if let Some(s) = app
        .store
        .list_live_sandboxes()?
        .into_iter()
        .find(|s| s.template_digest == digest)
    {
        return Ok(Some(format!("sandbox {} (tenant {})", s.id, s.tenant)));
    }
    for tenant in app.store.list_tenants()? {
        if let Some(s) = app
            .store
            .list_snapshots(&tenant)?
            .into_iter()
            .find(|s| s.template_digest == digest)
        {
            return Ok(Some(format!("snapshot {} (tenant {tenant})", s.id)));
        }
    }
    Ok(None)
}

/// `POST /v1/templates`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    name: String,
    #[serde(default)]
    from: Option<FromBody>,
    #[serde(default)]
    base: Option<String>,
    #[serde(default)]
    packages: Vec<String>,
    #[serde(default)]
    run: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    workdir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    start_cmd: Option<Command>,
    #[serde(default)]
    ready_cmd: Option<String>,
    #[serde(default)]
    network: Option<locker_types::NetworkPolicy>,
    /// Values of a Dockerfile's `ARG`s.
    #[serde(default)]
    build_args: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Command {
    Shell(String),
    Argv(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FromBody {
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    auth: Option<RegistryAuth>,
    #[serde(default)]
    dockerfile: Option<String>,
    #[serde(default)]
    context_id: Option<String>,
}

/// What a build starts from.
enum Base {
    Template(Template),
    Image(ImageSource),
    /// The packages form: mmdebstrap.
    Spec(TemplateSpec),
}

/// The largest Dockerfile accepted.
const MAX_DOCKERFILE_BYTES: usize = 256 << 10;

async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Json(b): Json<CreateBody>,
) -> Result<Response, ApiError> {
    check_name(&b.name)?;
    let tenant = caller.tenant.clone();
    let network = crate::limits::check_network(b.network.as_ref())?;
    crate::limits::require_egress(&network).await?;
    crate::limits::check_env(&b.env)?;
    let mut config = RunConfig {
        env: b.env.clone(),
        workdir: b.workdir.clone(),
        user: b.user.clone(),
        start_cmd: b.start_cmd.map(|c| match c {
            Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s],
            Command::Argv(v) => v,
        }),
        ready_cmd: b.ready_cmd.clone(),
        ..Default::default()
    };
    if let Some(w) = &config.workdir {
        if !w.starts_with('/') {
            return Err(ApiError::bad_request(format!(
                "`workdir` {w:?} must be an absolute path"
            )));
        }
    }
    if config.start_cmd.as_ref().is_some_and(|c| c.is_empty()) {
        return Err(ApiError::bad_request("`start_cmd` is empty"));
    }
    for p in &b.packages {
        if !p
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"+.-".contains(&c))
            || p.len() < 2
        {
            return Err(ApiError::bad_request(format!(
                "{p:?} is not a Debian package name"
            )));
        }
    }
    let from = b.from.as_ref();
    let sources = from.map_or(0, |f| {
        [
            f.template.is_some(),
            f.image.is_some(),
            f.dockerfile.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count()
    });
    if from.is_some() && sources != 1 {
        return Err(ApiError::bad_request(
            "`from` takes exactly one of `template`, `image` or `dockerfile`",
        ));
    }
    if from.is_some() && b.base.is_some() {
        return Err(ApiError::bad_request(
            "`base` belongs to the packages form: with `from`, leave it out",
        ));
    }
    if from.is_some_and(|f| f.dockerfile.is_none() && f.context_id.is_some()) {
        return Err(ApiError::bad_request(
            "`context_id` goes with `from.dockerfile` only",
        ));
    }
    let mut context = None;
    let (base, steps) = match from {
        Some(FromBody {
            dockerfile: Some(text),
            context_id,
            auth,
            ..
        }) => {
            if text.len() > MAX_DOCKERFILE_BYTES {
                return Err(ApiError::too_large(format!(
                    "the Dockerfile is larger than {} KiB",
                    MAX_DOCKERFILE_BYTES >> 10
                )));
            }
            if !b.packages.is_empty() || !b.run.is_empty() {
                return Err(ApiError::bad_request(
                    "with a Dockerfile, write `packages` and `run` as RUN lines in it",
                ));
            }
            let raw = dockerfile::parse(text).map_err(|e| ApiError::bad_request(e.to_string()))?;
            let plan = dockerfile::plan(&raw, &b.build_args)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            if let Some(id) = context_id {
                let ctx = contexts::find(&app, &tenant, id)?;
                // Sources that leave the context or are missing are the client's to fix now.
                for (line, _, s) in &plan.steps {
                    if let Step::Copy { srcs, .. } = s {
                        steps::expand_sources(&ctx, srcs).map_err(|e| {
                            ApiError::bad_request(format!(
                                "Dockerfile line {line}: COPY {e} (sources are paths inside the uploaded context)"
                            ))
                        })?;
                    }
                }
                context = Some(ctx);
            } else if let Some((line, _, _)) = plan
                .steps
                .iter()
                .find(|(_, _, s)| matches!(s, Step::Copy { .. }))
            {
                return Err(ApiError::bad_request(format!(
                    "Dockerfile line {line}: COPY needs a build context: upload it (POST /v1/templates/contexts, a tar body) and pass its `context_id`"
                )));
            }
            config = steps::merge_config(&plan.config, &config);
            let Step::From { image } = &plan.steps[0].2 else {
                unreachable!("a plan starts with FROM")
            };
            let base = match resolve_for(&app, &tenant, image)? {
                Some(t) => Base::Template(t),
                // `from.auth` is the credentials of the registry the FROM image is in.
                None => image_base(image, auth.clone())?,
            };
            (base, plan.steps)
        }
        Some(FromBody {
            template: Some(t), ..
        }) => {
            let base = resolve_for(&app, &tenant, t)?.ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unknown template {t:?}: GET /v1/templates lists yours"
                ))
            })?;
            let from = Step::From { image: t.clone() };
            (
                Base::Template(base),
                simple_steps(from, &b.packages, &b.run, &network)?,
            )
        }
        Some(FromBody {
            image: Some(r),
            auth,
            ..
        }) => {
            let from = Step::From { image: r.clone() };
            (
                image_base(r, auth.clone())?,
                simple_steps(from, &b.packages, &b.run, &network)?,
            )
        }
        _ => {
            if b.packages.is_empty() && b.run.is_empty() {
                return Err(ApiError::bad_request(
                    "say what to build: `from` (a template, an image or a Dockerfile) or `packages`/`run` on Debian bookworm",
                ));
            }
            if !app.cfg.template_build {
                return Err(ApiError::unavailable(
                    "this server does not build templates from packages (it runs without root or mmdebstrap): build from `default` with `from: {\"template\": \"default\"}` instead",
                ));
            }
            let spec = TemplateSpec {
                name: store_name(&tenant, &b.name),
                base: b.base.clone().unwrap_or_else(|| DEFAULT_BASE.to_string()),
                packages: b.packages.clone(),
                run: b.run.clone(),
            };
            spec.validate()
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            (
                Base::Spec(spec),
                vec![(
                    0,
                    "FROM debian:bookworm".to_string(),
                    Step::From {
                        image: DEFAULT_BASE.into(),
                    },
                )],
            )
        }
    };
    let id = new_id("tpl_");
    let build = app
        .builds
        .start(&id, &tenant, &b.name)
        .map_err(ApiError::quota)?;
    build.save(&app);
    let slots = app.builds.slots(&tenant, app.cfg.quotas.template_builds);
    let name = b.name.clone();
    let app2 = app.clone();
    tokio::spawn(async move {
        let app = app2;
        let _slot = slots.acquire_owned().await;
        let running = app.builds.gate().read().await;
        build.running(&app);
        build.log(format!(
            "building template {name:?} ({} steps)",
            steps.len()
        ));
        let result = execute(
            &app, &build, &tenant, &name, base, steps, context, network, config,
        )
        .await;
        match &result {
            Ok(t) => app.events.emit(
                &tenant,
                Kind::TemplateBuilt,
                &name,
                json!({"build_id": build.id, "digest": t["digest"]}),
            ),
            Err(e) => {
                build.log(format!("failed: {e}"));
                app.events.emit(
                    &tenant,
                    Kind::TemplateFailed,
                    &name,
                    json!({"build_id": build.id, "reason": e}),
                )
            }
        }
        build.finish(&app, result);
        drop(running);
        prune_steps(app).await;
    });
    Ok((StatusCode::ACCEPTED, axum::Json(json!({ "build_id": id }))).into_response())
}

/// Bounds the step cache (`locker_runtime::template::prune`) after a build or a removal,
/// with the limits `LOCKER_STEP_CACHE_*` set; skipped while a build runs.
async fn prune_steps(app: AppState) {
    let Ok(_quiet) = app.builds.gate().try_write() else {
        return;
    };
    let in_use = match digests_in_use(&app) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("pruning the step cache: {}", e.message);
            return;
        }
    };
    let store = app.templates.clone();
    let limits = StepCacheLimits::from_env();
    match tokio::task::spawn_blocking(move || store.prune_steps(limits, &in_use)).await {
        Ok(Ok(p)) if !p.removed.is_empty() => tracing::info!(
            removed = p.removed.len(),
            bytes = p.bytes,
            kept = p.kept,
            kept_bytes = p.kept_bytes,
            "pruned the template step cache"
        ),
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!("pruning the step cache: {e}"),
        Err(e) => tracing::warn!("pruning the step cache: {e}"),
    }
}

/// The template digests sandboxes (live or failed, not yet deleted) and snapshots of any
/// tenant stand on.
fn digests_in_use(app: &AppState) -> Result<std::collections::HashSet<String>, ApiError> {
    let mut used: std::collections::HashSet<String> = app
        .store
        .list_live_sandboxes()?
        .into_iter()
        .map(|s| s.template_digest)
        .collect();
    for tenant in app.store.list_tenants()? {
        used.extend(
            app.store
                .list_snapshots(&tenant)?
                .into_iter()
                .map(|s| s.template_digest),
        );
    }
    Ok(used)
}

fn image_base(reference: &str, auth: Option<RegistryAuth>) -> Result<Base, ApiError> {
    if reference.is_empty()
        || reference.len() > 512
        || reference.contains(char::is_whitespace)
        || reference == "scratch"
    {
        return Err(ApiError::bad_request(format!(
            "{reference:?} is neither one of your templates nor an image reference such as registry/ns/name:tag"
        )));
    }
    let plain_http = std::env::var("LOCKER_PLAIN_HTTP_REGISTRIES")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    Ok(Base::Image(ImageSource {
        reference: reference.to_string(),
        auth,
        plain_http,
    }))
}

/// The steps of the template and image forms: the packages (one apt step, which needs a
/// network policy that reaches the mirror) then each `run`, as root in `/`.
fn simple_steps(
    from: Step,
    packages: &[String],
    run: &[String],
    network: &Value,
) -> Result<Vec<(usize, String, Step)>, ApiError> {
    let mut steps = vec![(
        0,
        format!(
            "FROM {}",
            match &from {
                Step::From { image } => image.as_str(),
                _ => "",
            }
        ),
        from,
    )];
    let mut cmds = Vec::new();
    if !packages.is_empty() {
        if !crate::limits::has_egress(network) {
            return Err(ApiError::bad_request(
                "`packages` are installed with apt inside the build, which needs a network: give the build a `network` policy that reaches the Debian mirror (for example {\"egress\": \"allow\", \"allow\": [\"deb.debian.org\"]})",
            ));
        }
        cmds.push(format!(
            "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {} && rm -rf /var/lib/apt/lists/*",
            packages.join(" ")
        ));
    }
    for (i, r) in run.iter().enumerate() {
        if r.trim().is_empty() || r.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "`run[{i}]` is empty or holds a NUL byte"
            )));
        }
        cmds.push(r.clone());
    }
    for c in cmds {
        steps.push((
            0,
            format!("RUN {c}"),
            Step::Run {
                argv: vec!["/bin/sh".into(), "-c".into(), c],
                env: Vec::new(),
                workdir: "/".into(),
                user: None,
            },
        ));
    }
    Ok(steps)
}

/// Runs one build to its template JSON (named for the tenant) or its error.
#[allow(clippy::too_many_arguments)]
async fn execute(
    app: &AppState,
    build: &builds::Build,
    tenant: &str,
    name: &str,
    base: Base,
    steps: Vec<(usize, String, Step)>,
    context: Option<std::path::PathBuf>,
    network: Value,
    config: RunConfig,
) -> Result<Value, String> {
    let stored = store_name(tenant, name);
    let base = match base {
        Base::Template(t) => t,
        Base::Image(src) => {
            build.log(format!("pulling {}", src.reference));
            let image_name = store_name(
                tenant,
                &format!(
                    "image-{}",
                    &locker_sys::hex::encode(&Sha256::digest(src.reference.as_bytes()))[..16]
                ),
            );
            let mut progress = LogProgress(build);
            app.templates
                .pull_image(&image_name, &src, ImageLimits::default(), &mut progress)
                .await
                .map_err(|e| format!("pulling {}: {e}", src.reference))?
        }
        Base::Spec(spec) => {
            build.log("installing Debian packages with mmdebstrap".to_string());
            let store = app.templates.clone();
            tokio::task::spawn_blocking(move || {
                store.build(&spec, &mut locker_runtime::template::NoProgress)
            })
            .await
            .map_err(|e| format!("the build task failed: {e}"))?
            .map_err(|e| e.to_string())?
        }
    };
    let job = steps::Job {
        tenant: tenant.to_string(),
        network,
        context,
        base,
        config,
    };
    let t = steps::run(app, build, &job, &steps).await?;
    let store = app.templates.clone();
    let digest = t.digest.clone();
    let named = tokio::task::spawn_blocking(move || store.name_digest(&stored, &digest))
        .await
        .map_err(|e| format!("the build task failed: {e}"))?
        .map_err(|e| format!("naming the template: {e}"))?;
    Ok(view(name, &named))
}

/// An image pull's progress as build log lines.
struct LogProgress<'a>(&'a builds::Build);

impl locker_runtime::template::Progress for LogProgress<'_> {
    fn step(&mut self, name: &str, _fraction: f64) {
        self.0.log(name.to_string());
    }

    fn fraction(&mut self, _fraction: f64) {}
}

#[derive(Debug, Deserialize)]
struct FollowQuery {
    #[serde(default)]
    follow: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildsQuery {
    limit: Option<u32>,
}

/// `GET /v1/templates/builds`: the tenant's newest builds, newest first, without their
/// logs (`GET /v1/templates/builds/{id}` has a build's log; the dashboard's list).
async fn list_builds(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<BuildsQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "`limit` must be 1 to 100, got {limit}"
        )));
    }
    let builds: Vec<Value> = app
        .store
        .list_template_builds(&caller.tenant, limit)?
        .iter()
        .filter_map(|r| serde_json::from_str::<Value>(r).ok())
        .map(|v| {
            // A build of this server is newer in memory (its step, its state) than stored.
            let mut v = v["build_id"]
                .as_str()
                .and_then(|id| app.builds.get(&caller.tenant, id))
                .map_or(v, |b| b.to_json());
            if let Some(o) = v.as_object_mut() {
                o.remove("log");
            }
            builds::shown(v)
        })
        .collect();
    Ok(axum::Json(json!({ "builds": builds })).into_response())
}

/// `GET /v1/templates/builds/{id}`: the build as JSON, or with `?follow=true` its events
/// as NDJSON from the first, ending with the result.
async fn build_status(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<FollowQuery>,
) -> Result<Response, ApiError> {
    let missing = || {
        ApiError::not_found(format!(
            "template build {id:?} does not exist: POST /v1/templates answers a build_id"
        ))
    };
    let Some(build) = app.builds.get(&caller.tenant, &id) else {
        let rec = app
            .store
            .get_template_build(&caller.tenant, &id)?
            .ok_or_else(missing)?;
        let v: Value = serde_json::from_str(&rec)
            .map(builds::shown)
            .map_err(|e| ApiError::internal(format!("reading the build's record: {e}")))?;
        if !q.follow {
            return Ok(axum::Json(v).into_response());
        }
        let (tx, resp) = crate::stream::ndjson_response();
        tokio::spawn(async move {
            for line in v["log"].as_array().cloned().unwrap_or_default() {
                crate::stream::send_line(&tx, &json!({"type": "log", "line": line})).await;
            }
            let mut r = json!({"type": "result", "state": v["state"], "template": v["template"]});
            if !v["error"].is_null() {
                r["error"] = v["error"].clone();
            }
            crate::stream::send_line(&tx, &r).await;
        });
        return Ok(resp);
    };
    if !q.follow {
        return Ok(axum::Json(build.to_json()).into_response());
    }
    let (tx, resp) = crate::stream::ndjson_response();
    tokio::spawn(async move {
        let mut at = 0;
        loop {
            let (evs, done) = build.events_from(at);
            at += evs.len();
            for ev in &evs {
                if tx.is_closed() {
                    return;
                }
                crate::stream::send_line(&tx, ev).await;
            }
            if done {
                return;
            }
            tokio::select! {
                _ = build.wait_past(at) => {}
                _ = tx.closed() => return,
            }
        }
    });
    Ok(resp)
}

/// The run config of the template `digest` (templates never change, so it is read once).
pub fn run_config(app: &AppState, digest: &str) -> std::sync::Arc<RunConfig> {
    app.builds.config_of(digest, || {
        app.templates
            .by_digest(digest)
            .ok()
            .flatten()
            .map(|t| t.config)
            .unwrap_or_default()
    })
}

/// Gives an exec of a sandbox or run on template `digest` the template's working directory
/// and user where the call names none, and its environment under the call's.
pub fn apply_defaults(app: &AppState, digest: &str, spec: &mut locker_proto::ExecSpec) {
    let c = run_config(app, digest);
    if spec.cwd.is_none() {
        spec.cwd = c.workdir.clone();
    }
    if spec.user.is_none() {
        spec.user = c.user.clone();
    }
    for (k, v) in &c.env {
        if !spec.env.iter().any(|(e, _)| e == k) {
            spec.env.push((k.clone(), v.clone()));
        }
    }
}

/// How long a template's ready command may take to succeed at a sandbox's create, unless
/// [`READY_TIMEOUT_ENV`] says otherwise (seconds).
const READY_TIMEOUT_S: u64 = 60;
/// The environment variable that sets the server's ready timeout.
pub const READY_TIMEOUT_ENV: &str = "LOCKER_READY_TIMEOUT_S";

fn ready_timeout() -> std::time::Duration {
    let s = std::env::var(READY_TIMEOUT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(READY_TIMEOUT_S);
    std::time::Duration::from_secs(s)
}

/// After a sandbox of a template with a start or ready command started: the start command
/// as a background process (it outlives this call), then the ready command, again every
/// 250 ms, until it exits 0; the sandbox reads `starting` meanwhile (see
/// `lifecycle::launch`). An error (the ready command never succeeded within the ready
/// timeout, with its last output) means the caller discards the sandbox.
pub async fn start_sandbox(
    app: &AppState,
    caller: &Caller,
    live: &std::sync::Arc<crate::state::Live>,
) -> Result<(), ApiError> {
    let c = run_config(app, &live.template_digest);
    if let Some(cmd) = &c.start_cmd {
        let req = locker_types::ExecRequest {
            cmd: Some(cmd.clone()),
            ..Default::default()
        };
        crate::processes::spawn_background(
            app,
            caller,
            live,
            req,
            std::time::Instant::now(),
            |s| apply_defaults(app, &live.template_digest, s),
        )
        .await
        .map_err(|e| {
            ApiError::unprocessable(format!(
                "the template's start command {cmd:?} could not start: {}",
                e.message
            ))
        })?;
    }
    let Some(ready) = &c.ready_cmd else {
        return Ok(());
    };
    let timeout = ready_timeout();
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut spec = locker_proto::ExecSpec {
            call_id: new_id("call_"),
            argv: vec!["/bin/sh".into(), "-c".into(), ready.clone()],
            cwd: None,
            env: live.env.clone().into_iter().collect(),
            stdin: false,
            timeout_ms: Some(left.as_millis().clamp(250, 10_000) as u64),
            max_output_bytes: 16 << 10,
            user: None,
            stream_output: false,
            pty: None,
            kill_jobs: true,
        };
        apply_defaults(app, &live.template_digest, &mut spec);
        let last = match live.machine.agent.exec(spec, None, None).await {
            Ok(r) if r.exit_code == Some(0) => return Ok(()),
            Ok(r) => format!(
                "exit {:?}: {}{}",
                r.exit_code,
                r.stdout.trim_end(),
                if r.stderr.is_empty() {
                    String::new()
                } else {
                    format!(" {}", r.stderr.trim_end())
                }
            ),
            Err(e) => e.to_string(),
        };
        if std::time::Instant::now() >= deadline {
            return Err(ApiError::unprocessable(format!(
                "the template's ready command {ready:?} did not succeed within {} s (last: {last}): the sandbox {} was removed; fix the command or what it waits for ({READY_TIMEOUT_ENV} sets the server's timeout)",
                timeout.as_secs(),
                live.id
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
