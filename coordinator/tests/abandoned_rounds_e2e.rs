//! A trainer never outlives the task that started it (security review, issue 21,
//! finding 9). In a secure round the client trains while the protocol goes on; when the
//! round is abandoned before the update is needed, the training must still be waited
//! for, or an app's C callback runs on after `cohort_client_run_pending` returned (after
//! the app freed what the callback writes to), and beside the next task's.
//!
//! Each test runs four one-round secure experiments against a real `cohort serve`. In
//! each, the client under test and two scripted clients (driven here through the
//! protocol client and the SecAgg+ client state machine) are selected, and the scripted
//! ones stop at one stage, so that the round fails there at the stage's deadline:
//! advertising (they never send keys), sharing (keys, no shares), collection (shares, no
//! masked input) or unmasking (everything but their reveal). The trainer takes longer
//! than the stage, so it is still running when the round fails at the first two.
//!
//! What it protects:
//! - through the Rust API (`run_agent`): when it returns, no trainer call is running,
//!   none starts afterwards, and no two calls ever overlap;
//! - through the C API, under valgrind: the app's callback writes into memory the app
//!   frees once `cohort_client_run_pending` has returned (and more once
//!   `cohort_client_free` has); valgrind finds no invalid access, and the app's own
//!   counters find no overlapping call and no call outside `cohort_client_run_pending`.
//!   CI sets `COHORT_REQUIRE_VALGRIND=1`; elsewhere the app runs without valgrind (its
//!   counters still checked) and says the memory check was skipped. A C compiler (`cc`)
//!   is needed either way.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cohort_aggregation::secagg::ClientSession;
use cohort_aggregation::{ModelVector, secagg::KeyDirectory};
use cohort_edge::agent::{AgentConfig, run_agent};
use cohort_edge::protocol::{CoordinatorClient, Credential, ProtocolError, Task};
use cohort_edge::trainer::{TaskTrainer, TrainerFailure, TrainerJob, TrainerOutput};
use common::admin;
use reqwest::Method;

/// Where the scripted clients stop, so that the round fails there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    /// They never advertise keys: advertising closes short of the threshold.
    Advertise,
    /// They advertise but never reveal their graph nonce: the attempt fails.
    Reveal,
    /// They reveal but send no shares: sharing closes short.
    Share,
    /// They share but upload no masked input: collection closes below the quorum.
    Masked,
    /// They upload but never sign the survivor list: confirming closes short.
    Confirm,
    /// They sign but never reveal their shares: unmasking ends short of shares.
    Unmask,
}

const STAGES: [Stage; 6] = [
    Stage::Advertise,
    Stage::Reveal,
    Stage::Share,
    Stage::Masked,
    Stage::Confirm,
    Stage::Unmask,
];

/// Timing of one run of the scenario: `stage_seconds` for the stage that fails (the
/// others close as soon as everyone has answered), and a trainer that takes
/// `train` (longer than a failing stage plus the client's idle exit).
#[derive(Debug, Clone, Copy)]
struct Timing {
    stage_seconds: u64,
    train: Duration,
}

use common::Served as Server;

async fn serve(dir: &Path) -> Server {
    common::serve_in(dir).await
}

/// A client the test drives by hand.
struct Scripted {
    client: CoordinatorClient,
    cred: Credential,
    identity: std::sync::Arc<cohort_aggregation::secagg::Identity>,
}

impl Scripted {
    async fn enrol(server: &Server, label: &str) -> Self {
        let client = CoordinatorClient::new(&server.base, Some(&server.ca_pem)).unwrap();
        let token = common::issue_token(&server.http, &server.base, label).await;
        let identity = cohort_aggregation::secagg::identity::Identity::generate().unwrap();
        let cred = client.enrol(&token, &identity.public()).await.unwrap();
        Self {
            client,
            cred,
            identity: std::sync::Arc::new(identity),
        }
    }

    /// Checks in until selected, then takes the round's stages up to (not including)
    /// `stop`.
    async fn play(self, stop: Stage) -> Result<(), ProtocolError> {
        let Scripted {
            client,
            cred,
            identity,
        } = self;
        let task: Task = loop {
            if let Some(task) = client.checkin(&cred, 5).await? {
                break task;
            }
        };
        let secure = task.secure_aggregation.clone().expect("a secure task");
        let (mut session, keys) = ClientSession::new(
            secure.config.clone(),
            secure.index,
            &identity,
            &mut rand::rng(),
        )
        .expect("the round's settings are valid");
        if stop == Stage::Advertise {
            return Ok(());
        }
        client.advertise_keys(&cred, &task, &keys).await?;
        if stop == Stage::Reveal {
            return Ok(());
        }
        let roster = loop {
            if let Some(r) = client.roster(&cred, &task, 5).await? {
                break r;
            }
        };
        let reveal = session.reveal(&roster).unwrap();
        client.send_reveal(&cred, &task, &reveal).await?;
        if stop == Stage::Share {
            return Ok(());
        }
        let directory: KeyDirectory = loop {
            if let Some(d) = client.key_directory(&cred, &task, 5).await? {
                break d;
            }
        };
        let shares = session.share_keys(&directory, &mut rand::rng()).unwrap();
        client.send_shares(&cred, &task, &shares).await?;
        if stop == Stage::Masked {
            return Ok(());
        }
        let forwarded = loop {
            if let Some(f) = client.forwarded_shares(&cred, &task, 5).await? {
                break f;
            }
        };
        let delta = vec![0.0f32; secure.config.dimension];
        let masked = session
            .mask(&forwarded, &delta, 10, 0.5, &mut rand::rng())
            .unwrap();
        client
            .upload_masked(&cred, &task, &masked, uuid::Uuid::new_v4())
            .await?;
        if stop == Stage::Confirm {
            return Ok(());
        }
        let survivors = loop {
            if let Some(r) = client.survivors(&cred, &task, 5).await? {
                break r;
            }
        };
        let confirmation = session.confirm(&survivors, &identity).unwrap();
        client.send_confirmation(&cred, &task, &confirmation).await
    }
}

/// Opens a one-round secure experiment whose round fails at `stage`: the three clients
/// (the two scripted ones checking in now) are selected, and the scripted ones play up
/// to `stage`. Returns the experiment's id and the scripted clients' tasks, once the
/// round is open.
async fn open_round(
    server: &Server,
    scripted: [&Scripted; 2],
    stage: Stage,
    timing: Timing,
) -> (
    String,
    Vec<tokio::task::JoinHandle<Result<(), ProtocolError>>>,
) {
    let (quick, long) = (timing.stage_seconds, 120);
    let seconds = |s: Stage| if s == stage { quick } else { long };
    let exp = admin(
        &server.http,
        &server.base,
        Method::POST,
        "/experiments",
        Some(serde_json::json!({
            "name": format!("abandoned at {stage:?}"),
            "features": 4, "classes": 2, "model": "logreg",
            "rounds": 1, "clients_per_round": 3, "min_participants": 3,
            "max_round_attempts": 1,
            "collect_deadline_seconds": seconds(Stage::Masked),
            "secure_aggregation": {
                "advertise_seconds": seconds(Stage::Advertise),
                "reveal_seconds": seconds(Stage::Reveal),
                "share_seconds": seconds(Stage::Share),
                "confirm_seconds": seconds(Stage::Confirm),
                "unmask_seconds": seconds(Stage::Unmask)
            }
        })),
    )
    .await;
    let id = exp["id"].as_str().unwrap().to_string();
    let players = scripted
        .into_iter()
        .map(|s| {
            let s = Scripted {
                client: s.client.clone(),
                cred: s.cred.clone(),
                identity: s.identity.clone(),
            };
            tokio::spawn(s.play(stage))
        })
        .collect();
    admin(
        &server.http,
        &server.base,
        Method::POST,
        &format!("/experiments/{id}/start"),
        None,
    )
    .await;
    let start = std::time::Instant::now();
    while common::rounds(&server.http, &server.base, &id)
        .await
        .is_empty()
    {
        assert!(start.elapsed() < Duration::from_secs(30), "the round opens");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (id, players)
}

/// Waits for the round of experiment `id` to fail, and checks it failed at `stage`.
async fn assert_failed_at(server: &Server, id: &str, stage: Stage) {
    let start = std::time::Instant::now();
    let round = loop {
        let rounds = common::rounds(&server.http, &server.base, id).await;
        if rounds[0]["stage"] == "failed" {
            break rounds[0].clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the round fails at {stage:?}: {rounds:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let why = round["failure"].as_str().unwrap_or_default().to_lowercase();
    let expected = match stage {
        Stage::Advertise => "advertis",
        Stage::Reveal => "reveal",
        Stage::Share => "shar",
        Stage::Masked => "masked",
        Stage::Confirm => "confirm",
        Stage::Unmask => "unmasking",
    };
    assert!(why.contains(expected), "failed at {stage:?}? {round:#}");
}

/// Counts calls of a trainer that takes its time, and whether any two overlapped.
#[derive(Debug, Default)]
struct Calls {
    /// Calls running now.
    active: AtomicUsize,
    /// The most calls ever running at once.
    most_at_once: AtomicUsize,
    /// Calls started.
    entered: AtomicUsize,
    /// Calls finished.
    exited: AtomicUsize,
}

#[derive(Debug)]
struct SlowTrainer {
    calls: Arc<Calls>,
    takes: Duration,
}

impl TaskTrainer for SlowTrainer {
    fn run(&self, job: &TrainerJob<'_>) -> Result<TrainerOutput, TrainerFailure> {
        let c = &self.calls;
        c.entered.fetch_add(1, Ordering::SeqCst);
        let now = c.active.fetch_add(1, Ordering::SeqCst) + 1;
        c.most_at_once.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(self.takes);
        let update = ModelVector::new(job.global.layout().clone(), job.global.values().to_vec())
            .map_err(|e| TrainerFailure::new(e.to_string()));
        c.active.fetch_sub(1, Ordering::SeqCst);
        c.exited.fetch_add(1, Ordering::SeqCst);
        Ok(TrainerOutput {
            update: Some(update?),
            num_examples: 10,
            train_loss: Some(0.5),
            evaluation: None,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trainer_never_outlives_an_abandoned_secure_round() {
    let timing = Timing {
        stage_seconds: 1,
        train: Duration::from_secs(4),
    };
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path()).await;
    let scripted = [
        Scripted::enrol(&server, "scripted-1").await,
        Scripted::enrol(&server, "scripted-2").await,
    ];
    let calls = Arc::new(Calls::default());
    let token = common::issue_token(&server.http, &server.base, "under-test").await;
    let config = AgentConfig {
        coordinator: server.base.clone(),
        insecure_http: false,
        ca_pem: Some(server.ca_pem.clone()),
        identity_pem: None,
        enrol_token: Some(token),
        trainer: Arc::new(SlowTrainer {
            calls: calls.clone(),
            takes: timing.train,
        }),
        state_dir: dir.path().join("agent"),
        idle_exit: Some(Duration::from_secs(1)),
        seed: 1,
        local_dp: None,
        slowdown: Duration::ZERO,
        floors: cohort_aggregation::secagg::ClientFloors::default(),
        rules: Default::default(),
    };
    // Enrols and checks in, so that the rounds can select it.
    run_agent(config.clone()).await.unwrap();

    for (n, stage) in STAGES.into_iter().enumerate() {
        let (id, players) = open_round(&server, [&scripted[0], &scripted[1]], stage, timing).await;
        let report = run_agent(config.clone())
            .await
            .unwrap_or_else(|e| panic!("{stage:?}: {e}"));
        let (active, entered, exited) = (
            calls.active.load(Ordering::SeqCst),
            calls.entered.load(Ordering::SeqCst),
            calls.exited.load(Ordering::SeqCst),
        );
        assert_eq!(
            active, 0,
            "abandoned at {stage:?}: the trainer still runs after run_agent returned ({report:?})"
        );
        assert_eq!(entered, n + 1, "{stage:?}: the client trained in the round");
        assert_eq!(exited, entered);
        assert_failed_at(&server, &id, stage).await;
        for p in players {
            // A scripted client may find the round failed under it: that is the point.
            let _ = p.await.unwrap();
        }
        // Nothing starts later either.
        tokio::time::sleep(timing.train + Duration::from_millis(500)).await;
        assert_eq!(calls.entered.load(Ordering::SeqCst), n + 1, "{stage:?}");
        assert_eq!(calls.active.load(Ordering::SeqCst), 0, "{stage:?}");
    }
    assert_eq!(
        calls.most_at_once.load(Ordering::SeqCst),
        1,
        "two trainer calls overlapped"
    );
}

/// The app's next line of output, kept in `transcript` too.
async fn next_line(
    lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    transcript: &mut Vec<String>,
) -> String {
    let line = tokio::time::timeout(Duration::from_secs(180), lines.recv())
        .await
        .unwrap_or_else(|_| panic!("the app answers: {transcript:#?}"))
        .unwrap_or_else(|| panic!("the app is running: {transcript:#?}"));
    transcript.push(line.clone());
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_c_callback_never_outlives_an_abandoned_secure_round() {
    let dir = tempfile::tempdir().unwrap();
    let app = common::compile_c_app(dir.path(), "abandon_app");
    // Valgrind slows the app down many times: longer stages, and a callback that takes
    // longer than a failing stage plus the idle exit.
    let valgrind = common::valgrind_available();
    let timing = if valgrind {
        Timing {
            stage_seconds: 5,
            train: Duration::from_secs(9),
        }
    } else {
        Timing {
            stage_seconds: 1,
            train: Duration::from_secs(4),
        }
    };
    let server = serve(dir.path()).await;
    let scripted = [
        Scripted::enrol(&server, "scripted-1").await,
        Scripted::enrol(&server, "scripted-2").await,
    ];
    let token = common::issue_token(&server.http, &server.base, "c-app").await;
    let log = dir.path().join("valgrind.log");
    let mut command = if valgrind {
        let mut c = common::valgrind_command(&log);
        c.arg(&app);
        c
    } else {
        eprintln!("valgrind is not installed: the app runs without the memory check");
        Command::new(&app)
    };
    let mut child = command
        .arg(&server.base)
        .arg(&server.ca)
        .arg(&token)
        .arg(dir.path().join("c-app-state"))
        .arg(STAGES.len().to_string())
        .arg(timing.train.as_millis().to_string())
        .env("LD_LIBRARY_PATH", dir.path().join("lib"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to_app = child.stdin.take().unwrap();
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut transcript = Vec::new();
    let enrolled = next_line(&mut lines, &mut transcript).await;
    assert_eq!(enrolled, "enrolled", "{transcript:?}");
    for (n, stage) in STAGES.into_iter().enumerate() {
        let (id, players) = open_round(&server, [&scripted[0], &scripted[1]], stage, timing).await;
        writeln!(to_app, "go").unwrap();
        let returned = next_line(&mut lines, &mut transcript).await;
        assert!(
            returned.starts_with(&format!("returned {n} code=0 calls={}", n + 1)),
            "{stage:?}: {transcript:?}"
        );
        assert_failed_at(&server, &id, stage).await;
        for p in players {
            let _ = p.await.unwrap();
        }
    }
    drop(to_app);
    let output = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    while let Ok(line) = lines.try_recv() {
        transcript.push(line);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        output.status.success(),
        "the app failed ({:?}): {transcript:#?}\n{stderr}\n{report}",
        output.status
    );
    assert!(
        transcript
            .iter()
            .any(|l| l == &format!("calls={} overlaps=0 outside=0", STAGES.len())),
        "{transcript:#?}"
    );
    if valgrind {
        assert!(
            report.contains("ERROR SUMMARY: 0 errors"),
            "valgrind found invalid accesses:\n{report}"
        );
        assert!(!report.contains("Invalid write") && !report.contains("Invalid read"));
    }
}
