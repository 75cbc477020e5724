//! The bad-input catalogue: what the rest of the suite does not already cover. Each case gets
//! a clear error where someone can see it; nothing panics; nothing is lost.

mod common;

use std::time::Duration;

use rowq::store::admin::{self, NewJob};
use rowq::store::dispatch::{claim_due, claim_due_within};
use rowq::{JobState, MemoryPublisher, Scheduler};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::watch;

async fn refused(pool: &PgPool, sql: &'static str) -> String {
    sqlx::query(sql).execute(pool).await.err().map(|e| e.to_string()).unwrap_or_else(|| panic!("accepted: {sql}"))
}

#[tokio::test]
async fn updates_that_break_the_row_contract_are_refused_too() {
    let pool = common::database().await;
    common::enqueue(&pool, "noop", json!({})).await;
    let error = refused(&pool, "UPDATE rowq.jobs SET attempts = -1").await;
    assert!(error.contains("jobs_attempts_not_negative"), "{error}");
    let error = refused(&pool, "UPDATE rowq.jobs SET errors = '{}'").await;
    assert!(error.contains("jobs_errors_is_a_json_array"), "{error}");
    let error = refused(&pool, "UPDATE rowq.jobs SET max_attempts = 1001").await;
    assert!(error.contains("jobs_max_attempts_between_1_and_1000"), "{error}");
    let error = refused(&pool, "INSERT INTO rowq.jobs (kind, group_key) VALUES ('noop', repeat('g', 129))").await;
    assert!(error.contains("jobs_group_key_is_1_to_128_printable_ascii"), "{error}");
    let error = refused(&pool, "INSERT INTO rowq.jobs (kind, queue) VALUES ('noop', 'no/slashes')").await;
    assert!(error.contains("jobs_queue_is_a_nonempty_identifier"), "{error}");
    let error = refused(&pool, "INSERT INTO rowq.jobs (id, kind) VALUES (5, 'noop')").await;
    assert!(error.contains(r#"cannot insert a non-DEFAULT value into column "id""#), "{error}");
}

#[tokio::test]
async fn values_that_look_like_sql_are_stored_verbatim() {
    let pool = common::database().await;
    let nasty = "x'); DELETE FROM rowq.jobs; --";
    let job = NewJob {
        dedup_key: Some(nasty.into()),
        group_key: Some("g');DROP".into()),
        payload: json!({ "q": nasty }),
        ..NewJob::new("noop", json!({}))
    };
    let id = admin::enqueue(&pool, &job).await.unwrap().unwrap();
    let row = common::job(&pool, id).await;
    assert_eq!(row.dedup_key.as_deref(), Some(nasty));
    assert_eq!(row.group_key.as_deref(), Some("g');DROP"));
    assert_eq!(row.payload["q"], json!(nasty));
    // The kind, though, is an identifier: such a kind is refused at INSERT.
    let error = admin::enqueue(&pool, &NewJob::new(nasty, json!({}))).await.unwrap_err().to_string();
    assert!(error.contains("jobs_kind_is_a_nonempty_identifier"), "{error}");
}

#[tokio::test]
async fn run_at_far_in_the_past_runs_now_and_far_in_the_future_waits_without_harm() {
    let pool = common::database().await;
    sqlx::query("INSERT INTO rowq.jobs (kind, run_at) VALUES ('noop', '0001-01-01T00:00:00Z'), ('noop', '9999-12-31T23:59:59Z')")
        .execute(&pool)
        .await
        .unwrap();
    let claim = claim_due_within(&pool, "default", 10, u32::MAX, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claim.jobs.len(), 1, "the far-past job is due now, the far-future one is not");
    let next = claim.next_due.unwrap();
    assert_eq!(next.to_rfc3339(), "9999-12-31T23:59:59+00:00");

    // The scheduler's idle wait with a next run_at eight thousand years away stays bounded
    // by its poll interval: a short drain returns on time.
    let mut config = common::scheduler_config("memory://jobs.fifo");
    config.poll_interval = Duration::from_millis(100);
    config.drain_for = Some(Duration::from_millis(500));
    let scheduler = Scheduler::new(pool.clone(), MemoryPublisher::new(), config);
    let (_keep, shutdown) = watch::channel(false);
    let totals =
        tokio::time::timeout(Duration::from_secs(10), scheduler.run(shutdown, false)).await.expect("drain overran");
    assert!(totals.passes > 1, "it must have woken by its poll interval: {totals:?}");
    let future: i64 =
        sqlx::query_scalar("SELECT count(*) FROM rowq.jobs WHERE state = 'pending'").fetch_one(&pool).await.unwrap();
    assert_eq!(future, 1);
    assert_eq!(common::count_in_state(&pool, JobState::Dispatched).await, 1);
}

#[tokio::test]
async fn a_scheduler_claims_only_its_own_queue() {
    let pool = common::database().await;
    admin::enqueue(&pool, &NewJob { queue: Some("emails".into()), ..NewJob::new("noop", json!({})) })
        .await
        .unwrap()
        .unwrap();
    assert!(claim_due(&pool, "default", 10, Duration::from_secs(60)).await.unwrap().is_empty());
    assert_eq!(claim_due(&pool, "emails", 10, Duration::from_secs(60)).await.unwrap().len(), 1);
}
