//! The storage conformance suite: every test runs against SQLite always, and against
//! PostgreSQL when `COHORT_TEST_POSTGRES_URL` is set (CI sets it). Each PostgreSQL test
//! works in a schema of its own, so concurrent runs never see each other's rows.

use std::collections::HashSet;
use std::str::FromStr;

use cohort_coordinator::store::RoundKey;
use cohort_coordinator::store::{
    BufferRules, Buffered, Experiment, ExperimentState, JobKind, JobState, NewUpload,
    ParticipationState, PublishedModel, RoundMetrics, RoundStage, SecAggMessageKind, SecureNext,
    Store, StoreError, TaskFailure, now_millis,
};
use cohort_core::round::UploadRefusal;
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

/// A store plus whatever keeps it alive and cleans it up.
struct TestDb {
    store: Store,
    _dir: Option<tempfile::TempDir>,
    cleanup: Option<(PgConnectOptions, String)>,
}

impl TestDb {
    async fn finish(self) {
        self.store.close().await;
        if let Some((admin, schema)) = self.cleanup {
            let pool = sqlx::PgPool::connect_with(admin).await.unwrap();
            let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
            sqlx::query(sqlx::AssertSqlSafe(drop))
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
        }
    }
}

async fn sqlite() -> TestDb {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect("sqlite://store/test.db", dir.path())
        .await
        .unwrap();
    TestDb {
        store,
        _dir: Some(dir),
        cleanup: None,
    }
}

async fn postgres() -> Option<TestDb> {
    let Ok(url) = std::env::var("COHORT_TEST_POSTGRES_URL") else {
        eprintln!("COHORT_TEST_POSTGRES_URL is not set: PostgreSQL half of the suite skipped");
        return None;
    };
    let admin = PgConnectOptions::from_str(&url).expect("COHORT_TEST_POSTGRES_URL parses");
    let schema = format!("cohort_test_{}", Uuid::new_v4().simple());
    let pool = sqlx::PgPool::connect_with(admin.clone()).await.unwrap();
    let create = format!("CREATE SCHEMA \"{schema}\"");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let options = admin.clone().options([("search_path", schema.as_str())]);
    let store = Store::connect_postgres(options).await.unwrap();
    Some(TestDb {
        store,
        _dir: None,
        cleanup: Some((admin, schema)),
    })
}

/// Writes each test once and runs it on both backends.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let db = super::sqlite().await;
                    super::$name(&db.store).await;
                    db.finish().await;
                }
            )*
        }
        mod postgres_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(db) = super::postgres().await else { return };
                    super::$name(&db.store).await;
                    db.finish().await;
                }
            )*
        }
    };
}

conformance!(
    experiments_round_trip_and_list_newest_first,
    experiment_state_machine_refuses_illegal_moves,
    missing_rows_are_not_found,
    enrolment_token_enrols_exactly_once,
    concurrent_enrolments_with_one_token_enrol_one_client,
    refused_enrolments_change_nothing,
    client_credentials_and_revocation,
    concurrent_workers_never_claim_the_same_job,
    failed_job_is_retried_until_attempts_run_out,
    expired_lease_hands_the_job_to_another_worker,
    a_renewed_lease_keeps_the_job_and_only_its_holder_renews,
    round_records_uploads_and_drops_clients_that_miss_the_deadline,
    a_capped_upload_is_stored_with_the_cap_and_its_claim_is_audited,
    each_participation_counts_its_bytes_each_way,
    only_a_selected_client_takes_part_in_an_experiment,
    round_without_quorum_fails_and_runs_again_as_next_attempt,
    a_round_below_quorum_says_why_it_failed,
    a_failure_report_after_the_upload_is_refused,
    stopping_an_experiment_fails_its_collecting_round,
    selections_list_who_was_selected_for_every_attempt,
    uploads_outside_collection_are_refused_and_change_nothing,
    a_round_opens_only_while_running_and_idle,
    closing_into_aggregation_queues_exactly_one_job,
    a_round_whose_aggregation_job_fails_every_attempt_fails_and_runs_again,
    a_revoked_client_is_taken_out_of_its_open_round,
    revoking_a_client_frees_its_fedbuff_slot,
    concurrent_closes_close_once_and_queue_one_job,
    uploads_racing_the_close_are_either_refused_or_counted,
    secure_round_moves_through_its_stages_and_records_who_dropped_where,
    secure_messages_out_of_turn_are_refused_and_change_nothing,
    secure_round_fails_with_its_reason_and_runs_again,
    concurrent_secure_advances_move_the_round_once,
    fedbuff_hands_out_at_most_concurrency_tasks_and_expiry_frees_slots,
    fedbuff_full_buffer_opens_the_next_and_stale_updates_land_in_it,
    concurrent_fedbuff_uploads_fill_each_buffer_exactly,
    fedbuff_first_buffer_opens_once_and_only_while_running,
    a_failed_task_is_not_handed_out_again_and_frees_a_fedbuff_slot,
    a_withheld_evaluation_is_kept_with_its_reason_and_no_figures,
    counts_for_metrics_cover_every_table,
);

async fn experiments_round_trip_and_list_newest_first(store: &Store) {
    let spec = serde_json::json!({"model": "mlp", "rounds": 15});
    let a = store.create_experiment("first", &spec).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let b = store
        .create_experiment("second", &serde_json::json!({}))
        .await
        .unwrap();
    let got = store.experiment(a.id).await.unwrap();
    assert_eq!(got, a);
    assert_eq!(got.spec, spec);
    assert_eq!(got.state, ExperimentState::Created);
    let ids: Vec<Uuid> = store
        .experiments()
        .await
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids, vec![b.id, a.id]);
}

async fn experiment_state_machine_refuses_illegal_moves(store: &Store) {
    let e = store
        .create_experiment("e", &serde_json::json!({}))
        .await
        .unwrap();
    let err = store
        .set_experiment_state(e.id, ExperimentState::Paused, "admin")
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Conflict(ref m) if m.contains("created")),
        "{err}"
    );
    for to in [
        ExperimentState::Running,
        ExperimentState::Paused,
        ExperimentState::Running,
        ExperimentState::Stopped,
    ] {
        let moved = store.set_experiment_state(e.id, to, "admin").await.unwrap();
        assert_eq!(moved.state, to);
    }
    assert!(matches!(
        store
            .set_experiment_state(e.id, ExperimentState::Running, "admin")
            .await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        store.experiment(e.id).await.unwrap().state,
        ExperimentState::Stopped
    );
    let log = store.audit_log(10).await.unwrap();
    assert_eq!(log[0].action, "experiment.state");
    assert_eq!(log[0].detail, "stopped");
    assert_eq!(
        log.iter().filter(|l| l.subject == e.id.to_string()).count(),
        5
    );
}

async fn missing_rows_are_not_found(store: &Store) {
    let id = Uuid::new_v4();
    assert!(matches!(
        store.experiment(id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store
            .set_experiment_state(id, ExperimentState::Running, "admin")
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.revoke_client(id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.revoke_enrolment_token(id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.client_credential(id).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn enrolment_token_enrols_exactly_once(store: &Store) {
    let token = store
        .create_enrolment_token(b"hash-of-token", "hospital-a", None)
        .await
        .unwrap();
    let client = store
        .enrol(b"hash-of-token", b"hash-of-secret", now_millis())
        .await
        .unwrap();
    assert_eq!(client.label, "hospital-a");
    let again = store.enrol(b"hash-of-token", b"other", now_millis()).await;
    assert!(matches!(
        again,
        Err(StoreError::TokenRefused("enrolment token already used"))
    ));
    let tokens = store.enrolment_tokens().await.unwrap();
    assert_eq!(tokens.len(), 1);
    assert_eq!(tokens[0].id, token.id);
    assert_eq!(tokens[0].used_by, Some(client.id));
    assert_eq!(store.clients().await.unwrap(), vec![client]);
}

async fn concurrent_enrolments_with_one_token_enrol_one_client(store: &Store) {
    store
        .create_enrolment_token(b"shared", "race", None)
        .await
        .unwrap();
    let attempts: Vec<_> = (0..8u8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.enrol(b"shared", &[i; 32], now_millis()).await })
        })
        .collect();
    let mut enrolled = 0;
    for attempt in attempts {
        match attempt.await.unwrap() {
            Ok(_) => enrolled += 1,
            Err(StoreError::TokenRefused(_)) => {}
            // SQLite may report a busy database under a burst of writers; that, too,
            // must not enrol anyone.
            Err(StoreError::Database(_)) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(enrolled, 1);
    assert_eq!(store.clients().await.unwrap().len(), 1);
}

async fn refused_enrolments_change_nothing(store: &Store) {
    let now = now_millis();
    assert!(matches!(
        store.enrol(b"never-issued", b"s", now).await,
        Err(StoreError::TokenRefused("unknown enrolment token"))
    ));
    let revoked = store
        .create_enrolment_token(b"revoked", "r", None)
        .await
        .unwrap();
    store.revoke_enrolment_token(revoked.id).await.unwrap();
    assert!(matches!(
        store.enrol(b"revoked", b"s", now).await,
        Err(StoreError::TokenRefused("enrolment token revoked"))
    ));
    assert!(matches!(
        store.revoke_enrolment_token(revoked.id).await,
        Err(StoreError::Conflict(_))
    ));
    store
        .create_enrolment_token(b"expired", "x", Some(now - 1))
        .await
        .unwrap();
    assert!(matches!(
        store.enrol(b"expired", b"s", now).await,
        Err(StoreError::TokenRefused("enrolment token expired"))
    ));
    assert!(store.clients().await.unwrap().is_empty());
    assert!(
        store
            .enrolment_tokens()
            .await
            .unwrap()
            .iter()
            .all(|t| t.used_at.is_none())
    );
}

async fn client_credentials_and_revocation(store: &Store) {
    store.create_enrolment_token(b"t", "c", None).await.unwrap();
    let client = store
        .enrol(b"t", b"secret-hash", now_millis())
        .await
        .unwrap();
    let (hash, record) = store.client_credential(client.id).await.unwrap();
    assert_eq!(hash, b"secret-hash");
    assert_eq!(record.revoked_at, None);
    store.touch_client(client.id, 42).await.unwrap();
    assert_eq!(
        store
            .client_credential(client.id)
            .await
            .unwrap()
            .1
            .last_seen_at,
        Some(42)
    );
    store.revoke_client(client.id).await.unwrap();
    assert!(
        store
            .client_credential(client.id)
            .await
            .unwrap()
            .1
            .revoked_at
            .is_some()
    );
    assert!(matches!(
        store.revoke_client(client.id).await,
        Err(StoreError::Conflict(_))
    ));
}

async fn concurrent_workers_never_claim_the_same_job(store: &Store) {
    let e = store
        .create_experiment("jobs", &serde_json::json!({}))
        .await
        .unwrap();
    for round in 0..24 {
        store
            .enqueue_job(JobKind::Aggregate, e.id, round, 3)
            .await
            .unwrap();
    }
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let store = store.clone();
            tokio::spawn(async move {
                let name = format!("worker-{w}");
                let mut claimed = Vec::new();
                loop {
                    match store.claim_job(&name, now_millis(), 60_000).await {
                        Ok(Some(job)) => {
                            store.complete_job(job.id, &name).await.unwrap();
                            claimed.push(job.id);
                        }
                        Ok(None) => break,
                        // A busy SQLite file: try again, as a worker would.
                        Err(StoreError::Database(_)) => tokio::task::yield_now().await,
                        Err(other) => panic!("claim failed: {other}"),
                    }
                }
                claimed
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let distinct: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(all.len(), 24, "every job claimed once: {all:?}");
    assert_eq!(distinct.len(), 24);
    assert!(
        store
            .jobs(e.id)
            .await
            .unwrap()
            .iter()
            .all(|j| j.state == JobState::Done)
    );
}

async fn failed_job_is_retried_until_attempts_run_out(store: &Store) {
    let e = store
        .create_experiment("retry", &serde_json::json!({}))
        .await
        .unwrap();
    let job = store
        .enqueue_job(JobKind::Evaluate, e.id, 1, 2)
        .await
        .unwrap();
    let t0 = now_millis();
    let first = store.claim_job("w", t0, 1_000).await.unwrap().unwrap();
    assert_eq!((first.id, first.attempts), (job.id, 1));
    let after = store
        .fail_job(job.id, "w", "disk full", t0, 500)
        .await
        .unwrap();
    assert_eq!(after.state, JobState::Queued);
    assert_eq!(after.last_error.as_deref(), Some("disk full"));
    assert!(
        store
            .claim_job("w", t0 + 100, 1_000)
            .await
            .unwrap()
            .is_none(),
        "backoff"
    );
    let second = store
        .claim_job("w", t0 + 600, 1_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.attempts, 2);
    let last = store
        .fail_job(job.id, "w", "still full", t0 + 700, 500)
        .await
        .unwrap();
    assert_eq!(last.state, JobState::Failed);
    assert!(
        store
            .claim_job("w", t0 + 10_000, 1_000)
            .await
            .unwrap()
            .is_none()
    );
    assert!(matches!(
        store.enqueue_job(JobKind::Publish, e.id, 1, 0).await,
        Err(StoreError::Conflict(_))
    ));
}

async fn expired_lease_hands_the_job_to_another_worker(store: &Store) {
    let e = store
        .create_experiment("lease", &serde_json::json!({}))
        .await
        .unwrap();
    store
        .enqueue_job(JobKind::Aggregate, e.id, 1, 3)
        .await
        .unwrap();
    let t0 = now_millis();
    let a = store.claim_job("a", t0, 100).await.unwrap().unwrap();
    assert!(
        store.claim_job("b", t0 + 50, 100).await.unwrap().is_none(),
        "lease held"
    );
    let b = store.claim_job("b", t0 + 150, 100).await.unwrap().unwrap();
    assert_eq!(
        (a.id, b.attempts, b.locked_by.as_deref()),
        (b.id, 2, Some("b"))
    );
    assert!(matches!(
        store.complete_job(a.id, "a").await,
        Err(StoreError::Conflict(_))
    ));
    store.complete_job(b.id, "b").await.unwrap();
}

async fn a_renewed_lease_keeps_the_job_and_only_its_holder_renews(store: &Store) {
    let e = store
        .create_experiment("renew", &serde_json::json!({}))
        .await
        .unwrap();
    store
        .enqueue_job(JobKind::Aggregate, e.id, 1, 3)
        .await
        .unwrap();
    let t0 = now_millis();
    let a = store.claim_job("a", t0, 100).await.unwrap().unwrap();
    // The holder renews before its lease runs out; past the old end the job stays its.
    store.renew_job(a.id, "a", t0 + 1_000).await.unwrap();
    assert!(
        store.claim_job("b", t0 + 500, 100).await.unwrap().is_none(),
        "a renewed lease is still held"
    );
    assert!(matches!(
        store.renew_job(a.id, "b", t0 + 10_000).await,
        Err(StoreError::Conflict(_))
    ));
    // Once the renewed lease runs out, another worker takes over and the old holder can
    // neither renew nor complete it.
    let b = store
        .claim_job("b", t0 + 1_100, 100)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((b.id, b.attempts), (a.id, 2));
    assert!(matches!(
        store.renew_job(a.id, "a", t0 + 20_000).await,
        Err(StoreError::Conflict(_))
    ));
    store.complete_job(b.id, "b").await.unwrap();
    assert!(matches!(
        store.renew_job(b.id, "b", t0 + 20_000).await,
        Err(StoreError::Conflict(_))
    ));
}

/// A running experiment and `n` enrolled clients.
async fn running_with_clients(store: &Store, n: u8) -> (Experiment, Vec<Uuid>) {
    let e = store
        .create_experiment("rounds", &serde_json::json!({}))
        .await
        .unwrap();
    store
        .set_experiment_state(e.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    let mut clients = Vec::new();
    for i in 0..n {
        let token = [b't', i];
        store
            .create_enrolment_token(&token, "c", None)
            .await
            .unwrap();
        clients.push(
            store
                .enrol(&token, &[i; 32], now_millis())
                .await
                .unwrap()
                .id,
        );
    }
    (e, clients)
}

fn upload(client: Uuid, n: i64) -> NewUpload<'static> {
    NewUpload {
        client_id: client,
        blob_path: "uploads/blob",
        bytes: 400,
        sha256: &[7; 32],
        num_samples: n,
        claimed_samples: None,
        train_loss: Some(0.5),
        client_upload_id: None,
        wire_bytes: None,
    }
}

/// A participation records the bytes its client sent (as sent, when a compressed upload
/// is stored decoded) and the model bytes it downloaded while selected, and a round's
/// traffic sums them; a download after the upload counts for nothing.
async fn each_participation_counts_its_bytes_each_way(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    store.note_download(e.id, c[0], 1_000).await.unwrap();
    store.note_download(e.id, c[0], 500).await.unwrap();
    store.note_download(e.id, c[1], 700).await.unwrap();
    let compressed = NewUpload {
        wire_bytes: Some(60),
        ..upload(c[0], 10)
    };
    store
        .record_upload(e.id, 1, 1, &compressed, t0 + 1)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[1], 10), t0 + 2)
        .await
        .unwrap();
    store.note_download(e.id, c[0], 9_999).await.unwrap();
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let of = |client: Uuid| parts.iter().find(|p| p.client_id == client).unwrap();
    assert_eq!(
        (of(c[0]).bytes_up, of(c[0]).bytes_down),
        (Some(60), Some(1_500))
    );
    assert_eq!(
        (of(c[1]).bytes_up, of(c[1]).bytes_down),
        (Some(400), Some(700))
    );
    assert_eq!((of(c[2]).bytes_up, of(c[2]).bytes_down), (None, None));
    let traffic = store.traffic(e.id).await.unwrap();
    assert_eq!(traffic[&(1, 1)], (460, 2_200));
    // The blob is the decoded upload's: its own size.
    let uploads = store.uploads(e.id, 1, 1).await.unwrap();
    assert!(uploads.iter().all(|u| u.bytes == 400));
}

/// An upload whose claimed sample count was over the experiment's cap is stored with
/// the cap, and the audit log keeps what the client claimed, in the same transaction.
async fn a_capped_upload_is_stored_with_the_cap_and_its_claim_is_audited(store: &Store) {
    let (e, c) = running_with_clients(store, 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    let capped = NewUpload {
        claimed_samples: Some(1_000_000_000_000),
        ..upload(c[0], 1000)
    };
    store
        .record_upload(e.id, 1, 1, &capped, t0 + 1)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[1], 7), t0 + 2)
        .await
        .unwrap();
    let mut samples: Vec<i64> = store
        .uploads(e.id, 1, 1)
        .await
        .unwrap()
        .iter()
        .map(|u| u.num_samples)
        .collect();
    samples.sort_unstable();
    assert_eq!(samples, vec![7, 1000]);
    let log = store.audit_log(100).await.unwrap();
    let clamps: Vec<_> = log
        .iter()
        .filter(|a| a.action == "upload.weight_capped")
        .collect();
    assert_eq!(clamps.len(), 1, "{log:?}");
    assert_eq!(clamps[0].actor, c[0].to_string());
    assert_eq!(clamps[0].subject, e.id.to_string());
    assert!(
        clamps[0]
            .detail
            .contains("1000000000000 samples claimed, counted as 1000"),
        "{}",
        clamps[0].detail
    );
}

/// What ties a client to an experiment (and lets it fetch the model and report on it):
/// a selection for one of its rounds, whatever became of it; not one in another
/// experiment, nor having been merely available.
async fn only_a_selected_client_takes_part_in_an_experiment(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let (other, _) = running_with_clients_named(store, "other", 1).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c[..2], t0 + 60_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 10), t0 + 1)
        .await
        .unwrap();
    // c[1] is dropped when collection closes: it still took part.
    store
        .close_collection(e.id, 1, 1, 1, 3, t0 + 2)
        .await
        .unwrap();
    assert!(store.takes_part(e.id, c[0]).await.unwrap());
    assert!(store.takes_part(e.id, c[1]).await.unwrap());
    assert!(!store.takes_part(e.id, c[2]).await.unwrap());
    assert!(!store.takes_part(other.id, c[0]).await.unwrap());
    assert!(!store.takes_part(Uuid::new_v4(), c[0]).await.unwrap());
}

async fn round_records_uploads_and_drops_clients_that_miss_the_deadline(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let t0 = now_millis();
    let r = store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    assert_eq!(
        (r.stage, r.selected, r.reported),
        (RoundStage::Collecting, 3, 0)
    );
    assert_eq!(store.experiment(e.id).await.unwrap().current_round, 1);
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 10), t0 + 1)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[2], 30), t0 + 2)
        .await
        .unwrap();
    let closed = store
        .close_collection(e.id, 1, 1, 2, 3, t0 + 3)
        .await
        .unwrap();
    assert_eq!(
        (closed.stage, closed.reported, closed.dropped),
        (RoundStage::Aggregating, 2, 1)
    );
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let state_of = |id: Uuid| parts.iter().find(|p| p.client_id == id).unwrap().state;
    assert_eq!(state_of(c[0]), ParticipationState::Uploaded);
    assert_eq!(state_of(c[1]), ParticipationState::Dropped);
    assert_eq!(state_of(c[2]), ParticipationState::Uploaded);
    let uploads = store.uploads(e.id, 1, 1).await.unwrap();
    let mut samples: Vec<i64> = uploads.iter().map(|u| u.num_samples).collect();
    samples.sort_unstable();
    assert_eq!(samples, vec![10, 30]);
    let model = PublishedModel {
        round: 1,
        blob_path: "models/1".into(),
        parameters: 100,
    };
    let metrics = RoundMetrics {
        test_accuracy: Some(0.9),
        test_loss: Some(0.3),
        train_loss: Some(0.5),
    };
    store
        .publish_model(e.id, 1, 1, &model, metrics, t0 + 4)
        .await
        .unwrap();
    assert_eq!(store.latest_model(e.id).await.unwrap(), Some(model.clone()));
    let done = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(done.stage, RoundStage::Published);
    assert_eq!(done.test_accuracy, Some(0.9));
    assert!(matches!(
        store
            .publish_model(e.id, 1, 1, &model, metrics, t0 + 5)
            .await,
        Err(StoreError::Conflict(_))
    ));
}

/// A running experiment of `clients` clients whose first attempt took one upload and
/// closed below its quorum of 2; returns it, its clients, the time the attempt opened and
/// the failed attempt.
async fn attempt_below_quorum(
    store: &Store,
    clients: u8,
) -> (Experiment, Vec<Uuid>, i64, cohort_coordinator::store::Round) {
    let (e, c) = running_with_clients(store, clients).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0)
        .await
        .unwrap();
    let failed = store
        .close_collection(e.id, 1, 1, 2, 3, t0 + 1_001)
        .await
        .unwrap();
    (e, c, t0, failed)
}

async fn round_without_quorum_fails_and_runs_again_as_next_attempt(store: &Store) {
    let (e, c, t0, failed) = attempt_below_quorum(store, 2).await;
    assert_eq!(failed.stage, RoundStage::Failed);
    assert!(failed.finished_at.is_some());
    let retry = store
        .open_round(e.id, 1, 2, &c, t0 + 5_000, t0 + 1_002)
        .await
        .unwrap();
    assert_eq!((retry.round, retry.attempt), (1, 2));
    // The first attempt's upload does not count for the second.
    store
        .record_upload(e.id, 1, 2, &upload(c[0], 5), t0 + 1_003)
        .await
        .unwrap();
    let attempts: Vec<_> = store
        .rounds(e.id)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.attempt, r.stage, r.reported))
        .collect();
    assert_eq!(
        attempts,
        vec![(1, RoundStage::Failed, 1), (2, RoundStage::Collecting, 1)]
    );
}

/// Issue 23: an attempt that missed its quorum had `failure: null`, unlike every other
/// failed attempt; an admin reading the rounds could not tell why it failed.
async fn a_round_below_quorum_says_why_it_failed(store: &Store) {
    let (_, _, _, failed) = attempt_below_quorum(store, 3).await;
    assert_eq!(failed.stage, RoundStage::Failed);
    let why = failed.failure.expect("a failed attempt says why");
    assert!(why.contains("quorum of 2"), "{why}");
    assert!(why.starts_with("1 upload"), "{why}");
}

/// Who was selected for each attempt, failed ones included, in round and attempt order:
/// what privacy against the coordinator is composed from.
async fn selections_list_who_was_selected_for_every_attempt(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    // Another experiment's selections are not this one's.
    let other = store
        .create_experiment("other", &serde_json::json!({}))
        .await
        .unwrap();
    store
        .set_experiment_state(other.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    let t0 = now_millis();
    store
        .open_round(other.id, 1, 1, &c[..1], t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .open_round(e.id, 1, 1, &c[..2], t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .close_collection(e.id, 1, 1, 2, 3, t0 + 1_001)
        .await
        .unwrap();
    store
        .open_round(e.id, 1, 2, &c[1..], t0 + 5_000, t0 + 1_002)
        .await
        .unwrap();
    let got: Vec<(i64, i64, Uuid)> = store
        .selections(e.id)
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.round, s.attempt, s.client_id))
        .collect();
    let mut first = vec![(1, 1, c[0]), (1, 1, c[1])];
    let mut second = vec![(1, 2, c[1]), (1, 2, c[2])];
    first.sort();
    second.sort();
    first.extend(second);
    assert_eq!(got, first);
}

async fn uploads_outside_collection_are_refused_and_change_nothing(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c[..2], t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0)
        .await
        .unwrap();
    let refused = [
        // A replay of an acknowledged upload.
        store
            .record_upload(e.id, 1, 1, &upload(c[0], 5), t0 + 1)
            .await,
        // A client that was not selected.
        store
            .record_upload(e.id, 1, 1, &upload(c[2], 5), t0 + 1)
            .await,
        // After the deadline.
        store
            .record_upload(e.id, 1, 1, &upload(c[1], 5), t0 + 1_001)
            .await,
        // A round that does not exist.
        store
            .record_upload(e.id, 2, 1, &upload(c[1], 5), t0 + 1)
            .await,
    ];
    let codes: Vec<&str> = refused[..3]
        .iter()
        .map(|r| match r {
            Err(StoreError::Refused(refusal)) => refusal.code(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        codes,
        ["already_uploaded", "not_selected", "deadline_passed"]
    );
    assert!(matches!(refused[3], Err(StoreError::NotFound(_))));
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(round.reported, 1);
    assert_eq!(store.uploads(e.id, 1, 1).await.unwrap().len(), 1);
    store
        .close_collection(e.id, 1, 1, 1, 3, t0 + 1_002)
        .await
        .unwrap();
    assert!(matches!(
        store
            .record_upload(e.id, 1, 1, &upload(c[1], 5), t0 + 1)
            .await,
        Err(StoreError::Refused(UploadRefusal::NotCollecting { .. }))
    ));
    assert!(matches!(
        store.close_collection(e.id, 1, 1, 1, 3, t0 + 1_003).await,
        Err(StoreError::Conflict(_))
    ));
}

async fn a_round_opens_only_while_running_and_idle(store: &Store) {
    let e = store
        .create_experiment("idle", &serde_json::json!({}))
        .await
        .unwrap();
    let t0 = now_millis();
    assert!(matches!(
        store.open_round(e.id, 1, 1, &[], t0 + 1, t0).await,
        Err(StoreError::Conflict(_))
    ));
    store
        .set_experiment_state(e.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    store.open_round(e.id, 1, 1, &[], t0 + 1, t0).await.unwrap();
    assert!(matches!(
        store.open_round(e.id, 2, 1, &[], t0 + 1, t0).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store
            .open_round(Uuid::new_v4(), 1, 1, &[], t0 + 1, t0)
            .await,
        Err(StoreError::NotFound(_))
    ));
}

/// A restarted coordinator (or a second one) opens a migrated database: migrations run
/// again as a no-op and every row is still there.
async fn reopen_keeps_rows(first: TestDb, reopen: impl AsyncFnOnce() -> Store) {
    let e = first
        .store
        .create_experiment("kept", &serde_json::json!({"k": 1}))
        .await
        .unwrap();
    first.store.close().await;
    let again = reopen().await;
    assert_eq!(again.experiment(e.id).await.unwrap(), e);
    again.close().await;
    first.finish().await;
}

#[tokio::test]
async fn sqlite_reopen_keeps_rows() {
    let db = sqlite().await;
    let dir = db._dir.as_ref().unwrap().path().to_path_buf();
    reopen_keeps_rows(db, async || {
        Store::connect("sqlite://store/test.db", &dir)
            .await
            .unwrap()
    })
    .await;
}

#[tokio::test]
async fn postgres_reopen_keeps_rows() {
    let Some(db) = postgres().await else { return };
    let (admin, schema) = db.cleanup.clone().unwrap();
    reopen_keeps_rows(db, async move || {
        Store::connect_postgres(admin.options([("search_path", schema.as_str())]))
            .await
            .unwrap()
    })
    .await;
}

async fn closing_into_aggregation_queues_exactly_one_job(store: &Store) {
    let (e, c) = running_with_clients(store, 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0)
        .await
        .unwrap();
    // Without quorum the attempt fails and nothing is queued.
    store
        .close_collection(e.id, 1, 1, 2, 3, t0 + 1_001)
        .await
        .unwrap();
    assert!(store.jobs(e.id).await.unwrap().is_empty());
    store
        .open_round(e.id, 1, 2, &c, t0 + 5_000, t0 + 1_002)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 2, &upload(c[1], 5), t0 + 1_003)
        .await
        .unwrap();
    let closed = store
        .close_collection(e.id, 1, 2, 1, 3, t0 + 1_004)
        .await
        .unwrap();
    assert_eq!(closed.stage, RoundStage::Aggregating);
    let jobs = store.jobs(e.id).await.unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(
        (
            jobs[0].kind,
            jobs[0].round,
            jobs[0].state,
            jobs[0].max_attempts
        ),
        (JobKind::Aggregate, 1, JobState::Queued, 3)
    );
    // A job needs an attempt: refused before anything changes.
    let e2 = store
        .create_experiment("second", &serde_json::json!({}))
        .await
        .unwrap();
    store
        .set_experiment_state(e2.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    store
        .open_round(e2.id, 1, 1, &c[..1], t0 + 1_000, t0)
        .await
        .unwrap();
    assert!(matches!(
        store.close_collection(e2.id, 1, 1, 0, 0, t0 + 1).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        store.round(e2.id, 1, 1).await.unwrap().stage,
        RoundStage::Collecting
    );
}

/// Retries a store call the way the driver does on the next tick when SQLite reports
/// the file busy. (A macro: an async closure in a spawned task trips the compiler's
/// `Send` inference.)
macro_rules! retry_busy {
    ($call:expr) => {
        loop {
            match $call.await {
                Err(StoreError::Database(_)) => tokio::task::yield_now().await,
                other => break other,
            }
        }
    };
}

async fn concurrent_closes_close_once_and_queue_one_job(store: &Store) {
    let (e, c) = running_with_clients(store, 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    for client in &c {
        store
            .record_upload(e.id, 1, 1, &upload(*client, 5), t0)
            .await
            .unwrap();
    }
    // Coordinators closing the same round at once: one close wins.
    let closers: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                retry_busy!(store.close_collection(e.id, 1, 1, 1, 3, now_millis()))
            })
        })
        .collect();
    let mut won = 0;
    for closer in closers {
        match closer.await.unwrap() {
            Ok(round) => {
                assert_eq!(round.stage, RoundStage::Aggregating);
                won += 1;
            }
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("close failed: {other}"),
        }
    }
    assert_eq!(won, 1);
    assert_eq!(store.jobs(e.id).await.unwrap().len(), 1);
}

async fn uploads_racing_the_close_are_either_refused_or_counted(store: &Store) {
    let (e, c) = running_with_clients(store, 12).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    let uploaders: Vec<_> = c
        .iter()
        .map(|&client| {
            let store = store.clone();
            tokio::spawn(async move {
                let recorded: Result<_, StoreError> =
                    retry_busy!(store.record_upload(e.id, 1, 1, &upload(client, 1), now_millis()));
                recorded.is_ok()
            })
        })
        .collect();
    let closer = {
        let store = store.clone();
        tokio::spawn(
            async move { retry_busy!(store.close_collection(e.id, 1, 1, 1, 3, now_millis())) },
        )
    };
    let mut acknowledged = 0;
    for u in uploaders {
        acknowledged += i64::from(u.await.unwrap());
    }
    let closed = closer.await.unwrap();
    // Whatever the interleaving: every acknowledged upload is counted and kept, and
    // every selected client is either uploaded or dropped.
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(round.reported, acknowledged);
    assert_eq!(
        store.uploads(e.id, 1, 1).await.unwrap().len() as i64,
        acknowledged
    );
    if closed.is_ok() {
        assert_eq!(round.reported + round.dropped, 12, "{round:?}");
        let parts = store.participations(e.id, 1, 1).await.unwrap();
        let uploaded = parts
            .iter()
            .filter(|p| p.state == ParticipationState::Uploaded)
            .count() as i64;
        assert_eq!(uploaded, acknowledged);
    }
}

const SECAGG: &str = r#"{"session":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA","parties":4,"threshold":2,"neighbours":3,"dimension":5,"quantization":{"clip":4.0,"max_weight":1000,"loss_clip":64.0}}"#;

async fn advance(store: &Store, e: Uuid, from: RoundStage, next: SecureNext, at: i64) {
    store
        .advance_secure_round(e, 1, 1, from, &next, at)
        .await
        .unwrap();
}

async fn secure_round_moves_through_its_stages_and_records_who_dropped_where(store: &Store) {
    let (e, c) = running_with_clients(store, 5).await;
    let t0 = now_millis();
    let r = store
        .open_secure_round(RoundKey::new(e.id, 1, 1), &c, SECAGG, t0 + 60_000, t0)
        .await
        .unwrap();
    assert_eq!(r.stage, RoundStage::Advertising);
    assert_eq!(r.secagg.as_ref().unwrap()["parties"], 4);
    // The pending task of a secure round carries the client's index and the settings.
    let task = store.pending_task(c[2]).await.unwrap().unwrap();
    assert_eq!(task.secagg_index, Some(3));
    assert!(task.secagg.as_deref().unwrap().contains("\"threshold\":2"));
    let send = |client: Uuid, kind: SecAggMessageKind, body: &'static str, at: i64| async move {
        store
            .record_secagg_message(RoundKey::new(e.id, 1, 1), client, kind, body, at)
            .await
            .unwrap();
    };
    // c[3] never advertises.
    for client in [c[0], c[1], c[2], c[4]] {
        send(client, SecAggMessageKind::Advertise, "{}", t0 + 1).await;
    }
    // An advertised client has no task left to start; the silent one still has.
    assert!(store.pending_task(c[0]).await.unwrap().is_none());
    let stages = [
        RoundStage::Advertising,
        RoundStage::Revealing,
        RoundStage::Sharing,
        RoundStage::Collecting,
        RoundStage::Confirming,
        RoundStage::Unmasking,
    ];
    let next = |i: usize, at: i64| {
        advance(
            store,
            e.id,
            stages[i],
            SecureNext::Stage {
                to: stages[i + 1],
                deadline: t0 + 70_000 + 10_000 * i as i64,
            },
            at,
        )
    };
    next(0, t0 + 2).await;
    assert!(
        store.pending_task(c[3]).await.unwrap().is_none(),
        "too late to join"
    );
    // Sharing before every nonce is revealed is out of turn.
    assert!(matches!(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[0],
                SecAggMessageKind::Share,
                "{}",
                t0 + 3
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
    for client in [c[0], c[1], c[2], c[4]] {
        send(client, SecAggMessageKind::Reveal, "{\"n\":1}", t0 + 3).await;
    }
    next(1, t0 + 4).await;
    for client in [c[0], c[1], c[2], c[4]] {
        send(client, SecAggMessageKind::Share, "{\"s\":1}", t0 + 5).await;
    }
    next(2, t0 + 6).await;
    let mut masked = upload(c[0], 0);
    masked.train_loss = None;
    // c[2] shared but never uploads its masked input.
    for client in [c[0], c[1], c[4]] {
        store
            .record_upload(
                e.id,
                1,
                1,
                &NewUpload {
                    client_id: client,
                    ..masked.clone()
                },
                t0 + 7,
            )
            .await
            .unwrap();
    }
    // c[3] never advertised, so it cannot add a masked input.
    let r = store
        .record_upload(
            e.id,
            1,
            1,
            &NewUpload {
                client_id: c[3],
                ..masked.clone()
            },
            t0 + 7,
        )
        .await;
    assert!(
        matches!(
            r,
            Err(StoreError::Refused(UploadRefusal::Dropped { round: 1 }))
        ),
        "{r:?}"
    );
    next(3, t0 + 8).await;
    // c[4] uploaded but never signs the survivor list.
    for client in [c[0], c[1]] {
        send(client, SecAggMessageKind::Confirm, "{\"sig\":1}", t0 + 9).await;
    }
    next(4, t0 + 10).await;
    // c[4] never signed: it may not reveal shares.
    assert!(matches!(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[4],
                SecAggMessageKind::Confirm,
                "{}",
                t0 + 11
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
    // c[1] signed but never reveals its shares.
    send(c[0], SecAggMessageKind::Unmask, "{}", t0 + 11).await;
    let r = store
        .advance_secure_round(
            e.id,
            1,
            1,
            RoundStage::Unmasking,
            &SecureNext::Aggregate { job_attempts: 3 },
            t0 + 12,
        )
        .await
        .unwrap();
    assert_eq!(
        (r.stage, r.reported, r.dropped),
        (RoundStage::Aggregating, 3, 2)
    );
    let jobs = store.jobs(e.id).await.unwrap();
    assert_eq!(jobs.len(), 1, "one aggregation job, queued with the close");
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let of = |id: Uuid| parts.iter().find(|p| p.client_id == id).unwrap().clone();
    assert_eq!(of(c[0]).secagg_stage.as_deref(), Some("unmasked"));
    assert_eq!(of(c[0]).dropped_stage, None);
    assert_eq!(of(c[1]).secagg_stage.as_deref(), Some("confirmed"));
    assert_eq!(of(c[1]).dropped_stage.as_deref(), Some("unmask"));
    assert_eq!(of(c[4]).secagg_stage.as_deref(), Some("masked"));
    assert_eq!(
        of(c[4]).dropped_stage.as_deref(),
        Some("confirm"),
        "recorded where it stopped, not overwritten when unmasking closed"
    );
    for late in [c[1], c[4]] {
        assert_eq!(
            of(late).state,
            ParticipationState::Uploaded,
            "its input still counts"
        );
    }
    assert_eq!(of(c[2]).dropped_stage.as_deref(), Some("masked"));
    assert_eq!(of(c[2]).state, ParticipationState::Dropped);
    assert_eq!(of(c[3]).dropped_stage.as_deref(), Some("advertise"));
    assert_eq!(
        of(c[0]).num_samples,
        None,
        "a masked upload's weight is not stored"
    );
    let messages = store
        .secagg_messages(e.id, 1, 1, SecAggMessageKind::Share)
        .await
        .unwrap();
    let indices: Vec<u32> = messages.iter().map(|m| m.index).collect();
    assert_eq!(indices, vec![1, 2, 3, 5]);
    assert_eq!(messages[0].body, "{\"s\":1}");
    let confirmations = store
        .secagg_messages(e.id, 1, 1, SecAggMessageKind::Confirm)
        .await
        .unwrap();
    assert_eq!(confirmations.len(), 2);
}

async fn secure_messages_out_of_turn_are_refused_and_change_nothing(store: &Store) {
    let (e, c) = running_with_clients(store, 4).await;
    let t0 = now_millis();
    store
        .open_secure_round(RoundKey::new(e.id, 1, 1), &c[..3], SECAGG, t0 + 1_000, t0)
        .await
        .unwrap();
    let refused =
        |r: Result<(), StoreError>| assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    // Wrong stage, not selected, after the deadline, twice.
    refused(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[0],
                SecAggMessageKind::Share,
                "{}",
                t0,
            )
            .await,
    );
    refused(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[3],
                SecAggMessageKind::Advertise,
                "{}",
                t0,
            )
            .await,
    );
    refused(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[0],
                SecAggMessageKind::Advertise,
                "{}",
                t0 + 1_001,
            )
            .await,
    );
    store
        .record_secagg_message(
            RoundKey::new(e.id, 1, 1),
            c[0],
            SecAggMessageKind::Advertise,
            "{}",
            t0 + 1,
        )
        .await
        .unwrap();
    refused(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                c[0],
                SecAggMessageKind::Advertise,
                "{}",
                t0 + 2,
            )
            .await,
    );
    assert!(matches!(
        store
            .record_secagg_message(
                RoundKey::new(e.id, 2, 1),
                c[0],
                SecAggMessageKind::Advertise,
                "{}",
                t0
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    // A plain round takes no protocol messages, and an upload before collection is refused.
    assert!(matches!(
        store
            .record_upload(e.id, 1, 1, &upload(c[0], 1), t0 + 3)
            .await,
        Err(StoreError::Refused(UploadRefusal::NotCollecting { .. }))
    ));
    let messages = store
        .secagg_messages(e.id, 1, 1, SecAggMessageKind::Advertise)
        .await
        .unwrap();
    assert_eq!(messages.len(), 1);
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let progressed: Vec<_> = parts.iter().filter(|p| p.secagg_stage.is_some()).collect();
    assert_eq!(progressed.len(), 1);
    // Advancing from a stage the round is not at is a conflict and changes nothing.
    assert!(matches!(
        store
            .advance_secure_round(
                e.id,
                1,
                1,
                RoundStage::Sharing,
                &SecureNext::Aggregate { job_attempts: 1 },
                t0
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        store.round(e.id, 1, 1).await.unwrap().stage,
        RoundStage::Advertising
    );
    assert!(store.jobs(e.id).await.unwrap().is_empty());
    // A plain round refuses secure advances and messages.
    let (p, pc) = running_with_clients_named(store, "plain", 2).await;
    store
        .open_round(p.id, 1, 1, &pc, t0 + 1_000, t0)
        .await
        .unwrap();
    refused(
        store
            .record_secagg_message(
                RoundKey::new(p.id, 1, 1),
                pc[0],
                SecAggMessageKind::Advertise,
                "{}",
                t0,
            )
            .await,
    );
    assert!(matches!(
        store
            .advance_secure_round(
                p.id,
                1,
                1,
                RoundStage::Collecting,
                &SecureNext::Aggregate { job_attempts: 1 },
                t0
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
}

async fn running_with_clients_named(store: &Store, name: &str, n: u8) -> (Experiment, Vec<Uuid>) {
    let e = store
        .create_experiment(name, &serde_json::json!({}))
        .await
        .unwrap();
    store
        .set_experiment_state(e.id, ExperimentState::Running, "admin")
        .await
        .unwrap();
    let mut clients = Vec::new();
    for i in 0..n {
        let token = [b'p', i, name.len() as u8];
        store
            .create_enrolment_token(&token, "c", None)
            .await
            .unwrap();
        clients.push(
            store
                .enrol(&token, &[i; 32], now_millis())
                .await
                .unwrap()
                .id,
        );
    }
    (e, clients)
}

async fn secure_round_fails_with_its_reason_and_runs_again(store: &Store) {
    let (e, c) = running_with_clients(store, 4).await;
    let t0 = now_millis();
    store
        .open_secure_round(RoundKey::new(e.id, 1, 1), &c, SECAGG, t0 + 1_000, t0)
        .await
        .unwrap();
    // A second round cannot open while this one advertises.
    assert!(matches!(
        store.open_round(e.id, 2, 1, &c, t0 + 1_000, t0).await,
        Err(StoreError::Conflict(_))
    ));
    let failed = store
        .advance_secure_round(
            e.id,
            1,
            1,
            RoundStage::Advertising,
            &SecureNext::Fail {
                reason: "only 1 clients after the advertise stage, 3 needed".into(),
            },
            t0 + 1_001,
        )
        .await
        .unwrap();
    assert_eq!(failed.stage, RoundStage::Failed);
    assert!(failed.failure.as_deref().unwrap().contains("3 needed"));
    assert_eq!(failed.dropped, 4);
    assert!(failed.finished_at.is_some());
    let again = store
        .open_secure_round(
            RoundKey::new(e.id, 1, 2),
            &c,
            SECAGG,
            t0 + 5_000,
            t0 + 1_002,
        )
        .await
        .unwrap();
    assert_eq!((again.attempt, again.stage), (2, RoundStage::Advertising));
    // An aggregating round whose sum cannot be unmasked fails too, without dropping
    // anyone.
    for &client in &c {
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 2),
                client,
                SecAggMessageKind::Advertise,
                "{}",
                t0 + 1_003,
            )
            .await
            .unwrap();
    }
    for (from, to) in [(RoundStage::Advertising, RoundStage::Sharing)] {
        store
            .advance_secure_round(
                e.id,
                1,
                2,
                from,
                &SecureNext::Stage {
                    to,
                    deadline: t0 + 9_000,
                },
                t0 + 1_004,
            )
            .await
            .unwrap();
    }
    assert!(matches!(
        store
            .advance_secure_round(
                e.id,
                1,
                2,
                RoundStage::Aggregating,
                &SecureNext::Aggregate { job_attempts: 1 },
                t0
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
}

async fn concurrent_secure_advances_move_the_round_once(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let t0 = now_millis();
    store
        .open_secure_round(RoundKey::new(e.id, 1, 1), &c, SECAGG, t0 + 1_000, t0)
        .await
        .unwrap();
    for &client in &c {
        store
            .record_secagg_message(
                RoundKey::new(e.id, 1, 1),
                client,
                SecAggMessageKind::Advertise,
                "{}",
                t0 + 1,
            )
            .await
            .unwrap();
    }
    let next = SecureNext::Stage {
        to: RoundStage::Sharing,
        deadline: t0 + 2_000,
    };
    let tries: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            let next = next.clone();
            tokio::spawn(async move {
                retry_busy!(store.advance_secure_round(
                    e.id,
                    1,
                    1,
                    RoundStage::Advertising,
                    &next,
                    t0 + 2
                ))
            })
        })
        .collect();
    let mut moved = 0;
    for t in tries {
        match t.await.unwrap() {
            Ok(_) => moved += 1,
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!(moved, 1, "exactly one advance wins");
    let audit = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(audit.stage, RoundStage::Sharing);
}

// ---- FedBuff buffers ----

const TASK_MS: i64 = 60_000;

fn rules(buffer_size: i64, max_staleness: Option<i64>, last_step: i64) -> BufferRules {
    BufferRules {
        buffer_size,
        max_staleness,
        task_ms: TASK_MS,
        last_step,
        job_attempts: 3,
    }
}

/// A running experiment with `n` clients, its initial model published and its first
/// buffer open.
async fn fedbuff_with_clients(store: &Store, n: u8) -> (Experiment, Vec<Uuid>) {
    let (e, c) = running_with_clients(store, n).await;
    let t0 = now_millis();
    store
        .publish_model(e.id, 0, 0, &model(0), RoundMetrics::default(), t0)
        .await
        .unwrap();
    store.open_buffer(e.id, 1, t0).await.unwrap();
    (e, c)
}

fn model(round: i64) -> PublishedModel {
    PublishedModel {
        round,
        blob_path: format!("models/round-{round}.bin"),
        parameters: 10,
    }
}

/// Publishes buffer `round` (which must be aggregating) as the next model version.
async fn publish_step(store: &Store, e: Uuid, round: i64) {
    store
        .publish_model(
            e,
            round,
            1,
            &model(round),
            RoundMetrics::default(),
            now_millis(),
        )
        .await
        .unwrap();
}

async fn fedbuff_hands_out_at_most_concurrency_tasks_and_expiry_frees_slots(store: &Store) {
    let (e, c) = fedbuff_with_clients(store, 4).await;
    let t0 = now_millis();
    let a = store
        .fedbuff_task(e.id, c[0], 2, TASK_MS, true, t0)
        .await
        .unwrap()
        .expect("a free slot");
    assert_eq!((a.round, a.attempt, a.base_version), (1, 1, 0));
    assert_eq!(a.deadline, t0 + TASK_MS);
    // Asking again returns the task it holds, not a second one.
    let again = store
        .fedbuff_task(e.id, c[0], 2, TASK_MS, true, t0 + 5)
        .await
        .unwrap();
    assert_eq!(again, Some(a.clone()));
    assert!(
        store
            .fedbuff_task(e.id, c[1], 2, TASK_MS, true, t0)
            .await
            .unwrap()
            .is_some()
    );
    // Two outstanding with concurrency 2: the third client waits.
    assert_eq!(
        store
            .fedbuff_task(e.id, c[2], 2, TASK_MS, true, t0)
            .await
            .unwrap(),
        None
    );
    // Without hand-out (a paused experiment) nobody gets a new task.
    assert_eq!(
        store
            .fedbuff_task(e.id, c[3], 5, TASK_MS, false, t0)
            .await
            .unwrap(),
        None
    );
    // The two tasks expire: their slots free, and they count as dropped.
    let later = t0 + TASK_MS + 1;
    let fresh = store
        .fedbuff_task(e.id, c[2], 2, TASK_MS, true, later)
        .await
        .unwrap()
        .expect("expired tasks free their slots");
    assert_eq!(fresh.round, 1);
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!((round.selected, round.dropped), (3, 2), "{round:?}");
    assert_eq!(store.fedbuff_drops(e.id).await.unwrap().expired, 2);
    // An expired task's upload is refused and changes nothing.
    let refused = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[0], 5), rules(3, None, 10), later)
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Refused(UploadRefusal::TaskExpired { round: 1 }))
        ),
        "{refused:?}"
    );
    assert_eq!(store.round(e.id, 1, 1).await.unwrap().reported, 0);
    // A sync round's pending task never shows a FedBuff task.
    assert_eq!(store.pending_task(c[2]).await.unwrap(), None);
    // A stopped experiment takes no more updates, even for a task still in time.
    store
        .set_experiment_state(e.id, ExperimentState::Stopped, "admin")
        .await
        .unwrap();
    let refused = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[2], 5), rules(3, None, 10), later)
        .await;
    assert!(
        matches!(refused, Err(StoreError::Conflict(_))),
        "{refused:?}"
    );
    assert_eq!(store.round(e.id, 1, 1).await.unwrap().reported, 0);
}

async fn fedbuff_full_buffer_opens_the_next_and_stale_updates_land_in_it(store: &Store) {
    let (e, c) = fedbuff_with_clients(store, 5).await;
    let t0 = now_millis();
    let mut tasks = Vec::new();
    for client in &c {
        tasks.push(
            store
                .fedbuff_task(e.id, *client, 5, TASK_MS, true, t0)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let r = rules(2, Some(1), 3);
    // Two updates fill buffer 1: it aggregates, its job is queued, buffer 2 opens.
    for client in &c[..2] {
        let b = store
            .record_fedbuff_upload(e.id, 1, 1, &upload(*client, 4), r, t0 + 10)
            .await
            .unwrap();
        assert!(
            matches!(
                b,
                Buffered::Accepted {
                    buffer: 1,
                    staleness: 0,
                    ..
                }
            ),
            "{b:?}"
        );
    }
    let one = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!((one.stage, one.reported), (RoundStage::Aggregating, 2));
    let jobs = store.jobs(e.id).await.unwrap();
    assert_eq!((jobs.len(), jobs[0].round), (1, 1));
    assert_eq!(
        store.round(e.id, 2, 1).await.unwrap().stage,
        RoundStage::Collecting
    );
    // A replay is refused and changes nothing.
    let replay = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[0], 4), r, t0 + 11)
        .await;
    assert!(
        matches!(
            replay,
            Err(StoreError::Refused(UploadRefusal::AlreadyUploaded {
                round: 1
            }))
        ),
        "{replay:?}"
    );
    // Version 1 is published; a client that trained on version 0 uploads into buffer 2
    // with staleness 1, under its task's round 1 path.
    publish_step(store, e.id, 1).await;
    let stale = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[2], 4), r, t0 + 20)
        .await
        .unwrap();
    assert!(
        matches!(
            stale,
            Buffered::Accepted {
                buffer: 2,
                staleness: 1,
                closed: false,
                ..
            }
        ),
        "{stale:?}"
    );
    // A client that downloads version 1 before training is not stale.
    store.note_base_version(e.id, c[3], 1).await.unwrap();
    let fresh = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[3], 4), r, t0 + 21)
        .await
        .unwrap();
    assert!(
        matches!(
            fresh,
            Buffered::Accepted {
                buffer: 2,
                staleness: 0,
                closed: true,
                ..
            }
        ),
        "{fresh:?}"
    );
    let buffered = store.buffer_uploads(e.id, 2).await.unwrap();
    let mut seen: Vec<(Uuid, i64, i64)> = buffered
        .iter()
        .map(|u| (u.upload.client_id, u.base_version, u.staleness))
        .collect();
    seen.sort();
    let mut want = vec![(c[2], 0, 1), (c[3], 1, 0)];
    want.sort();
    assert_eq!(seen, want);
    // Buffer 3 is open; version 2 is published. The last client still trains on
    // version 0: two steps stale, more than max_staleness 1, so it is dropped.
    publish_step(store, e.id, 2).await;
    let dropped = store
        .record_fedbuff_upload(e.id, 1, 1, &upload(c[4], 4), r, t0 + 30)
        .await
        .unwrap();
    assert_eq!(
        dropped,
        Buffered::TooStale {
            staleness: 2,
            max_staleness: 1
        }
    );
    assert_eq!(store.fedbuff_drops(e.id).await.unwrap().too_stale, 1);
    assert_eq!(store.round(e.id, 3, 1).await.unwrap().reported, 0);
    let steps = store.fedbuff_steps(e.id).await.unwrap();
    assert_eq!(steps.len(), 2);
    assert_eq!(
        (
            steps[1].step,
            steps[1].updates,
            steps[1].stale_updates,
            steps[1].max_staleness
        ),
        (2, 2, 1, 1)
    );
    assert!((steps[1].mean_staleness - 0.5).abs() < 1e-9);
    // Fill buffer 3, the last step: it opens no successor.
    for client in &c[..2] {
        let t = store
            .fedbuff_task(e.id, *client, 5, TASK_MS, true, t0 + 40)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((t.round, t.base_version), (3, 2));
        store
            .record_fedbuff_upload(e.id, 3, 1, &upload(*client, 4), r, t0 + 41)
            .await
            .unwrap();
    }
    assert_eq!(
        store.round(e.id, 3, 1).await.unwrap().stage,
        RoundStage::Aggregating
    );
    assert!(matches!(
        store.round(e.id, 4, 1).await,
        Err(StoreError::NotFound(_))
    ));
    // No buffer open: nobody gets a task.
    assert_eq!(
        store
            .fedbuff_task(e.id, c[2], 5, TASK_MS, true, t0 + 42)
            .await
            .unwrap(),
        None
    );
}

async fn concurrent_fedbuff_uploads_fill_each_buffer_exactly(store: &Store) {
    let (e, c) = fedbuff_with_clients(store, 12).await;
    let t0 = now_millis();
    for client in &c {
        store
            .fedbuff_task(e.id, *client, 12, TASK_MS, true, t0)
            .await
            .unwrap()
            .unwrap();
    }
    // Twelve clients upload at once into buffers of 3, at most 3 steps: buffers 1-3 fill
    // with exactly three updates each, and the rest are refused (no buffer open).
    let r = rules(3, None, 3);
    let uploaders: Vec<_> = c
        .iter()
        .map(|&client| {
            let store = store.clone();
            tokio::spawn(async move {
                retry_busy!(store.record_fedbuff_upload(
                    e.id,
                    1,
                    1,
                    &upload(client, 1),
                    r,
                    now_millis()
                ))
            })
        })
        .collect();
    let mut accepted = 0;
    for u in uploaders {
        match u.await.unwrap() {
            Ok(Buffered::Accepted { .. }) => accepted += 1,
            Ok(other) => panic!("{other:?}"),
            Err(StoreError::Conflict(_)) => {}
            Err(other) => panic!("upload failed: {other}"),
        }
    }
    assert_eq!(accepted, 9);
    for round in 1..=3 {
        let r = store.round(e.id, round, 1).await.unwrap();
        assert_eq!((r.stage, r.reported), (RoundStage::Aggregating, 3), "{r:?}");
        assert_eq!(store.buffer_uploads(e.id, round).await.unwrap().len(), 3);
    }
    assert_eq!(store.jobs(e.id).await.unwrap().len(), 3);
}

async fn fedbuff_first_buffer_opens_once_and_only_while_running(store: &Store) {
    let (e, _) = running_with_clients(store, 1).await;
    let t0 = now_millis();
    store.open_buffer(e.id, 1, t0).await.unwrap();
    assert!(matches!(
        store.open_buffer(e.id, 1, t0).await,
        Err(StoreError::Conflict(_))
    ));
    let other = store
        .create_experiment("idle", &serde_json::json!({}))
        .await
        .unwrap();
    assert!(matches!(
        store.open_buffer(other.id, 1, t0).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(store.latest_round(other.id).await.unwrap().is_none());
}

fn failure(round: i64, client: Uuid, reason: &str) -> TaskFailure {
    TaskFailure {
        round,
        attempt: 1,
        client_id: client,
        reason: reason.into(),
        at: now_millis(),
    }
}

/// A client whose trainer fails reports it: the round counts it (so that it can close
/// without waiting for the deadline), never offers it the same task again, and a
/// FedBuff task's slot goes to the next client at once.
async fn a_withheld_evaluation_is_kept_with_its_reason_and_no_figures(store: &Store) {
    use cohort_coordinator::store::ClientEvaluation;
    let (e, c) = running_with_clients_named(store, "evaluations", 2).await;
    let reported = ClientEvaluation {
        model_version: 0,
        client_id: c[0],
        num_examples: 40,
        metrics: [("accuracy".to_string(), 0.75)].into_iter().collect(),
        at: 1,
        withheld: None,
    };
    let withheld = ClientEvaluation {
        model_version: 0,
        client_id: c[1],
        num_examples: 0,
        metrics: Default::default(),
        at: 2,
        withheld: Some("local_differential_privacy".into()),
    };
    assert!(
        store
            .record_client_evaluation(e.id, &reported)
            .await
            .unwrap()
    );
    assert!(
        store
            .record_client_evaluation(e.id, &withheld)
            .await
            .unwrap()
    );
    // A second report for the same version (a retry, or figures after all) changes
    // nothing.
    let again = ClientEvaluation {
        num_examples: 5,
        metrics: reported.metrics.clone(),
        withheld: None,
        ..withheld.clone()
    };
    assert!(!store.record_client_evaluation(e.id, &again).await.unwrap());
    let mut stored = store.client_evaluations(e.id).await.unwrap();
    stored.sort_by_key(|s| s.at);
    assert_eq!(stored, [reported, withheld]);
}

/// Issue 23: a client could report its task failed after its upload was counted, and
/// the admin saw both; the report is refused as `already_uploaded` and changes nothing.
async fn a_failure_report_after_the_upload_is_refused(store: &Store) {
    let (e, c) = running_with_clients_named(store, "uploaded then failed", 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 10), t0 + 1)
        .await
        .unwrap();
    let refused = store
        .record_task_failure(e.id, &failure(1, c[0], "the trainer crashed"))
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Refused(UploadRefusal::AlreadyUploaded {
                round: 1
            }))
        ),
        "{refused:?}"
    );
    assert!(store.task_failures(e.id).await.unwrap().is_empty());
    assert_eq!(store.task_failure_count(e.id, 1, 1).await.unwrap(), 0);
}

/// Issue 23: a stopped experiment's round stayed `collecting` for ever, so a dashboard
/// or an integrator listing rounds saw a round running in an experiment that was not.
async fn stopping_an_experiment_fails_its_collecting_round(store: &Store) {
    let (e, c) = running_with_clients_named(store, "stopped mid-round", 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    store
        .set_experiment_state(e.id, ExperimentState::Stopped, "admin")
        .await
        .unwrap();
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(round.stage, RoundStage::Failed);
    assert_eq!(round.failure.as_deref(), Some("the experiment was stopped"));
    assert!(round.finished_at.is_some());
    // Nothing is taken for it any more.
    let refused = store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0 + 1)
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Refused(UploadRefusal::NotCollecting { .. }))
        ),
        "{refused:?}"
    );
}

async fn a_failed_task_is_not_handed_out_again_and_frees_a_fedbuff_slot(store: &Store) {
    let (e, c) = running_with_clients_named(store, "failures", 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    assert_eq!(store.pending_task(c[0]).await.unwrap().unwrap().round, 1);
    store
        .record_task_failure(e.id, &failure(1, c[0], "the trainer exited with 3"))
        .await
        .unwrap();
    // A repeat report of the same task is ignored: the first reason stands.
    store
        .record_task_failure(e.id, &failure(1, c[0], "again"))
        .await
        .unwrap();
    assert_eq!(store.pending_task(c[0]).await.unwrap(), None);
    assert_eq!(store.pending_task(c[1]).await.unwrap().unwrap().round, 1);
    assert_eq!(store.task_failure_count(e.id, 1, 1).await.unwrap(), 1);
    let failures = store.task_failures(e.id).await.unwrap();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].reason, "the trainer exited with 3");
    // A client that uploaded after all is counted as an upload, not a failure.
    store
        .record_task_failure(e.id, &failure(1, c[1], "late report"))
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[1], 10), t0 + 1)
        .await
        .unwrap();
    assert_eq!(store.task_failure_count(e.id, 1, 1).await.unwrap(), 1);

    let (f, d) = fedbuff_with_clients(store, 2).await;
    let t0 = now_millis();
    let task = store
        .fedbuff_task(f.id, d[0], 1, TASK_MS, true, t0)
        .await
        .unwrap()
        .expect("a free slot");
    assert_eq!(
        store
            .fedbuff_task(f.id, d[1], 1, TASK_MS, true, t0)
            .await
            .unwrap(),
        None,
        "concurrency 1: the slot is taken"
    );
    store
        .record_task_failure(f.id, &failure(task.round, d[0], "NaN weights"))
        .await
        .unwrap();
    assert!(
        store
            .fedbuff_task(f.id, d[1], 1, TASK_MS, true, t0 + 1)
            .await
            .unwrap()
            .is_some(),
        "the failed task's slot is free before it would expire"
    );
    let round = store.round(f.id, 1, 1).await.unwrap();
    assert_eq!((round.selected, round.dropped), (2, 1), "{round:?}");
    // Its upload, should one come after all, is refused.
    let refused = store
        .record_fedbuff_upload(f.id, 1, 1, &upload(d[0], 5), rules(3, None, 10), t0 + 2)
        .await;
    assert!(
        matches!(
            refused,
            Err(StoreError::Refused(UploadRefusal::Dropped { round: 1 }))
        ),
        "{refused:?}"
    );
}

/// What `/metrics` reads from the database: every count moves with the rows behind it.
async fn counts_for_metrics_cover_every_table(store: &Store) {
    let empty = store.counts(0).await.unwrap();
    assert_eq!(
        (empty.uploads, empty.clients, empty.task_failures),
        (0, 0, 0)
    );
    assert!(empty.rounds.is_empty() && empty.jobs.is_empty());
    let (e, c) = running_with_clients_named(store, "counts", 3).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 60_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 10), t0 + 1)
        .await
        .unwrap();
    store
        .record_task_failure(e.id, &failure(1, c[1], "exit 1"))
        .await
        .unwrap();
    let counts = store.counts(0).await.unwrap();
    assert_eq!(counts.experiments, vec![("running".to_string(), 1)]);
    assert_eq!(counts.rounds, vec![("collecting".to_string(), 1)]);
    assert_eq!((counts.uploads, counts.upload_bytes), (1, 400));
    assert_eq!(counts.task_failures, 1);
    assert_eq!(counts.clients, 3);
    // Nobody has checked in since the far future.
    assert_eq!(store.counts(i64::MAX).await.unwrap().clients_active, 0);
    store
        .close_collection(e.id, 1, 1, 1, 3, t0 + 2)
        .await
        .unwrap();
    let counts = store.counts(0).await.unwrap();
    assert_eq!(counts.rounds, vec![("aggregating".to_string(), 1)]);
    assert_eq!(counts.jobs.len(), 1, "{:?}", counts.jobs);
    assert_eq!(counts.jobs[0].1, "queued");
}

/// Issue 22: a round whose aggregation job failed every attempt stayed `aggregating` for
/// ever and held its experiment. Now it fails, with the job's last error as its reason,
/// once its job is out of attempts and not before, and the next attempt can open.
async fn a_round_whose_aggregation_job_fails_every_attempt_fails_and_runs_again(store: &Store) {
    let (e, c) = running_with_clients(store, 2).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c, t0 + 1_000, t0)
        .await
        .unwrap();
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0)
        .await
        .unwrap();
    store
        .close_collection(e.id, 1, 1, 1, 2, t0 + 1)
        .await
        .unwrap();
    // Nothing to do while the job has attempts left: queued, then failed once.
    assert!(
        !store
            .fail_round_if_aggregation_failed(e.id, 1, 1, t0 + 2)
            .await
            .unwrap()
    );
    for attempt in 0..2 {
        let job = store
            .claim_job("w", t0 + 10 + attempt * 2_000, 1_000)
            .await
            .unwrap()
            .expect("the job is claimable again after its retry delay");
        store
            .fail_job(
                job.id,
                "w",
                "blob missing",
                t0 + 11 + attempt * 2_000,
                1_000,
            )
            .await
            .unwrap();
        let failed = store
            .fail_round_if_aggregation_failed(e.id, 1, 1, t0 + 12 + attempt * 2_000)
            .await
            .unwrap();
        assert_eq!(failed, attempt == 1, "after failed attempt {}", attempt + 1);
    }
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!(round.stage, RoundStage::Failed);
    assert_eq!(
        round.failure.as_deref(),
        Some("aggregation failed 2 times: blob missing")
    );
    // Once only, and the round runs again as its next attempt.
    assert!(
        !store
            .fail_round_if_aggregation_failed(e.id, 1, 1, t0 + 5_000)
            .await
            .unwrap()
    );
    store
        .open_round(e.id, 1, 2, &c, t0 + 9_000, t0 + 5_001)
        .await
        .unwrap();
    assert_eq!(
        store.round(e.id, 1, 2).await.unwrap().stage,
        RoundStage::Collecting
    );
}

/// Issue 22: revoking a client left it selected in the round it was in, so the round
/// waited for it until the deadline. Now the revocation drops it from its open plain
/// rounds in the same transaction (counted as dropped, stage `revoked`), its upload
/// there is refused, and the close counts it once.
async fn a_revoked_client_is_taken_out_of_its_open_round(store: &Store) {
    let (e, c) = running_with_clients(store, 3).await;
    let t0 = now_millis();
    store
        .open_round(e.id, 1, 1, &c[..2], t0 + 60_000, t0)
        .await
        .unwrap();
    store.revoke_client(c[1]).await.unwrap();
    let round = store.round(e.id, 1, 1).await.unwrap();
    assert_eq!((round.selected, round.reported, round.dropped), (2, 0, 1));
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let revoked = parts.iter().find(|p| p.client_id == c[1]).unwrap();
    assert_eq!(revoked.state, ParticipationState::Dropped);
    assert_eq!(revoked.dropped_stage.as_deref(), Some("revoked"));
    let r = store
        .record_upload(e.id, 1, 1, &upload(c[1], 5), t0 + 1)
        .await;
    assert!(
        matches!(
            r,
            Err(StoreError::Refused(UploadRefusal::Dropped { round: 1 }))
        ),
        "{r:?}"
    );
    // The other client goes on; at the close the revoked one is not counted twice.
    store
        .record_upload(e.id, 1, 1, &upload(c[0], 5), t0 + 2)
        .await
        .unwrap();
    let closed = store
        .close_collection(e.id, 1, 1, 1, 3, t0 + 3)
        .await
        .unwrap();
    assert_eq!(
        (closed.stage, closed.reported, closed.dropped),
        (RoundStage::Aggregating, 1, 1)
    );
}

/// Issue 22: a revoked client's FedBuff task held its slot until it expired. Now the
/// revocation frees it at once: with concurrency 1, the next client gets a task.
async fn revoking_a_client_frees_its_fedbuff_slot(store: &Store) {
    let (e, c) = fedbuff_with_clients(store, 2).await;
    let t0 = now_millis();
    store
        .fedbuff_task(e.id, c[0], 1, TASK_MS, true, t0)
        .await
        .unwrap()
        .expect("a free slot");
    assert_eq!(
        store
            .fedbuff_task(e.id, c[1], 1, TASK_MS, true, t0 + 1)
            .await
            .unwrap(),
        None,
        "one slot, held"
    );
    store.revoke_client(c[0]).await.unwrap();
    assert!(
        store
            .fedbuff_task(e.id, c[1], 1, TASK_MS, true, t0 + 2)
            .await
            .unwrap()
            .is_some(),
        "the revoked client's slot is free"
    );
    let parts = store.participations(e.id, 1, 1).await.unwrap();
    let revoked = parts.iter().find(|p| p.client_id == c[0]).unwrap();
    assert_eq!(revoked.dropped_stage.as_deref(), Some("revoked"));
}
