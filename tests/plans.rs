//! The hot statements reach their rows through the index meant for them, whatever the table's
//! statistics say: their plans, from `EXPLAIN`, on tables shaped the way a busy queue leaves
//! them. A queue's statistics are always stale (rows change state faster than ANALYZE runs),
//! and a plan chosen from them cost the claim a sequential scan of the whole table and each
//! fence a scan of every in-flight row, until these statements were written not to allow it.

mod common;

use std::time::Duration;

use rowq::store::dispatch::{self, CLAIM_SQL, RELEASE_SQL};
use rowq::store::maintenance::{PRUNE_DONE_SQL, PRUNE_FAILED_SQL, RESCUE_DISPATCHED_SQL, RESCUE_RUNNING_SQL};
use rowq::store::run::{self, FINISH_SQL, Finish, Outcome, START_SQL, SUCCEED_SQL, StartRequest};
use serde_json::Value;
use sqlx::PgPool;

/// `EXPLAIN (FORMAT JSON)` of one of rowq's own statements (constants, no outside input).
fn explain(sql: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {sql}"))
}

/// Every `(node type, index name)` of a plan, depth first; for a sequential scan, the table's
/// name in place of the index's.
fn nodes(plan: &Value, out: &mut Vec<(String, String)>) {
    if let Some(node) = plan.get("Node Type").and_then(Value::as_str) {
        let index = plan.get(if node == "Seq Scan" { "Relation Name" } else { "Index Name" });
        let index = index.and_then(Value::as_str).unwrap_or("");
        out.push((node.to_string(), index.to_string()));
    }
    for child in plan.get("Plans").and_then(Value::as_array).into_iter().flatten() {
        nodes(child, out);
    }
}

fn plan_nodes(explained: Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    nodes(&explained[0]["Plan"], &mut out);
    out
}

/// The statement looks its rows up by primary key and reads no other index and no whole table.
fn assert_reads_only_its_batch(name: &str, explained: Value) {
    let nodes = plan_nodes(explained);
    assert!(
        nodes.iter().any(|(node, index)| node == "Index Scan" && index == "jobs_pkey"),
        "the {name} does not look its rows up by primary key: {nodes:?}"
    );
    assert!(
        nodes.iter().all(|(node, index)| (index.is_empty() || index == "jobs_pkey") && node != "Seq Scan"),
        "the {name} scans more than the batch's rows: {nodes:?}"
    );
}

/// `n` pending rows, analyzed while all of them were pending: the statistics a queue's table
/// has after a burst of enqueues.
async fn backlog_analyzed_while_pending(pool: &PgPool, n: i64) {
    enqueue(pool, n).await;
    sqlx::query("ANALYZE rowq.jobs").execute(pool).await.unwrap();
}

/// `n` pending no-op jobs.
async fn enqueue(pool: &PgPool, n: i64) {
    sqlx::query("INSERT INTO rowq.jobs (kind) SELECT 'noop' FROM generate_series(1, $1)")
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
}

/// 50,000 finished rows, then 20,000 pending ones analyzed while pending: a long history and a
/// deep backlog, for which a `LIMIT` the planner cannot evaluate makes it expect a tenth.
async fn history_and_deep_backlog(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, state, finished_at) SELECT 'noop', 'succeeded', now() FROM generate_series(1, 50000)",
    )
    .execute(pool)
    .await
    .unwrap();
    backlog_analyzed_while_pending(pool, 20_000).await;
}

/// The statement reads no table from end to end.
///
/// `rowq.paused_queues` may be scanned: a table of a few rows, one page read either way.
fn assert_scans_no_table(name: &str, nodes: &[(String, String)]) {
    assert!(
        nodes.iter().all(|(node, table)| node != "Seq Scan" || table == PAUSED_QUEUES),
        "the {name} scans the whole table: {nodes:?}"
    );
}

/// The table of paused queues, and its primary key, which the claim and the gauges read.
const PAUSED_QUEUES: &str = "paused_queues";
const PAUSED_QUEUES_PKEY: &str = "paused_queues_pkey";

/// Fences every claimed row (`dispatched → running`); returns how many started.
async fn start(pool: &PgPool, claimed: &[dispatch::Claimed]) -> usize {
    started(pool, claimed).await.len()
}

/// Fences every claimed row; returns the executions that started.
async fn started(pool: &PgPool, claimed: &[dispatch::Claimed]) -> Vec<run::Started> {
    let starts: Vec<StartRequest> = claimed
        .iter()
        .map(|c| StartRequest { id: c.id, dispatch_gen: c.dispatch_gen, lease: Duration::from_secs(60) })
        .collect();
    run::start(pool, &starts).await.unwrap()
}

fn requests(ids: &[rowq::JobId]) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    (ids.iter().map(|id| id.0).collect(), vec![1; ids.len()], vec![60_000; ids.len()])
}

#[tokio::test]
async fn the_fence_and_the_release_find_their_rows_by_primary_key_while_statistics_say_nothing_is_in_flight() {
    let pool = common::database().await;
    backlog_analyzed_while_pending(&pool, 5000).await;
    let claimed = dispatch::claim_due(&pool, "default", 2000, Duration::from_secs(60)).await.unwrap();
    let ids: Vec<_> = claimed.iter().take(10).map(|c| c.id).collect();
    let (ids, gens, leases) = requests(&ids);

    let fence: Value =
        sqlx::query_scalar(explain(START_SQL)).bind(&ids).bind(&gens).bind(&leases).fetch_one(&pool).await.unwrap();
    let release: Value =
        sqlx::query_scalar(explain(RELEASE_SQL)).bind(&ids).bind(&gens).fetch_one(&pool).await.unwrap();
    assert_reads_only_its_batch("fence", fence);
    assert_reads_only_its_batch("release", release);
    let generic_fence = explain_generic_only(
        &pool,
        START_SQL,
        "bigint[], bigint[], bigint[]",
        &format!("{}, {}, {}", array(&ids), array(&gens), array(&leases)),
    )
    .await;
    assert_reads_only_its_batch("fence's generic plan", generic_fence);
    // The release runs on the scheduler's pool, whose sessions plan generically.
    let generic_release =
        explain_generic(&pool, RELEASE_SQL, "bigint[], bigint[]", &format!("{}, {}", array(&ids), array(&gens))).await;
    assert_reads_only_its_batch("release's generic plan", generic_release);
}

/// An array of integers as an SQL literal.
fn array<T: ToString>(values: &[T]) -> String {
    format!("'{{{}}}'", values.iter().map(T::to_string).collect::<Vec<_>>().join(","))
}

#[tokio::test]
async fn the_finish_finds_its_rows_by_primary_key_while_statistics_say_nothing_is_running() {
    let pool = common::database().await;
    backlog_analyzed_while_pending(&pool, 5000).await;
    let claimed = dispatch::claim_due(&pool, "default", 2000, Duration::from_secs(60)).await.unwrap();
    assert_eq!(start(&pool, &claimed).await, 2000);

    let ids: Vec<i64> = claimed.iter().take(10).map(|c| c.id.0).collect();
    let explained: Value = sqlx::query_scalar(explain(FINISH_SQL))
        .bind(&ids)
        .bind(vec![1_i64; 10])
        .bind(vec![1_i32; 10])
        .bind(vec!["succeeded"; 10])
        .bind(vec![Some("null"); 10])
        .bind(vec![None::<String>; 10])
        .bind(vec![0_i64; 10])
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_reads_only_its_batch("finish", explained);
    let explained: Value = sqlx::query_scalar(explain(SUCCEED_SQL))
        .bind(&ids)
        .bind(vec![1_i64; 10])
        .bind(vec![1_i32; 10])
        .bind(vec![Some("null"); 10])
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_reads_only_its_batch("succeed", explained);

    // The fence and the success-only finish in one statement: the fence's rows are the next
    // ten claimed, still `dispatched`.
    let next: Vec<i64> = claimed.iter().skip(10).take(10).map(|c| c.id.0).collect();
    let explained: Value = sqlx::query_scalar(explain(&run::STEP_SQL))
        .bind(&ids)
        .bind(vec![1_i64; 10])
        .bind(vec![1_i32; 10])
        .bind(vec![Some("null"); 10])
        .bind(&next)
        .bind(vec![1_i64; 10])
        .bind(vec![60_000_i64; 10])
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_reads_only_its_batch("fence and finish", explained);

    let (gens, attempts, results) = (array(&[1; 10]), array(&[1; 10]), "array_fill('null'::text, ARRAY[10])");
    let generic_succeed = explain_generic_only(
        &pool,
        SUCCEED_SQL,
        "bigint[], bigint[], int[], text[]",
        &format!("{}, {gens}, {attempts}, {results}", array(&ids)),
    )
    .await;
    assert_reads_only_its_batch("success-only finish's generic plan", generic_succeed);
    let generic_finish = explain_generic_only(
        &pool,
        FINISH_SQL,
        "bigint[], bigint[], int[], text[], text[], text[], bigint[]",
        &format!(
            "{}, {gens}, {attempts}, array_fill('pending'::text, ARRAY[10]), array_fill(NULL::text, ARRAY[10]), \
             array_fill('timed out'::text, ARRAY[10]), {}",
            array(&ids),
            array(&[1000; 10])
        ),
    )
    .await;
    assert_reads_only_its_batch("joined finish's generic plan", generic_finish);
    let generic_step = explain_generic_only(
        &pool,
        &run::STEP_SQL,
        "bigint[], bigint[], int[], text[], bigint[], bigint[], bigint[]",
        &format!("{}, {gens}, {attempts}, {results}, {}, {gens}, {}", array(&ids), array(&next), array(&[60_000; 10])),
    )
    .await;
    assert_reads_only_its_batch("fence and finish's generic plan", generic_step);
}

#[tokio::test]
async fn the_claim_reads_the_pending_index_and_the_primary_key_never_the_finished_rows() {
    let pool = common::database().await;
    history_and_deep_backlog(&pool).await;

    let explained: Value = sqlx::query_scalar(explain(CLAIM_SQL))
        .bind("default")
        .bind(100_i64)
        .bind(60_000_i64)
        .bind(1000_i64)
        .bind(500_i64)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_claim_reads_its_indexes(explained);
}

/// The scheduler's gauges, every maintenance interval, read only the partial indexes of
/// unfinished rows: neither the finished history nor the table, with a group in the backlog.
#[tokio::test]
async fn the_gauges_read_the_indexes_of_unfinished_rows_only() {
    let pool = common::database().await;
    history_and_deep_backlog(&pool).await;
    sqlx::query("UPDATE rowq.jobs SET group_key = 'g' WHERE id % 2 = 0 AND state = 'pending'")
        .execute(&pool)
        .await
        .unwrap();

    let explained: Value = sqlx::query_scalar(explain(rowq::store::admin::GAUGES_SQL))
        .bind("default")
        .bind(100_000_i64)
        .bind(10_000_i64)
        .fetch_one(&pool)
        .await
        .unwrap();
    let nodes = plan_nodes(explained);
    assert_scans_no_table("gauges", &nodes);
    let unfinished = [
        "jobs_claimable_idx",
        "jobs_pending_run_at_idx",
        "jobs_group_idx",
        "jobs_dispatched_idx",
        "jobs_running_idx",
        PAUSED_QUEUES_PKEY,
        PAUSED_QUEUES,
    ];
    let read: Vec<&str> = nodes.iter().map(|(_, index)| index.as_str()).filter(|index| !index.is_empty()).collect();
    assert!(read.iter().all(|index| unfinished.contains(index)), "the gauges read another index: {nodes:?}");
    assert!(read.contains(&"jobs_group_idx"), "the claimable wait does not test jobs' groups: {nodes:?}");
    assert!(read.contains(&"jobs_claimable_idx"), "the claimable wait reads jobs set aside: {nodes:?}");
}

/// The nodes of the plan of the CTE `name` (its "Subplan Name" is `CTE name`).
fn cte_nodes(plan: &Value, name: &str) -> Option<Vec<(String, String)>> {
    if plan.get("Subplan Name").and_then(Value::as_str) == Some(&format!("CTE {name}")) {
        let mut out = Vec::new();
        nodes(plan, &mut out);
        return Some(out);
    }
    plan.get("Plans").and_then(Value::as_array).into_iter().flatten().find_map(|child| cte_nodes(child, name))
}

/// The claim reads the pending index and updates by primary key, and scans no table. What it
/// reads to set jobs aside behind their group (docs/DESIGN.md, 36) is the same index, its test
/// of a job's group is a lookup in the group's index, and the group's first unfinished job is
/// locked by primary key.
fn assert_claim_reads_its_indexes(explained: Value) {
    // `looked_at` is read once, by `behind`, into which Postgres folds it.
    let behind = cte_nodes(&explained[0]["Plan"], "behind").expect("the claim has a CTE behind");
    let indexes: Vec<&str> = behind.iter().map(|(_, index)| index.as_str()).filter(|index| !index.is_empty()).collect();
    let read = ["jobs_claimable_idx", "jobs_group_idx", "jobs_pkey"];
    assert!(
        read.iter().all(|index| indexes.contains(index)) && indexes.iter().all(|index| read.contains(index)),
        "the claim looks for jobs to set aside elsewhere than among the claimable ones and their groups: {behind:?}"
    );
    let set_aside = cte_nodes(&explained[0]["Plan"], "set_aside").expect("the claim has a CTE set_aside");
    assert!(
        set_aside.iter().all(|(_, index)| index.is_empty() || index == "jobs_pkey"),
        "the claim finds the jobs it sets aside other than by primary key: {set_aside:?}"
    );
    let nodes = plan_nodes(explained);
    assert_scans_no_table("claim", &nodes);
    assert!(
        nodes.iter().any(|(_, index)| index == "jobs_claimable_idx"),
        "the claim does not read the pending index: {nodes:?}"
    );
    assert!(
        nodes.iter().any(|(node, index)| (node == "Index Scan" || node == "Bitmap Index Scan") && index == "jobs_pkey"),
        "the claim's UPDATE does not find its rows by primary key: {nodes:?}"
    );
}

#[tokio::test]
async fn the_rescues_update_the_rescued_rows_by_primary_key_while_statistics_say_no_row_is_stuck() {
    let pool = common::database().await;
    backlog_analyzed_while_pending(&pool, 5000).await;
    let claimed = dispatch::claim_due(&pool, "default", 2000, Duration::from_secs(60)).await.unwrap();
    assert_eq!(start(&pool, &claimed[..1000]).await, 1000);

    let dispatched: Value =
        sqlx::query_scalar(explain(RESCUE_DISPATCHED_SQL)).bind(1000_i64).fetch_one(&pool).await.unwrap();
    let running: Value =
        sqlx::query_scalar(explain(RESCUE_RUNNING_SQL)).bind(1000_i64).bind(1000_i64).fetch_one(&pool).await.unwrap();
    for (name, explained) in [("dispatched", dispatched), ("running", running)] {
        let nodes = plan_nodes(explained);
        assert!(
            nodes.iter().any(|(node, index)| node == "Index Scan" && index == "jobs_pkey"),
            "the rescue of {name} rows does not update them by primary key: {nodes:?}"
        );
        assert_scans_no_table(&format!("rescue of {name} rows"), &nodes);
    }
}

/// `EXPLAIN` of the plan the scheduler's sessions run: the generic one, planned without the
/// parameters' values, with sequential scans turned off (see `rowq::store::connect_scheduler`).
async fn explain_generic(pool: &PgPool, sql: &str, types: &str, arguments: &str) -> Value {
    explain_in_session(pool, &rowq::store::SCHEDULER_SESSION, sql, types, arguments).await
}

/// `EXPLAIN` of the generic plan alone: the plan a worker's connection keeps for its own
/// statements after Postgres's five trial plans (see `run::start`), and the scheduler's without
/// `enable_seqscan = off`.
async fn explain_generic_only(pool: &PgPool, sql: &str, types: &str, arguments: &str) -> Value {
    explain_in_session(pool, &[("plan_cache_mode", "force_generic_plan")], sql, types, arguments).await
}

/// `EXPLAIN` of a prepared statement in a session with `settings`, set for one transaction: a
/// pool's connection goes back to it with the server's defaults, so that the next explain on it
/// does not plan with this one's settings.
async fn explain_in_session(
    pool: &PgPool,
    settings: &[(&str, &str)],
    sql: &str,
    types: &str,
    arguments: &str,
) -> Value {
    let mut transaction = pool.begin().await.unwrap();
    for (setting, value) in settings {
        let set = format!("SET LOCAL {setting} = {value}");
        sqlx::query(sqlx::AssertSqlSafe(set)).execute(&mut *transaction).await.unwrap();
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("PREPARE statement ({types}) AS {sql}")))
        .execute(&mut *transaction)
        .await
        .unwrap();
    let explained =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) EXECUTE statement ({arguments})")))
            .fetch_one(&mut *transaction)
            .await
            .unwrap();
    sqlx::query("DEALLOCATE statement").execute(&mut *transaction).await.unwrap();
    transaction.rollback().await.unwrap();
    explained
}

#[tokio::test]
async fn the_scheduler_statements_generic_plans_read_their_indexes_too() {
    let pool = common::database().await;
    history_and_deep_backlog(&pool).await;
    let claimed = dispatch::claim_due(&pool, "default", 2000, Duration::from_secs(60)).await.unwrap();
    assert_eq!(start(&pool, &claimed[..1000]).await, 1000);

    let claim =
        explain_generic(&pool, CLAIM_SQL, "text, bigint, bigint, bigint, bigint", "'default', 100, 60000, 1000, 500")
            .await;
    assert_claim_reads_its_indexes(claim);
    let dispatched = explain_generic(&pool, RESCUE_DISPATCHED_SQL, "bigint", "1000").await;
    let running = explain_generic(&pool, RESCUE_RUNNING_SQL, "bigint, bigint", "1000, 1000").await;
    for (name, explained) in [("dispatched", dispatched), ("running", running)] {
        let nodes = plan_nodes(explained);
        assert_scans_no_table(&format!("rescue of {name} rows"), &nodes);
    }
}

/// Failed rows kept for a month and succeeded ones for a day (or the other way round): the
/// prune of each reads its own index by `finished_at`, never an index that holds the other's
/// rows, which it would walk past on every pass (50,000 here; a month of a steady failure rate
/// in production). `jobs_finished_idx`, kept for older binaries, holds both.
#[tokio::test]
async fn each_prune_reads_the_index_of_its_own_finished_rows_only() {
    let pool = common::database().await;
    for (sql, kept, pruned, own) in [
        (PRUNE_DONE_SQL, "failed", "succeeded", "jobs_done_idx"),
        (PRUNE_FAILED_SQL, "succeeded", "failed", "jobs_failed_idx"),
    ] {
        sqlx::query("TRUNCATE rowq.jobs").execute(&pool).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO rowq.jobs (kind, state, finished_at)
             SELECT 'noop', CASE WHEN i % 50 = 0 THEN '{pruned}' ELSE '{kept}' END::rowq.job_state,
                    now() - interval '2 days'
             FROM generate_series(1, 51000) i"
        )))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE rowq.jobs").execute(&pool).await.unwrap();
        let nodes = plan_nodes(explain_generic(&pool, sql, "bigint, bigint", "86400000, 5000").await);
        assert!(
            nodes.iter().any(|(_, index)| index == own),
            "the prune of {pruned} rows does not read {own}: {nodes:?}"
        );
        let others =
            ["jobs_done_idx", "jobs_failed_idx", "jobs_finished_idx"].into_iter().filter(|index| *index != own);
        for other in others {
            assert!(
                nodes.iter().all(|(_, index)| index != other),
                "the prune of {pruned} rows reads {other}: {nodes:?}"
            );
        }
        assert_scans_no_table("prune", &nodes);
    }
}

/// A quiet queue's table: `n` jobs that went through rowq's claim, fence and finish one at a
/// time, as the pickup-latency benchmark leaves it, and one pending job, analyzed at the end (an
/// autoanalyze part-way through would otherwise leave statistics of its own choosing).
async fn finished_one_at_a_time_and_one_pending(pool: &PgPool, n: usize) {
    one_at_a_time(pool, n, Outcome::Succeeded { result: serde_json::json!({}) }).await;
    enqueue(pool, 1).await;
    sqlx::query("ANALYZE rowq.jobs").execute(pool).await.unwrap();
}

/// `n` jobs, each enqueued, claimed, fenced and finished with `outcome` before the next.
async fn one_at_a_time(pool: &PgPool, n: usize, outcome: Outcome) {
    for _ in 0..n {
        enqueue(pool, 1).await;
        let claimed = dispatch::claim_due(pool, "default", 1, Duration::from_secs(60)).await.unwrap();
        let finishes: Vec<Finish> = started(pool, &claimed)
            .await
            .into_iter()
            .map(|s| Finish { id: s.id, dispatch_gen: s.dispatch_gen, attempt: s.attempt, outcome: outcome.clone() })
            .collect();
        assert_eq!(run::finish(pool, &finishes).await.unwrap().len(), 1);
    }
}

#[tokio::test]
async fn on_a_backlog_of_200000_jobs_the_scheduler_does_not_compile_its_claim() {
    let pool = common::database().await;
    backlog_analyzed_while_pending(&pool, 200_000).await;
    let arguments = "'default', 100, 60000, 1000, 500";
    let claim = explain_generic(&pool, CLAIM_SQL, "text, bigint, bigint, bigint, bigint", arguments).await;
    assert_eq!(claim[0]["JIT"], Value::Null, "the scheduler's claim is compiled: {claim}");
    assert_claim_reads_its_indexes(claim);
    // What the setting is for, where the server can compile (a build with LLVM, `jit` on by
    // default): the same claim without it is compiled at every execution.
    let can_compile: bool = sqlx::query_scalar("SELECT current_setting('jit')::boolean AND pg_jit_available()")
        .fetch_one(&pool)
        .await
        .unwrap();
    if can_compile {
        let settings: Vec<_> = rowq::store::SCHEDULER_SESSION.into_iter().filter(|(name, _)| *name != "jit").collect();
        let compiled =
            explain_in_session(&pool, &settings, CLAIM_SQL, "text, bigint, bigint, bigint, bigint", arguments).await;
        assert_ne!(compiled[0]["JIT"], Value::Null, "the backlog is not deep enough to tell: {compiled}");
    }
}

#[tokio::test]
async fn on_a_small_table_the_scheduler_still_claims_by_primary_key_not_by_reading_every_row() {
    let pool = common::database().await;
    // 50 jobs through the whole protocol, then the table rewritten compactly. As the run
    // leaves it, its size follows how many dead versions the other tests' transactions kept
    // alive (any snapshot's horizon spans every database): 2-7 pages here. In one CI run on
    // PostgreSQL 18 the precondition below failed: a table grown past 7 pages, or the unguarded
    // explain given the connection the guarded one had just set `enable_seqscan = off` on
    // (`explain_in_session` now sets it for a transaction only). Rewritten, even every version of the 50 jobs kept is 4 pages
    // (an open snapshot held through the fill), where the unguarded plan reads the whole
    // table; it turns to the indexes between 7 and 12 pages.
    finished_one_at_a_time_and_one_pending(&pool, 50).await;
    sqlx::query("VACUUM (FULL, ANALYZE) rowq.jobs").execute(&pool).await.unwrap();
    let claim =
        explain_generic(&pool, CLAIM_SQL, "text, bigint, bigint, bigint, bigint", "'default', 100, 60000, 1000, 500")
            .await;
    assert_claim_reads_its_indexes(claim);
    // What the settings are for: with the generic plan alone, the planner reads the whole table.
    let unguarded = explain_generic_only(
        &pool,
        CLAIM_SQL,
        "text, bigint, bigint, bigint, bigint",
        "'default', 100, 60000, 1000, 500",
    )
    .await;
    assert!(plan_nodes(unguarded).iter().any(|(node, _)| node == "Seq Scan"), "the table is not small enough to tell");
}

/// The scheduler plans its claim once per connection, perhaps on a table never analyzed (a
/// fresh deploy), or analyzed when every job had a group: what it reads to set jobs aside is
/// still the claim's own index, in order, once a backlog of ungrouped jobs has come.
#[tokio::test]
async fn the_claims_set_aside_reads_the_claims_index_whatever_the_statistics() {
    let types = "text, bigint, bigint, bigint, bigint";
    let arguments = "'default', 500, 60000, 1000, 500";
    let fresh = common::database().await;
    enqueue(&fresh, 20_000).await;
    assert_claim_reads_its_indexes(explain_generic(&fresh, CLAIM_SQL, types, arguments).await);

    let all_grouped = common::database().await;
    sqlx::query(
        "INSERT INTO rowq.jobs (kind, group_key) SELECT 'noop', 'g' || (i % 100) FROM generate_series(1, 20000) i",
    )
    .execute(&all_grouped)
    .await
    .unwrap();
    sqlx::query("ANALYZE rowq.jobs").execute(&all_grouped).await.unwrap();
    enqueue(&all_grouped, 20_000).await;
    assert_claim_reads_its_indexes(explain_generic(&all_grouped, CLAIM_SQL, types, arguments).await);
}

#[tokio::test]
async fn on_a_quiet_queue_the_fence_and_the_finish_are_planned_once_per_connection_not_per_job() {
    // One connection: the plans counted are those of the session every statement ran on.
    let pool = common::database_with(1).await;
    finished_one_at_a_time_and_one_pending(&pool, 10).await;
    assert_planned_once_per_connection(&pool, &[("fence", START_SQL), ("finish", SUCCEED_SQL)]).await;
}

#[tokio::test]
async fn on_a_quiet_queue_a_failure_is_planned_once_per_connection_not_per_job() {
    let pool = common::database_with(1).await;
    // Ten jobs fail one at a time: a batch with a failure takes the joined finish.
    one_at_a_time(&pool, 10, Outcome::Failed { error: "permanent".into() }).await;
    assert_planned_once_per_connection(&pool, &[("finish of a failure", FINISH_SQL)]).await;
}

/// Each of `statements` (run ten times or more on the pool's one connection) was planned for
/// its parameters' values at most five times and generically at least five.
async fn assert_planned_once_per_connection(pool: &PgPool, statements: &[(&str, &str)]) {
    for &(name, sql) in statements {
        let (generic, custom): (i64, i64) =
            sqlx::query_as("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1")
                .bind(sql)
                .fetch_one(pool)
                .await
                .unwrap();
        // Postgres tries a plan for the values five times before it compares them with the generic one.
        assert!(
            custom <= 5 && generic >= 5,
            "the {name} of ten jobs was planned for its values {custom} times, generically {generic}"
        );
    }
}
