//! Egress policies as the server enforces them: the allowlist, the name-checking proxy
//! ([`proxy`]), the DNS responder ([`dns`]) and the record of what they refused.
//!
//! Owns what needs a name: a policy's domains, the pinned names of the operator
//! (`--egress-resolve`), which machine address has which policy, and what each machine
//! was refused (for `egress_denied` in call records). It does not own packets: the
//! runtime (`locker_runtime::net`) wires a machine's link and steers its DNS queries and,
//! under `allow`, its TCP connections to the two ports bound here; everything else a
//! machine sends under `allow` is dropped by nftables before it gets anywhere.
//!
//! Why a proxy that dials the name: an allowlist of names checked against destination
//! addresses is easy to fool (a name can resolve anywhere, an address can serve any
//! name). The proxy reads the name the client asks for (the TLS ClientHello's SNI, or the
//! HTTP `Host` header), checks it, resolves it on the host and connects there itself. A
//! forged SNI aimed at another address reaches only the allowed name's servers; a bare
//! address reaches nothing unless it is in an allowed CIDR. Both listeners start on the
//! first machine that needs them and bind every address on an ephemeral port: only
//! machines' own addresses are served (anything else is closed or ignored), and the
//! host's input chain lets a machine reach them only through its redirect rules.

pub mod ca;
pub mod dns;
pub mod intercept;
pub mod limits;
pub mod proxy;

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use locker_runtime::net::{Cidr, Policy};
use locker_runtime::node::{Machine, Node};
use serde_json::Value;

/// The most entries one `allow` list holds.
pub const MAX_ALLOW: usize = 256;
/// Refusals kept per machine (the oldest go first).
const MAX_DENIED: usize = 512;
/// Names or addresses one call record lists at most.
const MAX_DENIED_PER_CALL: usize = 64;
/// How long the host may take to resolve a name.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A checked allowlist: exact names, `*.` suffixes, IPv4 networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    names: Vec<String>,
    /// `.example.com` for `*.example.com`: subdomains only, not the name itself.
    suffixes: Vec<String>,
    pub cidrs: Vec<Cidr>,
}

impl Allowlist {
    /// Checks the `allow` entries of a policy and returns the list and its normalized
    /// form (lowercase names without a final dot, CIDRs masked, duplicates dropped).
    pub fn parse(entries: &[Value]) -> Result<(Allowlist, Vec<String>), String> {
        if entries.len() > MAX_ALLOW {
            return Err(format!("`network.allow` holds at most {MAX_ALLOW} entries"));
        }
        let mut list = Allowlist::default();
        let mut norm: Vec<String> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let s = e.as_str().ok_or_else(|| {
                format!("`network.allow[{i}]` must be a string: a domain (`pypi.org`, `*.github.com`) or an IPv4 CIDR (`10.0.0.0/8`)")
            })?;
            let s = s.trim().to_ascii_lowercase();
            let s = s.strip_suffix('.').unwrap_or(&s).to_owned();
            let canon = if s.contains(':') {
                return Err(format!(
                    "`network.allow[{i}]` {s:?}: IPv6 is not supported (machines have IPv4 only)"
                ));
            } else if s.contains('/') || s.parse::<Ipv4Addr>().is_ok() {
                let c = Cidr::parse(&s).ok_or_else(|| {
                    format!(
                        "`network.allow[{i}]` {s:?} is not an IPv4 address or CIDR like 10.0.0.0/8"
                    )
                })?;
                list.cidrs.push(c);
                c.to_string()
            } else if let Some(rest) = s.strip_prefix("*.") {
                check_domain(rest).map_err(|e| format!("`network.allow[{i}]` {s:?}: {e}"))?;
                list.suffixes.push(format!(".{rest}"));
                s.clone()
            } else if s == "*" {
                return Err(format!(
                    "`network.allow[{i}]` \"*\" would allow every name: use {{\"egress\": \"all\"}}"
                ));
            } else {
                check_domain(&s).map_err(|e| format!("`network.allow[{i}]` {s:?}: {e}"))?;
                list.names.push(s.clone());
                s.clone()
            };
            if !norm.contains(&canon) {
                norm.push(canon);
            }
        }
        list.cidrs = locker_runtime::net::merge_cidrs(&list.cidrs);
        if list.cidrs.len() > locker_runtime::net::MAX_CIDRS {
            return Err(format!(
                "`network.allow` holds at most {} CIDRs",
                locker_runtime::net::MAX_CIDRS
            ));
        }
        Ok((list, norm))
    }

    /// Whether `name` (lowercase, no final dot) is allowed.
    pub fn allows_name(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
            || self
                .suffixes
                .iter()
                .any(|s| name.len() > s.len() && name.ends_with(s.as_str()))
    }

    /// Whether `ip` is in an allowed CIDR.
    pub fn allows_ip(&self, ip: Ipv4Addr) -> bool {
        self.cidrs.iter().any(|c| c.contains(ip))
    }
}

/// Checks a domain name: dot-separated labels of letters, digits, `-` and `_`.
fn check_domain(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 253 {
        return Err("a domain name has 1 to 253 characters".into());
    }
    for label in s.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("every label of a domain has 1 to 63 characters".into());
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            || label.starts_with('-')
            || label.ends_with('-')
        {
            return Err(
                "a domain holds letters, digits, `-` and `_` (and `*.` only as its start)".into(),
            );
        }
    }
    Ok(())
}

/// A machine's policy, as the proxy and the DNS responder apply it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Every name (DNS only: TCP is not proxied).
    All,
    Allow(Allowlist),
}

impl Rule {
    /// The rule of a checked policy (`sandboxes::check_network`); `None` for `none`.
    pub fn of(network: &Value) -> Result<Option<Rule>, String> {
        match network.get("egress").and_then(Value::as_str) {
            Some("all") => Ok(Some(Rule::All)),
            Some("allow") => {
                let entries = network
                    .get("allow")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                Ok(Some(Rule::Allow(Allowlist::parse(entries)?.0)))
            }
            _ => Ok(None),
        }
    }

    /// Whether DNS may answer for `name`.
    pub fn allows_name(&self, name: &str) -> bool {
        match self {
            Rule::All => true,
            Rule::Allow(l) => l.allows_name(name),
        }
    }
}

/// What one machine, one tenant or the whole server holds now.
#[derive(Debug, Default)]
pub struct Held {
    /// Proxied connections open.
    pub conns: limits::Count,
    /// DNS queries being resolved.
    pub dns: limits::Count,
}

/// One machine with a network, as the proxy and the DNS responder know it.
#[derive(Debug)]
pub struct Entry {
    /// The sandbox id, or the call id of a run.
    pub key: String,
    pub ip: Ipv4Addr,
    rule: RwLock<Arc<Rule>>,
    denied: Mutex<VecDeque<(Instant, String)>>,
    /// What this machine holds, and what its tenant holds (shared by its machines).
    pub held: Held,
    pub tenant: Arc<Held>,
    /// Refusals are logged at most once per [`limits::LOG_EVERY`] per machine.
    log: limits::LogGate,
}

impl Entry {
    pub fn rule(&self) -> Arc<Rule> {
        self.rule.read().expect("egress rule").clone()
    }

    /// Whether a line about this machine's refusals may be logged now: `Some(n)`, with
    /// `n` refusals not logged since the last line.
    pub fn log_now(&self) -> Option<u64> {
        self.log.pass(Instant::now())
    }

    /// Counts a refusal (a name, or `address:port`) for the machine's call records.
    pub fn deny(&self, what: String, why: &str) {
        if let Some(held_back) = self.log_now() {
            tracing::info!(machine = %self.key, denied = %what, why, more_refused_before = held_back, "egress refused");
        }
        let mut d = self.denied.lock().expect("egress denied");
        if d.len() >= MAX_DENIED {
            d.pop_front();
        }
        d.push_back((Instant::now(), what));
    }
}

/// A machine armed for secrets (see `secrets::arm`): its placeholders, its CA, and what
/// the proxy saw them do, for call records.
#[derive(Debug)]
pub struct Armed {
    pub tenant: String,
    /// `(secret name, placeholder)`.
    pub secrets: Vec<(String, String)>,
    pub ca: Arc<ca::MachineCa>,
    seen: Mutex<VecDeque<(Instant, Seen)>>,
}

/// What the proxy saw a placeholder do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Its value went into a request to `host`.
    Used { name: String, host: String },
    /// It went to `destination`, where its value may not go; it stayed a placeholder.
    Misuse { name: String, destination: String },
}

impl Armed {
    /// Notes what the proxy saw (the oldest notes go first past [`MAX_DENIED`]).
    pub fn note(&self, s: Seen) {
        if let Seen::Misuse { name, destination } = &s {
            tracing::info!(secret = %name, destination = %destination, "a secret's placeholder went where its value may not (it was not replaced)");
        }
        let mut q = self.seen.lock().expect("secrets seen");
        if q.len() >= MAX_DENIED {
            q.pop_front();
        }
        q.push_back((Instant::now(), s));
    }

    /// The secrets whose placeholders occur in `bytes`.
    pub fn found_in<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> impl Iterator<Item = &'a (String, String)> + 'a {
        self.secrets
            .iter()
            .filter(move |(_, p)| bytes.windows(p.len()).any(|w| w == p.as_bytes()))
    }
}

/// The two listeners, once started.
#[derive(Debug, Clone, Copy)]
struct Ports {
    proxy: u16,
    dns: u16,
}

/// The server's egress service: pinned names, machines' rules, the proxy and DNS ports.
pub struct Egress {
    pins: HashMap<String, Vec<IpAddr>>,
    ports: tokio::sync::OnceCell<Ports>,
    by_key: Mutex<HashMap<String, Arc<Entry>>>,
    by_ip: RwLock<HashMap<Ipv4Addr, Arc<Entry>>>,
    /// What each tenant's machines hold (kept for the server's life: tenants are few).
    tenants: Mutex<HashMap<String, Arc<Held>>>,
    /// What all machines hold.
    pub total: Held,
    /// Caps of proxied connections (from the file limit).
    pub proxy_caps: limits::Caps,
    /// Accept failures of the proxy are logged at most this often.
    accept_log: limits::LogGate,
    /// Machines armed for secrets, by key.
    armed: Mutex<HashMap<String, Arc<Armed>>>,
    /// Where values come from, and how upstream TLS is checked (set once at start).
    secrets: std::sync::OnceLock<Arc<crate::secrets::Secrets>>,
    pub(crate) upstream: std::sync::OnceLock<intercept::UpstreamTls>,
}

/// Parses an `--egress-resolve` pin: `name=address[,address…]`.
pub fn parse_pin(s: &str) -> Result<(String, Vec<IpAddr>), String> {
    let (name, addrs) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected name=address, like pypi.org=151.101.0.223"))?;
    let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
    check_domain(&name).map_err(|e| format!("{s:?}: {e}"))?;
    let addrs = addrs
        .split(',')
        .map(|a| {
            a.trim()
                .parse::<IpAddr>()
                .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name, addrs))
}

impl Egress {
    /// The service with the operator's pinned names (`--egress-resolve`), for a server
    /// whose open files limit is `nofile` (see [`limits::raise_nofile`]): the proxy's
    /// connection caps come from it. Nothing is bound until a machine needs it.
    pub fn new(pins: &[(String, Vec<IpAddr>)], nofile: u64) -> Arc<Egress> {
        let mut map: HashMap<String, Vec<IpAddr>> = HashMap::new();
        for (n, a) in pins {
            map.entry(n.clone()).or_default().extend(a.iter().copied());
        }
        let proxy_caps = limits::Caps::proxy(nofile);
        tracing::info!(
            per_machine = proxy_caps.machine,
            per_tenant = proxy_caps.tenant,
            total = proxy_caps.total,
            "egress proxy connection caps"
        );
        Arc::new(Egress {
            pins: map,
            ports: tokio::sync::OnceCell::new(),
            by_key: Mutex::new(HashMap::new()),
            by_ip: RwLock::new(HashMap::new()),
            tenants: Mutex::new(HashMap::new()),
            total: Held::default(),
            proxy_caps,
            accept_log: limits::LogGate::default(),
            armed: Mutex::new(HashMap::new()),
            secrets: std::sync::OnceLock::new(),
            upstream: std::sync::OnceLock::new(),
        })
    }

    /// Gives the proxy the secrets service and the CAs it trusts upstream beside the
    /// host's (`--egress-ca`). Called once at start; an unreadable CA file is an error.
    pub fn configure_secrets(
        &self,
        secrets: Arc<crate::secrets::Secrets>,
        extra_cas: &[std::path::PathBuf],
    ) -> Result<(), String> {
        let tls = intercept::UpstreamTls::new(extra_cas)?;
        let _ = self.upstream.set(tls);
        let _ = self.secrets.set(secrets);
        Ok(())
    }

    /// The secrets service, once configured.
    pub fn secrets(&self) -> Option<&Arc<crate::secrets::Secrets>> {
        self.secrets.get()
    }

    /// Arms machine `key` for `secrets` (`(name, placeholder)`) with CA `ca`.
    pub fn arm(
        &self,
        key: &str,
        tenant: &str,
        secrets: Vec<(String, String)>,
        ca: Arc<ca::MachineCa>,
    ) {
        let armed = Arc::new(Armed {
            tenant: tenant.to_owned(),
            secrets,
            ca,
            seen: Mutex::new(VecDeque::new()),
        });
        self.armed
            .lock()
            .expect("armed")
            .insert(key.to_owned(), armed);
    }

    /// Machine `key`'s secrets, if it has any.
    pub fn armed(&self, key: &str) -> Option<Arc<Armed>> {
        self.armed.lock().expect("armed").get(key).cloned()
    }

    /// What machine `key`'s placeholders did since `since`: `(secrets_used,
    /// secret_misuse)` for a call record, each once.
    pub fn secrets_since(
        &self,
        key: &str,
        since: Instant,
    ) -> (
        Vec<locker_store::SecretUse>,
        Vec<locker_store::SecretMisuse>,
    ) {
        match self.armed(key) {
            Some(a) => a.seen_since(Some(since)),
            None => (Vec::new(), Vec::new()),
        }
    }

    /// Forgets machine `key`'s secrets and returns what they did over its life (for a
    /// run's record).
    pub fn disarm(
        &self,
        key: &str,
    ) -> (
        Vec<locker_store::SecretUse>,
        Vec<locker_store::SecretMisuse>,
    ) {
        match self.armed.lock().expect("armed").remove(key) {
            Some(a) => a.seen_since(None),
            None => (Vec::new(), Vec::new()),
        }
    }
}

impl Armed {
    fn seen_since(
        &self,
        since: Option<Instant>,
    ) -> (
        Vec<locker_store::SecretUse>,
        Vec<locker_store::SecretMisuse>,
    ) {
        let q = self.seen.lock().expect("secrets seen");
        let mut used: Vec<locker_store::SecretUse> = Vec::new();
        let mut misuse: Vec<locker_store::SecretMisuse> = Vec::new();
        for (_, s) in q.iter().filter(|(t, _)| since.is_none_or(|x| *t >= x)) {
            match s {
                Seen::Used { name, host } => {
                    let u = locker_store::SecretUse {
                        name: name.clone(),
                        host: host.clone(),
                    };
                    if !used.contains(&u) && used.len() < MAX_DENIED_PER_CALL {
                        used.push(u);
                    }
                }
                Seen::Misuse { name, destination } => {
                    let m = locker_store::SecretMisuse {
                        name: name.clone(),
                        destination: destination.clone(),
                    };
                    if !misuse.contains(&m) && misuse.len() < MAX_DENIED_PER_CALL {
                        misuse.push(m);
                    }
                }
            }
        }
        (used, misuse)
    }
}

impl Egress {
    /// Starts the proxy and the DNS responder (once) and returns their ports.
    async fn ports(self: &Arc<Self>) -> Result<Ports, String> {
        self.ports
            .get_or_try_init(|| async {
                let tcp = tokio::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
                    .await
                    .map_err(|e| format!("binding the egress proxy: {e}"))?;
                let udp = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                    .await
                    .map_err(|e| format!("binding the egress DNS responder: {e}"))?;
                let ports = Ports {
                    proxy: tcp.local_addr().map_err(|e| e.to_string())?.port(),
                    dns: udp.local_addr().map_err(|e| e.to_string())?.port(),
                };
                tokio::spawn(proxy::serve(self.clone(), tcp));
                tokio::spawn(dns::serve(self.clone(), Arc::new(udp)));
                tracing::info!(
                    proxy_port = ports.proxy,
                    dns_port = ports.dns,
                    "egress proxy and DNS responder started"
                );
                Ok(ports)
            })
            .await
            .copied()
    }

    /// Gives machine `m` (known as `key`: its sandbox id, or a run's call id) of `tenant`
    /// the checked policy `network`: its link, rules and `/etc/resolv.conf` through the
    /// node, and its rule here. `none` takes all of that away.
    pub async fn apply(
        self: &Arc<Self>,
        node: &Node,
        m: &Machine,
        key: &str,
        tenant: &str,
        network: &Value,
    ) -> Result<(), String> {
        let rule = Rule::of(network)?;
        let policy = match &rule {
            None => Policy::None,
            Some(Rule::All) => Policy::All {
                dns_port: self.ports().await?.dns,
            },
            Some(Rule::Allow(l)) => {
                let p = self.ports().await?;
                Policy::Allow {
                    cidrs: l.cidrs.clone(),
                    proxy_port: p.proxy,
                    dns_port: p.dns,
                }
            }
        };
        let had_link = locker_runtime::net::NetLease::load(&m.dir)
            .is_some_and(|l| locker_runtime::net::link_exists(&l.link()));
        let lease = node
            .set_egress(m, policy)
            .await
            .map_err(|e| e.to_string())?;
        match (lease, rule) {
            (Some(lease), Some(rule)) => {
                self.register(key, tenant, lease.machine_ip(), rule);
                if had_link {
                    // A policy change (or a new server adopting the machine): its resolver
                    // is in place, and the machine may be frozen.
                    return Ok(());
                }
                let conf = format!(
                    "# Written by Locker: the host answers for the names this machine may reach.\nnameserver {}\noptions timeout:2 attempts:2\n",
                    lease.host_ip()
                );
                m.agent
                    .write_file("/etc/resolv.conf", Some(0o644), conf.as_bytes())
                    .await
                    .map_err(|e| format!("writing the machine's /etc/resolv.conf: {e}"))?;
            }
            _ => {
                self.forget(key);
            }
        }
        Ok(())
    }

    /// Sets the rule of machine `key` of `tenant` at `ip` (replacing an earlier entry,
    /// whose refusals it keeps).
    fn register(&self, key: &str, tenant: &str, ip: Ipv4Addr, rule: Rule) {
        let mut by_key = self.by_key.lock().expect("egress machines");
        if let Some(e) = by_key.get(key) {
            if e.ip == ip {
                *e.rule.write().expect("egress rule") = Arc::new(rule);
                return;
            }
        }
        let old = by_key.remove(key);
        let denied = old
            .as_ref()
            .map(|o| std::mem::take(&mut *o.denied.lock().expect("egress denied")))
            .unwrap_or_default();
        let tenant = self
            .tenants
            .lock()
            .expect("egress tenants")
            .entry(tenant.to_owned())
            .or_default()
            .clone();
        let e = Arc::new(Entry {
            key: key.to_owned(),
            ip,
            rule: RwLock::new(Arc::new(rule)),
            denied: Mutex::new(denied),
            held: Held::default(),
            tenant,
            log: limits::LogGate::default(),
        });
        by_key.insert(key.to_owned(), e.clone());
        let mut by_ip = self.by_ip.write().expect("egress addresses");
        if let Some(o) = old {
            if by_ip.get(&o.ip).is_some_and(|x| Arc::ptr_eq(x, &o)) {
                by_ip.remove(&o.ip);
            }
        }
        by_ip.insert(ip, e);
    }

    /// Forgets machine `key` (it lost its link or is gone) and returns what it was
    /// refused, each name or address once.
    pub fn forget(&self, key: &str) -> Vec<String> {
        self.armed.lock().expect("armed").remove(key);
        let Some(e) = self.by_key.lock().expect("egress machines").remove(key) else {
            return Vec::new();
        };
        {
            let mut by_ip = self.by_ip.write().expect("egress addresses");
            if by_ip.get(&e.ip).is_some_and(|x| Arc::ptr_eq(x, &e)) {
                by_ip.remove(&e.ip);
            }
        }
        let held_back = e.log.take_held();
        if held_back > 0 {
            tracing::info!(machine = %e.key, refused = held_back, "egress refused (not logged one by one)");
        }
        let d = e.denied.lock().expect("egress denied");
        unique(d.iter().map(|(_, w)| w))
    }

    /// Logs that the proxy could not accept (at most once per [`limits::LOG_EVERY`]).
    pub fn accept_failed(&self, e: &std::io::Error) {
        if let Some(held_back) = self.accept_log.pass(Instant::now()) {
            tracing::warn!(error = %e, failed_before = held_back, "egress proxy: accept failed");
        }
    }

    /// What machine `key` was refused since `since` (for the record of a call that
    /// started then), each name or address once.
    pub fn denied_since(&self, key: &str, since: Instant) -> Vec<String> {
        let Some(e) = self
            .by_key
            .lock()
            .expect("egress machines")
            .get(key)
            .cloned()
        else {
            return Vec::new();
        };
        let d = e.denied.lock().expect("egress denied");
        unique(d.iter().filter(|(t, _)| *t >= since).map(|(_, w)| w))
    }

    /// The machine at `ip`, if it has a network policy here.
    pub fn entry(&self, ip: Ipv4Addr) -> Option<Arc<Entry>> {
        self.by_ip
            .read()
            .expect("egress addresses")
            .get(&ip)
            .cloned()
    }

    /// The addresses of `name` as the host resolves it (the operator's pins first).
    pub async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, String> {
        if let Some(a) = self.pins.get(name) {
            return Ok(a.clone());
        }
        match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((name, 0))).await {
            Ok(Ok(addrs)) => {
                let mut v: Vec<IpAddr> = Vec::new();
                for a in addrs {
                    if !v.contains(&a.ip()) {
                        v.push(a.ip());
                    }
                }
                Ok(v)
            }
            Ok(Err(e)) => Err(format!("resolving {name}: {e}")),
            Err(_) => Err(format!(
                "resolving {name}: no answer within {RESOLVE_TIMEOUT:?}"
            )),
        }
    }
}

fn unique<'a>(it: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in it {
        if !out.contains(w) {
            if out.len() == MAX_DENIED_PER_CALL {
                break;
            }
            out.push(w.clone());
        }
    }
    out
}

/// Whether an address is never reachable, whatever the policy: loopback, link-local and
/// metadata addresses, machines' range, multicast and broadcast, unspecified, and every
/// address of the host itself (the proxy runs on the host: without this, an allowed name
/// resolving to 127.0.0.1 would reach Locker's own port).
pub fn forbidden(ip: IpAddr) -> bool {
    let never = match ip {
        IpAddr::V4(a) => never_v4(a),
        IpAddr::V6(a) => {
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (a.segments()[0] & 0xffc0) == 0xfe80
                || a == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
                || a.to_ipv4_mapped().is_some_and(never_v4)
        }
    };
    // An address is the host's own exactly when it can be bound to.
    never || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

fn never_v4(a: Ipv4Addr) -> bool {
    let machines = Cidr::parse(locker_runtime::net::RANGE).expect("the machines' range parses");
    a.is_loopback()
        || a.is_link_local()
        || a.is_multicast()
        || a.is_broadcast()
        || a.octets()[0] == 0
        || machines.contains(a)
}

/// A name as a request carries it, made comparable: lowercase, no final dot.
pub fn normalize_name(s: &str) -> String {
    let s = s.trim().to_ascii_lowercase();
    s.strip_suffix('.').map(str::to_owned).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn list(v: Value) -> Result<(Allowlist, Vec<String>), String> {
        Allowlist::parse(v.as_array().unwrap())
    }

    #[test]
    fn allowlists_parse_names_wildcards_and_cidrs() {
        let (l, norm) = list(json!([
            "PyPI.org.",
            "*.githubusercontent.com",
            "10.1.2.3/24",
            "192.168.0.1",
            "pypi.org"
        ]))
        .unwrap();
        assert_eq!(
            norm,
            [
                "pypi.org",
                "*.githubusercontent.com",
                "10.1.2.0/24",
                "192.168.0.1/32"
            ]
        );
        assert!(l.allows_name("pypi.org"));
        assert!(!l.allows_name("files.pypi.org"), "exact names are exact");
        assert!(l.allows_name("raw.githubusercontent.com"));
        assert!(l.allows_name("a.b.githubusercontent.com"));
        assert!(
            !l.allows_name("githubusercontent.com"),
            "`*.` is subdomains only"
        );
        assert!(!l.allows_name("evilgithubusercontent.com"));
        assert!(l.allows_ip(Ipv4Addr::new(10, 1, 2, 200)));
        assert!(!l.allows_ip(Ipv4Addr::new(10, 1, 3, 1)));
        assert!(l.allows_ip(Ipv4Addr::new(192, 168, 0, 1)));
        for bad in [
            json!(["*"]),
            json!(["::1"]),
            json!(["10.0.0.0/40"]),
            json!(["a..b"]),
            json!(["-a.com"]),
            json!(["a b.com"]),
            json!(["*.*.com"]),
            json!([7]),
        ] {
            assert!(list(bad.clone()).is_err(), "{bad}");
        }
        assert!(list(json!([])).unwrap().0.cidrs.is_empty());
    }

    #[test]
    fn rules_of_checked_policies() {
        assert_eq!(Rule::of(&json!({"egress": "none"})).unwrap(), None);
        assert_eq!(
            Rule::of(&json!({"egress": "all"})).unwrap(),
            Some(Rule::All)
        );
        let r = Rule::of(&json!({"egress": "allow", "allow": ["a.test"]}))
            .unwrap()
            .unwrap();
        assert!(r.allows_name("a.test") && !r.allows_name("b.test"));
        assert!(Rule::All.allows_name("anything.test"));
    }

    #[test]
    fn pins_parse() {
        let (n, a) = parse_pin("Allowed.Test.=198.18.0.1,::1").unwrap();
        assert_eq!(n, "allowed.test");
        assert_eq!(a.len(), 2);
        assert!(parse_pin("nope").is_err());
        assert!(parse_pin("a.test=not-an-ip").is_err());
    }

    #[test]
    fn never_reachable_addresses() {
        for a in [
            "127.0.0.1",
            "169.254.169.254",
            "100.96.0.2",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
        ] {
            assert!(forbidden(a.parse().unwrap()), "{a}");
        }
        assert!(!forbidden("198.51.100.7".parse().unwrap()));
    }

    #[test]
    fn refusals_are_kept_per_machine_and_listed_once() {
        let eg = Egress::new(&[], 1024);
        let t0 = Instant::now();
        eg.register("sb_1", "t", Ipv4Addr::new(100, 96, 0, 2), Rule::All);
        let e = eg.entry(Ipv4Addr::new(100, 96, 0, 2)).unwrap();
        e.deny("evil.test".into(), "test");
        e.deny("evil.test".into(), "test");
        e.deny("1.2.3.4:80".into(), "test");
        assert_eq!(eg.denied_since("sb_1", t0), ["evil.test", "1.2.3.4:80"]);
        assert!(eg.denied_since("sb_1", Instant::now()).is_empty());
        // A new address for the same machine keeps its refusals; the old one is gone.
        eg.register("sb_1", "t", Ipv4Addr::new(100, 96, 0, 6), Rule::All);
        assert!(eg.entry(Ipv4Addr::new(100, 96, 0, 2)).is_none());
        assert_eq!(eg.forget("sb_1"), ["evil.test", "1.2.3.4:80"]);
        assert!(eg.entry(Ipv4Addr::new(100, 96, 0, 6)).is_none());
        assert!(eg.forget("sb_1").is_empty());
    }
}
