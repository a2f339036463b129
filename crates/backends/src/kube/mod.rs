//! The Kubernetes executor: Flotilla's placed work as Pods on a cluster
//! that runs the NVIDIA device plugin (the GPU operator), through the API
//! server with kube-rs.
//!
//! - **Inventory**: every Ready node, with its allocatable CPU, memory,
//!   `nvidia.com/gpu` and MIG resources read with GPU feature discovery's
//!   labels ([`inventory`]); the node pool is the value of a configurable
//!   node label.
//! - **Work**: each assignment becomes one Pod pinned to the placed node
//!   with the GPUs (or MIG devices) placement gave it, in its tenant's
//!   namespace, which is created on first use with a ResourceQuota and a
//!   NetworkPolicy that admits no other tenant ([`pods`]). A job's members
//!   are created together or not at all: members are held until every
//!   member placed on this cluster has been assigned, then created; if one
//!   create fails, the ones created are deleted and every member reports
//!   the failure.
//! - **Status**: one watch on Flotilla's pods in all namespaces
//!   (`kube::runtime::watcher`, which resumes an ended watch and relists
//!   after `410 Gone`) keeps a cache that `observe` reads ([`status`]).
//!   Pods deleted while nobody watched are noticed at the relist.
//! - **Logs** through the pods/log API; **stop** deletes the pod with the
//!   assignment's grace period; a pod the server no longer assigns is
//!   deleted (as an agent stops orphans).
//!
//! It never decides anything: where work runs and when it stops is the
//! server's; the cluster is the source of truth for what runs.

#[cfg(feature = "testing")]
pub mod fake;
pub mod inventory;
pub mod pods;
pub mod quantity;
pub mod status;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use flotilla_core::api::{
    Assignment, LogLine, LogStream, ObservedInstance, ObservedPhase, RegisterNode,
};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::InstanceId;
use flotilla_core::node::ExecutorKind;
use futures::future::BoxFuture;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ResourceQuota, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use serde::{Deserialize, Serialize};

use crate::executor::{Executor, ExecutorError};

/// How a pod is pinned to the node placement chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pinning {
    /// `spec.nodeName`: the pod skips the Kubernetes scheduler and goes
    /// straight to the node's kubelet, which admits it or fails it at once
    /// (`OutOfnvidia.com/gpu` when something else holds the GPUs), so a
    /// placement never waits unseen in Kubernetes' own queue.
    #[default]
    NodeName,
    /// A `kubernetes.io/hostname` node selector: the pod goes through the
    /// scheduler (taints, other workloads' requests, scheduler plugins)
    /// and waits `Pending` while the node is full.
    HostnameSelector,
}

/// How the executor uses the cluster. The server's `flotilla executor
/// kubernetes` reads it from its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeConfig {
    /// Only nodes matching this label selector are offered to Flotilla
    /// (e.g. `nvidia.com/gpu.present=true`); all Ready nodes when absent.
    pub node_selector: Option<String>,
    /// The node label whose value is the node's Flotilla pool.
    pub pool_label: String,
    /// The pool of nodes without that label (`default` when absent).
    pub default_pool: Option<String>,
    /// The region of every node; else `topology.kubernetes.io/region`.
    pub region: Option<String>,
    /// Tenant namespaces are this prefix and the tenant id.
    pub namespace_prefix: String,
    /// Where work without a tenant runs.
    pub shared_namespace: String,
    /// The ResourceQuota `hard` limits of each tenant namespace.
    pub tenant_quota: BTreeMap<String, String>,
    /// Namespaces whose pods may reach tenant pods (Flotilla's own, for
    /// the gateway); every other namespace is denied ingress.
    pub ingress_from_namespaces: Vec<String>,
    /// How pods are pinned to their node.
    pub pinning: Pinning,
}

impl Default for KubeConfig {
    fn default() -> Self {
        Self {
            node_selector: None,
            pool_label: "flotilla.dev/pool".into(),
            default_pool: None,
            region: None,
            namespace_prefix: "flotilla-".into(),
            shared_namespace: "flotilla-work".into(),
            tenant_quota: BTreeMap::from([
                ("pods".to_string(), "500".to_string()),
                ("requests.nvidia.com/gpu".to_string(), "64".to_string()),
            ]),
            ingress_from_namespaces: vec!["flotilla".into()],
            pinning: Pinning::NodeName,
        }
    }
}

/// The field manager of the executor's server-side applies.
const FIELD_MANAGER: &str = "flotilla";

/// A pod the executor saw go away, kept until the server stops assigning
/// its instance (as an agent reports finished work until then).
#[derive(Debug, Clone)]
struct Gone {
    node: String,
    observed: ObservedInstance,
}

impl Gone {
    /// An instance stopped before Flotilla created its pod: it ends as
    /// stopped, with `message` saying so, instead of waiting for a pod
    /// that will never come.
    fn never_started(node: &str, id: &InstanceId, now: DateTime<Utc>, message: &str) -> Self {
        Gone {
            node: node.to_string(),
            observed: ObservedInstance {
                instance_id: id.clone(),
                phase: ObservedPhase::Exited {
                    code: status::TERMINATED,
                    stopped: true,
                },
                at: now,
                started_at: None,
                message: Some(message.into()),
                container: None,
                weights_tier: None,
                limit_exceeded: None,
            },
        }
    }
}

/// An instance whose pod could not be created.
#[derive(Debug, Clone)]
struct Failed {
    node: String,
    reason: String,
    at: DateTime<Utc>,
}

/// A job member held until its gang is complete.
#[derive(Debug, Clone)]
struct Staged {
    node: String,
    assignment: Assignment,
    since: DateTime<Utc>,
}

/// Where the log of an instance was read up to, so that the next read
/// asks only for what is new (`sinceTime`) instead of the whole log.
#[derive(Debug, Clone)]
struct LogCursor {
    /// The next line's number.
    next_seq: u64,
    /// Timestamp of the last line read.
    last: DateTime<Utc>,
    /// How many lines read carried exactly `last`.
    at_last: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Flotilla's pods by instance, as the watch last saw them.
    pods: HashMap<InstanceId, (Pod, DateTime<Utc>)>,
    /// The watch has listed once: `pods` is the cluster's truth.
    synced: bool,
    /// Pods seen in the current relist, until it is done.
    relist: Option<HashMap<InstanceId, (Pod, DateTime<Utc>)>>,
    gone: HashMap<InstanceId, Gone>,
    failed: HashMap<InstanceId, Failed>,
    /// Job members by (job id, attempt).
    staged: HashMap<(String, String), HashMap<InstanceId, Staged>>,
    /// Instances whose pods the executor deleted on the server's request.
    stopping: HashSet<InstanceId>,
    /// Tenant namespaces known to be set up.
    namespaces: HashSet<String>,
    /// The nodes of the last inventory: which members of a job this
    /// cluster runs.
    nodes: Option<HashSet<String>>,
    logs: HashMap<InstanceId, LogCursor>,
}

impl State {
    fn forget(&mut self, id: &InstanceId) {
        self.gone.remove(id);
        self.failed.remove(id);
        self.stopping.remove(id);
        self.logs.remove(id);
    }

    /// A pod left the cluster: keep its last word.
    fn pod_gone(&mut self, id: InstanceId, pod: &Pod, seen: DateTime<Utc>) {
        let stopped = self.stopping.contains(&id);
        if let (Some(node), Some(o)) = (status::node_of(pod), status::tombstone(pod, stopped, seen))
        {
            self.gone.insert(
                id,
                Gone {
                    node: node.to_string(),
                    observed: o,
                },
            );
        }
    }

    fn on_event(&mut self, event: watcher::Event<Pod>, now: DateTime<Utc>) {
        match event {
            watcher::Event::Init => self.relist = Some(HashMap::new()),
            watcher::Event::InitApply(pod) => {
                if let Some(id) = status::instance_of(&pod) {
                    self.relist
                        .get_or_insert_with(HashMap::new)
                        .insert(id, (pod, now));
                }
            }
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let vanished: Vec<(InstanceId, Pod)> = self
                    .pods
                    .iter()
                    .filter(|(id, _)| !listed.contains_key(*id))
                    .map(|(id, (p, _))| (id.clone(), p.clone()))
                    .collect();
                for (id, pod) in vanished {
                    tracing::info!(instance_id = %id, "pod deleted while the watch was down");
                    self.pod_gone(id, &pod, now);
                }
                for id in listed.keys() {
                    self.gone.remove(id);
                }
                self.pods = listed;
                self.synced = true;
            }
            watcher::Event::Apply(pod) => {
                if let Some(id) = status::instance_of(&pod) {
                    self.gone.remove(&id);
                    self.pods.insert(id, (pod, now));
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some(id) = status::instance_of(&pod) {
                    self.pods.remove(&id);
                    self.pod_gone(id, &pod, now);
                }
            }
        }
    }
}

/// Aborts the watch task when the executor is dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The Kubernetes executor. Cheap to share behind an `Arc`; dropping it
/// stops its watch.
pub struct KubeExecutor {
    client: kube::Client,
    config: KubeConfig,
    catalog: Catalog,
    state: Arc<Mutex<State>>,
    _watch: AbortOnDrop,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unavailable(message: impl Into<String>) -> ExecutorError {
    ExecutorError::Unavailable {
        engine: ExecutorKind::Kubernetes,
        message: message.into(),
    }
}

/// Maps a client error to the executor's: the API server's refusals (4xx)
/// are `Refused` with its message, its failures (5xx, 429) and the
/// network's are `Unavailable` (retried), answers that do not parse are
/// `Protocol`.
pub fn map_error(e: kube::Error) -> ExecutorError {
    match e {
        kube::Error::Api(s) if s.code >= 500 || s.code == 429 || s.code == 0 => {
            unavailable(format!("{} ({} {})", s.message, s.code, s.reason))
        }
        kube::Error::Api(s) => ExecutorError::Refused {
            engine: ExecutorKind::Kubernetes,
            message: format!("{} ({} {})", s.message, s.code, s.reason),
        },
        kube::Error::SerdeError(e) => ExecutorError::Protocol {
            engine: ExecutorKind::Kubernetes,
            message: e.to_string(),
        },
        kube::Error::FromUtf8(e) => ExecutorError::Protocol {
            engine: ExecutorKind::Kubernetes,
            message: e.to_string(),
        },
        other => unavailable(other.to_string()),
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// A client for `config` as the executor uses it: without kube's own
/// retries of 429/503/504 (up to 15, for minutes), because the bridge's
/// next round is the retry; a call answers `Unavailable` at once instead
/// of holding the round (and every other node's sync) meanwhile. The pod
/// watch backs off on its own.
pub fn client(mut config: kube::Config) -> Result<kube::Client, ExecutorError> {
    config.default_retry = false;
    kube::Client::try_from(config).map_err(map_error)
}

/// Which gang an assignment belongs to, if any.
fn gang_of(a: &Assignment) -> Option<(String, String)> {
    let job = a.env.get("FLOTILLA_JOB_ID")?;
    let attempt = a
        .env
        .get("FLOTILLA_JOB_ATTEMPT")
        .cloned()
        .unwrap_or_default();
    Some((job.clone(), attempt))
}

impl KubeExecutor {
    /// Connects with the ambient configuration (`KUBECONFIG`, then
    /// `~/.kube/config`, then the in-cluster service account).
    pub async fn connect(config: KubeConfig) -> Result<Self, ExecutorError> {
        let kube_config = kube::Config::infer()
            .await
            .map_err(|e| unavailable(format!("no Kubernetes configuration: {e}")))?;
        Ok(Self::new(client(kube_config)?, config))
    }

    /// An executor on `client`; starts the pod watch (needs a Tokio
    /// runtime).
    pub fn new(client: kube::Client, config: KubeConfig) -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let watch = tokio::spawn(watch_pods(client.clone(), Arc::downgrade(&state)));
        Self {
            client,
            config,
            catalog: Catalog::default(),
            state,
            _watch: AbortOnDrop(watch),
        }
    }

    /// Uses another GPU catalog to name the nodes' GPUs.
    pub fn with_catalog(mut self, catalog: Catalog) -> Self {
        self.catalog = catalog;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &KubeConfig {
        &self.config
    }

    /// Whether the pod watch has listed the cluster's pods at least once
    /// (until then `observe` and `apply` answer `Unavailable`).
    pub fn synced(&self) -> bool {
        self.lock().synced
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; the
        // watch rebuilds it at the next relist.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn require_synced(&self) -> Result<(), ExecutorError> {
        if self.synced() {
            Ok(())
        } else {
            Err(unavailable("the pod watch has not listed the cluster yet"))
        }
    }

    /// Creates (or updates) a tenant's namespace, quota and network policy
    /// with server-side apply, once per executor life.
    async fn ensure_namespace(&self, a: &Assignment) -> Result<String, kube::Error> {
        let ns = pods::namespace_for(a.tenant_id.as_ref(), &self.config);
        if self.lock().namespaces.contains(&ns) {
            return Ok(ns);
        }
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        Api::<Namespace>::all(self.client.clone())
            .patch(
                &ns,
                &pp,
                &Patch::Apply(pods::namespace(&ns, a.tenant_id.as_ref())),
            )
            .await?;
        Api::<ResourceQuota>::namespaced(self.client.clone(), &ns)
            .patch(
                pods::TENANCY_OBJECT,
                &pp,
                &Patch::Apply(pods::quota(&ns, &self.config)),
            )
            .await?;
        Api::<NetworkPolicy>::namespaced(self.client.clone(), &ns)
            .patch(
                pods::TENANCY_OBJECT,
                &pp,
                &Patch::Apply(pods::network_policy(&ns, &self.config)),
            )
            .await?;
        self.lock().namespaces.insert(ns.clone());
        Ok(ns)
    }

    /// Creates one member's pod (and its pull secret). A pod that already
    /// exists is ours from an earlier round whose watch event has not
    /// arrived: that is success.
    async fn create_one(&self, node: &str, a: &Assignment) -> Result<(), CreateError> {
        let ns = self.ensure_namespace(a).await.map_err(CreateError::Api)?;
        let pod = pods::pod_for(a, node, &ns, &self.config)
            .map_err(|e| CreateError::Invalid(e.to_string()))?;
        if let Some(secret) = pods::pull_secret(a, &ns) {
            let pp = PatchParams::apply(FIELD_MANAGER).force();
            let name = pods::pod_name(&a.instance_id);
            Api::<Secret>::namespaced(self.client.clone(), &ns)
                .patch(&name, &pp, &Patch::Apply(secret))
                .await
                .map_err(CreateError::Api)?;
        }
        match Api::<Pod>::namespaced(self.client.clone(), &ns)
            .create(&PostParams::default(), &pod)
            .await
        {
            Ok(created) => {
                let mut st = self.lock();
                st.pods
                    .entry(a.instance_id.clone())
                    .or_insert_with(|| (created, Utc::now()));
                Ok(())
            }
            Err(e) if is_status(&e, 409) => Ok(()),
            Err(e) => {
                if is_status(&e, 404) {
                    // The namespace was deleted behind our back: set it up
                    // again next time.
                    self.lock().namespaces.remove(&ns);
                }
                Err(CreateError::Api(e))
            }
        }
    }

    /// Deletes an instance's pod and pull secret; gone already is fine.
    async fn delete_pod(
        &self,
        namespace: &str,
        id: &InstanceId,
        grace_s: Option<u32>,
    ) -> Result<(), kube::Error> {
        let name = pods::pod_name(id);
        let dp = DeleteParams {
            grace_period_seconds: grace_s,
            ..DeleteParams::default()
        };
        match Api::<Pod>::namespaced(self.client.clone(), namespace)
            .delete(&name, &dp)
            .await
        {
            Ok(_) => {}
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(e),
        }
        match Api::<Secret>::namespaced(self.client.clone(), namespace)
            .delete(&name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Creates a gang's pods in rank order, all or none: on the first
    /// failure the pods already created are deleted at once (no grace:
    /// they have not started their work) and the failure is returned.
    async fn create_gang(&self, members: &[Staged]) -> Result<(), (InstanceId, CreateError)> {
        let mut created: Vec<&Staged> = Vec::new();
        for m in members {
            match self.create_one(&m.node, &m.assignment).await {
                Ok(()) => created.push(m),
                Err(e) => {
                    for c in created {
                        let ns = pods::namespace_for(c.assignment.tenant_id.as_ref(), &self.config);
                        if let Err(de) = self
                            .delete_pod(&ns, &c.assignment.instance_id, Some(0))
                            .await
                        {
                            tracing::error!(instance_id = %c.assignment.instance_id, error = %de, "cannot delete a member of a gang that failed to start");
                        }
                        self.lock().pods.remove(&c.assignment.instance_id);
                    }
                    return Err((m.assignment.instance_id.clone(), e));
                }
            }
        }
        Ok(())
    }

    async fn apply_inner(
        &self,
        node: &str,
        assignments: &[Assignment],
    ) -> Result<(), ExecutorError> {
        self.require_synced()?;
        let now = Utc::now();
        let wanted: HashSet<&InstanceId> = assignments.iter().map(|a| &a.instance_id).collect();

        // Orphans: pods on this node the server no longer assigns.
        let (orphans, by_id): (Vec<(String, InstanceId)>, HashMap<InstanceId, Pod>) = {
            let mut st = self.lock();
            let orphans: Vec<(String, InstanceId)> = st
                .pods
                .iter()
                .filter(|(id, (p, _))| {
                    // Already being deleted: asking again changes nothing.
                    status::node_of(p) == Some(node)
                        && !wanted.contains(id)
                        && p.metadata.deletion_timestamp.is_none()
                })
                .filter_map(|(id, (p, _))| Some((p.metadata.namespace.clone()?, id.clone())))
                .collect();
            let forgotten: Vec<InstanceId> = st
                .gone
                .iter()
                .filter(|(id, g)| g.node == node && !wanted.contains(id))
                .map(|(id, _)| id.clone())
                .chain(
                    st.failed
                        .iter()
                        .filter(|(id, f)| f.node == node && !wanted.contains(id))
                        .map(|(id, _)| id.clone()),
                )
                .collect();
            for id in forgotten {
                st.forget(&id);
            }
            for gang in st.staged.values_mut() {
                gang.retain(|id, s| s.node != node || wanted.contains(id));
            }
            st.staged.retain(|_, g| !g.is_empty());
            let by_id = st
                .pods
                .iter()
                .map(|(id, (p, _))| (id.clone(), p.clone()))
                .collect();
            (orphans, by_id)
        };
        let mut transient: Option<ExecutorError> = None;
        for (ns, id) in orphans {
            tracing::info!(instance_id = %id, node, "deleting a pod the server no longer assigns");
            if let Err(e) = self.delete_pod(&ns, &id, None).await {
                transient.get_or_insert(map_error(e));
            }
        }

        let mut singles: Vec<&Assignment> = Vec::new();
        let mut touched_gangs: HashSet<(String, String)> = HashSet::new();
        for a in assignments {
            let id = &a.instance_id;
            let (known, staged_gang) = {
                let st = self.lock();
                let known = by_id.contains_key(id)
                    || st.gone.contains_key(id)
                    || st.failed.contains_key(id);
                let staged_gang = st
                    .staged
                    .iter()
                    .find(|(_, g)| g.contains_key(id))
                    .map(|(k, _)| k.clone());
                (known, staged_gang)
            };
            if a.stop {
                if let Some(key) = staged_gang {
                    // Never created: it ends here.
                    let mut st = self.lock();
                    if let Some(g) = st.staged.get_mut(&key) {
                        g.remove(id);
                    }
                    st.gone.insert(
                        id.clone(),
                        Gone::never_started(
                            node,
                            id,
                            now,
                            "stopped before its job's pods were created",
                        ),
                    );
                    continue;
                }
                if let Some(pod) = by_id.get(id) {
                    let ended = matches!(
                        status::observe(pod, false, now).map(|o| o.phase),
                        Some(ObservedPhase::Exited { .. } | ObservedPhase::FailedToStart { .. })
                    );
                    let deleting = pod.metadata.deletion_timestamp.is_some();
                    if !ended && !deleting {
                        let ns = pod.metadata.namespace.clone().unwrap_or_default();
                        self.lock().stopping.insert(id.clone());
                        let grace =
                            u32::try_from(a.stop_grace_ms.div_ceil(1000)).unwrap_or(u32::MAX);
                        tracing::info!(instance_id = %id, node, grace_s = grace, "stopping");
                        if let Err(e) = self.delete_pod(&ns, id, Some(grace)).await {
                            transient.get_or_insert(map_error(e));
                        }
                    }
                } else if !known {
                    self.lock().gone.insert(
                        id.clone(),
                        Gone::never_started(node, id, now, "stopped before its pod was created"),
                    );
                }
                continue;
            }
            if known {
                continue;
            }
            match gang_of(a) {
                Some(key) => {
                    let mut st = self.lock();
                    st.staged
                        .entry(key.clone())
                        .or_default()
                        .entry(id.clone())
                        .or_insert(Staged {
                            node: node.to_string(),
                            assignment: a.clone(),
                            since: now,
                        });
                    touched_gangs.insert(key);
                }
                None => singles.push(a),
            }
        }

        for a in singles {
            match self.create_one(node, a).await {
                Ok(()) => tracing::info!(instance_id = %a.instance_id, node, "pod created"),
                Err(e) => {
                    if let Some(t) = self.record_failure(node, &a.instance_id, e, now) {
                        transient.get_or_insert(t);
                    }
                }
            }
        }

        for key in touched_gangs {
            let ready: Option<Vec<Staged>> = {
                let st = self.lock();
                st.staged.get(&key).and_then(|g| {
                    let sample = g.values().next()?;
                    let expected = self.expected_members(&sample.assignment, &st);
                    // Members whose pods exist already (an earlier life
                    // of the executor created the gang) count as there.
                    let existing = existing_members(&st, &key);
                    (g.len() + existing >= expected).then(|| {
                        let mut members: Vec<Staged> = g.values().cloned().collect();
                        members.sort_by_key(|m| {
                            m.assignment
                                .env
                                .get("FLOTILLA_JOB_RANK")
                                .and_then(|r| r.parse::<u32>().ok())
                                .unwrap_or(u32::MAX)
                        });
                        members
                    })
                })
            };
            let Some(members) = ready else { continue };
            let result = self.create_gang(&members).await;
            let mut st = self.lock();
            match result {
                Ok(()) => {
                    st.staged.remove(&key);
                    tracing::info!(job = %key.0, members = members.len(), "job pods created");
                }
                Err((failing, e)) => {
                    let error = map_error_create(e);
                    if error.is_transient() {
                        // Keep them staged: the next round tries again.
                        transient.get_or_insert(error);
                        continue;
                    }
                    st.staged.remove(&key);
                    for m in &members {
                        let reason = if m.assignment.instance_id == failing {
                            error.to_string()
                        } else {
                            format!(
                                "another member of job {} could not start ({failing}): {error}",
                                key.0
                            )
                        };
                        st.failed.insert(
                            m.assignment.instance_id.clone(),
                            Failed {
                                node: m.node.clone(),
                                reason,
                                at: now,
                            },
                        );
                    }
                }
            }
        }
        match transient {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// How many members of `a`'s job this cluster runs: those whose node
    /// (`FLOTILLA_JOB_NODES`, by rank) is one of ours. Members on other
    /// executors are not ours to hold back.
    fn expected_members(&self, a: &Assignment, st: &State) -> usize {
        let nodes: Vec<&str> = a
            .env
            .get("FLOTILLA_JOB_NODES")
            .map(|n| n.split(',').filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        let world: usize = a
            .env
            .get("FLOTILLA_JOB_WORLD_SIZE")
            .and_then(|w| w.parse().ok())
            .unwrap_or(nodes.len().max(1));
        match &st.nodes {
            Some(ours) if !nodes.is_empty() => {
                nodes.iter().filter(|n| ours.contains(**n)).count().max(1)
            }
            _ => world.max(1),
        }
    }

    /// Records a refused create against its instance; returns the error
    /// when it is transient instead (the next round retries).
    fn record_failure(
        &self,
        node: &str,
        id: &InstanceId,
        e: CreateError,
        now: DateTime<Utc>,
    ) -> Option<ExecutorError> {
        let error = map_error_create(e);
        if error.is_transient() {
            return Some(error);
        }
        tracing::warn!(instance_id = %id, node, %error, "pod refused");
        self.lock().failed.insert(
            id.clone(),
            Failed {
                node: node.to_string(),
                reason: error.to_string(),
                at: now,
            },
        );
        None
    }

    fn observe_inner(&self, node: &str) -> Result<Vec<ObservedInstance>, ExecutorError> {
        self.require_synced()?;
        let st = self.lock();
        let mut out: BTreeMap<InstanceId, ObservedInstance> = BTreeMap::new();
        for (key, gang) in &st.staged {
            let expected = gang
                .values()
                .next()
                .map(|s| self.expected_members(&s.assignment, &st))
                .unwrap_or(0);
            for (id, s) in gang.iter().filter(|(_, s)| s.node == node) {
                out.insert(
                    id.clone(),
                    ObservedInstance {
                        instance_id: id.clone(),
                        phase: ObservedPhase::Starting,
                        at: s.since,
                        started_at: None,
                        message: Some(format!(
                            "waiting for the other members of job {} ({} of {} assigned)",
                            key.0,
                            gang.len(),
                            expected
                        )),
                        container: None,
                        weights_tier: None,
                        limit_exceeded: None,
                    },
                );
            }
        }
        for (id, f) in st.failed.iter().filter(|(_, f)| f.node == node) {
            out.insert(
                id.clone(),
                ObservedInstance {
                    instance_id: id.clone(),
                    phase: ObservedPhase::FailedToStart {
                        reason: f.reason.clone(),
                    },
                    at: f.at,
                    started_at: None,
                    message: None,
                    container: None,
                    weights_tier: None,
                    limit_exceeded: None,
                },
            );
        }
        for (id, g) in st.gone.iter().filter(|(_, g)| g.node == node) {
            out.insert(id.clone(), g.observed.clone());
        }
        for (id, (pod, seen)) in &st.pods {
            if status::node_of(pod) != Some(node) {
                continue;
            }
            if let Some(o) = status::observe(pod, st.stopping.contains(id), *seen) {
                out.insert(id.clone(), o);
            }
        }
        Ok(out.into_values().collect())
    }

    async fn inventory_inner(&self) -> Result<Vec<RegisterNode>, ExecutorError> {
        // Registration names the instances a node still runs (the server
        // fails every other one it had there), so it waits for the watch.
        self.require_synced()?;
        let mut lp = ListParams::default();
        if let Some(sel) = &self.config.node_selector {
            lp = lp.labels(sel);
        }
        let list = Api::<Node>::all(self.client.clone())
            .list(&lp)
            .await
            .map_err(map_error)?;
        let mut out = Vec::new();
        let now = Utc::now();
        for node in &list.items {
            match inventory::register(node, &self.config, &self.catalog) {
                Ok(mut r) => {
                    let st = self.lock();
                    r.running = st
                        .pods
                        .iter()
                        .filter(|(_, (p, _))| status::node_of(p) == Some(r.name.as_str()))
                        .filter(|(id, (p, _))| {
                            matches!(
                                status::observe(p, st.stopping.contains(*id), now).map(|o| o.phase),
                                Some(ObservedPhase::Starting | ObservedPhase::Running { .. })
                            )
                        })
                        .map(|(id, _)| id.clone())
                        .collect();
                    r.running.sort();
                    out.push(r)
                }
                Err(skip) => {
                    tracing::debug!(node = ?node.metadata.name, ?skip, "node left out of the inventory")
                }
            }
        }
        self.lock().nodes = Some(out.iter().map(|r| r.name.clone()).collect());
        Ok(out)
    }

    async fn logs_inner(
        &self,
        instance: &InstanceId,
        since: u64,
    ) -> Result<Vec<LogLine>, ExecutorError> {
        let (namespace, cursor) = {
            let st = self.lock();
            let ns = st
                .pods
                .get(instance)
                .and_then(|(p, _)| p.metadata.namespace.clone());
            (ns, st.logs.get(instance).cloned())
        };
        let namespace = match namespace {
            Some(ns) => ns,
            None => {
                // Not in the cache (another executor's life): find it.
                let lp = ListParams::default().labels(&format!(
                    "{}={}",
                    pods::LABEL_INSTANCE,
                    instance.as_str()
                ));
                let found = Api::<Pod>::all(self.client.clone())
                    .list(&lp)
                    .await
                    .map_err(map_error)?;
                match found
                    .items
                    .first()
                    .and_then(|p| p.metadata.namespace.clone())
                {
                    Some(ns) => ns,
                    // No pod, no log: it was never created or is deleted.
                    None => return Ok(vec![]),
                }
            }
        };
        // Continue from the cursor when the caller asks for what follows
        // it; otherwise read the whole log and skip `since` lines.
        let cursor = cursor.filter(|c| c.next_seq == since);
        let lp = LogParams {
            container: Some(pods::CONTAINER.into()),
            timestamps: true,
            since_time: cursor
                .as_ref()
                .and_then(|c| k8s_openapi::jiff::Timestamp::from_second(c.last.timestamp()).ok()),
            ..LogParams::default()
        };
        let text = match Api::<Pod>::namespaced(self.client.clone(), &namespace)
            .logs(&pods::pod_name(instance), &lp)
            .await
        {
            Ok(t) => t,
            // Not started yet ("waiting to start") or deleted: nothing.
            Err(e) if is_status(&e, 400) || is_status(&e, 404) => return Ok(vec![]),
            Err(e) => return Err(map_error(e)),
        };
        let parsed = parse_log(&text);
        let mut out = Vec::new();
        let (mut seq, skip_before, mut skip_at_last) = match &cursor {
            Some(c) => (c.next_seq, Some(c.last), c.at_last),
            None => (0, None, 0),
        };
        let mut last = cursor.as_ref().map(|c| c.last);
        let mut at_last = cursor.as_ref().map(|c| c.at_last).unwrap_or(0);
        for (at, line) in parsed {
            if let Some(b) = skip_before {
                // sinceTime has second precision: drop what the cursor
                // has already passed.
                if at < b {
                    continue;
                }
                if at == b && skip_at_last > 0 {
                    skip_at_last -= 1;
                    continue;
                }
            }
            if Some(at) == last {
                at_last += 1;
            } else {
                last = Some(at);
                at_last = 1;
            }
            if seq >= since {
                out.push(LogLine {
                    seq,
                    stream: LogStream::Stdout,
                    at,
                    line,
                });
            }
            seq += 1;
        }
        if let Some(last) = last {
            self.lock().logs.insert(
                instance.clone(),
                LogCursor {
                    next_seq: seq,
                    last,
                    at_last,
                },
            );
        }
        Ok(out)
    }
}

/// How many pods of the job attempt `key` exist.
fn existing_members(st: &State, key: &(String, String)) -> usize {
    st.pods
        .values()
        .filter(|(p, _)| {
            let Some(labels) = p.metadata.labels.as_ref() else {
                return false;
            };
            labels.get(pods::LABEL_JOB) == Some(&key.0)
                && labels.get(pods::LABEL_ATTEMPT).cloned().unwrap_or_default() == key.1
        })
        .count()
}

/// Why creating a pod failed.
#[derive(Debug)]
enum CreateError {
    Api(kube::Error),
    Invalid(String),
}

fn map_error_create(e: CreateError) -> ExecutorError {
    match e {
        CreateError::Api(e) => map_error(e),
        CreateError::Invalid(message) => ExecutorError::Refused {
            engine: ExecutorKind::Kubernetes,
            message,
        },
    }
}

/// Splits a `timestamps=true` log into (time, line). The kubelet prefixes
/// every line with an RFC 3339 time and a space; a line without one (never
/// from a real kubelet) keeps the previous line's time.
pub fn parse_log(text: &str) -> Vec<(DateTime<Utc>, String)> {
    let mut last = DateTime::<Utc>::default();
    text.lines()
        .map(|l| {
            if let Some((ts, rest)) = l.split_once(' ') {
                if let Ok(t) = DateTime::parse_from_rfc3339(ts) {
                    last = t.with_timezone(&Utc);
                    return (last, rest.to_string());
                }
            }
            (last, l.to_string())
        })
        .collect()
}

/// The pod watch: one `watcher` over Flotilla's pods in every namespace,
/// feeding the cache. The watcher resumes an ended watch from the last
/// resource version and relists after `410 Gone`; its errors are logged
/// and retried with kube's default backoff. Ends when the executor is
/// dropped.
async fn watch_pods(client: kube::Client, state: std::sync::Weak<Mutex<State>>) {
    let api = Api::<Pod>::all(client);
    let config = watcher::Config::default().labels(&pods::managed_selector());
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(item) = stream.next().await {
        let Some(state) = state.upgrade() else { return };
        match item {
            Ok(event) => state
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .on_event(event, Utc::now()),
            Err(error) => tracing::warn!(%error, "pod watch failed; it restarts"),
        }
    }
}

impl Executor for KubeExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Kubernetes
    }

    fn inventory(&self) -> BoxFuture<'_, Result<Vec<RegisterNode>, ExecutorError>> {
        Box::pin(self.inventory_inner())
    }

    fn apply<'a>(
        &'a self,
        node: &'a str,
        assignments: &'a [Assignment],
    ) -> BoxFuture<'a, Result<(), ExecutorError>> {
        Box::pin(self.apply_inner(node, assignments))
    }

    fn observe<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ObservedInstance>, ExecutorError>> {
        Box::pin(async move { self.observe_inner(node) })
    }

    fn logs<'a>(
        &'a self,
        instance: &'a InstanceId,
        since: u64,
    ) -> BoxFuture<'a, Result<Vec<LogLine>, ExecutorError>> {
        Box::pin(self.logs_inner(instance, since))
    }
}
