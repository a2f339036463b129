//! Serverless endpoints: the spec at its revision, the gateway's last
//! demand signals, the autoscaler's last decision, and the replica
//! instances with their revision, port, readiness and draining marks. The
//! route table the gateway polls is read from here.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use flotilla_core::api::PublishedPort;
use flotilla_core::endpoint::{Endpoint, EndpointReplica, EndpointSpec};
use flotilla_core::gateway::{EndpointRoute, EndpointSignals, ReplicaRoute, RouteTable};
use flotilla_core::id::{EndpointId, InstanceId, TenantId};
use flotilla_core::instance::{ImageSpec, InstanceState};
use flotilla_core::queue_trigger::TriggerStatus;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::instances::opt_json;
use crate::{at, json, ms, to_json, PageOf, PageReq, Result, Store, StoreError};

/// The host replicas that run as processes are reached at. Nodes do not
/// advertise an address yet, so they are reached on the loopback: the
/// gateway must run on the replica's machine (as `flotilla up` does). A
/// replica in a container is reached where its node published its port
/// (the node's `--public-host`).
pub const REPLICA_HOST: &str = "127.0.0.1";

/// One replica row with its instance's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRow {
    /// The instance.
    pub instance_id: InstanceId,
    /// The endpoint.
    pub endpoint_id: EndpointId,
    /// The revision it runs.
    pub revision: u32,
    /// Its `PORT`.
    pub port: u16,
    /// When its readiness probe first passed.
    pub ready_at: Option<DateTime<Utc>>,
    /// When it was taken out of rotation.
    pub draining_at: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// The instance's state.
    pub state: InstanceState,
    /// A stop was asked for.
    pub stop_requested: bool,
    /// Where its node published the port it serves on, when it runs in a
    /// container and the container runs.
    pub published_url: Option<String>,
}

impl ReplicaRow {
    /// Not ended and not being stopped.
    pub fn is_live(&self) -> bool {
        !self.state.is_terminal() && !self.stop_requested
    }

    /// Takes traffic, or finishes what it has: running, probed ready,
    /// not being stopped.
    pub fn is_ready(&self) -> bool {
        self.is_live() && self.state == InstanceState::Running && self.ready_at.is_some()
    }

    /// Its base URL: the published port of its container, or its port on
    /// the loopback.
    pub fn url(&self) -> String {
        if let Some(url) = &self.published_url {
            return url.clone();
        }
        format!("http://{REPLICA_HOST}:{}", self.port)
    }
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
}

fn small(v: i64) -> u32 {
    v.clamp(0, i64::from(u32::MAX)) as u32
}

fn replica_row(r: &AnyRow) -> Result<ReplicaRow> {
    let state: String = r.try_get("state")?;
    Ok(ReplicaRow {
        instance_id: InstanceId::from_trusted(r.try_get("instance_id")?),
        endpoint_id: EndpointId::from_trusted(r.try_get("endpoint_id")?),
        revision: small(r.try_get("revision")?),
        port: r.try_get::<i64, _>("port")?.clamp(0, i64::from(u16::MAX)) as u16,
        ready_at: r.try_get::<Option<i64>, _>("ready_at")?.map(at),
        draining_at: r.try_get::<Option<i64>, _>("draining_at")?.map(at),
        created_at: at(r.try_get("created_at")?),
        state: InstanceState::parse(&state).ok_or_else(|| corrupt("instance state", &state))?,
        stop_requested: r.try_get::<i64, _>("stop_requested")? != 0,
        published_url: published_url(r)?,
    })
}

/// The URL of the port a container replica serves on (the first of its
/// image's ports), once its node published it.
fn published_url(r: &AnyRow) -> Result<Option<String>> {
    let Some(image) = opt_json::<ImageSpec>(r, "image")? else {
        return Ok(None);
    };
    let published: Vec<PublishedPort> = opt_json(r, "published_ports")?.unwrap_or_default();
    Ok(image.ports.first().and_then(|served| {
        published
            .into_iter()
            .find(|p| p.container_port == *served)
            .map(|p| p.url)
    }))
}

const REPLICAS: &str = "SELECT r.instance_id AS instance_id, r.endpoint_id AS endpoint_id, \
     r.revision AS revision, r.port AS port, r.ready_at AS ready_at, r.draining_at AS draining_at, \
     r.created_at AS created_at, i.state AS state, i.stop_requested AS stop_requested, \
     i.image AS image, i.published_ports AS published_ports \
     FROM endpoint_replicas r JOIN instances i ON i.id = r.instance_id";

impl Store {
    fn endpoint_row(&self, row: &AnyRow, replicas: &[ReplicaRow]) -> Result<Endpoint> {
        let spec: EndpointSpec = json(&row.try_get::<String, _>("spec")?, "endpoint spec")?;
        let signals: Option<String> = row.try_get("signals")?;
        let signals = signals
            .map(|s| json::<EndpointSignals>(&s, "endpoint signals"))
            .transpose()?;
        let custom: Option<String> = row.try_get("custom_metric")?;
        let custom_metric = custom
            .map(|s| json::<f64>(&s, "custom metric"))
            .transpose()?;
        let desired: Option<i64> = row.try_get("desired")?;
        let triggers: Option<String> = row.try_get("triggers")?;
        let triggers = triggers
            .map(|s| json::<Vec<TriggerStatus>>(&s, "endpoint triggers"))
            .transpose()?
            .unwrap_or_default();
        Ok(Endpoint {
            id: EndpointId::from_trusted(row.try_get("id")?),
            tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
            name: row.try_get("name")?,
            revision: small(row.try_get("revision")?),
            spec,
            desired_replicas: desired.map(small),
            reason: row.try_get("reason")?,
            replicas: replicas
                .iter()
                .filter(|r| !r.state.is_terminal())
                .map(|r| EndpointReplica {
                    instance_id: r.instance_id.clone(),
                    revision: r.revision,
                    state: r.state,
                    url: r.url(),
                    ready: r.is_ready(),
                    draining: r.draining_at.is_some() || r.stop_requested,
                })
                .collect(),
            signals,
            custom_metric,
            last_request_at: Some(at(row.try_get("last_request_at")?)),
            triggers,
            deleting: row.try_get::<Option<i64>, _>("deleted_at")?.is_some(),
            created_at: at(row.try_get("created_at")?),
            updated_at: at(row.try_get("updated_at")?),
        })
    }

    /// Stores a new endpoint at revision 1. A name taken by another live
    /// endpoint of the tenant is [`StoreError::AlreadyExists`].
    pub async fn create_endpoint(
        &self,
        id: &EndpointId,
        tenant: &TenantId,
        spec: &EndpointSpec,
        now: DateTime<Utc>,
    ) -> Result<Endpoint> {
        sqlx::query(
            "INSERT INTO endpoints (id, tenant_id, name, spec, revision, last_request_at, \
             created_at, updated_at) VALUES ($1, $2, $3, $4, 1, $5, $5, $5)",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .bind(&spec.name)
        .bind(to_json(spec))
        .bind(ms(now))
        .execute(self.writer())
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::AlreadyExists(_) => {
                StoreError::AlreadyExists(format!("endpoint `{}`", spec.name))
            }
            other => other,
        })?;
        self.endpoint(id).await
    }

    /// An endpoint by id (deleted ones too, while their row remains).
    pub async fn endpoint(&self, id: &EndpointId) -> Result<Endpoint> {
        let row = sqlx::query("SELECT * FROM endpoints WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("endpoint"))?;
        let replicas = self.endpoint_replicas(id).await?;
        self.endpoint_row(&row, &replicas)
    }

    /// When an endpoint was deleted; `None` while it is live.
    pub async fn endpoint_deleted_at(&self, id: &EndpointId) -> Result<Option<DateTime<Utc>>> {
        let row = sqlx::query("SELECT deleted_at FROM endpoints WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("endpoint"))?;
        Ok(row.try_get::<Option<i64>, _>("deleted_at")?.map(at))
    }

    /// Live endpoints, optionally of one tenant, by id.
    pub async fn list_endpoints(
        &self,
        only: Option<&TenantId>,
        page: &PageReq,
    ) -> Result<PageOf<Endpoint>> {
        let rows = self
            .page_rows(
                "SELECT * FROM endpoints WHERE deleted_at IS NULL AND id > $1 \
             AND ($2 = '' OR tenant_id = $2) ORDER BY id LIMIT $3",
                only,
                page,
            )
            .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            let id = EndpointId::from_trusted(row.try_get("id")?);
            let replicas = self.endpoint_replicas(&id).await?;
            items.push(self.endpoint_row(row, &replicas)?);
        }
        Ok(PageOf::from_overfetch(items, page, |e| e.id.to_string()))
    }

    /// Every endpoint the autoscaler must look at: live ones, and deleted
    /// ones whose replicas have not all ended.
    pub async fn endpoint_ids_to_scale(&self) -> Result<Vec<EndpointId>> {
        let rows = sqlx::query(
            "SELECT e.id AS id FROM endpoints e WHERE e.deleted_at IS NULL OR EXISTS ( \
             SELECT 1 FROM endpoint_replicas r JOIN instances i ON i.id = r.instance_id \
             WHERE r.endpoint_id = e.id AND i.state NOT IN ('succeeded', 'failed', 'stopped')) \
             ORDER BY e.created_at, e.id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| Ok(EndpointId::from_trusted(r.try_get("id")?)))
            .collect()
    }

    /// Replaces the spec; `bump` moves to the next revision.
    pub async fn update_endpoint(
        &self,
        id: &EndpointId,
        spec: &EndpointSpec,
        bump: bool,
        now: DateTime<Utc>,
    ) -> Result<Endpoint> {
        let done = sqlx::query(
            "UPDATE endpoints SET spec = $1, revision = revision + $2, updated_at = $3 \
             WHERE id = $4 AND deleted_at IS NULL",
        )
        .bind(to_json(spec))
        .bind(i64::from(bump))
        .bind(ms(now))
        .bind(id.as_str())
        .execute(self.writer())
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("endpoint"));
        }
        self.endpoint(id).await
    }

    /// Marks an endpoint deleted: its name is free, the autoscaler drains
    /// and stops its replicas.
    pub async fn delete_endpoint(&self, id: &EndpointId, now: DateTime<Utc>) -> Result<Endpoint> {
        sqlx::query(
            "UPDATE endpoints SET deleted_at = $1, updated_at = $1 WHERE id = $2 AND deleted_at IS NULL",
        )
        .bind(ms(now))
        .bind(id.as_str())
        .execute(self.writer())
        .await?;
        self.endpoint(id).await
    }

    /// Records a gateway's demand signals. A request seen (a new arrival,
    /// or anything in flight or queued) moves `last_request_at` to `now`,
    /// which the idle window counts from.
    pub async fn set_endpoint_signals(
        &self,
        id: &EndpointId,
        s: &EndpointSignals,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let row = sqlx::query("SELECT signals FROM endpoints WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("endpoint"))?;
        let prev: Option<String> = row.try_get("signals")?;
        let prev_total = prev
            .and_then(|p| serde_json::from_str::<EndpointSignals>(&p).ok())
            .map(|p| p.requests_total);
        let active = s.in_flight > 0 || s.queued > 0 || prev_total != Some(s.requests_total);
        let active = active && !(prev_total.is_none() && s.requests_total == 0);
        let q = if active {
            sqlx::query("UPDATE endpoints SET signals = $1, last_request_at = $2 WHERE id = $3")
                .bind(to_json(s))
                .bind(ms(now))
        } else {
            sqlx::query("UPDATE endpoints SET signals = $1 WHERE id = $2").bind(to_json(s))
        };
        q.bind(id.as_str()).execute(self.writer()).await?;
        Ok(())
    }

    /// Records a custom metric.
    pub async fn set_endpoint_custom_metric(&self, id: &EndpointId, value: f64) -> Result<()> {
        sqlx::query("UPDATE endpoints SET custom_metric = $1 WHERE id = $2")
            .bind(to_json(&value))
            .bind(id.as_str())
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Records what the endpoint's queue triggers read. Messages waiting
    /// (`demand`) count as activity: `last_request_at` moves to `now`, so
    /// the idle window runs from when the queues were last seen drained.
    pub async fn set_endpoint_triggers(
        &self,
        id: &EndpointId,
        triggers: &[TriggerStatus],
        demand: bool,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let value = (!triggers.is_empty()).then(|| to_json(&triggers));
        let q = if demand {
            sqlx::query("UPDATE endpoints SET triggers = $1, last_request_at = $2 WHERE id = $3")
                .bind(value)
                .bind(ms(now))
        } else {
            sqlx::query("UPDATE endpoints SET triggers = $1 WHERE id = $2").bind(value)
        };
        q.bind(id.as_str()).execute(self.writer()).await?;
        Ok(())
    }

    /// The last trigger reads of every live endpoint that has queue
    /// triggers, by endpoint id (for `/metrics`).
    pub async fn endpoint_trigger_statuses(&self) -> Result<Vec<(EndpointId, Vec<TriggerStatus>)>> {
        let rows = sqlx::query(
            "SELECT id, triggers FROM endpoints WHERE deleted_at IS NULL AND triggers IS NOT NULL \
             ORDER BY id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    EndpointId::from_trusted(r.try_get("id")?),
                    json(&r.try_get::<String, _>("triggers")?, "endpoint triggers")?,
                ))
            })
            .collect()
    }

    /// Records the autoscaler's decision.
    pub async fn set_endpoint_decision(
        &self,
        id: &EndpointId,
        desired: u32,
        reason: &str,
    ) -> Result<()> {
        sqlx::query("UPDATE endpoints SET desired = $1, reason = $2 WHERE id = $3")
            .bind(i64::from(desired))
            .bind(reason)
            .bind(id.as_str())
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Records that `instance` is a replica of `endpoint` at `revision`,
    /// listening on `port`.
    pub async fn add_endpoint_replica(
        &self,
        endpoint: &EndpointId,
        instance: &InstanceId,
        revision: u32,
        port: u16,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO endpoint_replicas (instance_id, endpoint_id, revision, port, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(instance.as_str())
        .bind(endpoint.as_str())
        .bind(i64::from(revision))
        .bind(i64::from(port))
        .bind(ms(now))
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// An endpoint's replicas, oldest first, ended ones included.
    pub async fn endpoint_replicas(&self, endpoint: &EndpointId) -> Result<Vec<ReplicaRow>> {
        let rows = sqlx::query(&format!(
            "{REPLICAS} WHERE r.endpoint_id = $1 ORDER BY r.created_at, r.instance_id"
        ))
        .bind(endpoint.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(replica_row).collect()
    }

    /// The replica an instance is, if it is one.
    pub async fn replica_of(&self, instance: &InstanceId) -> Result<Option<ReplicaRow>> {
        let row = sqlx::query(&format!("{REPLICAS} WHERE r.instance_id = $1"))
            .bind(instance.as_str())
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(replica_row).transpose()
    }

    /// The endpoint each of `instances` serves, for those that are
    /// replicas: one read for a metering page.
    pub async fn replica_endpoints(
        &self,
        instances: &[InstanceId],
    ) -> Result<BTreeMap<InstanceId, EndpointId>> {
        let mut out = BTreeMap::new();
        for chunk in instances.chunks(500) {
            let sql = format!(
                "SELECT instance_id, endpoint_id FROM endpoint_replicas WHERE instance_id IN ({})",
                crate::params(chunk.len())
            );
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(id.as_str());
            }
            for r in q.fetch_all(self.pool()).await? {
                out.insert(
                    InstanceId::from_trusted(r.try_get("instance_id")?),
                    EndpointId::from_trusted(r.try_get("endpoint_id")?),
                );
            }
        }
        Ok(out)
    }

    /// Ports of replicas not yet ended, so a new one gets another.
    pub async fn replica_ports_in_use(&self) -> Result<BTreeSet<u16>> {
        let rows = sqlx::query(&format!(
            "{REPLICAS} WHERE i.state NOT IN ('succeeded', 'failed', 'stopped')"
        ))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(|r| Ok(replica_row(r)?.port)).collect()
    }

    /// The replica passed its readiness probe (first time only).
    pub async fn mark_replica_ready(
        &self,
        instance: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE endpoint_replicas SET ready_at = $1 WHERE instance_id = $2 AND ready_at IS NULL",
        )
        .bind(ms(now))
        .bind(instance.as_str())
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// Takes the replica out of rotation (first time only).
    pub async fn mark_replica_draining(
        &self,
        instance: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE endpoint_replicas SET draining_at = $1 WHERE instance_id = $2 AND draining_at IS NULL",
        )
        .bind(ms(now))
        .bind(instance.as_str())
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// What the gateway routes by: every live endpoint, with its ready
    /// replicas (draining ones marked so).
    pub async fn route_table(&self) -> Result<RouteTable> {
        let rows = sqlx::query("SELECT * FROM endpoints WHERE deleted_at IS NULL ORDER BY id")
            .fetch_all(self.pool())
            .await?;
        let reps = sqlx::query(&format!(
            "{REPLICAS} WHERE i.state = 'running' AND i.stop_requested = 0 \
             AND r.ready_at IS NOT NULL ORDER BY r.created_at, r.instance_id"
        ))
        .fetch_all(self.pool())
        .await?;
        let mut by_ep: BTreeMap<String, Vec<ReplicaRoute>> = BTreeMap::new();
        for r in &reps {
            let r = replica_row(r)?;
            by_ep
                .entry(r.endpoint_id.to_string())
                .or_default()
                .push(ReplicaRoute {
                    url: r.url(),
                    instance_id: r.instance_id,
                    revision: r.revision,
                    draining: r.draining_at.is_some(),
                });
        }
        let mut endpoints = Vec::with_capacity(rows.len());
        for row in &rows {
            let spec: EndpointSpec = json(&row.try_get::<String, _>("spec")?, "endpoint spec")?;
            let id: String = row.try_get("id")?;
            endpoints.push(EndpointRoute {
                replicas: by_ep.remove(&id).unwrap_or_default(),
                id: EndpointId::from_trusted(id),
                tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
                name: spec.name,
                models: spec.models,
                balance: spec.balance,
                queue_limit: spec.queue_limit,
                queue_timeout_ms: spec.queue_timeout_ms,
                replica_concurrency: spec.replica_concurrency,
                rate_limit_rps: spec.rate_limit_rps,
            });
        }
        Ok(RouteTable { endpoints })
    }
}
