//! The table contract: what a plain INSERT from any client gets.

mod common;

use std::time::Duration;

use rowq::JobState;
use rowq::store::{self, admin};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

/// Inserts with plain SQL, as a client in another language would, and returns the error text.
async fn insert_error(pool: &PgPool, sql: &'static str) -> String {
    match sqlx::query(sql).execute(pool).await {
        Ok(_) => panic!("the database accepted a bad row: {sql}"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn a_plain_insert_of_kind_and_payload_is_a_complete_enqueue() {
    let pool = common::database().await;
    sqlx::query(r#"INSERT INTO rowq.jobs (kind, payload) VALUES ('resize_image', '{"key":"a.png"}')"#)
        .execute(&pool)
        .await
        .unwrap();
    let row: admin::JobRow = sqlx::query_as("SELECT * FROM rowq.jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(row.state, JobState::Pending);
    assert_eq!(row.queue, "default");
    assert_eq!(row.attempts, 0);
    assert_eq!(row.max_attempts, 5);
    assert_eq!(row.dispatch_gen, 0);
    assert_eq!(row.priority, 0);
    assert_eq!(row.errors, json!([]));
    assert_eq!(row.payload, json!({"key": "a.png"}));
}

#[tokio::test]
async fn bad_rows_are_refused_by_the_database_with_a_constraint_that_says_why() {
    let pool = common::database().await;
    let cases: [(&'static str, &str); 10] = [
        ("INSERT INTO rowq.jobs (kind) VALUES ('')", "jobs_kind_is_a_nonempty_identifier"),
        ("INSERT INTO rowq.jobs (kind) VALUES ('x''; DROP TABLE rowq.jobs; --')", "jobs_kind_is_a_nonempty_identifier"),
        ("INSERT INTO rowq.jobs (kind, max_attempts) VALUES ('noop', 0)", "jobs_max_attempts_between_1_and_1000"),
        ("INSERT INTO rowq.jobs (kind, payload) VALUES ('noop', '[1,2]')", "jobs_payload_is_a_json_object"),
        ("INSERT INTO rowq.jobs (kind, payload) VALUES ('noop', '\"text\"')", "jobs_payload_is_a_json_object"),
        (
            "INSERT INTO rowq.jobs (kind, payload) VALUES ('noop', jsonb_build_object('blob', repeat('x', 1048577)))",
            "jobs_payload_is_at_most_1_mib",
        ),
        ("INSERT INTO rowq.jobs (kind, queue) VALUES ('noop', '')", "jobs_queue_is_a_nonempty_identifier"),
        (
            "INSERT INTO rowq.jobs (kind, group_key) VALUES ('noop', 'has space')",
            "jobs_group_key_is_1_to_128_printable_ascii",
        ),
        ("INSERT INTO rowq.jobs (kind, priority) VALUES ('noop', 5000)", "jobs_priority_between_minus_1000_and_1000"),
        ("INSERT INTO rowq.jobs (kind, dedup_key) VALUES ('noop', '')", "jobs_dedup_key_is_1_to_256_characters"),
    ];
    for (sql, constraint) in cases {
        let error = insert_error(&pool, sql).await;
        assert!(error.contains(constraint), "{sql}\n  gave: {error}\n  expected the constraint {constraint}");
    }
    let error = insert_error(&pool, "INSERT INTO rowq.jobs (payload) VALUES ('{}')").await;
    assert!(error.contains(r#"null value in column "kind""#), "{error}");
    let error = insert_error(&pool, "INSERT INTO rowq.jobs (kind, state) VALUES ('noop', 'done')").await;
    assert!(error.contains("invalid input value for enum rowq.job_state"), "{error}");
    // Nothing was half-inserted.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rowq.jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 0);
}

#[tokio::test]
async fn a_second_enqueue_with_the_same_dedup_key_is_a_no_op_until_the_first_finishes() {
    let pool = common::database().await;
    let insert =
        "INSERT INTO rowq.jobs (kind, dedup_key) VALUES ('noop', 'invoice-7') ON CONFLICT DO NOTHING RETURNING id";
    let first: Option<i64> = sqlx::query_scalar(insert).fetch_optional(&pool).await.unwrap();
    let second: Option<i64> = sqlx::query_scalar(insert).fetch_optional(&pool).await.unwrap();
    assert!(first.is_some());
    assert_eq!(second, None, "the duplicate enqueue inserted a row");

    // Once the first job is finished the key is free again.
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now()").execute(&pool).await.unwrap();
    let third: Option<i64> = sqlx::query_scalar(insert).fetch_optional(&pool).await.unwrap();
    assert!(third.is_some());
    assert_ne!(third, first);
}

/// The README's recurring job (a `pg_cron` schedule of an `INSERT`): a tick while the last
/// run is unfinished adds nothing; once it has finished, the next tick enqueues again.
#[tokio::test]
async fn the_readmes_recurring_insert_enqueues_once_per_tick_and_never_doubles_an_unfinished_run() {
    let readme = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let schedule = readme.split("SELECT cron.schedule(").nth(1).expect("the README schedules a recurring job");
    let insert = schedule.split("$$").nth(1).expect("the schedule's command is quoted with $$");
    let pool = common::database().await;
    let tick = || sqlx::query(sqlx::AssertSqlSafe(insert.to_string())).execute(&pool);
    assert_eq!(tick().await.unwrap().rows_affected(), 1);
    assert_eq!(tick().await.unwrap().rows_affected(), 0, "the last run is unfinished: this tick adds nothing");
    sqlx::query("UPDATE rowq.jobs SET state = 'succeeded', finished_at = now()").execute(&pool).await.unwrap();
    assert_eq!(tick().await.unwrap().rows_affected(), 1, "the last run finished: this tick enqueues");
    let kinds: Vec<(String, String)> =
        sqlx::query_as("SELECT kind::text, state::text FROM rowq.jobs ORDER BY id").fetch_all(&pool).await.unwrap();
    assert_eq!(kinds, [("nightly_report".into(), "succeeded".into()), ("nightly_report".into(), "pending".into())]);
}

#[tokio::test]
async fn concurrent_enqueues_with_one_dedup_key_insert_exactly_one_row() {
    let pool = common::database().await;
    let attempts = (0..16).map(|_| {
        let pool = pool.clone();
        async move {
            let job = admin::NewJob { dedup_key: Some("race".into()), ..admin::NewJob::new("noop", json!({})) };
            admin::enqueue(&pool, &job).await.unwrap()
        }
    });
    let inserted: Vec<_> = futures::future::join_all(attempts).await.into_iter().flatten().collect();
    assert_eq!(inserted.len(), 1);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rowq.jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn an_enqueue_inside_the_callers_transaction_vanishes_with_its_rollback() {
    let pool = common::database().await;
    let mut tx = pool.begin().await.unwrap();
    admin::enqueue(&mut *tx, &admin::NewJob::new("noop", json!({}))).await.unwrap();
    tx.rollback().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rowq.jobs").fetch_one(&pool).await.unwrap();
    assert_eq!(rows, 0);
}

#[tokio::test]
async fn one_insert_statement_sends_one_notification_however_many_rows() {
    let pool = common::database().await;
    let mut listener = PgListener::connect_with(&pool).await.unwrap();
    listener.listen(store::NOTIFY_CHANNEL).await.unwrap();
    common::enqueue_many(&pool, "noop", 500).await;
    common::enqueue_many(&pool, "noop", 3).await;
    let mut received = 0;
    while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await {
        received += 1;
    }
    assert_eq!(received, 2, "expected one NOTIFY per INSERT statement");
}

#[tokio::test]
async fn migrations_apply_twice_without_change() {
    let pool = common::database().await;
    store::migrate(&pool).await.unwrap();
    store::migrate(&pool).await.unwrap();
}

#[tokio::test]
async fn row_updates_evaluate_no_costly_check_and_writes_still_do() {
    let pool = common::database().await;
    // Postgres evaluates every table CHECK on every UPDATE, and reads each one back from its
    // stored text and plans it again on every INSERT statement (~20 µs of CPU per one-row
    // enqueue for five cheap ones). Every rule on a column is a domain constraint, which runs
    // only when a value of the column is written.
    let table_checks: Vec<(String, String)> = sqlx::query_as(
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conrelid = 'rowq.jobs'::regclass AND contype = 'c'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(table_checks.is_empty(), "table CHECKs, parsed on every INSERT and run on every UPDATE: {table_checks:?}");
    // A row stored before a rule existed keeps moving through its states: no UPDATE re-checks
    // the kind. (A table CHECK, even NOT VALID, would refuse the claim below.)
    let id = common::enqueue(&pool, "legacy-kind", json!({})).await;
    sqlx::query("ALTER DOMAIN rowq.job_kind ADD CONSTRAINT no_legacy_kinds CHECK (VALUE NOT LIKE 'legacy%') NOT VALID")
        .execute(&pool)
        .await
        .unwrap();
    let claimed = store::dispatch::claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.id).collect::<Vec<_>>(), vec![id]);
    // ...while a write of the column is checked.
    let error = sqlx::query("INSERT INTO rowq.jobs (kind) VALUES ('legacy-two')").execute(&pool).await.unwrap_err();
    assert!(error.to_string().contains("no_legacy_kinds"), "{error}");
}

/// The third migration moves five rules from the table to domains without rewriting the table:
/// a column changed to a domain that already has constraints makes Postgres rewrite the table
/// and every index (the second migration did), under an `ACCESS EXCLUSIVE` lock.
#[tokio::test]
async fn the_rules_move_to_domains_without_rewriting_the_table() {
    let pool = common::database_migrated_to(20261130000002).await; // the schema as migration 2 left it
    common::enqueue_many(&pool, "noop", 50).await;
    sqlx::query("UPDATE rowq.jobs SET priority = 7, dedup_key = 'k' || id WHERE id % 2 = 0")
        .execute(&pool)
        .await
        .unwrap();
    let file = "SELECT pg_relation_filenode('rowq.jobs')::bigint";
    let before: i64 = sqlx::query_scalar(file).fetch_one(&pool).await.unwrap();
    store::migrate(&pool).await.unwrap(); // the third, as `rowq migrate` applies it
    let after: i64 = sqlx::query_scalar(file).fetch_one(&pool).await.unwrap();
    assert_eq!(after, before, "the third migration rewrote rowq.jobs");
    let kept: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE priority = 7 AND dedup_key = 'k' || id) FROM rowq.jobs",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, (50, 25));
    let error = sqlx::query("UPDATE rowq.jobs SET priority = 5000").execute(&pool).await.unwrap_err();
    assert!(error.to_string().contains("jobs_priority_between_minus_1000_and_1000"), "{error}");
}

/// The indexes of `rowq.jobs` by name.
async fn job_indexes(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = 'rowq' AND tablename = 'jobs' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Waits until a statement of this database whose text holds `text` waits for a lock.
async fn waiting_for_a_lock(pool: &PgPool, text: &str, what: &str) {
    common::eventually(Duration::from_secs(30), what, || {
        let pool = pool.clone();
        let pattern = format!("%{text}%");
        async move {
            let waiting: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT FROM pg_stat_activity
                 WHERE datname = current_database() AND query LIKE $1 AND wait_event_type = 'Lock')",
            )
            .bind(pattern)
            .fetch_one(&pool)
            .await
            .ok()?;
            waiting.then_some(())
        }
    })
    .await;
}

/// Migrations 5–6 add an index of finished rows per outcome, `CONCURRENTLY`: on a large table a
/// plain `CREATE INDEX` would hold back every enqueue, claim and finish until it is built. It
/// still waits for the writers already running, as any index build does; those that start
/// meanwhile go through. The index of all finished rows stays, for the binaries older than
/// these migrations (docs/DESIGN.md, 29).
#[tokio::test]
async fn the_index_migrations_hold_back_no_enqueue_while_they_wait_or_build() {
    let pool = common::database_migrated_to(20261206000004).await;
    common::enqueue_many(&pool, "noop", 50).await;
    sqlx::query("UPDATE rowq.jobs SET state = 'failed', finished_at = now() - interval '2 days' WHERE id % 2 = 0")
        .execute(&pool)
        .await
        .unwrap();
    let mut writer = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO rowq.jobs (kind) VALUES ('noop')").execute(&mut *writer).await.unwrap();
    let migrating = tokio::spawn({
        let pool = pool.clone();
        async move { store::migrate(&pool).await }
    });
    waiting_for_a_lock(&pool, "CREATE INDEX", "the index build to wait for the open writer").await;
    let enqueued = tokio::time::timeout(Duration::from_secs(10), common::enqueue(&pool, "noop", json!({}))).await;
    assert!(enqueued.is_ok(), "an enqueue waited for the index build");
    writer.commit().await.unwrap();
    migrating.await.unwrap().unwrap();
    let indexes = job_indexes(&pool).await;
    assert!(
        indexes.contains(&"jobs_done_idx".to_string()) && indexes.contains(&"jobs_failed_idx".to_string()),
        "{indexes:?}"
    );
    assert!(indexes.contains(&"jobs_finished_idx".to_string()), "older binaries' prune needs it: {indexes:?}");
    assert_eq!(store::invalid_indexes(&pool).await.unwrap(), Vec::<String>::new());
    let pruned = rowq::maintenance::run_once(&pool, Duration::from_secs(3600)).await.unwrap().pruned;
    assert_eq!(pruned, 25, "the failed rows finished before the migration are found by the new index");
}

/// Migration 7 adds a column to `rowq.jobs`, which needs the table's strongest lock: waiting for
/// it behind a transaction that wrote to the table would queue every enqueue behind the
/// migration until that transaction ended. It waits a second at a time instead, and gives way in
/// between; once the writer is gone it goes through, and the schema is whole.
#[tokio::test]
async fn the_column_migration_gives_way_to_a_writer_instead_of_holding_up_enqueues() {
    let pool = common::database_migrated_to(20261206000006).await;
    let mut writer = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO rowq.jobs (kind) VALUES ('noop')").execute(&mut *writer).await.unwrap();
    let migrating = tokio::spawn({
        let pool = pool.clone();
        async move { store::migrate(&pool).await }
    });
    waiting_for_a_lock(&pool, "behind_group", "the migration to wait for the open writer").await;
    for _ in 0..3 {
        let enqueued = tokio::time::timeout(Duration::from_secs(5), common::enqueue(&pool, "noop", json!({}))).await;
        assert!(enqueued.is_ok(), "an enqueue waited behind the migration for the open writer");
    }
    assert!(!migrating.is_finished(), "the migration did not wait for the writer");
    writer.commit().await.unwrap();
    migrating.await.unwrap().unwrap();
    let column: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM information_schema.columns
         WHERE table_schema = 'rowq' AND table_name = 'jobs' AND column_name = 'behind_group')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(column);
    let indexes = job_indexes(&pool).await;
    assert!(
        indexes.contains(&"jobs_claimable_idx".to_string()) && indexes.contains(&"jobs_behind_group_idx".to_string()),
        "{indexes:?}"
    );
    assert!(indexes.contains(&"jobs_claim_idx".to_string()), "older binaries' claim needs it: {indexes:?}");
    assert_eq!(common::count_in_state(&pool, JobState::Pending).await, 4);
}

/// An index build that was interrupted leaves the index invalid, and its migration skips the
/// existing name when run again: `migrate` rebuilds every invalid index of the schema, and
/// drops what an interrupted rebuild leaves.
#[tokio::test]
async fn migrate_rebuilds_an_index_whose_build_was_interrupted() {
    let pool = common::database().await;
    // What a cancelled `CREATE INDEX CONCURRENTLY` leaves behind.
    sqlx::query("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'rowq.jobs_failed_idx'::regclass")
        .execute(&pool)
        .await
        .unwrap();
    // What an interrupted `REINDEX CONCURRENTLY` leaves: its new index, invalid.
    sqlx::query("CREATE INDEX jobs_done_idx_ccnew ON rowq.jobs (finished_at)").execute(&pool).await.unwrap();
    sqlx::query("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'rowq.jobs_done_idx_ccnew'::regclass")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(store::invalid_indexes(&pool).await.unwrap(), ["rowq.jobs_done_idx_ccnew", "rowq.jobs_failed_idx"]);
    store::migrate(&pool).await.unwrap();
    assert_eq!(store::invalid_indexes(&pool).await.unwrap(), Vec::<String>::new());
    let indexes = job_indexes(&pool).await;
    assert!(indexes.contains(&"jobs_failed_idx".to_string()), "rebuilt, not dropped: {indexes:?}");
    assert!(!indexes.contains(&"jobs_done_idx_ccnew".to_string()), "the leftover is dropped: {indexes:?}");
}

/// `store::MIGRATOR` lists the migrations by hand: it must be what the directory holds, as
/// `sqlx::migrate!` would have read it, or a new file would never run.
#[tokio::test]
async fn the_embedded_migrations_are_the_files_of_the_migrations_directory() {
    let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let read = sqlx::migrate::Migrator::new(directory.as_path()).await.unwrap();
    let summary = |migrator: &sqlx::migrate::Migrator| -> Vec<_> {
        migrator
            .iter()
            .map(|m| (m.version, m.description.to_string(), m.migration_type, m.checksum.to_vec(), m.no_tx))
            .collect()
    };
    assert_eq!(read.iter().count(), 11, "the directory has the migrations the list is checked against");
    assert_eq!(summary(&store::MIGRATOR), summary(&read));
}

/// `JobState`'s encoding is written by hand (`store::types`): every state is a label of
/// `rowq.job_state`, each label a state, alone and in arrays.
#[tokio::test]
async fn every_job_state_is_a_label_of_the_postgres_enum_and_back() {
    let pool = common::database().await;
    let labels: Vec<JobState> =
        sqlx::query_scalar("SELECT unnest(enum_range(NULL::rowq.job_state))").fetch_all(&pool).await.unwrap();
    assert_eq!(labels, JobState::ALL);
    for state in JobState::ALL {
        let back: JobState = sqlx::query_scalar("SELECT $1").bind(state).fetch_one(&pool).await.unwrap();
        assert_eq!(back, state);
    }
    let back: Vec<JobState> =
        sqlx::query_scalar("SELECT $1::rowq.job_state[]").bind(JobState::ALL.to_vec()).fetch_one(&pool).await.unwrap();
    assert_eq!(back, JobState::ALL);
    let ids: Vec<rowq::JobId> = sqlx::query_scalar("SELECT $1::bigint[]")
        .bind(vec![rowq::JobId(1), rowq::JobId(2)])
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ids, [rowq::JobId(1), rowq::JobId(2)]);
}
