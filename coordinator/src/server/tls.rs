//! TLS for `cohort serve`: a development CA created on demand, and a rustls server
//! configuration loaded from PEM files.
//!
//! Everything stays on ring as the crypto provider; aws-lc-rs is never linked.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Common name of the development CA, also used to rebuild its issuer identity.
const DEV_CA_NAME: &str = "Cohort development CA";
/// Names the development server certificate is valid for.
const DEV_SERVER_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];
/// How long development certificates stay valid, in days.
const DEV_VALIDITY_DAYS: i64 = 825;

/// Why TLS could not be set up. Messages name the file involved.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("cannot access `{path}`: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A PEM file holds nothing usable.
    #[error("invalid PEM in `{path}`: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Certificate generation failed.
    #[error("cannot create development certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the certificate and key (for example, they do not match).
    #[error("cannot use certificate `{cert}` with key `{key}`: {source}")]
    Config {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        source: rustls::Error,
    },
}

/// Where the development TLS files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevTlsFiles {
    /// The CA certificate, to hand to clients (`ca.pem`).
    pub ca_cert: PathBuf,
    /// The CA private key (`ca-key.pem`, mode 0600).
    pub ca_key: PathBuf,
    /// The server certificate signed by the CA (`server.pem`).
    pub server_cert: PathBuf,
    /// The server private key (`server-key.pem`, mode 0600).
    pub server_key: PathBuf,
}

impl DevTlsFiles {
    /// The file names inside `<data_dir>/tls/`.
    pub fn in_data_dir(data_dir: &Path) -> Self {
        let dir = data_dir.join("tls");
        Self {
            ca_cert: dir.join("ca.pem"),
            ca_key: dir.join("ca-key.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server-key.pem"),
        }
    }
}

/// Makes sure a development CA and a server certificate for `localhost`, `127.0.0.1` and
/// `::1` exist in `<data_dir>/tls/`, creating what is missing, and returns their paths.
/// An existing CA is reused, so clients that trust it keep working across restarts.
pub fn ensure_dev_tls(data_dir: &Path) -> Result<DevTlsFiles, TlsError> {
    let files = DevTlsFiles::in_data_dir(data_dir);
    let dir = files
        .ca_cert
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| data_dir.join("tls"));
    fs::create_dir_all(&dir).map_err(|source| TlsError::Io {
        path: dir.clone(),
        source,
    })?;

    let ca_params = dev_ca_params();
    let ca_key = if files.ca_cert.exists() && files.ca_key.exists() {
        let pem = read(&files.ca_key)?;
        let text = String::from_utf8(pem).map_err(|_| TlsError::Pem {
            path: files.ca_key.clone(),
            message: "not UTF-8 text".into(),
        })?;
        KeyPair::from_pem(&text).map_err(|e| TlsError::Pem {
            path: files.ca_key.clone(),
            message: e.to_string(),
        })?
    } else {
        let key = KeyPair::generate()?;
        let cert = ca_params.self_signed(&key)?;
        write_secret(&files.ca_key, key.serialize_pem().as_bytes())?;
        write_public(&files.ca_cert, cert.pem().as_bytes())?;
        // A new CA invalidates any server certificate signed by an old one.
        remove_if_present(&files.server_cert)?;
        remove_if_present(&files.server_key)?;
        key
    };

    if !(files.server_cert.exists() && files.server_key.exists()) {
        // The issuer is rebuilt from the same fixed parameters and the stored key: the
        // subject and key identifier then match the CA certificate on disk, so no
        // certificate parsing is needed to sign with it.
        let issuer = Issuer::new(ca_params, ca_key);
        let mut params = CertificateParams::new(
            DEV_SERVER_NAMES
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )?;
        params
            .distinguished_name
            .push(DnType::CommonName, "Cohort development server");
        params.use_authority_key_identifier_extension = true;
        params.key_usages.push(KeyUsagePurpose::DigitalSignature);
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
        set_validity(&mut params);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        write_secret(&files.server_key, key.serialize_pem().as_bytes())?;
        write_public(&files.server_cert, cert.pem().as_bytes())?;
    }
    Ok(files)
}

fn dev_ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, DEV_CA_NAME);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Cohort");
    params.key_usages.push(KeyUsagePurpose::KeyCertSign);
    params.key_usages.push(KeyUsagePurpose::CrlSign);
    params.key_usages.push(KeyUsagePurpose::DigitalSignature);
    set_validity(&mut params);
    params
}

/// From yesterday (clock skew between machines) to a bounded time ahead.
fn set_validity(params: &mut CertificateParams) {
    use chrono::Datelike;
    let today = chrono::Utc::now().date_naive();
    let from = today - chrono::Duration::days(1);
    let until = today + chrono::Duration::days(DEV_VALIDITY_DAYS);
    let ymd = |d: chrono::NaiveDate| rcgen::date_time_ymd(d.year(), d.month() as u8, d.day() as u8);
    params.not_before = ymd(from);
    params.not_after = ymd(until);
}

/// Builds a rustls server configuration (ring provider, ALPN `h2` and `http/1.1`) from a
/// PEM certificate chain and a PEM private key.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    load_server_config_with_clients(cert, key, None)
}

/// Like [`load_server_config`]; with `client_ca`, mutual TLS: every client must present
/// a certificate that chains to one of the CA certificates in that PEM file, or the
/// handshake fails before any HTTP is read.
pub fn load_server_config_with_clients(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let cert_pem = read(cert)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: cert.to_path_buf(),
            message: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            path: cert.to_path_buf(),
            message: "no CERTIFICATE section found".into(),
        });
    }
    let key_pem = read(key)?;
    let private_key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
        path: key.to_path_buf(),
        message: match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no PRIVATE KEY section found".into(),
            other => other.to_string(),
        },
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config_error = |source| TlsError::Config {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    };
    let versions = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(config_error)?;
    let builder = match client_ca {
        None => versions.with_no_client_auth(),
        Some(ca) => versions.with_client_cert_verifier(client_verifier(ca, provider)?),
    };
    let mut config = builder
        .with_single_cert(chain, private_key)
        .map_err(config_error)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A verifier that accepts only client certificates issued by the CAs in `ca`.
fn client_verifier(
    ca: &Path,
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let pem = read(ca)?;
    let pem_error = |message: String| TlsError::Pem {
        path: ca.to_path_buf(),
        message,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| pem_error(e.to_string()))?;
        roots
            .add(cert)
            .map_err(|e| pem_error(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(pem_error("no CERTIFICATE section found".into()));
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| pem_error(format!("cannot verify clients with it: {e}")))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn remove_if_present(path: &Path) -> Result<(), TlsError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TlsError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

fn write_public(path: &Path, bytes: &[u8]) -> Result<(), TlsError> {
    fs::write(path, bytes).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes a private key readable by the owner only. The mode is set at creation, so the
/// key is never briefly world-readable.
pub(crate) fn write_secret_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        options.mode(0o600);
        let mut file = options.open(path)?;
        // `mode` only applies to new files; tighten one that already existed too.
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.write_all(bytes)?;
        file.sync_all()
    }
    #[cfg(not(unix))]
    {
        let mut file = options.open(path)?;
        file.write_all(bytes)?;
        file.sync_all()
    }
}

fn write_secret(path: &Path, bytes: &[u8]) -> Result<(), TlsError> {
    write_secret_file(path, bytes).map_err(|source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_tls_is_created_once_and_loads() {
        let dir = tempfile::tempdir().unwrap();
        let files = ensure_dev_tls(dir.path()).unwrap();
        assert_eq!(files.ca_cert, dir.path().join("tls/ca.pem"));
        load_server_config(&files.server_cert, &files.server_key).unwrap();

        let ca_before = fs::read(&files.ca_cert).unwrap();
        let server_before = fs::read(&files.server_cert).unwrap();
        let again = ensure_dev_tls(dir.path()).unwrap();
        assert_eq!(again, files);
        assert_eq!(fs::read(&again.ca_cert).unwrap(), ca_before, "CA reused");
        assert_eq!(
            fs::read(&again.server_cert).unwrap(),
            server_before,
            "server certificate reused"
        );
    }

    #[test]
    fn missing_server_cert_is_reissued_by_the_same_ca() {
        let dir = tempfile::tempdir().unwrap();
        let files = ensure_dev_tls(dir.path()).unwrap();
        let ca_before = fs::read(&files.ca_cert).unwrap();
        fs::remove_file(&files.server_cert).unwrap();
        let again = ensure_dev_tls(dir.path()).unwrap();
        assert_eq!(fs::read(&again.ca_cert).unwrap(), ca_before);
        load_server_config(&again.server_cert, &again.server_key).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn dev_tls_keys_are_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let files = ensure_dev_tls(dir.path()).unwrap();
        for key in [&files.ca_key, &files.server_key] {
            let mode = fs::metadata(key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
    }

    #[test]
    fn missing_and_invalid_pem_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let files = ensure_dev_tls(dir.path()).unwrap();
        let missing = dir.path().join("nope.pem");
        let err = load_server_config(&missing, &files.server_key).unwrap_err();
        assert!(matches!(err, TlsError::Io { .. }));
        assert!(err.to_string().contains("nope.pem"), "{err}");

        let garbage = dir.path().join("garbage.pem");
        fs::write(&garbage, "not a pem file").unwrap();
        let err = load_server_config(&garbage, &files.server_key).unwrap_err();
        assert!(matches!(err, TlsError::Pem { .. }), "{err}");
        assert!(err.to_string().contains("garbage.pem"), "{err}");
        let err = load_server_config(&files.server_cert, &garbage).unwrap_err();
        assert!(matches!(err, TlsError::Pem { .. }), "{err}");
        assert!(err.to_string().contains("garbage.pem"), "{err}");
    }

    #[test]
    fn mismatched_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let files = ensure_dev_tls(dir.path()).unwrap();
        let err = load_server_config(&files.server_cert, &files.ca_key).unwrap_err();
        assert!(matches!(err, TlsError::Config { .. }), "{err}");
    }
}
