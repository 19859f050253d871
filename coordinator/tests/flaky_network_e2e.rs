//! A bad network between the edge clients and the coordinator. The clients of this test
//! reach `cohort serve` only through a fault-injecting TCP proxy (below): of the
//! connections they open, some are dropped at once, some stall, some are cut (or reset)
//! part-way through what the client sends, as in the middle of an upload, and some
//! deliver the request but lose the answer, so that a stored upload is retried. TLS runs
//! end to end through it. Every round still publishes, and no contribution counts
//! twice: each published round has exactly one upload row per participant that
//! uploaded, and its `reported` count equals them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cohort_coordinator::demo::write_digits_partitions;
use cohort_edge::partition::PartitionScheme;
use common::{admin, free_port, spawn_serve, wait_healthy};
use rand::{RngExt, SeedableRng};
use reqwest::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does to one connection.
#[derive(Debug, Clone, Copy)]
enum Fate {
    /// Close it before anything is forwarded.
    Drop,
    /// Hold it this long, then forward until the client has sent `then` bytes, then
    /// close.
    Stall { pause: Duration, then: usize },
    /// Forward this many bytes from the client, then close (with a reset when `reset`):
    /// a request body cut short.
    Cut { after: usize, reset: bool },
    /// Forward the client's bytes, but lose the server's answer after this many bytes
    /// from the client, then close: the request may have been stored, the client never
    /// hears so.
    LoseAnswer { after: usize },
}

#[derive(Default)]
struct Counts {
    drop: AtomicUsize,
    stall: AtomicUsize,
    cut: AtomicUsize,
    lose: AtomicUsize,
}

/// Connections live long (HTTP/2 carries every request of a client on one), so every
/// connection fails sooner or later: after a number of the client's bytes that falls in
/// the middle of a session, often in the middle of a 38 KB upload. The client then
/// opens another, which gets a fate of its own.
fn fate(rng: &mut impl RngExt) -> Fate {
    match rng.random_range(0..100) {
        0..10 => Fate::Drop,
        10..25 => Fate::Stall {
            pause: Duration::from_millis(rng.random_range(500..3000)),
            then: rng.random_range(1..150_000),
        },
        25..65 => Fate::Cut {
            after: rng.random_range(1..150_000),
            reset: rng.random_bool(0.5),
        },
        _ => Fate::LoseAnswer {
            after: rng.random_range(1..150_000),
        },
    }
}

async fn serve_connection(client: TcpStream, upstream: u16, fate: Fate) {
    if let Fate::Drop = fate {
        drop(client);
        return;
    }
    if let Fate::Stall { pause, .. } = fate {
        tokio::time::sleep(pause).await;
    }
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    let (limit, lose_answer) = match fate {
        Fate::Cut { after, reset } => {
            if reset {
                // Closing the socket then sends a reset instead of a FIN.
                let _ = client.set_zero_linger();
            }
            (Some(after), false)
        }
        Fate::LoseAnswer { after } => (Some(after), true),
        Fate::Stall { then, .. } => (Some(then), false),
        Fate::Drop => (None, false),
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let answers_lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lost = answers_lost.clone();
    // Server to client, until the answer is to be lost.
    let down = tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if lost.load(Ordering::SeqCst) {
                continue;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    // Client to server, counting bytes against the limit.
    let mut sent = 0usize;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let take = limit.map_or(n, |l| n.min(l.saturating_sub(sent)));
        if server_write.write_all(&buf[..take]).await.is_err() {
            break;
        }
        sent += take;
        if limit.is_some_and(|l| sent >= l) {
            if lose_answer {
                // The rest of what was read goes through; no answer comes back.
                answers_lost.store(true, Ordering::SeqCst);
                let _ = server_write.write_all(&buf[take..n]).await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            break;
        }
    }
    drop(server_write);
    // Dropping the task drops the client's write half; with the read half gone too the
    // socket closes.
    down.abort();
    let _ = down.await;
    drop(client_read);
}

/// Accepts connections on `listener` and gives each a fate drawn from `seed`.
async fn run_proxy(listener: TcpListener, upstream: u16, seed: u64, counts: Arc<Counts>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    loop {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        let f = fate(&mut rng);
        let counter = match f {
            Fate::Drop => &counts.drop,
            Fate::Stall { .. } => &counts.stall,
            Fate::Cut { .. } => &counts.cut,
            Fate::LoseAnswer { .. } => &counts.lose,
        };
        counter.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(serve_connection(client, upstream, f));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rounds_complete_through_a_faulty_network_and_nothing_counts_twice() {
    cohort_coordinator::server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("coordinator");
    let ca = data_dir.join("tls/ca.pem");
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut server = spawn_serve(&data_dir, port, None);
    // The admin talks to the coordinator directly; only the edge clients' traffic
    // crosses the faulty network.
    let http = wait_healthy(&base, &ca).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = format!(
        "https://127.0.0.1:{}",
        listener.local_addr().unwrap().port()
    );
    let counts = Arc::new(Counts::default());
    let proxy_task = tokio::spawn(run_proxy(listener, port, 7, counts.clone()));

    const SITES: usize = 4;
    const ROUNDS: i64 = 6;
    let (csvs, _) =
        write_digits_partitions(&dir.path().join("sites"), SITES, &PartitionScheme::Iid, 0)
            .unwrap();
    let exp = admin(
        &http,
        &base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": "flaky", "features": 64, "classes": 10, "model": "mlp:128",
            "rounds": ROUNDS, "clients_per_round": SITES, "min_participants": 3,
            "collect_deadline_seconds": 60, "train": {"local_epochs": 1}
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let mut edges = Vec::new();
    for (site, csv) in csvs.iter().enumerate() {
        let issued = common::issue_token(&http, &base, &format!("site-{site}")).await;
        let log = dir.path().join(format!("edge-{site}.log"));
        edges.push((
            common::edge_command(site, &proxy, &ca, csv, dir.path(), &issued, 30)
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
            log,
        ));
    }
    common::wait_checked_in(&http, &base, SITES, Duration::from_secs(120)).await;
    admin(
        &http,
        &base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    common::wait_finished(&http, &base, &id, Duration::from_secs(600)).await;

    let rounds = common::rounds(&http, &base, &id).await;
    let published: Vec<_> = rounds
        .iter()
        .filter(|r| r["stage"] == "published")
        .collect();
    assert_eq!(published.len(), ROUNDS as usize, "{rounds:#?}");
    for r in &published {
        let (round, attempt) = (r["round"].as_i64().unwrap(), r["attempt"].as_i64().unwrap());
        let detail = admin(
            &http,
            &base,
            Method::GET,
            &format!("/experiments/{id}/rounds/{round}/attempts/{attempt}"),
            None,
        )
        .await;
        let uploaded: Vec<_> = detail["participants"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["state"] == "uploaded")
            .map(|p| p["client_id"].as_str().unwrap().to_string())
            .collect();
        let mut distinct = uploaded.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), uploaded.len(), "round {round}: {detail:#}");
        assert_eq!(
            r["reported"].as_i64().unwrap() as usize,
            uploaded.len(),
            "round {round}: each upload counted once: {detail:#}"
        );
        assert!(uploaded.len() >= 3, "round {round}: {detail:#}");
    }
    let faults = [
        ("dropped", counts.drop.load(Ordering::SeqCst)),
        ("stalled", counts.stall.load(Ordering::SeqCst)),
        ("cut", counts.cut.load(Ordering::SeqCst)),
        ("answer lost", counts.lose.load(Ordering::SeqCst)),
    ];
    eprintln!("proxy: {faults:?}");
    for (what, n) in faults {
        assert!(
            n > 0,
            "the proxy never {what} a connection: the test proves nothing"
        );
    }
    let retries: usize = edges
        .iter()
        .map(|(_, log)| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .matches("retrying in")
                .count()
        })
        .sum();
    eprintln!("edge clients retried {retries} times");
    assert!(retries > 0);
    for (mut edge, _) in edges {
        let _ = edge.kill();
        let _ = edge.wait();
    }
    proxy_task.abort();
    server.kill().unwrap();
    server.wait().unwrap();
}
