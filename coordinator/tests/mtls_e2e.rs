//! Optional mutual TLS, with real processes: `cohort serve --client-ca FILE` completes a
//! handshake only with clients whose certificate that CA issued. Without a certificate,
//! or with one from another CA, no HTTP is exchanged at all (not even the health
//! check); with the right one, API calls answer and a `cohort edge --client-cert
//! --client-key` enrols and trains through a round.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{ADMIN, admin, free_port};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use reqwest::Method;

/// A CA (certificate PEM) and an issuer to sign client certificates with.
fn make_ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// A client certificate and key (PEM) for `name`, issued by `issuer`.
fn client_cert(name: &str, issuer: &Issuer<'static, KeyPair>) -> (String, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn http(ca: &Path, identity: Option<(&str, &str)>) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    let mut builder = reqwest::Client::builder()
        .tls_certs_only([ca])
        .timeout(Duration::from_secs(10));
    if let Some((cert, key)) = identity {
        builder = builder
            .identity(reqwest::Identity::from_pem(format!("{cert}\n{key}").as_bytes()).unwrap());
    }
    builder.build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_clients_with_a_certificate_from_the_client_ca_get_in() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let (client_ca_pem, issuer) = make_ca("Hospital network client CA");
    let (_, rogue_issuer) = make_ca("Someone else's CA");
    let client_ca = dir.path().join("client-ca.pem");
    std::fs::write(&client_ca, &client_ca_pem).unwrap();
    let (site_cert, site_key) = client_cert("site-0", &issuer);
    let (admin_cert, admin_key) = client_cert("admin", &issuer);
    let (rogue_cert, rogue_key) = client_cert("site-0", &rogue_issuer);

    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["serve", "--dev-tls", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--client-ca")
        .arg(&client_ca)
        .env("COHORT_ADMIN_TOKEN", ADMIN)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Up once the dev CA exists and a client with the right certificate gets an answer.
    let good = loop {
        if ca.exists() {
            let client = http(&ca, Some((&admin_cert, &admin_key)));
            if client
                .get(format!("{base}/api/v1/health"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                break client;
            }
        }
        assert!(server.try_wait().unwrap().is_none(), "cohort serve exited");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    for (what, client) in [
        ("no certificate", http(&ca, None)),
        (
            "a certificate from another CA",
            http(&ca, Some((&rogue_cert, &rogue_key))),
        ),
    ] {
        let r = client.get(format!("{base}/api/v1/health")).send().await;
        assert!(r.is_err(), "{what}: the handshake went through: {r:?}");
    }

    let (csvs, _) =
        write_digits_partitions(&dir.path().join("sites"), 1, &PartitionScheme::Iid, 0).unwrap();
    let exp = admin(
        &good,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "mtls", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 1, "clients_per_round": 1, "min_participants": 1,
            "train": {"local_epochs": 1}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let issued = common::issue_token(&good, &base, "site-0").await;
    let cert_file = dir.path().join("site-0.pem");
    let key_file = dir.path().join("site-0.key");
    std::fs::write(&cert_file, &site_cert).unwrap();
    std::fs::write(&key_file, &site_key).unwrap();
    let log = dir.path().join("edge.log");
    let mut edge = common::edge_command(0, &base, &ca, &csvs[0], dir.path(), &issued, 10)
        .arg("--client-cert")
        .arg(&cert_file)
        .arg("--client-key")
        .arg(&key_file)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    loop {
        let clients = admin(&good, &base, Method::GET, "/clients", None).await;
        if clients
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["last_seen_at"].is_i64())
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the edge client did not get in: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    admin(
        &good,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&good, &base, &id, Duration::from_secs(120)).await;
    let rounds = common::rounds(&good, &base, &id).await;
    assert_eq!(rounds[0]["stage"], "published", "{rounds:?}");
    assert_eq!(rounds[0]["reported"], 1);
    let status = edge.wait().unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    server.kill().unwrap();
    server.wait().unwrap();
}
