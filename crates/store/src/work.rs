//! What the instance and job tables share. An instance is work of one
//! member and a job a gang of instances; each has a row with a tenant and
//! a state, and an append-only table of the transitions it went through.
//! Paging those rows and writing and reading those transitions is written
//! once, here, for both.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use flotilla_core::id::{InstanceId, JobId};
use flotilla_core::instance::InstanceState;
use flotilla_core::job::JobState;

use crate::{at, ms, PageReq, Result, Store};

/// The tables that hold work: a closed set, so a table name is never
/// built from input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkTable {
    Instances,
    Jobs,
}

impl WorkTable {
    fn name(self) -> &'static str {
        match self {
            WorkTable::Instances => "instances",
            WorkTable::Jobs => "jobs",
        }
    }

    /// Its transitions' table and the column naming the work there.
    fn events(self) -> (&'static str, &'static str) {
        match self {
            WorkTable::Instances => ("instance_events", "instance_id"),
            WorkTable::Jobs => ("job_events", "job_id"),
        }
    }
}

/// One recorded transition, its state still the stored name: the caller
/// parses it into its own kind of state.
#[derive(Debug, Clone)]
pub(crate) struct Transition {
    pub state: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// An id of work, and which table and states go with it.
pub(crate) trait WorkKey {
    /// The table its rows are in.
    const TABLE: WorkTable;
    /// Its kind of state.
    type State: Copy;
    /// The state it waits in before it is placed.
    const WAITING: &'static str;
    /// The id as stored.
    fn key(&self) -> &str;
    /// A state's stored name.
    fn state_name(state: Self::State) -> &'static str;
}

impl WorkKey for InstanceId {
    const TABLE: WorkTable = WorkTable::Instances;
    const WAITING: &'static str = "pending";
    type State = InstanceState;
    fn key(&self) -> &str {
        self.as_str()
    }
    fn state_name(state: InstanceState) -> &'static str {
        state.as_str()
    }
}

impl WorkKey for JobId {
    const TABLE: WorkTable = WorkTable::Jobs;
    const WAITING: &'static str = "queued";
    type State = JobState;
    fn key(&self) -> &str {
        self.as_str()
    }
    fn state_name(state: JobState) -> &'static str {
        state.as_str()
    }
}

/// Appends a transition of work `id` inside `tx`, numbered after the last.
pub(crate) async fn add_event<K: WorkKey>(
    tx: &mut Transaction<'static, Any>,
    id: &K,
    state: K::State,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<()> {
    let (events, key) = K::TABLE.events();
    let sql = format!(
        "INSERT INTO {events} ({key}, seq, state, reason, at) \
         SELECT $1, COALESCE(MAX(seq), -1) + 1, $2, $3, $4 FROM {events} WHERE {key} = $1"
    );
    sqlx::query(&sql)
        .bind(id.key())
        .bind(K::state_name(state))
        .bind(reason)
        .bind(ms(now))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

impl Store {
    /// Updates why waiting work is not placed yet; nothing when it has
    /// left its waiting state meanwhile.
    pub(crate) async fn set_wait_reason<K: WorkKey>(
        &self,
        id: &K,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let sql = format!(
            "UPDATE {} SET state_reason = $1, updated_at = $2 WHERE id = $3 AND state = $4",
            K::TABLE.name()
        );
        sqlx::query(&sql)
            .bind(reason)
            .bind(ms(now))
            .bind(id.key())
            .bind(K::WAITING)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// A page of work rows by id, optionally of one tenant and in one state
    /// (the state's stored name), over-fetched by one to learn whether a
    /// next page exists.
    pub(crate) async fn work_page(
        &self,
        table: WorkTable,
        only: Option<&flotilla_core::id::TenantId>,
        state: Option<&str>,
        page: &PageReq,
    ) -> Result<Vec<AnyRow>> {
        let sql = format!(
            "SELECT * FROM {} WHERE id > $1 AND ($2 = '' OR tenant_id = $2) AND ($3 = '' OR state = $3) \
             ORDER BY id LIMIT $4",
            table.name()
        );
        Ok(sqlx::query(&sql)
            .bind(page.after_or_empty())
            .bind(only.map(|t| t.as_str()).unwrap_or(""))
            .bind(state.unwrap_or(""))
            .bind(page.fetch())
            .fetch_all(self.pool())
            .await?)
    }

    /// The transitions of the works `ids` (sorted), oldest first, by work
    /// id; one query over their id range rather than one per work.
    pub(crate) async fn transitions<'a>(
        &self,
        table: WorkTable,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<HashMap<String, Vec<Transition>>> {
        let mut out: HashMap<String, Vec<Transition>> = ids
            .into_iter()
            .map(|id| (id.to_string(), Vec::new()))
            .collect();
        let (Some(lo), Some(hi)) = (out.keys().min(), out.keys().max()) else {
            return Ok(out);
        };
        let (events, key) = table.events();
        let sql = format!(
            "SELECT {key} AS work_id, state, reason, at FROM {events} \
             WHERE {key} >= $1 AND {key} <= $2 ORDER BY {key}, seq"
        );
        let rows = sqlx::query(&sql)
            .bind(lo.clone())
            .bind(hi.clone())
            .fetch_all(self.pool())
            .await?;
        for r in &rows {
            // The range may hold work of other tenants or states: skip it.
            let Some(list) = out.get_mut(&r.try_get::<String, _>("work_id")?) else {
                continue;
            };
            list.push(Transition {
                state: r.try_get("state")?,
                reason: r.try_get("reason")?,
                at: at(r.try_get("at")?),
            });
        }
        Ok(out)
    }
}
