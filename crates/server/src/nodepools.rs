//! The node-pool loop: grows and shrinks node pools through a capacity
//! provider. Gather, then decide, then act, each pass:
//!
//! 1. Observe: a booting machine whose node registered in the pool has
//!    joined; a booting machine the provider failed (Nova's `ERROR` with
//!    "No valid host was found") is failed; a joined machine's node that
//!    runs nothing is idle since the first pass that saw it so; a spot
//!    machine the provider is taking back is cordoned and drained.
//! 2. Decide: the placement planner runs over the same snapshot the
//!    scheduling pass uses, and the work it could fit nowhere (`no fit`)
//!    that this pool's machines could host goes to the pure
//!    `flotilla_scale::nodepool::decide` with the pool's machines and
//!    bounds.
//! 3. Act: give machines back (cordon, check it is still empty, terminate,
//!    revoke its agent key), then ask for new ones, each recorded with a
//!    one-time join token before the provider is asked, so a crash between
//!    the two leaves a row the next pass cleans up after the boot timeout.
//!
//! Only the leader runs it, like every loop; every step is idempotent, so a
//! new leader carries on where the old one stopped.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_backends::capacity::{CapacityError, Join, MachineState as Cloud, ProvisionRequest};
use flotilla_core::id::NodeId;
use flotilla_core::nodepool::{NodePoolView, PoolMachineView};
use flotilla_scale::nodepool::{self, Phase, PoolDecision, Waiting, Why};
use flotilla_sched::Runtime;
use flotilla_store::capacity::{MachineState, NewMachine, PoolMachine};
use flotilla_store::StoreError;
use rand::RngCore;

use crate::auth::hash_secret;
pub use crate::config::{NodePoolConfig, PoolStatus};
use crate::state::AppState;

/// How long a pool waits after the provider refused a machine before it
/// asks again (quota exceeded, no capacity): asking every tick would only
/// hammer the cloud's API.
pub const PROVISION_BACKOFF: Duration = Duration::from_secs(30);

/// Why a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum NodePoolError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The provider failed.
    #[error("capacity provider: {0}")]
    Capacity(#[from] CapacityError),
}

fn ms_of(t: DateTime<Utc>) -> u64 {
    u64::try_from(t.timestamp_millis()).unwrap_or(0)
}

/// A one-time join token: `fjt_` and 32 random bytes in hex.
fn mint_join_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("fjt_{}", hex::encode(bytes))
}

/// The waiting work this pool's machines could host: queued work the
/// planner fits nowhere (its last plan while current, see
/// `crate::last_plan`), that asks for GPUs, allows the pool's GPU model
/// and runs on its runtime.
async fn waiting_work(st: &AppState, pool: &NodePoolConfig) -> Result<Vec<Waiting>, StoreError> {
    let plan = crate::schedule::current_plan(st).await?;
    let runtime = Runtime::from(pool.runtime);
    Ok(plan
        .unfit
        .iter()
        .filter(|u| {
            u.runtime == runtime
                && (u.models.is_empty()
                    || u.models
                        .iter()
                        .any(|m| m.eq_ignore_ascii_case(&pool.gpu_model)))
        })
        .map(|u| Waiting {
            members: u.members,
            gpus: u.gpus,
        })
        .collect())
}

/// One pass over one pool (see the module doc). Returns the decision.
pub async fn pass(st: &AppState, pool: &NodePoolConfig) -> Result<PoolDecision, NodePoolError> {
    let now = st.now();
    let now_ms = ms_of(now);
    let store = st.store();
    let nodes: BTreeMap<String, NodeId> = store
        .nodes_in_pool(&pool.name)
        .await?
        .into_iter()
        .map(|(id, name)| (name, id))
        .collect();
    let notices = match pool.provider.interruptions(now_ms).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(pool = %pool.name, error = %e, "cannot read interruption notices");
            Vec::new()
        }
    };

    // 1. Observe.
    let mut machines: Vec<PoolMachine> = Vec::new();
    for mut m in store.pool_machines(&pool.name).await? {
        match m.state {
            MachineState::Booting => {
                if let Some(node) = nodes.get(&m.name) {
                    store.mark_machine_joined(&m.name, node, now).await?;
                    tracing::info!(pool = %pool.name, machine = %m.name, node = %node, "node-pool machine joined");
                    m = store.pool_machine(&m.name).await?;
                } else if let Some(id) = m.machine_id.clone() {
                    let failed = match pool.provider.describe(now_ms, &id).await {
                        Ok(seen) => match seen.state {
                            Cloud::Failed { reason, .. } => Some(reason),
                            Cloud::Terminated => Some("terminated before it joined".to_string()),
                            Cloud::Provisioning | Cloud::Running => None,
                        },
                        Err(CapacityError::NotFound { .. }) => {
                            Some("the provider no longer knows it".to_string())
                        }
                        Err(e) => {
                            tracing::warn!(pool = %pool.name, machine = %m.name, error = %e, "cannot describe machine");
                            None
                        }
                    };
                    if let Some(reason) = failed {
                        tracing::warn!(pool = %pool.name, machine = %m.name, %reason, "node-pool machine failed");
                        store
                            .set_machine_state(&m.name, MachineState::Failed, Some(&reason), now)
                            .await?;
                        m.state = MachineState::Failed;
                    }
                }
            }
            MachineState::Joined => {
                let Some(node) = m.node_id.clone() else {
                    continue;
                };
                let notice = notices
                    .iter()
                    .find(|n| m.machine_id.as_deref() == Some(n.machine.as_str()));
                if let Some(n) = notice {
                    let reason = format!(
                        "spot interruption: the provider takes it back at {}",
                        DateTime::<Utc>::from_timestamp_millis(
                            i64::try_from(n.terminate_at_ms).unwrap_or(i64::MAX)
                        )
                        .map_or_else(|| n.terminate_at_ms.to_string(), |t| t.to_rfc3339())
                    );
                    store.set_node_cordoned(&node, true).await?;
                    store
                        .set_machine_state(&m.name, MachineState::Draining, Some(&reason), now)
                        .await?;
                    tracing::warn!(pool = %pool.name, machine = %m.name, %reason, "draining node-pool machine");
                    m.state = MachineState::Draining;
                    st.notify_change();
                } else {
                    let busy = store.live_instances_on(&node).await? > 0;
                    if busy && m.idle_since.is_some() {
                        store.set_machine_idle_since(&m.name, None).await?;
                        m.idle_since = None;
                    } else if !busy && m.idle_since.is_none() {
                        store.set_machine_idle_since(&m.name, Some(now)).await?;
                        m.idle_since = Some(now);
                    }
                }
            }
            MachineState::Draining => {
                let empty = match &m.node_id {
                    Some(node) => store.live_instances_on(node).await? == 0,
                    None => true,
                };
                if empty {
                    give_back(st, pool, &m, "drained").await?;
                }
                continue;
            }
            MachineState::Failed | MachineState::Terminated => {}
        }
        machines.push(m);
    }

    // 2. Decide.
    let waiting = waiting_work(st, pool).await?;
    let phases: Vec<nodepool::PoolMachine> = machines
        .iter()
        .filter_map(|m| {
            let phase = match m.state {
                MachineState::Booting => Phase::Booting {
                    since_ms: ms_of(m.created_at),
                },
                MachineState::Joined => Phase::Joined {
                    idle_since_ms: m.idle_since.map(ms_of),
                },
                MachineState::Failed => Phase::Failed,
                MachineState::Draining | MachineState::Terminated => return None,
            };
            Some(nodepool::PoolMachine {
                name: m.name.clone(),
                phase,
            })
        })
        .collect();
    let mut decision = nodepool::decide(now_ms, &pool.bounds, &waiting, &phases);

    // 3. Act.
    for t in &decision.terminate {
        let Some(m) = machines.iter().find(|m| m.name == t.name) else {
            continue;
        };
        if t.why == Why::Idle {
            if let Some(node) = &m.node_id {
                // Drain: no new work lands on it; then make sure none did
                // since the decision was gathered.
                store.set_node_cordoned(node, true).await?;
                if store.live_instances_on(node).await? > 0 {
                    store.set_node_cordoned(node, false).await?;
                    continue;
                }
            }
        }
        give_back(st, pool, m, t.why.label()).await?;
    }
    let backoff = {
        let s = pool.status.lock().unwrap_or_else(|e| e.into_inner());
        s.backoff_until.filter(|b| *b > now)
    };
    if decision.provision > 0 {
        if let Some(until) = backoff {
            decision.reason = format!(
                "{}; not asking before {} after a refusal",
                decision.reason,
                until.to_rfc3339()
            );
            decision.provision = 0;
        }
    }
    for _ in 0..decision.provision {
        if let Err(e) = provision_one(st, pool, now).await {
            let until = now
                + chrono::Duration::from_std(PROVISION_BACKOFF)
                    .unwrap_or(chrono::Duration::seconds(30));
            let mut s = pool.status.lock().unwrap_or_else(|e| e.into_inner());
            s.backoff_until = Some(until);
            decision.reason = format!("{}; provisioning refused: {e}", decision.reason);
            tracing::warn!(pool = %pool.name, error = %e, "node-pool machine refused");
            break;
        }
    }
    {
        let mut s = pool.status.lock().unwrap_or_else(|e| e.into_inner());
        if s.last_decision.as_deref() != Some(decision.reason.as_str()) {
            tracing::info!(pool = %pool.name, provision = decision.provision,
                terminate = decision.terminate.len(), reason = %decision.reason, "node-pool decision");
        }
        s.last_decision = Some(decision.reason.clone());
    }
    Ok(decision)
}

/// Records a machine and its join token, then asks the provider for it.
async fn provision_one(
    st: &AppState,
    pool: &NodePoolConfig,
    now: DateTime<Utc>,
) -> Result<(), NodePoolError> {
    let store = st.store();
    let tenant = store
        .tenant_by_name("default")
        .await?
        .ok_or(StoreError::NotFound("tenant default"))?;
    let (_, r) = st.ids();
    let name = format!("{}-{:010x}", pool.name, (r as u64) & 0xff_ffff_ffff);
    let token = mint_join_token();
    let ttl = chrono::Duration::from_std(pool.join_ttl).unwrap_or(chrono::Duration::minutes(30));
    store
        .add_pool_machine(
            &NewMachine {
                name: name.clone(),
                pool: pool.name.clone(),
                provider: pool.provider.kind().to_string(),
                instance_type: pool.instance_type.clone(),
                token_hash: hash_secret(&token),
                tenant_id: tenant.id,
                expires_at: now + ttl,
            },
            now,
        )
        .await?;
    let req = ProvisionRequest {
        name: name.clone(),
        instance_type: pool.instance_type.clone(),
        region: pool.region.clone(),
        spot: pool.spot,
        join: Some(Join {
            server_url: pool.join_url.clone(),
            token,
            tls_fingerprint: pool.join_fingerprint.clone(),
        }),
    };
    match pool.provider.provision(ms_of(now), &req).await {
        Ok(m) => {
            store.set_machine_id(&name, &m.id).await?;
            tracing::info!(pool = %pool.name, machine = %name, id = %m.id, provider = pool.provider.kind(), "node-pool machine requested");
            Ok(())
        }
        Err(e) => {
            store
                .set_machine_state(&name, MachineState::Failed, Some(&e.to_string()), now)
                .await?;
            Err(e.into())
        }
    }
}

/// Terminates a machine at its provider, records it, and revokes the agent
/// key its join token was traded for.
async fn give_back(
    st: &AppState,
    pool: &NodePoolConfig,
    m: &PoolMachine,
    why: &str,
) -> Result<(), NodePoolError> {
    let now = st.now();
    if let Some(node) = &m.node_id {
        st.store().set_node_cordoned(node, true).await?;
    }
    if let Some(id) = &m.machine_id {
        pool.provider.terminate(ms_of(now), id).await?;
    }
    st.store()
        .set_machine_state(&m.name, MachineState::Terminated, Some(why), now)
        .await?;
    st.store().revoke_machine_key(&m.name, now).await?;
    tracing::info!(pool = %pool.name, machine = %m.name, why, "node-pool machine given back");
    st.notify_change();
    Ok(())
}

/// What the API shows of `pool`.
pub async fn view(st: &AppState, pool: &NodePoolConfig) -> Result<NodePoolView, StoreError> {
    let machines = st.store().pool_machines(&pool.name).await?;
    let status = pool
        .status
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Ok(NodePoolView {
        name: pool.name.clone(),
        provider: pool.provider.kind().to_string(),
        instance_type: pool.instance_type.clone(),
        min: pool.bounds.min,
        max: pool.bounds.max,
        last_decision: status.last_decision,
        machines: machines
            .into_iter()
            .map(|m| PoolMachineView {
                name: m.name,
                state: m.state.as_str().to_string(),
                machine_id: m.machine_id,
                reason: m.reason,
                created_at: m.created_at,
                idle_since: m.idle_since,
            })
            .collect(),
    })
}

/// Runs a pass over every configured pool every `tick` while this replica
/// leads, until shutdown.
pub async fn run(st: AppState, tick: Duration) {
    let pools = st.config().node_pools.clone();
    if pools.is_empty() {
        return;
    }
    let mut shutdown = st.shutdown_signal();
    loop {
        if *shutdown.borrow() {
            return;
        }
        if st.leads() {
            for pool in &pools {
                if let Err(e) = pass(&st, pool).await {
                    tracing::warn!(pool = %pool.name, error = %e, "node-pool pass failed; retrying");
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.changed() => {}
        }
    }
}
