//! PostgreSQL restarted in the middle of a round. The test runs a PostgreSQL cluster of
//! its own (initdb in a temporary folder, a free port), so that restarting it disturbs
//! no other test, puts `cohort serve` and two `cohort edge` processes on it, and stops
//! the database while round 1 collects uploads. During the outage the API answers 503
//! `unavailable` with `Retry-After`, never a 500; once the database is back the
//! coordinator reconnects by itself and every round completes.
//!
//! Needs PostgreSQL's server binaries (`initdb`, `pg_ctl`) and root (to run them as the
//! `postgres` user); skipped without them, unless `COHORT_REQUIRE_PG_TOOLS=1` (CI).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, spawn_serve, wait_healthy};
use reqwest::Method;

/// The newest PostgreSQL server binaries installed, if any.
fn pg_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A throwaway cluster, stopped when dropped.
struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
}

impl Cluster {
    fn as_postgres(&self, tool: &str) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(self.bin.join(tool));
        c.stdin(Stdio::null());
        c
    }

    fn create(bin: PathBuf, root: &Path) -> Cluster {
        use std::os::unix::fs::PermissionsExt;
        let data = root.join("pgdata");
        std::fs::create_dir_all(&data).unwrap();
        // The test's temporary folder is root's alone; the postgres user must get in.
        let parent = root.parent().unwrap();
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).unwrap();
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(root)
            .status()
            .unwrap();
        assert!(chown.success());
        let cluster = Cluster {
            bin,
            data,
            port: free_port(),
        };
        let init = cluster
            .as_postgres("initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&cluster.data)
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        cluster.start();
        cluster
    }

    fn start(&self) {
        let out = self
            .as_postgres("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1",
                self.port,
                self.data.display()
            ))
            .args(["-l"])
            .arg(self.data.join("server.log"))
            .args(["-w", "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn stop(&self) {
        let _ = self
            .as_postgres("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "stop"])
            .output();
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_coordinator_rides_out_a_postgres_restart_mid_round() {
    let usable = pg_bin().filter(|_| is_root());
    let Some(bin) = usable else {
        assert!(
            std::env::var_os("COHORT_REQUIRE_PG_TOOLS").is_none(),
            "COHORT_REQUIRE_PG_TOOLS is set but initdb/pg_ctl or root is missing"
        );
        eprintln!("skipped: needs PostgreSQL's initdb and pg_ctl, run as root");
        return;
    };
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::create(bin, &dir.path().join("pg"));
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, Some(&cluster.url()));
    let http = wait_healthy(&base, &ca).await;

    let (csvs, _) =
        write_digits_partitions(&dir.path().join("sites"), 2, &PartitionScheme::Iid, 0).unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "restart", "features": 64, "classes": 10, "model": "logreg",
            "rounds": 3, "clients_per_round": 2, "min_participants": 2,
            "collect_deadline_seconds": 120, "train": {"local_epochs": 1}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let mut edges = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let issued = common::issue_token(&http, &base, &format!("site-{site}")).await;
        edges.push(
            common::edge_command(site, &base, &ca, csv, dir.path(), &issued, 20)
                // Slow enough that round 1 is still collecting when the database goes.
                .args(["--slowdown-ms", "6000"])
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
    }
    common::wait_checked_in(&http, &base, 2, Duration::from_secs(60)).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    // Round 1 collecting, then the database goes away.
    let start = Instant::now();
    loop {
        let rounds = common::rounds(&http, &base, &id).await;
        if rounds.iter().any(|r| r["stage"] == "collecting") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{rounds:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.stop();
    let down = http
        .get(format!("{base}/api/v1/admin/experiments/{id}"))
        .bearer_auth(common::ADMIN)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(down.status(), 503, "{}", down.text().await.unwrap());
    let retry: u64 = down.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let body: serde_json::Value = down.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable");
    // The health check says the process is up; it does not need the database.
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start();

    common::wait_finished(&http, &base, &id, Duration::from_secs(240)).await;
    let rounds = common::rounds(&http, &base, &id).await;
    let published: Vec<_> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .map(|r| r["round"].as_i64().unwrap())
        .collect();
    assert_eq!(published, vec![1, 2, 3], "{rounds:#?}");
    for mut edge in edges {
        let _ = edge.wait();
    }
    assert!(
        server.try_wait().unwrap().is_none(),
        "the coordinator kept running through the outage"
    );
    server.kill().unwrap();
    server.wait().unwrap();
}
