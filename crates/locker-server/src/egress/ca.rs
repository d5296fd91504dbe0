//! A machine's egress CA: made when a machine with secrets gets its network, trusted inside
//! that machine only, held in the server's memory only (its key never touches a disk or a
//! machine). It signs one leaf certificate per intercepted host, made on first use and
//! kept for the machine's life, and the TLS server configuration that presents it.
//!
//! Owns: certificates and keys for interception. It does not decide what is intercepted
//! (`intercept` does) and does not install the CA in the machine (`secrets::arm` does).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::ids::this_year;

/// How many hosts' leaf configurations one machine keeps (a secret names at most 16, a
/// machine at most 32 secrets).
const MAX_LEAVES: usize = 512;

/// One machine's CA and its leaves.
pub struct MachineCa {
    /// The CA certificate, PEM, as the machine trusts it.
    pub pem: String,
    cert: rcgen::Certificate,
    key: KeyPair,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl std::fmt::Debug for MachineCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MachineCa(..)")
    }
}

/// The crypto every TLS configuration of the interception uses (ring, the one in the lock).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl MachineCa {
    /// A new CA for machine `key` (its sandbox or call id, in the CA's name).
    pub fn new(key: &str) -> Result<MachineCa, String> {
        let err = |e: rcgen::Error| format!("making the machine's egress CA: {e}");
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        p.distinguished_name
            .push(DnType::CommonName, format!("Locker egress CA {key}"));
        p.distinguished_name
            .push(DnType::OrganizationName, "Locker");
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + 10, 1, 1);
        let key = KeyPair::generate().map_err(err)?;
        let cert = p.self_signed(&key).map_err(err)?;
        Ok(MachineCa {
            pem: cert.pem(),
            cert,
            key,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The TLS server configuration for `host` (a leaf signed by this CA; ALPN h2 and
    /// http/1.1), made on first use.
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        if let Some(c) = self.leaves.lock().expect("leaves").get(host) {
            return Ok(c.clone());
        }
        let err = |e: rcgen::Error| format!("making a certificate for {host}: {e}");
        let mut p = CertificateParams::new(vec![host.to_owned()]).map_err(err)?;
        p.distinguished_name.push(DnType::CommonName, host);
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + 1, 1, 1);
        let leaf_key = KeyPair::generate().map_err(err)?;
        let leaf = p.signed_by(&leaf_key, &self.cert, &self.key).map_err(err)?;
        let chain: Vec<CertificateDer<'static>> = vec![leaf.der().clone(), self.cert.der().clone()];
        let pk = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, pk)
            .map_err(|e| format!("the certificate for {host}: {e}"))?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        let mut leaves = self.leaves.lock().expect("leaves");
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), cfg.clone());
        Ok(cfg)
    }
}

/// The configuration for connections to real hosts: the host's trust store
/// (rustls-native-certs) plus the operator's `--egress-ca` files, full verification,
/// ALPN `alpn`.
pub fn upstream_config(
    extra: &[std::path::PathBuf],
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _) = roots.add_parsable_certificates(native.certs);
    for path in extra {
        let pem = std::fs::read(path)
            .map_err(|e| format!("reading --egress-ca {}: {e}", path.display()))?;
        let mut n = 0;
        for c in rustls_pemfile_certs(&pem) {
            roots
                .add(c)
                .map_err(|e| format!("--egress-ca {}: {e}", path.display()))?;
            n += 1;
        }
        if n == 0 {
            return Err(format!(
                "--egress-ca {}: no PEM certificate in it",
                path.display()
            ));
        }
    }
    if added == 0 && extra.is_empty() {
        tracing::warn!(
            "no trusted roots on this host: intercepted hosts will fail their certificate checks"
        );
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// The certificates of a PEM file.
fn rustls_pemfile_certs(pem: &[u8]) -> Vec<CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_are_made_once_per_host_and_chain_to_the_ca() {
        let ca = MachineCa::new("sb_test").unwrap();
        assert!(ca.pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca.server_config("api.example.test").unwrap();
        let b = ca.server_config("api.example.test").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.alpn_protocols, [b"h2".to_vec(), b"http/1.1".to_vec()]);
    }
}
