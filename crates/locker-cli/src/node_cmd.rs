//! `locker node`: this host as a node of a fleet. The first start joins with a one-time
//! token (`locker fleet token` on a control host); every start after it beats with the
//! identity the join left in `<data-dir>/fleet/`.

use std::path::PathBuf;

use locker_server::fleet::member::{self, MemberConfig};

#[derive(clap::Args)]
pub struct NodeArgs {
    /// The control plane to join: the URL `locker fleet token` printed (https://HOST:PORT).
    #[arg(long, value_name = "URL", requires = "token")]
    join: Option<String>,
    /// The one-time join token (lkj_…).
    #[arg(
        long,
        env = "LOCKER_JOIN_TOKEN",
        hide_env_values = true,
        requires = "join"
    )]
    token: Option<String>,
    /// The node's name in the fleet [default: this host's name].
    #[arg(long)]
    name: Option<String>,
    /// Where the control plane reaches this node's listener (HOST:PORT) [default: the
    /// host's name and 7443].
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// Where the node's listener binds [default: every address, the advertised port].
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<std::net::SocketAddr>,
    /// Sandboxes this node takes at most [default: 4 per CPU].
    #[arg(long)]
    slots: Option<u32>,
    /// Warm machines kept ready for runs (0: none).
    #[arg(long, env = "LOCKER_WARM_POOL", default_value_t = 2)]
    warm_pool: usize,
    /// Ready microVMs kept per sandbox shape asked for (0: none).
    #[arg(long, env = "LOCKER_VM_POOL", default_value_t = 1)]
    vm_pool: usize,
    /// Pin a name to addresses for machines' egress (as `locker serve --egress-resolve`):
    /// `name=ip[,ip…]`; repeatable.
    #[arg(long, value_name = "NAME=IP", value_parser = locker_server::egress::parse_pin)]
    egress_resolve: Vec<(String, Vec<std::net::IpAddr>)>,
    /// A CA (PEM file) the egress proxy trusts, beside the host's trust store, when it
    /// connects to a secret's host (as `locker serve --egress-ca`); repeatable.
    #[arg(long, value_name = "FILE")]
    egress_ca: Vec<PathBuf>,
    /// Do not build the template `default` in the background when it is missing.
    #[arg(long)]
    no_template_build: bool,
    /// Where sandboxes' disks and snapshots share blocks (as `locker serve --cow-disks`).
    #[arg(long, env = "LOCKER_COW_DISKS", default_value = "auto")]
    cow_disks: locker_runtime::cow_disks::Mode,
    /// Where the node's state, sandboxes and volumes live (its identity in `fleet/`).
    #[arg(long, env = "LOCKER_DATA_DIR", default_value = "/var/lib/locker")]
    data_dir: PathBuf,
    /// Template cache shared by every data dir on the host.
    #[arg(long, env = "LOCKER_CACHE_DIR", default_value = "/var/cache/locker")]
    cache_dir: PathBuf,
}

/// This host's name, lower case (the default node name).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_ascii_lowercase())
        .unwrap_or_default()
}

pub fn run(a: NodeArgs) -> anyhow::Result<()> {
    crate::serve_cmd::init_logging(false);
    let name = a.name.unwrap_or_else(host_name);
    locker_store::validate_node_name(&name)
        .map_err(|e| anyhow::anyhow!("{e} (the host's name is the default)"))?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let advertise = a
        .advertise
        .unwrap_or_else(|| format!("{}:7443", host_name()));
    let port = advertise
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| anyhow::anyhow!("--advertise {advertise:?}: expected HOST:PORT"))?;
    let listen = a
        .listen
        .unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], port)));
    let slots = a
        .slots
        .unwrap_or_else(|| u32::try_from(cpus * 4).unwrap_or(u32::MAX));
    // The engine: `locker serve`'s, serving the control plane only. Tenants' quotas are
    // the control plane's to keep; here the host's capacity bounds what runs.
    let host = locker_server::Quotas::for_host(&a.data_dir);
    let engine = locker_server::Config {
        listen,
        data_dir: a.data_dir.clone(),
        api_key: None,
        admin_key: None,
        metrics_token: None,
        quotas: locker_server::Quotas {
            sandboxes: u64::from(slots),
            ..host
        },
        cache_dir: a.cache_dir,
        warm_pool: a.warm_pool,
        vm_pool: a.vm_pool,
        egress_resolve: a.egress_resolve,
        egress_ca: a.egress_ca,
        template_build: !a.no_template_build,
        preview: None,
        favordynmods: true,
        database: None,
        cow_disks: a.cow_disks,
        fleet: None,
        local_node: None,
        fleet_member: true,
    };
    let cfg = MemberConfig {
        control: a.join,
        token: a.token,
        advertise,
        listen,
        data_dir: a.data_dir,
        name,
        slots,
        engine,
    };
    // A thread per CPU, as `locker serve`: the node's engine and its heartbeats share them.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(member::run(cfg, stop_signal()))
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Resolves on SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut t) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
