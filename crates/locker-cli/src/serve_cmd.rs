//! `locker serve`: the HTTP API.

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "LOCKER_LISTEN", default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Where state, sandboxes and volumes live.
    #[arg(long, env = "LOCKER_DATA_DIR", default_value = "/var/lib/locker")]
    data_dir: PathBuf,
    /// A key of tenant `default`; without one, the first start generates and prints one.
    #[arg(long, env = "LOCKER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Enables the admin routes (tenants, keys).
    #[arg(long, env = "LOCKER_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Require this bearer token on /metrics.
    #[arg(long, env = "LOCKER_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// Template cache shared by every data dir on the host.
    #[arg(long, env = "LOCKER_CACHE_DIR", default_value = "/var/cache/locker")]
    cache_dir: PathBuf,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Per-tenant quota: sandboxes at once.
    #[arg(long, default_value_t = 100)]
    quota_sandboxes: u64,
    /// Per-tenant quota: total sandbox memory in MB [default: the host's RAM (MemTotal)].
    #[arg(long)]
    quota_memory_mb: Option<u64>,
    /// Per-tenant quota: serverless runs in flight.
    #[arg(long, default_value_t = 32)]
    quota_runs: u64,
    /// Per-tenant quota: template builds running at once (more wait, queued).
    #[arg(long, default_value_t = 2)]
    quota_template_builds: u64,
    /// Per-tenant quota: total disk in MB, the sandboxes' `disk_mb` plus the volumes'
    /// `size_mb` [default: the size of the data dir's filesystem]. Whatever the quota, one
    /// disk or volume larger than the data dir's free space (less a reserve of 5% of the
    /// filesystem, 256 to 4096 MB) is refused.
    #[arg(long)]
    quota_disk_mb: Option<u64>,
    /// On a data dir whose filesystem cannot reflink (ext4), keep sandboxes' disks and
    /// snapshots on an XFS image of Locker's own (`<data-dir>/disks.xfs`, mounted at
    /// `<data-dir>/disks`), so snapshots and forks share blocks instead of copying them:
    /// `auto` makes it on a data dir without sandboxes yet; `off` never makes one (an image
    /// already made is still used). See docs/operations.md for the trade-off.
    #[arg(long, env = "LOCKER_COW_DISKS", default_value = "auto")]
    cow_disks: locker_runtime::cow_disks::Mode,
    /// Warm machines kept ready for serverless runs of the default shape (0: none).
    #[arg(long, env = "LOCKER_WARM_POOL", default_value_t = 2)]
    warm_pool: usize,
    /// Ready microVMs kept per sandbox shape (template, cpus, memory, disk) that has been
    /// asked for: restored and warmed, so a create only takes one (0: none).
    #[arg(long, env = "LOCKER_VM_POOL", default_value_t = 1)]
    vm_pool: usize,
    /// Pin a name to addresses for machines' egress, like curl's --resolve:
    /// `name=ip[,ip…]`; repeatable. The egress proxy and DNS responder use it instead of
    /// resolving the name on the host.
    #[arg(long, value_name = "NAME=IP", value_parser = locker_server::egress::parse_pin)]
    egress_resolve: Vec<(String, Vec<std::net::IpAddr>)>,
    /// A CA (PEM file) the egress proxy trusts, beside the host's trust store, when it
    /// connects to a secret's host; repeatable (private hosts, tests).
    #[arg(long, value_name = "FILE")]
    egress_ca: Vec<std::path::PathBuf>,
    /// Do not build the template `default` when it is missing (the server then only warns:
    /// build it with `locker template build default`).
    #[arg(long)]
    no_template_build: bool,
    /// Serve sandboxes' ports at preview URLs `{port}-{sandbox_id}.D` (point a wildcard DNS
    /// name `*.D` at this server): `D` (URLs on this server's port), `D:PORT`, or
    /// `https://D` behind a proxy that terminates TLS. `none` turns preview URLs off.
    /// [default: `localhost` when listening on a loopback address (browsers resolve
    /// `*.localhost` themselves), else none]
    #[arg(long, env = "LOCKER_PREVIEW_DOMAIN", value_name = "D")]
    preview_domain: Option<String>,
    /// Leave the kernel's cgroup settings as they are. By default the server puts moves of
    /// processes into cgroups on the kernel's fast path (`favordynmods`, for as long as the
    /// host runs): without it, every create and every exec after a pause waits an RCU grace
    /// period (8-20 ms on a small VM); with it, forks and exits host-wide take a slightly
    /// slower path. `locker doctor` says which this host has.
    #[arg(long, env = "LOCKER_NO_FAVORDYNMODS")]
    no_favordynmods: bool,
    /// Keep the state (tenants, keys, sandboxes, records…) in this Postgres database
    /// instead of SQLite in the data dir: `postgres://USER:PASSWORD@HOST:PORT/DB`. Several
    /// servers may share one. Move a one-host install's data there first with
    /// `locker db migrate --to URL`. [default: SQLite, `<data-dir>/db.sqlite`]
    #[arg(long, env = "LOCKER_DATABASE", hide_env_values = true, value_name = "URL",
          value_parser = parse_database)]
    database: Option<String>,
    /// Accept nodes of other hosts on this address (HOST:PORT; TLS with the fleet's own
    /// CA, which the first start makes and keeps in the state store). Mint a join token
    /// with `locker fleet token`. [default: no fleet]
    #[arg(long, env = "LOCKER_FLEET_LISTEN", value_name = "ADDR")]
    fleet_listen: Option<SocketAddr>,
    /// A name or address nodes dial this server by, for the fleet listener's certificate
    /// (repeatable; the listen address and this host's name are always in it).
    #[arg(long, value_name = "NAME")]
    fleet_name: Vec<String>,
    /// The URL nodes join (printed in join commands) when it is not the fleet listen
    /// address: behind NAT or a TCP load balancer (`https://HOST:PORT`).
    #[arg(long, env = "LOCKER_FLEET_URL", value_name = "URL")]
    fleet_url: Option<String>,
    /// Copy every snapshot a fleet node takes into this directory, so that should the node
    /// die its sandboxes start again on another node from their last snapshot (shared by
    /// the fleet's control replicas: an NFS or CephFS mount, a mounted bucket). [default:
    /// none: a dead node's sandboxes are lost]
    #[arg(
        long,
        env = "LOCKER_SNAPSHOT_STORE",
        value_name = "DIR",
        requires = "fleet_listen"
    )]
    snapshot_store: Option<PathBuf>,
    /// Also be a node of the fleet (`local`: this server's own machines, listed by `locker
    /// fleet nodes` with what they run; every host of a small fleet can run the same
    /// command). [default: not a node]
    #[arg(long, value_name = "local", value_parser = ["local"])]
    node: Option<String>,
    /// This server's node name with `--node local` [default: the host's name].
    #[arg(long, requires = "node")]
    node_name: Option<String>,
    /// Sandboxes this server's node takes at most [default: 4 per CPU].
    #[arg(long, requires = "node")]
    node_slots: Option<u32>,
    /// Where this server's node listener binds with `--node local` on a control plane
    /// (`--fleet-listen`): other control replicas route its sandboxes' calls there (TLS, a
    /// certificate from the fleet's CA). [default: the fleet listen address, any free port]
    #[arg(long, requires = "node", value_name = "ADDR")]
    node_listen: Option<SocketAddr>,
}

/// `--database`: a Postgres URL (SQLite needs no flag: it is the default).
pub fn parse_database(s: &str) -> Result<String, String> {
    if locker_store::is_postgres_url(s) {
        Ok(s.to_owned())
    } else {
        Err(
            "expected a Postgres URL, postgres://USER:PASSWORD@HOST:PORT/DB (without \
             --database, the state is SQLite in the data dir)"
                .to_owned(),
        )
    }
}

/// `--node local`'s node: its name (the host's by default, checked now), where its node
/// listener binds (on a control plane only), its slots.
fn local_node(
    name: Option<String>,
    slots: Option<u32>,
    listen: SocketAddr,
) -> anyhow::Result<locker_server::fleet::local::LocalNodeConfig> {
    let name = name.unwrap_or_else(crate::node_cmd::host_name);
    locker_store::validate_node_name(&name)
        .map_err(|e| anyhow::anyhow!("{e} (--node-name; the host's name is the default)"))?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(locker_server::fleet::local::LocalNodeConfig {
        name,
        listen,
        slots: slots.unwrap_or_else(|| u32::try_from(cpus * 4).unwrap_or(u32::MAX)),
    })
}

/// Logs to stderr at `LOCKER_LOG` (default `info`), as JSON lines when asked.
pub fn init_logging(json: bool) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("LOCKER_LOG").unwrap_or_else(|_| "info".into());
    // Colour codes only for a person at a terminal, never in a redirected log or journald
    // (and never under NO_COLOR).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    if json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .init();
    }
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    init_logging(a.log_json);
    let preview_raw = match a.preview_domain.as_deref() {
        Some("none") | Some("") => None,
        Some(d) => Some(d.to_owned()),
        None => a.listen.ip().is_loopback().then(|| "localhost".to_owned()),
    };
    let preview = preview_raw
        .map(|d| locker_server::PreviewDomain::parse(&d, a.listen.port()))
        .transpose()
        .map_err(|e| anyhow::anyhow!(e))?;
    let host = locker_server::Quotas::for_host(&a.data_dir);
    let cfg = locker_server::Config {
        listen: a.listen,
        data_dir: a.data_dir,
        api_key: a.api_key,
        admin_key: a.admin_key,
        metrics_token: a.metrics_token,
        quotas: locker_server::Quotas {
            sandboxes: a.quota_sandboxes,
            memory_mb: a.quota_memory_mb.unwrap_or(host.memory_mb),
            runs: a.quota_runs,
            template_builds: a.quota_template_builds,
            disk_mb: a.quota_disk_mb.unwrap_or(host.disk_mb),
        },
        cache_dir: a.cache_dir,
        warm_pool: a.warm_pool,
        vm_pool: a.vm_pool,
        egress_resolve: a.egress_resolve,
        egress_ca: a.egress_ca,
        template_build: !a.no_template_build,
        preview,
        favordynmods: !a.no_favordynmods,
        database: a.database,
        cow_disks: a.cow_disks,
        fleet: a
            .fleet_listen
            .map(|listen| locker_server::fleet::control::ControlConfig {
                listen,
                names: a.fleet_name,
                url: a.fleet_url,
                snapshot_store: a.snapshot_store,
            }),
        local_node: match a.node {
            Some(_) => Some(local_node(
                a.node_name,
                a.node_slots,
                a.node_listen.unwrap_or_else(|| {
                    SocketAddr::new(a.fleet_listen.map_or([0, 0, 0, 0].into(), |f| f.ip()), 0)
                }),
            )?),
            None => None,
        },
        fleet_member: false,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(locker_server::serve(cfg))
        .map_err(|e| anyhow::anyhow!("{e}"))
}
