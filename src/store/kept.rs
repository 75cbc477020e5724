//! Connections the worker keeps checked out of its pool between back-to-back statements.
//!
//! sqlx tests every connection that comes back to a pool with a round trip (an empty `Sync`
//! that Postgres must wake up and answer) before another task may have it, whatever
//! `test_before_acquire` says. The worker's combined statements (`run::step`) follow each other
//! within microseconds when several batches are in flight, so that test was one more round
//! trip and two more process wake-ups on each side per statement: with eight pollers the drain
//! spent 68–76 µs of CPU per job with it and 58–64 µs without, at 14.1–16.0k against
//! 17.5–18.3k jobs/s (BENCHMARKS.md, round 8).
//!
//! A [`KeptConnections`] hands out the connection the last statement used, when there is one,
//! and otherwise asks the pool. A connection is kept only briefly: [`KEEP_FOR`] after it was
//! last used it goes back to the pool, so a Lambda instance, which handles one batch at a time,
//! gives its connection back while the handlers run (a job's own transaction takes one from
//! the same pool), and no connection sits checked out longer than the pool's own idle test
//! ([`super::IDLE_BEFORE_PING`]) would allow. It never keeps every connection of its pool: the
//! jobs' transactions must always be able to get one.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

/// How long a connection stays kept after its last statement, unused, before it goes back to
/// the pool. The next statement of a busy worker comes within microseconds; an idle one does
/// not come at all.
pub const KEEP_FOR: Duration = Duration::from_millis(5);

/// The connections last used by a worker's statements; share it by `Arc`.
pub struct KeptConnections {
    pool: PgPool,
    most: usize,
    keep_for: Duration,
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
}

impl KeptConnections {
    /// Keeps at most `most` connections, and never all of `pool`'s: one fewer than its size.
    pub fn new(pool: PgPool, most: usize, keep_for: Duration) -> Self {
        let pool_size = usize::try_from(pool.options().get_max_connections()).unwrap_or(usize::MAX);
        KeptConnections { most: most.min(pool_size.saturating_sub(1)), pool, keep_for, idle: Mutex::new(Vec::new()) }
    }

    /// The connection used last, if it was used less than `keep_for` ago; else one from the
    /// pool. A process that was frozen (a Lambda instance between invocations) finds its kept
    /// connections too old, whether or not their release ran: they go back to the pool, which
    /// tests a connection that sat idle before it hands it out again.
    ///
    /// The pool's `acquire` future is boxed: it is ~14.5 kB, and inline it made every future
    /// that awaits a `take` as large, twice over in the combiner's statement (29 kB). That
    /// future was built, then moved through the combiner's wrappers into its task, once per
    /// statement: 7.5 µs at p50 between a fence's request and its statement, on the pickup
    /// path of every job (0.9 µs boxed, plus 1.9 µs for the box; BENCHMARKS.md, round 27).
    pub async fn take(&self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let kept = self.idle().pop();
        if let Some((connection, at)) = kept {
            if at.elapsed() < self.keep_for {
                return Ok(connection);
            }
            drop(connection); // the newest kept is stale, so are the others
            self.release_unused();
        }
        Box::pin(self.pool.acquire()).await
    }

    /// Keeps `connection` for the next statement, for [`KEEP_FOR`] at most. Keep only a
    /// connection whose statement succeeded: one that failed may be broken, and dropping it
    /// lets the pool test it.
    pub fn keep(self: &Arc<Self>, connection: PoolConnection<Postgres>) {
        {
            let mut idle = self.idle();
            if idle.len() >= self.most {
                return; // `connection` goes back to the pool
            }
            idle.push((connection, Instant::now()));
        }
        let kept = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(kept.keep_for).await;
            kept.release_unused();
        });
    }

    /// How many connections are kept now.
    pub fn len(&self) -> usize {
        self.idle().len()
    }

    /// Whether no connection is kept now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gives the connections unused for `keep_for` back to the pool.
    fn release_unused(&self) {
        let unused: Vec<_> = {
            let mut idle = self.idle();
            let (unused, fresh) = idle.drain(..).partition(|(_, at)| at.elapsed() >= self.keep_for);
            *idle = fresh;
            unused
        };
        drop(unused); // outside the lock: each one starts its return to the pool
    }

    /// The kept connections; a panic elsewhere while holding the lock left nothing half-done.
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<(PoolConnection<Postgres>, Instant)>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every combined statement of the worker awaits a `take`; an inline pool `acquire` made
    /// that future, and each one built around it, ~14.5 kB (see [`KeptConnections::take`]).
    #[tokio::test]
    async fn a_take_is_a_small_future() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("a lazy pool does not connect");
        let kept = KeptConnections::new(pool, 1, KEEP_FOR);
        let take = kept.take();
        assert!(std::mem::size_of_val(&take) <= 256, "a take is {} bytes", std::mem::size_of_val(&take));
    }
}
