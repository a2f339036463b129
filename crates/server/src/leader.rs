//! One leader among server replicas. Every replica serves the API; the one
//! holding the `leader` lease in the database also runs the control loops
//! (jobs, placement, liveness, metering, billing, billing reconciliation,
//! autoscaling).
//!
//! The election loop tries for the lease (or renews it) every third of its
//! time to live. Granted: the loops run on a state whose store is fenced
//! with the lease's token ([`AppState::fenced`]), so should this replica
//! stall past its lease (a pause, a lost network) and another take over,
//! every write it still attempts is refused by the database. A renewal
//! that fails, times out or finds another holder stops the loops at once;
//! between the lease running out by this process's clock and the election
//! loop noticing, the loops skip their passes ([`AppState::leads`]). A
//! renewal or takeover that finds the lease row locked gives up at once
//! ([`StoreError::Busy`]) and is tried again next round: a replica frozen
//! inside a fenced write holds that lock until PostgreSQL ends its
//! session (see [`flotilla_store::leases`]), and must not stall the
//! others meanwhile.
//!
//! SQLite is one server: a second one started on the same file while the
//! first holds the lease refuses to start ([`claim_single`]).

use std::time::Duration;

use anyhow::bail;
use chrono::Duration as ChronoDuration;
use flotilla_store::leases::{Lease, LEADER};
use flotilla_store::{Store, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::state::replica_id;
use crate::state::{AppState, Leadership};

/// The shortest wait between two tries for the lease.
const MIN_TRY_EVERY: Duration = Duration::from_millis(100);

/// Whether the replica `holder` (see [`replica_id`]) ran on this host and
/// its process has ended, so that its lease need not be waited out (a
/// server killed with SIGKILL, then restarted). Unknown: not gone.
fn holder_is_gone(holder: &str) -> bool {
    let mut parts = holder.rsplitn(3, '-');
    let (Some(_suffix), Some(pid), Some(host)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    let mine = replica_id();
    let my_host = mine.rsplitn(3, '-').nth(2).unwrap_or_default();
    let proc = std::path::Path::new("/proc");
    host == my_host
        && pid != std::process::id()
        && proc.join("self").exists()
        && !proc.join(pid.to_string()).exists()
}

fn ttl_of(d: Duration) -> ChronoDuration {
    ChronoDuration::from_std(d).unwrap_or(ChronoDuration::seconds(5))
}

/// SQLite runs one server: takes the leader lease for `me` before serving,
/// waiting up to two lease lifetimes for one left by a server that ended
/// without giving it back (a crash); fails when another server keeps
/// renewing it.
pub async fn claim_single(store: &Store, me: &str, ttl: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + ttl * 2 + MIN_TRY_EVERY;
    let mut told = false;
    loop {
        let now = chrono::Utc::now();
        let lease = match store.acquire_lease(LEADER, me, ttl_of(ttl), now).await {
            Ok(lease) => lease,
            // A file lock held a moment too long (a loaded machine, another
            // process on the file): a server that gave up here would leave
            // `up` without its API. Tried again until the deadline.
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                tracing::warn!(error = %e, "the leader lease could not be read yet; trying again");
                tokio::time::sleep(MIN_TRY_EVERY).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if lease.held_by(me, now) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "another flotilla server ({}) is running on this SQLite database; SQLite runs \
                 one server: stop the other one, or use PostgreSQL (--database-url postgres://…) \
                 to run several",
                lease.holder
            );
        }
        if holder_is_gone(&lease.holder) {
            let taken = store
                .take_over_lease(LEADER, &lease.holder, me, ttl_of(ttl), now)
                .await?;
            if taken.held_by(me, now) {
                tracing::info!(previous = %lease.holder, "took the leader lease over from a server that ended without giving it back");
                return Ok(());
            }
            continue;
        }
        if !told {
            tracing::warn!(holder = %lease.holder, "the SQLite database's leader lease is held; waiting for it to run out");
            told = true;
        }
        tokio::time::sleep((ttl / 3).max(MIN_TRY_EVERY)).await;
    }
}

/// The loops of one term, running on the fenced state.
struct Term {
    token: i64,
    tasks: Vec<JoinHandle<()>>,
}

impl Term {
    fn start(st: &AppState, token: i64, tick: Duration) -> Self {
        let fenced = st.fenced(token);
        Self {
            token,
            tasks: vec![
                tokio::spawn(crate::reconcile::run(fenced.clone(), tick)),
                tokio::spawn(crate::metering::run(fenced.clone(), tick)),
                tokio::spawn(crate::nodepools::run(fenced.clone(), tick)),
                tokio::spawn(crate::reconciliation::run(fenced.clone())),
                tokio::spawn(crate::endpoints::run(fenced, tick)),
            ],
        }
    }

    /// Cancels the loops and waits until they are gone. Every pass may be
    /// cut at any line: what it committed stays, the rest is redone by
    /// the next leader.
    async fn stop(self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }

    /// Waits for the loops to return (they watch the shutdown signal).
    async fn join(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// What the replica is after one try for the lease.
fn follower_of(lease: &Lease, now: chrono::DateTime<chrono::Utc>) -> Leadership {
    Leadership::Follower {
        leader: (lease.expires_at > now).then(|| lease.holder.clone()),
    }
}

/// The election loop of replica `me`; runs the control loops (each pass at
/// least every `tick`) while this replica leads. Returns at shutdown, once
/// the loops have returned, after giving the lease back.
pub async fn run(st: AppState, tick: Duration, me: String) {
    let ttl = st.config().leader_lease();
    let every = (ttl / 3).max(MIN_TRY_EVERY);
    let mut shutdown = st.shutdown_signal();
    let mut term: Option<Term> = None;
    loop {
        if *shutdown.borrow() {
            break;
        }
        let sent = Instant::now();
        let now = st.now();
        // A renewal slower than a third of the lease is as good as lost:
        // by the time it returned the lease might have run out.
        let tried = tokio::time::timeout(
            every,
            st.store().acquire_lease(LEADER, &me, ttl_of(ttl), now),
        )
        .await;
        match tried {
            Ok(Ok(lease)) if lease.held_by(&me, now) => {
                let valid_until = sent + ttl;
                st.set_leadership(Leadership::Leader {
                    token: lease.token,
                    valid_until,
                });
                if term.as_ref().map(|t| t.token) != Some(lease.token) {
                    if let Some(old) = term.take() {
                        old.stop().await;
                    }
                    tracing::info!(replica = %me, token = lease.token, "leader lease taken: running the control loops");
                    let mut started = Term::start(&st, lease.token, tick);
                    started.tasks.extend(hold_lease_lock_hook(&st, lease.token));
                    term = Some(started);
                }
            }
            Ok(Ok(lease)) => {
                if let Some(old) = term.take() {
                    tracing::warn!(replica = %me, holder = %lease.holder, "leader lease lost: stopping the control loops");
                    old.stop().await;
                }
                st.set_leadership(follower_of(&lease, now));
            }
            // The row stayed locked past the lease's lock timeout, most
            // likely by this replica's own fenced writes: the lease stays
            // ours until `valid_until` (the loops skip their passes after
            // that), so this is only "not renewed this round".
            Ok(Err(StoreError::Busy(e))) if term.is_some() && st.leads() => {
                tracing::debug!(replica = %me, error = %e, "leader lease row busy: renewing next round");
            }
            Ok(Err(e)) => {
                if let Some(old) = term.take() {
                    tracing::warn!(replica = %me, error = %e, "leader lease not renewed: stopping the control loops");
                    old.stop().await;
                } else {
                    // A takeover that found the row locked (a holder stalled
                    // inside a fenced write) gave up at once: tried again
                    // next round, once PostgreSQL ended the stalled session.
                    tracing::debug!(replica = %me, error = %e, "cannot take or read the leader lease");
                }
                st.set_leadership(Leadership::Follower { leader: None });
            }
            Err(_) => {
                if let Some(old) = term.take() {
                    tracing::warn!(replica = %me, "leader lease renewal timed out: stopping the control loops");
                    old.stop().await;
                }
                st.set_leadership(Leadership::Follower { leader: None });
            }
        }
        let next = sent + every;
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = shutdown.changed() => {}
        }
    }
    if let Some(t) = term.take() {
        t.join().await;
        match st.store().release_lease(LEADER, &me).await {
            Ok(true) => tracing::info!(replica = %me, "leader lease given back"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(replica = %me, error = %e, "could not give the leader lease back")
            }
        }
    }
    st.set_leadership(Leadership::Follower { leader: None });
}

/// Test hook, in debug builds only (release builds have none): with
/// `FLOTILLA_TEST_HOLD_LEASE_LOCK=PATH`, a leader that sees the file PATH
/// appear opens a fenced write transaction (which share-locks the lease
/// row on PostgreSQL), creates `PATH.held`, and keeps the transaction open
/// until PATH is gone: a leader stopped inside a fenced write, as the
/// other replicas see it, at a moment a test chooses (crates/cli/tests/ha.rs).
#[cfg(debug_assertions)]
fn hold_lease_lock_hook(st: &AppState, token: i64) -> Option<JoinHandle<()>> {
    let path = std::path::PathBuf::from(std::env::var_os("FLOTILLA_TEST_HOLD_LEASE_LOCK")?);
    let store = st.fenced(token).store().clone();
    Some(tokio::spawn(async move {
        let exists = |p: std::path::PathBuf| async move { tokio::fs::metadata(p).await.is_ok() };
        while !exists(path.clone()).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut held = path.clone().into_os_string();
        held.push(".held");
        let r = store
            .hold_write_transaction(async {
                tracing::warn!(
                    token,
                    "test hook: holding the leader lease row in a fenced transaction"
                );
                let _ = tokio::fs::write(&held, b"").await;
                while exists(path.clone()).await {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
        match r {
            Ok(()) => tracing::warn!(token, "test hook: lease row released"),
            Err(e) => tracing::warn!(token, error = %e, "test hook: the held transaction failed"),
        }
    }))
}

#[cfg(not(debug_assertions))]
fn hold_lease_lock_hook(_st: &AppState, _token: i64) -> Option<JoinHandle<()>> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ids_differ_within_one_process() {
        let (a, b) = (replica_id(), replica_id());
        assert!(a.contains(&std::process::id().to_string()), "{a}");
        // Random suffixes: equal with probability 1/65536; two tries.
        assert!(a != b || replica_id() != a);
    }

    #[test]
    fn only_an_ended_process_on_this_host_is_gone() {
        let me = replica_id();
        let host = me.rsplitn(3, '-').nth(2).unwrap().to_string();
        assert!(!holder_is_gone(&me), "this process runs");
        // Beyond the largest pid Linux hands out: no such process.
        assert!(holder_is_gone(&format!("{host}-4294967295-abcd")));
        assert!(!holder_is_gone("elsewhere.example-4294967295-abcd"));
        assert!(!holder_is_gone("garbage"));
    }

    #[test]
    fn a_follower_names_the_leader_only_while_its_lease_is_current() {
        let now = chrono::Utc::now();
        let lease = Lease {
            name: LEADER.into(),
            holder: "r1".into(),
            token: 3,
            expires_at: now + ChronoDuration::seconds(1),
            acquired_at: now,
        };
        assert_eq!(
            follower_of(&lease, now),
            Leadership::Follower {
                leader: Some("r1".into())
            }
        );
        assert_eq!(
            follower_of(&lease, now + ChronoDuration::seconds(2)),
            Leadership::Follower { leader: None }
        );
    }
}
