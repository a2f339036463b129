//! What the instance and job tables share. An instance is work of one
//! member and a job a gang of instances; each has a row with a tenant and
//! a state, and an append-only table of the transitions it went through.
//! Paging those rows and writing and reading those transitions is written
//! once, here, for both. (The one queue the scheduler reads over both
//! kinds is [`crate::waiting`]; it builds on this module and on the two
//! tables' own, which build on this one.)

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
    /// [`Store::set_work_reason`] for one kind of work.
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
            .execute(self.writer())
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
        // Only the filters given are written into the statement, so the
        // database can walk the index that matches them in id order and
        // stop after one page: `(tenant_id, state, id)`, `(tenant_id,
        // id)`, `(state, id)` or the primary key. (`$2 = '' OR tenant_id =
        // $2` hides that choice from the planner: it walked the primary key
        // and filtered, reading every other tenant's rows on the way.)
        let mut filter = String::new();
        let mut next = 2;
        for (column, value) in [("tenant_id", only.map(|t| t.as_str())), ("state", state)] {
            if value.is_some() {
                filter.push_str(&format!("{column} = ${next} AND "));
                next += 1;
            }
        }
        let sql = format!(
            "SELECT * FROM {} WHERE {filter}id > $1 ORDER BY id LIMIT ${next}",
            table.name()
        );
        let mut q = sqlx::query(&sql).bind(page.after_or_empty());
        for value in [only.map(|t| t.as_str()), state].into_iter().flatten() {
            q = q.bind(value);
        }
        Ok(q.bind(page.fetch()).fetch_all(self.pool()).await?)
    }

    /// The transitions of the works `ids` (a page: at most
    /// [`PageReq`]'s 1,000), oldest first, by work id; one query for all
    /// of them, each read through the events' primary key. (A range from
    /// the lowest to the highest id read the events of every other work
    /// created between them, other tenants' included.)
    pub(crate) async fn transitions<'a>(
        &self,
        table: WorkTable,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<HashMap<String, Vec<Transition>>> {
        let mut out: HashMap<String, Vec<Transition>> = ids
            .into_iter()
            .map(|id| (id.to_string(), Vec::new()))
            .collect();
        if out.is_empty() {
            return Ok(out);
        }
        let (events, key) = table.events();
        let sql = match self.backend() {
            // PostgreSQL prices `{key} IN (100 values)` through the key as
            // a hundred separate descents, dearer than reading the whole
            // table until that holds some 20,000 events: with 10,000 it
            // read all of them for every page (1-2 ms a list, where the
            // key takes 0.2). A lateral read per work is a loop over the
            // key at any size.
            crate::Backend::Postgres => {
                let values = (1..=out.len())
                    .map(|n| format!("(${n})"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(
                    "SELECT w.id AS work_id, e.state, e.reason, e.at FROM (VALUES {values}) AS w (id) \
                     CROSS JOIN LATERAL (SELECT seq, state, reason, at FROM {events} \
                     WHERE {key} = w.id ORDER BY seq) AS e ORDER BY w.id, e.seq"
                )
            }
            // SQLite looks each value of an `IN` list up in the key.
            crate::Backend::Sqlite => {
                let params = (1..=out.len())
                    .map(|n| format!("${n}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(
                    "SELECT {key} AS work_id, state, reason, at FROM {events} \
                     WHERE {key} IN ({params}) ORDER BY {key}, seq"
                )
            }
        };
        let mut q = sqlx::query(&sql);
        for id in out.keys() {
            q = q.bind(id.clone());
        }
        let rows = q.fetch_all(self.pool()).await?;
        for r in &rows {
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
