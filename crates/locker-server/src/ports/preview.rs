//! Preview URLs: `{scheme}://{port}-{sandbox_id}.{domain}/…` reaches `127.0.0.1:{port}` in
//! the sandbox's machine, whatever the path, so an app built for `/` runs unchanged and a
//! person can open it in a browser (`--preview-domain`, with wildcard DNS; `localhost`
//! needs none, browsers resolve `*.localhost` to the loopback address).
//!
//! Owns: recognising a preview host, who may pass, and the token's cookie. A private port
//! (the default) lets through the sandbox's tenant's API key (`Authorization: Bearer`), the
//! sandbox's preview token (`X-Locker-Token`), or the cookie `locker_token` that a
//! `?locker_token=` in a URL sets once for that one host (answered with a redirect to the
//! same URL without it, so the token leaves the address bar and the history). A public port
//! (`PUT …/ports/{port}` `{"public": true}`) lets anyone with the URL through. None of these
//! credentials reaches the machine. The forwarding is [`super::proxy`]'s.
//!
//! A sandbox's token and public ports live in its record (the store) and in its [`Live`]
//! entry, written together; a request reads only the latter.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use super::{port_of, proxy};
use crate::auth::{self, constant_time_eq};
use crate::error::ApiError;
use crate::state::{AppState, Live};

/// The cookie a `?locker_token=` sets, and the query parameter that carries the token.
const COOKIE: &str = "locker_token";

/// Where preview URLs live: `--preview-domain` parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewDomain {
    scheme: String,
    /// Lowercase, without a port.
    host: String,
    /// `:{port}` where URLs must name one, else empty.
    port_suffix: String,
}

impl PreviewDomain {
    /// From `--preview-domain`: `D` (URLs `http://{port}-{id}.D:{listen port}/`, the server
    /// reached directly), `D:PORT`, or `http(s)://D[:PORT]` (behind a proxy that terminates
    /// TLS and forwards the Host header: `https://preview.example.com`).
    pub fn parse(raw: &str, listen_port: u16) -> Result<Self, String> {
        let (scheme, rest) = match raw.split_once("://") {
            Some((s @ ("http" | "https"), rest)) => (s.to_owned(), rest),
            Some((s, _)) => {
                return Err(format!(
                    "--preview-domain: unknown scheme {s:?}: use http or https"
                ))
            }
            None => ("http".to_owned(), raw),
        };
        let explicit_scheme = raw.contains("://");
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => {
                let p: u16 = p
                    .parse()
                    .map_err(|_| format!("--preview-domain: {p:?} is not a port number"))?;
                (h, Some(p))
            }
            None => (rest, None),
        };
        let host = host.trim_start_matches("*.").to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if host.is_empty() || !host.split('.').all(label_ok) {
            return Err(format!(
                "--preview-domain: {raw:?} is not a domain name (write e.g. `localhost`, \
                 `preview.example.com` or `https://preview.example.com`)"
            ));
        }
        let port_suffix = match (port, explicit_scheme) {
            (Some(p), _) => format!(":{p}"),
            (None, true) => String::new(),
            (None, false) => format!(":{listen_port}"),
        };
        Ok(Self {
            scheme,
            host,
            port_suffix,
        })
    }

    /// The sandbox's preview URL with `{port}` left to fill in.
    pub fn template(&self, id: &str) -> String {
        format!(
            "{}://{{port}}-{id}.{}{}/",
            self.scheme, self.host, self.port_suffix
        )
    }

    /// The preview URL of `port` of sandbox `id`.
    pub fn url(&self, id: &str, port: u16) -> String {
        format!(
            "{}://{port}-{id}.{}{}/",
            self.scheme, self.host, self.port_suffix
        )
    }

    /// The host (and port, where URLs name one) that preview hosts are under: what E2B's
    /// SDKs take as a sandbox's `domain`.
    pub fn authority(&self) -> String {
        format!("{}{}", self.host, self.port_suffix)
    }

    pub(crate) fn is_https(&self) -> bool {
        self.scheme == "https"
    }

    /// The sandbox and port a request's authority names, or `None` when it is not a preview
    /// host (the API's own host, any other name). `sb-…` is taken for `sb_…`, for clients
    /// that refuse an underscore in a host name.
    pub(crate) fn target(&self, authority: &str) -> Option<Result<(String, u16), ApiError>> {
        let host = match authority.rsplit_once(':') {
            Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => authority,
        };
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let label = host.strip_suffix(&self.host)?.strip_suffix('.')?;
        let bad = || {
            ApiError::bad_request(format!(
                "{host:?} is not a preview host: preview URLs are {}",
                self.template("{sandbox_id}")
            ))
        };
        if label.contains('.') {
            return Some(Err(bad()));
        }
        let Some((port, id)) = label.split_once('-') else {
            return Some(Err(bad()));
        };
        let id = match id.strip_prefix("sb-") {
            Some(rest) => format!("sb_{rest}"),
            None => id.to_owned(),
        };
        if !id.starts_with("sb_")
            || !id[3..].bytes().all(|b| b.is_ascii_alphanumeric())
            || id.len() > 64
        {
            return Some(Err(bad()));
        }
        Some(port_of(port).map(|p| (id, p)))
    }
}

/// Middleware in front of every route: a request to a preview host goes to the machine,
/// whatever its path; any other goes on to the API.
pub async fn dispatch(State(app): State<AppState>, req: Request, next: Next) -> Response {
    // A fleet node: a preview request the control plane routed here names its target in a
    // header (this node may have no preview domain, or another).
    if let Some(routed) = routed(&req) {
        return match routed {
            Ok(r) if crate::e2b::is_e2b_port(r.port) => {
                crate::e2b::serve_host(app.clone(), &r.id, r.port, req).await
            }
            Ok(r) => serve(&app, r.id, r.port, r.authority, r.https, r.vouched, req)
                .await
                .unwrap_or_else(IntoResponse::into_response),
            Err(e) => e.into_response(),
        };
    }
    let Some(domain) = app.cfg.preview.as_ref() else {
        return next.run(req).await;
    };
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        });
    let target = authority.as_deref().and_then(|a| domain.target(a));
    match target {
        None => next.run(req).await,
        Some(Err(e)) => e.into_response(),
        // E2B's envd and code interpreter of the sandbox, as E2B's SDKs reach them by host.
        Some(Ok((id, port))) if crate::e2b::is_e2b_port(port) => {
            crate::e2b::serve_host(app.clone(), &id, port, req).await
        }
        Some(Ok((id, port))) => {
            let https = domain.is_https();
            serve(
                &app,
                id,
                port,
                authority.unwrap_or_default(),
                https,
                false,
                req,
            )
            .await
            .unwrap_or_else(IntoResponse::into_response)
        }
    }
}

/// A preview request the fleet's control plane routed to this node
/// (`node::PREVIEW_HEADER`): its sandbox, port, scheme and host, and whether control let it
/// through by the tenant's key.
struct Routed {
    id: String,
    port: u16,
    https: bool,
    authority: String,
    vouched: bool,
}

/// The routed preview request `req` is, if it is one. Only a call through a node's listener
/// (which only control's certificate opens) is believed; elsewhere the headers mean nothing.
fn routed(req: &Request) -> Option<Result<Routed, ApiError>> {
    use crate::fleet::node::{Forwarded, PREVIEW_HEADER, PREVIEW_KEY_HEADER};
    req.extensions().get::<Forwarded>()?;
    let raw = req.headers().get(PREVIEW_HEADER)?;
    let bad = || ApiError::bad_request(format!("{PREVIEW_HEADER}: not `sandbox port scheme host`"));
    let mut words = raw.to_str().map(str::split_ascii_whitespace).ok()?;
    let (Some(id), Some(port), Some(scheme), Some(authority)) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Some(Err(bad()));
    };
    let Ok(port) = port.parse::<u16>() else {
        return Some(Err(bad()));
    };
    Some(Ok(Routed {
        id: id.to_owned(),
        port,
        https: scheme == "https",
        authority: authority.to_owned(),
        vouched: req.headers().contains_key(PREVIEW_KEY_HEADER),
    }))
}

/// How a preview request got through.
#[derive(Debug, PartialEq, Eq)]
enum Pass {
    Public,
    Key,
    Token,
    Cookie,
    /// The token in the query: the answer sets the cookie.
    QueryToken,
}

async fn serve(
    app: &AppState,
    id: String,
    port: u16,
    authority: String,
    https: bool,
    vouched: bool,
    mut req: Request,
) -> Result<Response, ApiError> {
    let live = app.live.read().await.get(&id).cloned();
    let no_such = || ApiError::not_found(format!("no sandbox {id} is running on this server"));
    let live = live.ok_or_else(no_such)?;
    let query_token = query_param(req.uri().query(), COOKIE);
    // Control took the tenant's key (a fleet node): the tenant it vouches for must be the
    // sandbox's.
    let vouched = vouched
        && req
            .extensions()
            .get::<crate::fleet::node::Forwarded>()
            .is_some_and(|f| f.tenant == live.tenant);
    let pass = match vouched {
        true => Pass::Key,
        false => admit(app, &live, port, req.headers(), query_token.as_deref())?,
    };
    let query = strip_query_param(req.uri().query(), COOKIE);

    if pass == Pass::QueryToken && matches!(*req.method(), Method::GET | Method::HEAD) {
        let location = same_host_location(req.uri().path(), query.as_deref());
        return Ok(redirect_with_cookie(
            &location,
            query_token.as_deref().unwrap_or(""),
            https,
        ));
    }

    strip_cookie(req.headers_mut());
    if pass != Pass::Key {
        // Not Locker's key: the app's own, for the machine.
        req.extensions_mut().insert(proxy::AppAuthorization);
    }
    if !req.headers().contains_key(header::HOST) {
        if let Ok(h) = HeaderValue::from_str(&authority) {
            req.headers_mut().insert(header::HOST, h);
        }
    }
    let target = proxy::target_of(req.uri().path(), query.as_deref())?;
    let busy = crate::lifecycle::enter(app, live)?;
    let mut resp = proxy::forward(busy, &id, port, target, req).await?;
    if pass == Pass::QueryToken {
        if let Some(c) = query_token.as_deref().and_then(|t| cookie(t, https)) {
            resp.headers_mut().append(header::SET_COOKIE, c);
        }
    }
    Ok(resp)
}

/// Decides whether a request may reach `port` of `live`'s sandbox, and by which right.
/// Locker's own credentials are tried before the API key, so that an app's own
/// `Authorization` (Basic auth, its own tokens) reaches it on a public port or beside a
/// preview token or cookie; only a header that was Locker's key is kept from the machine.
fn admit(
    app: &AppState,
    live: &Arc<Live>,
    port: u16,
    headers: &HeaderMap,
    query_token: Option<&str>,
) -> Result<Pass, ApiError> {
    let (token, public) = {
        let p = live.preview.read().expect("preview lock");
        (p.token.clone(), p.public_ports.contains(&port))
    };
    if public {
        return Ok(Pass::Public);
    }
    let matches = |t: &str| !token.is_empty() && constant_time_eq(t.as_bytes(), token.as_bytes());
    // `E2b-Traffic-Access-Token` is E2B's name for it (the `trafficAccessToken` E2B's
    // create answers), so hosts from E2B's `get_host` take what E2B's users send.
    let header_token = headers
        .get("x-locker-token")
        .or_else(|| headers.get("e2b-traffic-access-token"))
        .map(|t| t.to_str().map(str::trim).unwrap_or(""));
    if header_token.is_some_and(matches) {
        return Ok(Pass::Token);
    }
    if query_token.is_some_and(matches) {
        return Ok(Pass::QueryToken);
    }
    // Every `locker_token` the browser sends counts: a page on a sibling host may have set
    // one for the parent domain, which must not shadow this host's own.
    let cookies = cookie_values(headers);
    if cookies.iter().any(|t| matches(t)) {
        return Ok(Pass::Cookie);
    }
    let rotated = |what: &str| {
        ApiError::unauthorized(format!(
            "{what} is not the preview token of sandbox {} (it may have been rotated)",
            live.id
        ))
    };
    if header_token.is_some() {
        return Err(rotated("X-Locker-Token"));
    }
    if query_token.is_some() {
        return Err(rotated("locker_token"));
    }
    if headers.contains_key(header::AUTHORIZATION) {
        let caller = auth::caller_of(app, headers)?;
        // Another tenant's key learns nothing of this sandbox.
        if caller.tenant != live.tenant {
            return Err(ApiError::not_found(format!(
                "no sandbox {} is running on this server",
                live.id
            )));
        }
        return Ok(Pass::Key);
    }
    if !cookies.is_empty() {
        return Err(private(
            &live.id,
            port,
            " (the preview token in this browser's cookie was rotated)",
        ));
    }
    Err(private(&live.id, port, ""))
}

fn private(id: &str, port: u16, why: &str) -> ApiError {
    ApiError::unauthorized(format!(
        "port {port} of sandbox {id} is private{why}: send `Authorization: Bearer <api key>` or \
         `X-Locker-Token: <the sandbox's preview_token>`, or open the URL once with \
         `?locker_token=<preview_token>`; or make the port public with \
         `PUT /v1/sandboxes/{id}/ports/{port}` {{\"public\": true}}"
    ))
}

/// A redirect target on this same host: `//evil.example/…` or `/\\evil…` would send the
/// browser to another host, so the path always starts with exactly one `/`.
fn same_host_location(path: &str, query: Option<&str>) -> String {
    let path = format!(
        "/{}",
        path.trim_start_matches(['/', '\\']).replace('\\', "%5C")
    );
    match query {
        Some(q) => format!("{path}?{q}"),
        None => path,
    }
}

fn redirect_with_cookie(location: &str, token: &str, https: bool) -> Response {
    let mut resp = StatusCode::FOUND.into_response();
    let h = resp.headers_mut();
    if let Ok(l) = HeaderValue::from_str(location) {
        h.insert(header::LOCATION, l);
    }
    if let Some(c) = cookie(token, https) {
        h.insert(header::SET_COOKIE, c);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The cookie for this host only (no `Domain`): no other port or sandbox ever sees it.
fn cookie(token: &str, https: bool) -> Option<HeaderValue> {
    let secure = if https { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax{secure}"
    ))
    .ok()
}

/// The values of our cookie in the request's `Cookie` headers.
fn cookie_values(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim().to_owned())
        .collect()
}

/// Removes our cookie from the request, keeping the app's own cookies.
fn strip_cookie(headers: &mut HeaderMap) {
    let kept: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && c.split_once('=').map_or(*c, |(k, _)| k) != COOKIE)
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if !kept.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&kept.join("; ")) {
            headers.insert(header::COOKIE, v);
        }
    }
}

/// The first value of `name` in a query string, decoded.
fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// The query without any `name=` pair, or `None` when nothing is left.
fn strip_query_param(query: Option<&str>, name: &str) -> Option<String> {
    let kept: Vec<&str> = query?
        .split('&')
        .filter(|kv| !kv.is_empty() && kv.split_once('=').map_or(*kv, |(k, _)| k) != name)
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(raw: &str) -> PreviewDomain {
        PreviewDomain::parse(raw, 7070).unwrap()
    }

    #[test]
    fn domains_parse_into_url_templates() {
        assert_eq!(
            domain("localhost").template("sb_1"),
            "http://{port}-sb_1.localhost:7070/"
        );
        assert_eq!(
            domain("Preview.Example.com:8443").url("sb_1", 3000),
            "http://3000-sb_1.preview.example.com:8443/"
        );
        assert_eq!(
            domain("https://preview.example.com/").url("sb_1", 80),
            "https://80-sb_1.preview.example.com/"
        );
        assert_eq!(
            domain("*.p.example").template("sb_1"),
            "http://{port}-sb_1.p.example:7070/"
        );
        for bad in ["", "ftp://x", "a..b", "-a.b", "a b", "x:port", "a_b.c"] {
            assert!(PreviewDomain::parse(bad, 7070).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hosts_name_a_sandbox_and_port_or_are_not_preview_hosts() {
        let d = domain("localhost");
        let t = |a: &str| d.target(a).map(|r| r.map_err(|e| e.to_string()));
        assert_eq!(
            t("8000-sb_0a1b.localhost:7070"),
            Some(Ok(("sb_0a1b".into(), 8000)))
        );
        assert_eq!(
            t("8000-SB-0A1B.LOCALHOST"),
            Some(Ok(("sb_0a1b".into(), 8000)))
        );
        assert_eq!(
            t("8000-sb_0a1b.localhost."),
            Some(Ok(("sb_0a1b".into(), 8000)))
        );
        assert_eq!(t("localhost:7070"), None);
        assert_eq!(t("127.0.0.1:7070"), None);
        assert_eq!(t("evil-localhost"), None);
        assert_eq!(t("8000-sb_1.other.example"), None);
        for bad in [
            "sb_1.localhost",
            "0-sb_1.localhost",
            "65536-sb_1.localhost",
            "80-sb_1.x.localhost",
            "80-vol_1.localhost",
            "80-sb_1%2f.localhost",
        ] {
            assert!(matches!(t(bad), Some(Err(_))), "{bad}");
        }
    }

    #[test]
    fn the_token_leaves_the_query_and_our_cookie_leaves_the_request() {
        assert_eq!(
            query_param(Some("a=1&locker_token=lpt_x%2By&b"), COOKIE).as_deref(),
            Some("lpt_x+y")
        );
        assert_eq!(
            strip_query_param(Some("a=1&locker_token=t&b"), COOKIE).as_deref(),
            Some("a=1&b")
        );
        assert_eq!(strip_query_param(Some("locker_token=t"), COOKIE), None);
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, "app=1; locker_token=t".parse().unwrap());
        h.append(header::COOKIE, "locker_token=t2; other=2".parse().unwrap());
        assert_eq!(cookie_values(&h), ["t", "t2"]);
        strip_cookie(&mut h);
        assert_eq!(h.get(header::COOKIE).unwrap(), "app=1; other=2");
        let mut only = HeaderMap::new();
        only.insert(header::COOKIE, "locker_token=t".parse().unwrap());
        strip_cookie(&mut only);
        assert!(only.get(header::COOKIE).is_none());
        assert_eq!(
            query_param(Some("locker_token=%zz%4"), COOKIE).as_deref(),
            Some("%zz%4")
        );
        assert_eq!(
            same_host_location("//evil.example/x", Some("a=1")),
            "/evil.example/x?a=1"
        );
        assert_eq!(same_host_location("/\\evil.example", None), "/evil.example");
        assert_eq!(same_host_location("/a\\b", None), "/a%5Cb");
    }
}
