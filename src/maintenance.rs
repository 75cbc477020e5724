//! Scheduler maintenance: rescue rows whose owner went away, prune old finished rows.
//! [`run_once`] is called by the scheduler every `maintenance_interval`, beside its dispatch
//! loop (`dispatch::Scheduler::run_until`), and by tests.

use std::time::Duration;

use sqlx::PgPool;

use crate::job::JobState;
use crate::store::maintenance::{self as store, Finished, RESCUE_BATCH, Rescued};

/// Delay before a job rescued from a dead worker is claimed again.
pub const RESCUE_RETRY_DELAY: Duration = Duration::from_secs(1);
/// At most this many statements of each kind per pass, so one pass stays short (and a shutdown
/// waits for no more than that). A pass that leaves work says so
/// ([`MaintenanceReport::more_left`]), and the scheduler runs the next one at once.
const MAX_ROUNDS: usize = 10;

/// What one maintenance pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// `dispatched` rows past their lease, back to `pending`.
    pub rescued_dispatched: usize,
    /// `running` rows past their run deadline, back to `pending`.
    pub rescued_running: usize,
    /// Rescued rows whose attempts were used up, now `failed`.
    pub failed: usize,
    /// Finished rows deleted.
    pub pruned: u64,
    /// Jobs set aside behind their group with nothing left before them, released
    /// ([`store::release_set_aside`]).
    pub released: usize,
    /// A rescue or the prune stopped at [`MAX_ROUNDS`] full statements: rows are left for the
    /// next pass. Without it a pass would be a ceiling, 50,000 pruned rows per
    /// `maintenance_interval` (10,000 a second by default), which a busy queue outgrows.
    pub more_left: bool,
}

impl MaintenanceReport {
    pub fn is_empty(&self) -> bool {
        *self == MaintenanceReport::default()
    }

    fn count(&mut self, rescued: &[Rescued], from: JobState) {
        for job in rescued {
            match (job.state, from) {
                (JobState::Pending, JobState::Dispatched) => self.rescued_dispatched += 1,
                (JobState::Pending, _) => self.rescued_running += 1,
                _ => self.failed += 1,
            }
            tracing::warn!(
                job.id = job.id.0,
                job.dispatch_gen = job.dispatch_gen,
                job.from = from.as_str(),
                job.to = job.state.as_str(),
                "job rescued"
            );
        }
    }
}

/// How long finished rows are kept before maintenance deletes them; zero keeps them forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Succeeded and cancelled rows (`ROWQ_RETENTION_HOURS`).
    pub done: Duration,
    /// Failed rows (`ROWQ_FAILED_RETENTION_HOURS`): what an operator may still have to read,
    /// or retry once the cause is fixed, so often kept longer.
    pub failed: Duration,
}

impl Retention {
    /// Nothing is ever deleted.
    pub const FOREVER: Retention = Retention { done: Duration::ZERO, failed: Duration::ZERO };
}

/// The same retention for every finished row.
impl From<Duration> for Retention {
    fn from(retention: Duration) -> Self {
        Retention { done: retention, failed: retention }
    }
}

/// One pass: rescue lost dispatches, rescue dead workers' jobs, release jobs left set aside
/// behind their group with nothing before them, prune by `retention`. Rows
/// rescued to `pending`, and a group's next job once a rescue failed its head, send no
/// notification of their own, so a rescue that made either wakes the schedulers
/// ([`crate::store::wake_schedulers`]) as an insert does.
pub async fn run_once(pool: &PgPool, retention: impl Into<Retention>) -> Result<MaintenanceReport, sqlx::Error> {
    let retention = retention.into();
    let mut report = MaintenanceReport::default();
    let mut wake = false;
    // Each kind runs until a statement moves less than a full batch, or MAX_ROUNDS have run;
    // a full last one may have left rows.
    for round in 1..=MAX_ROUNDS {
        let rescued = store::rescue_dispatched(pool).await?;
        report.count(&rescued, JobState::Dispatched);
        wake |= rescued.iter().any(claimable_after);
        if (rescued.len() as i64) < RESCUE_BATCH {
            break;
        }
        report.more_left |= round == MAX_ROUNDS;
    }
    for round in 1..=MAX_ROUNDS {
        let rescued = store::rescue_running(pool, RESCUE_RETRY_DELAY).await?;
        report.count(&rescued, JobState::Running);
        wake |= rescued.iter().any(claimable_after);
        if (rescued.len() as i64) < RESCUE_BATCH {
            break;
        }
        report.more_left |= round == MAX_ROUNDS;
    }
    let released = store::release_set_aside(pool).await?;
    for job in &released {
        tracing::warn!(
            job.id = job.id.0,
            job.group_key = job.group_key.as_deref().unwrap_or(""),
            "job released: it was set aside behind its group with no unfinished job before it"
        );
    }
    report.released = released.len();
    wake |= !released.is_empty();
    if wake {
        crate::store::wake_schedulers(pool, "rescued").await?;
    }
    for (which, kept) in [(Finished::Done, retention.done), (Finished::Failed, retention.failed)] {
        if kept.is_zero() {
            continue;
        }
        for round in 1..=MAX_ROUNDS {
            let pruned = store::prune_finished(pool, which, kept).await?;
            report.pruned += pruned;
            if pruned < store::PRUNE_BATCH as u64 {
                break;
            }
            report.more_left |= round == MAX_ROUNDS;
        }
    }
    Ok(report)
}

/// Whether a rescue of `row` may have made a row claimable: itself, back to `pending`, or the
/// next job of its group, once it failed.
fn claimable_after(row: &Rescued) -> bool {
    row.state == JobState::Pending || row.group_key.is_some()
}
