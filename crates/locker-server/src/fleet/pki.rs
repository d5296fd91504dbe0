//! The fleet's certificates: the CA the control plane keeps (in the store, its key sealed
//! with the secrets key every control replica shares), the client certificates it signs for
//! nodes at join, the control listener's TLS (its leaf signed by the CA, client certificates
//! checked against the CA), and a node's TLS towards the control plane (before join: the CA
//! pinned by the join token; after: the CA it was handed, and its own certificate).
//!
//! Owns: keys, certificates, rustls configurations. It does not decide who may join (the
//! store redeems tokens) and holds no sockets.

use std::net::IpAddr;
use std::sync::Arc;

use locker_store::{FleetCaRecord, Store};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, PublicKeyData, SignatureAlgorithm,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::ids::{hex, this_year};
use crate::secrets::Sealer;

/// The row the CA's key is sealed for (the sealer binds a value to its row).
const SEAL_ROW: (&str, &str) = ("_fleet", "ca-key");
/// How many hex digits of the CA's SHA-256 a join token pins (128 bits).
pub const PIN_HEX: usize = 32;
/// How long a node's certificate is valid. A node renews by joining again.
const NODE_CERT_YEARS: i32 = 5;

/// The name a node's certificate holds: the control plane dials node `id` at whatever
/// address it advertised and accepts only this name, so a node cannot answer for another.
pub fn node_name(node_id: &str) -> String {
    format!("{node_id}.nodes.locker")
}

/// The name a control replica's client certificate holds: a node's listener accepts no
/// other (a node's certificate, signed by the same CA, opens no other node).
pub const CONTROL_NAME: &str = "control.locker";

/// The crypto of every fleet TLS configuration (ring, the one in the lock).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// SHA-256 of `der`, hex.
pub fn fingerprint(der: &[u8]) -> String {
    hex(&Sha256::digest(der))
}

/// The DER of the first certificate in `pem`.
pub fn pem_to_der(pem: &str) -> Result<CertificateDer<'static>, String> {
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE-----"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    let der = locker_types::base64::decode(body.trim()).map_err(|_| "not a PEM certificate")?;
    Ok(CertificateDer::from(der))
}

/// The CA's name and uses: the same every time, so that the issuer rebuilt from the stored
/// key signs certificates that chain to the stored CA certificate.
fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name
        .push(DnType::CommonName, "Locker fleet CA");
    p.distinguished_name
        .push(DnType::OrganizationName, "Locker");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

/// The fleet's CA, opened.
pub struct FleetCa {
    /// The CA certificate as stored (PEM and DER): what nodes trust.
    pub pem: String,
    pub der: CertificateDer<'static>,
    /// The same name and key, re-signed in memory: rcgen's handle for signing.
    issuer: rcgen::Certificate,
    key: KeyPair,
}

impl std::fmt::Debug for FleetCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetCa(..)")
    }
}

/// A node's public key as it sent it: an uncompressed P-256 point (what
/// `KeyPair::generate` makes and `public_key_raw` gives).
struct NodeKey<'a>(&'a [u8]);

impl PublicKeyData for NodeKey<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.0
    }

    fn algorithm(&self) -> &SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

impl FleetCa {
    /// The store's CA, made (and stored) now if there is none.
    pub fn load_or_make(store: &dyn Store, sealer: &Sealer) -> Result<FleetCa, String> {
        if let Some(rec) = store.fleet_ca().map_err(|e| e.to_string())? {
            return FleetCa::open(&rec, sealer);
        }
        let err = |e: rcgen::Error| format!("making the fleet CA: {e}");
        let key = KeyPair::generate().map_err(err)?;
        let mut p = ca_params().map_err(err)?;
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + 20, 1, 1);
        let cert = p.self_signed(&key).map_err(err)?;
        let sealed = sealer.seal(SEAL_ROW.0, SEAL_ROW.1, key.serialize_pem().as_bytes())?;
        let rec = FleetCaRecord {
            cert_pem: cert.pem(),
            key_sealed: sealed,
            created_at: locker_types::rfc3339(crate::ids::now_s()),
        };
        // Another replica may have made one at the same time: the first stored wins.
        let stored = store.put_fleet_ca_once(&rec).map_err(|e| e.to_string())?;
        if stored.cert_pem == rec.cert_pem {
            tracing::info!(fingerprint = %fingerprint(cert.der()), "made the fleet CA");
        }
        FleetCa::open(&stored, sealer)
    }

    fn open(rec: &FleetCaRecord, sealer: &Sealer) -> Result<FleetCa, String> {
        let key_pem = sealer.open(SEAL_ROW.0, SEAL_ROW.1, &rec.key_sealed).ok_or(
            "the fleet CA's key cannot be opened with this server's secrets key: every \
                 control replica must run with the same LOCKER_SECRETS_KEY",
        )?;
        let key_pem = String::from_utf8(key_pem).map_err(|_| "the fleet CA's key is corrupt")?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| format!("the fleet CA's key: {e}"))?;
        let issuer = ca_params()
            .and_then(|p| p.self_signed(&key))
            .map_err(|e| format!("opening the fleet CA: {e}"))?;
        Ok(FleetCa {
            pem: rec.cert_pem.clone(),
            der: pem_to_der(&rec.cert_pem).map_err(|e| format!("the fleet CA: {e}"))?,
            issuer,
            key,
        })
    }

    /// The prefix of the CA's fingerprint a join token carries.
    pub fn pin(&self) -> String {
        fingerprint(&self.der)[..PIN_HEX].to_owned()
    }

    /// A client certificate for node `node_id` over its public key (hex of an uncompressed
    /// P-256 point), PEM, with its fingerprint.
    pub fn sign_node(
        &self,
        node_id: &str,
        public_key_hex: &str,
    ) -> Result<(String, String), String> {
        let raw = crate::ids::decode_hex(public_key_hex)
            .filter(|k| k.len() == 65 && k[0] == 4)
            .ok_or(
                "public_key must be the hex of an uncompressed P-256 point (130 hex digits \
                 starting with 04)",
            )?;
        ring_checks_point(&raw)?;
        let err = |e: rcgen::Error| format!("signing the node's certificate: {e}");
        let mut p = CertificateParams::new(vec![node_name(node_id)]).map_err(err)?;
        p.distinguished_name.push(DnType::CommonName, node_id);
        p.distinguished_name
            .push(DnType::OrganizationName, "Locker fleet");
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Client (its calls to the control plane) and server (its listener, dialled by
        // the control plane under the name above).
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ClientAuth,
            ExtendedKeyUsagePurpose::ServerAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + NODE_CERT_YEARS, 1, 1);
        let cert = p
            .signed_by(&NodeKey(&raw), &self.issuer, &self.key)
            .map_err(err)?;
        Ok((cert.pem(), fingerprint(cert.der())))
    }

    /// The control listener's TLS: a fresh leaf for `names` (host names or addresses nodes
    /// dial) signed by the CA; client certificates are checked against the CA when given,
    /// and are optional (a joining node has none yet: each route says whether it needs one).
    pub fn server_config(&self, names: &[String]) -> Result<Arc<rustls::ServerConfig>, String> {
        let (leaf, leaf_key) = self
            .control_leaf(names.to_vec(), ExtendedKeyUsagePurpose::ServerAuth)
            .map_err(|e| format!("making the control listener's certificate: {e}"))?;
        let chain = vec![leaf.der().clone(), self.der.clone()];
        let pk = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let mut roots = RootCertStore::empty();
        roots.add(self.der.clone()).map_err(|e| e.to_string())?;
        let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .allow_unauthenticated()
        .build()
        .map_err(|e| e.to_string())?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(clients)
            .with_single_cert(chain, pk)
            .map_err(|e| format!("the control listener's certificate: {e}"))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }
}

impl FleetCa {
    /// A control plane's certificate for `names`, for one use (server or client), valid 2
    /// years, with its new key.
    fn control_leaf(
        &self,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<(rcgen::Certificate, KeyPair), rcgen::Error> {
        let mut p = CertificateParams::new(names)?;
        p.distinguished_name
            .push(DnType::CommonName, "Locker fleet control");
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![usage];
        p.use_authority_key_identifier_extension = true;
        let y = this_year();
        p.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
        p.not_after = rcgen::date_time_ymd(y + 2, 1, 1);
        let key = KeyPair::generate()?;
        let leaf = p.signed_by(&key, &self.issuer, &self.key)?;
        Ok((leaf, key))
    }

    /// A control replica's TLS towards nodes: a client certificate of its own (made now,
    /// named [`CONTROL_NAME`], client use only) and nodes' certificates verified against
    /// the CA, under the name the caller gives ([`node_name`]).
    pub fn control_client_config(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        let (leaf, key) = self
            .control_leaf(
                vec![CONTROL_NAME.to_owned()],
                ExtendedKeyUsagePurpose::ClientAuth,
            )
            .map_err(|e| format!("making the control plane's client certificate: {e}"))?;
        client_config(trust_ca(&self.pem)?, Some((&leaf.pem(), &key)))
    }
}

impl FleetCa {
    /// The TLS of a control replica's own node listener (`--node local`): a fresh key and a
    /// certificate for node `node_id` signed here (the replica holds the CA: no join), as a
    /// joined node's listener has.
    pub fn local_node_server_config(
        &self,
        node_id: &str,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let key = KeyPair::generate().map_err(|e| format!("making the node's key: {e}"))?;
        let (cert, _) = self.sign_node(node_id, &crate::ids::hex(key.public_key_raw()))?;
        node_server_config(&self.pem, &cert, &key)
    }
}

/// A node's listener: its certificate from the join and its key; every client must show
/// a certificate from the fleet CA that names the control plane ([`CONTROL_NAME`]).
pub fn node_server_config(
    ca_pem: &str,
    cert_pem: &str,
    key: &KeyPair,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let ca = pem_to_der(ca_pem)?;
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).map_err(|e| e.to_string())?;
    let inner =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| e.to_string())?;
    let chain = vec![pem_to_der(cert_pem)?, ca];
    let pk = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(Arc::new(ControlOnly(inner)))
        .with_single_cert(chain, pk)
        .map_err(|e| format!("the node listener's certificate: {e}"))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// The CA's client verification, and the client's certificate must name the control plane.
#[derive(Debug)]
struct ControlOnly(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for ControlOnly {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self.0.verify_client_cert(end_entity, intermediates, now)?;
        let name = ServerName::try_from(CONTROL_NAME).expect("a DNS name");
        webpki::EndEntityCert::try_from(end_entity)
            .and_then(|c| c.verify_is_valid_for_subject_name(&name))
            .map_err(|_| {
                rustls::Error::General(
                    "only the fleet's control plane may call a node (this certificate does \
                     not name it)"
                        .into(),
                )
            })?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Refuses a point that is not on the curve (ring parses it as a P-256 public key).
fn ring_checks_point(raw: &[u8]) -> Result<(), String> {
    // ring's ECDH parses the peer's point and refuses one off the curve: agreeing with an
    // ephemeral key of ours is that check, and nothing is kept of it.
    let peer = ring::agreement::UnparsedPublicKey::new(&ring::agreement::ECDH_P256, raw);
    let rng = ring::rand::SystemRandom::new();
    let mine = ring::agreement::EphemeralPrivateKey::generate(&ring::agreement::ECDH_P256, &rng)
        .map_err(|_| "cannot check the node's public key")?;
    ring::agreement::agree_ephemeral(mine, &peer, |_| ())
        .map_err(|_| "public_key is not a point on P-256".to_owned())
}

/// A node's TLS towards the control plane.
pub fn client_config(
    server: Arc<dyn ServerCertVerifier>,
    identity: Option<(&str, &KeyPair)>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(server);
    let mut cfg = match identity {
        None => b.with_no_client_auth(),
        Some((cert_pem, key)) => b
            .with_client_auth_cert(
                vec![pem_to_der(cert_pem)?],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .map_err(|e| format!("the node's certificate: {e}"))?,
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// Full verification against the fleet CA (a node after join).
pub fn trust_ca(ca_pem: &str) -> Result<Arc<dyn ServerCertVerifier>, String> {
    let mut roots = RootCertStore::empty();
    roots.add(pem_to_der(ca_pem)?).map_err(|e| e.to_string())?;
    let v =
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| e.to_string())?;
    Ok(v)
}

/// Before join: the server's chain must hold the CA whose fingerprint starts with the join
/// token's pin, and the server's certificate must verify against that CA (name included).
#[derive(Debug)]
pub struct PinnedCa {
    pin: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl PinnedCa {
    pub fn new(pin: &str) -> Arc<PinnedCa> {
        Arc::new(PinnedCa {
            pin: pin.to_ascii_lowercase(),
            provider: provider(),
        })
    }
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| fingerprint(c).starts_with(&self.pin))
            .ok_or_else(|| {
                rustls::Error::General(
                    "the control plane's CA is not the one the join token names (a wrong \
                     URL, or someone in between)"
                        .into(),
                )
            })?;
        let mut roots = RootCertStore::empty();
        roots
            .add(ca.clone().into_owned())
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?
        .verify_server_cert(end_entity, &[], server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The names the control listener's certificate holds: the operator's, the listen address
/// when it is a specific one, and this host's loopback names.
pub fn listener_names(extra: &[String], listen: std::net::SocketAddr) -> Vec<String> {
    let mut names: Vec<String> = extra.to_vec();
    if !listen.ip().is_unspecified() {
        names.push(listen.ip().to_string());
    }
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        names.push(h.trim().to_owned());
    }
    names.extend([
        "localhost".to_owned(),
        IpAddr::from([127, 0, 0, 1]).to_string(),
    ]);
    names.retain(|n| !n.is_empty());
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (std::path::PathBuf, Arc<dyn Store>) {
        let dir = std::env::temp_dir().join(crate::ids::new_id("fleet-pki-"));
        std::fs::create_dir_all(&dir).unwrap();
        let s = locker_store::SqliteStore::open(dir.join("db.sqlite")).unwrap();
        (dir, Arc::new(s))
    }

    #[test]
    fn a_reopened_ca_signs_certificates_that_chain_to_the_stored_one() {
        let (dir, store) = store();
        let sealer = Sealer::new(&[7u8; 32]);
        let made = FleetCa::load_or_make(store.as_ref(), &sealer).unwrap();
        // Another replica (or a restart) opens the same CA from the store.
        let opened = FleetCa::load_or_make(store.as_ref(), &sealer).unwrap();
        assert_eq!(made.pem, opened.pem);
        let node_key = KeyPair::generate().unwrap();
        let (pem, fp) = opened
            .sign_node("node_1", &hex(node_key.public_key_raw()))
            .unwrap();
        let der = pem_to_der(&pem).unwrap();
        assert_eq!(fp, fingerprint(&der));
        let mut roots = RootCertStore::empty();
        roots.add(made.der.clone()).unwrap();
        let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .unwrap();
        v.verify_client_cert(&der, &[], UnixTime::now())
            .expect("the node's certificate chains to the stored CA");
        // A key the secrets key cannot open is refused, saying what to share.
        let other = Sealer::new(&[8u8; 32]);
        let e = FleetCa::load_or_make(store.as_ref(), &other).unwrap_err();
        assert!(e.contains("LOCKER_SECRETS_KEY"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn node_keys_must_be_points_on_p256() {
        let (dir, store) = store();
        let ca = FleetCa::load_or_make(store.as_ref(), &Sealer::new(&[1u8; 32])).unwrap();
        for bad in [
            "",
            "04",
            &"ab".repeat(65),
            &format!("04{}", "00".repeat(64)),
            "zz",
        ] {
            assert!(ca.sign_node("node_1", bad).is_err(), "{bad}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn join_tokens_carry_the_ca_pin() {
        let pin = "0123456789abcdef0123456789abcdef";
        let secret = "f".repeat(40);
        assert_eq!(
            super::super::token_pin(&format!("lkj_{pin}_{secret}")),
            Some(pin)
        );
        for bad in [
            format!("lkj_{pin}"),
            format!("lkj_{}_{secret}", &pin[1..]),
            format!("lk_{pin}_{secret}"),
            format!("lkj_{pin}_short"),
            format!("lkj_{pin}_{}", "g".repeat(40)),
        ] {
            assert_eq!(super::super::token_pin(&bad), None, "{bad}");
        }
    }
}
