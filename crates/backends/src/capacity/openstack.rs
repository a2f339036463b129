//! OpenStack Nova as a capacity provider: the compute API v2.1 behind a
//! Keystone v3 token.
//!
//! Why Nova: it is the API many GPU clouds and most private GPU fleets run
//! (public OpenStack clouds, research clouds, telco clouds), it is
//! documented down to its error bodies, and one client serves all of them.
//!
//! What it uses, all documented in the compute API reference:
//! - Keystone `POST /v3/auth/tokens` (password method, project scope): the
//!   token comes back in `X-Subject-Token`, the compute endpoint from the
//!   token's service catalog (type `compute`, interface `public`, the
//!   configured region). A 401 from Nova (an expired token) re-authenticates
//!   once and retries.
//! - `GET /flavors/detail` (microversion 2.61 lists `extra_specs`): a GPU
//!   flavor carries `pci_passthrough:alias` = `ALIAS:COUNT[,ALIAS:COUNT]`
//!   (PCI passthrough, how Nova hands out whole GPUs) or `resources:VGPU`;
//!   the alias maps to a catalog GPU model through the configuration (or is
//!   the model's name itself).
//! - `POST /servers` (name, flavorRef, imageRef, networks, base64
//!   `user_data` with the boot script that runs `flotilla agent
//!   --join-token`, metadata, the tag `flotilla`); 403 `Quota exceeded for
//!   instances...` is [`CapacityError::QuotaExceeded`].
//! - `GET /servers/{id}`: `BUILD` is provisioning, `ACTIVE` running, `ERROR`
//!   failed with its `fault.message`; "No valid host was found" there is the
//!   cloud having no capacity ([`MachineState::Failed`] with
//!   `no_capacity`). `DELETE /servers/{id}` terminates (404: already gone).
//! - `GET /limits`: `maxTotalInstances`/`totalInstancesUsed`, cores and RAM
//!   (-1 is unlimited).
//!
//! Spot: Nova has no spot market. Clouds that offer preemptible servers on
//! OpenStack (Blazar's preemptible instances on unreserved hosts, the
//! INDIGO/CERN preemptible-instance work, vendors' "preemptible" tags) mark
//! the flavors they may reclaim and stop or delete those servers when they
//! need the hosts. The mapping: a flavor with the extra spec
//! `flotilla:preemptible=true` is a spot instance type; a spot server is
//! created with metadata `flotilla:preemptible=true`; an interruption notice
//! is (a) metadata `flotilla:interrupt-at` (RFC 3339) set on the server by
//! the operator's reclaimer ahead of time, or (b) a preemptible server found
//! `SHUTOFF` or `DELETED` that Flotilla did not terminate (a notice with no
//! lead time). Times are Unix milliseconds: the server's clock is the wall
//! clock, so `now_ms` is compared with the cloud's timestamps directly.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use futures::future::{BoxFuture, FutureExt};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{
    CapacityError, CapacityProvider, InstanceType, InterruptionNotice, Limit, Machine,
    MachineState, ProvisionRequest, Quota, Region,
};

/// The compute API microversion this client speaks: 2.61 is the first
/// that lists flavors' extra specs, and embeds the flavor (with its extra
/// specs) in a server.
pub const MICROVERSION: &str = "2.61";

/// The flavor extra spec that marks a preemptible (spot) flavor.
pub const PREEMPTIBLE_SPEC: &str = "flotilla:preemptible";
/// The server metadata key a reclaimer sets ahead of taking a server back.
pub const INTERRUPT_AT_KEY: &str = "flotilla:interrupt-at";
/// The tag on every server Flotilla creates.
pub const TAG: &str = "flotilla";

/// How to reach and use one OpenStack project.
#[derive(Clone, PartialEq, Eq)]
pub struct NovaConfig {
    /// Keystone v3 URL, e.g. `https://keystone.example:5000/v3`.
    pub auth_url: String,
    /// User name.
    pub username: String,
    /// Password (a secret).
    pub password: String,
    /// The user's domain (`Default`).
    pub user_domain: String,
    /// Project to scope the token to.
    pub project: String,
    /// The project's domain (`Default`).
    pub project_domain: String,
    /// Region whose compute endpoint to use.
    pub region: String,
    /// Image to boot (id); it must have the `flotilla` binary.
    pub image: String,
    /// Network to attach (id); `None`: Nova's `auto` allocation.
    pub network: Option<String>,
    /// PCI alias (or VGPU) -> catalog GPU model.
    pub gpu_aliases: BTreeMap<String, String>,
}

impl std::fmt::Debug for NovaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NovaConfig")
            .field("auth_url", &self.auth_url)
            .field("username", &self.username)
            .field("password", &"***")
            .field("project", &self.project)
            .field("region", &self.region)
            .field("image", &self.image)
            .field("network", &self.network)
            .finish()
    }
}

#[derive(Debug, Clone)]
struct Session {
    token: String,
    compute: String,
    regions: Vec<String>,
}

/// The Nova client (see the module doc).
#[derive(Debug)]
pub struct Nova {
    cfg: NovaConfig,
    http: reqwest::Client,
    session: tokio::sync::Mutex<Option<Session>>,
    /// Servers this process deleted: their going is no interruption.
    deleted: Mutex<BTreeSet<String>>,
}

// Keystone's token body, as much as is read.
#[derive(Deserialize)]
struct TokenBody {
    token: TokenInner,
}
#[derive(Deserialize)]
struct TokenInner {
    #[serde(default)]
    catalog: Vec<CatalogEntry>,
}
#[derive(Deserialize)]
struct CatalogEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    endpoints: Vec<Endpoint>,
}
#[derive(Deserialize)]
struct Endpoint {
    interface: String,
    #[serde(default)]
    region_id: Option<String>,
    #[serde(default)]
    region: Option<String>,
    url: String,
}

#[derive(Deserialize)]
struct Flavor {
    id: String,
    name: String,
    vcpus: u32,
    ram: u64,
    #[serde(default)]
    extra_specs: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct ServerFlavor {
    original_name: String,
    #[serde(default)]
    extra_specs: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Fault {
    #[serde(default)]
    message: String,
}

#[derive(Deserialize)]
struct Server {
    id: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    fault: Option<Fault>,
    #[serde(default)]
    flavor: Option<ServerFlavor>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

fn protocol(e: impl std::fmt::Display) -> CapacityError {
    CapacityError::Protocol {
        message: e.to_string(),
    }
}

fn unavailable(e: impl std::fmt::Display) -> CapacityError {
    CapacityError::Unavailable {
        message: e.to_string(),
    }
}

/// The message of a compute API error body: `{"<kind>": {"code", "message"}}`
/// (`forbidden`, `badRequest`, `itemNotFound`, `computeFault`, ...).
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v.as_object()?
                .values()
                .find_map(|inner| inner.get("message")?.as_str().map(str::to_string))
        })
        .unwrap_or_else(|| body.chars().take(200).collect())
}

/// Whether a fault or error says the cloud has no host for the server.
fn is_no_capacity(message: &str) -> bool {
    message.contains("No valid host was found")
}

/// `(gpu model, count)` of a flavor's extra specs.
fn gpus_of(
    specs: &BTreeMap<String, String>,
    aliases: &BTreeMap<String, String>,
) -> (Option<String>, u32) {
    if let Some(alias) = specs.get("pci_passthrough:alias") {
        // `a100:2` or `a100:2,nic:1`: the first alias that maps to a GPU.
        for part in alias.split(',') {
            let (name, count) = part.split_once(':').unwrap_or((part, "1"));
            let name = name.trim();
            let model = aliases.get(name).cloned().or_else(|| {
                aliases
                    .is_empty()
                    .then(|| name.to_ascii_uppercase())
                    .filter(|n| !n.is_empty())
            });
            if let Some(model) = model {
                return (Some(model), count.trim().parse().unwrap_or(1));
            }
        }
    }
    if let Some(n) = specs.get("resources:VGPU") {
        let model = aliases
            .get("VGPU")
            .cloned()
            .unwrap_or_else(|| "VGPU".to_string());
        return (Some(model), n.trim().parse().unwrap_or(1));
    }
    (None, 0)
}

fn limit(abs: &Value, max: &str, used: &str) -> Limit {
    let m = abs.get(max).and_then(Value::as_i64).unwrap_or(-1);
    Limit {
        max: u64::try_from(m).ok(),
        used: abs
            .get(used)
            .and_then(Value::as_i64)
            .and_then(|u| u64::try_from(u).ok())
            .unwrap_or(0),
    }
}

fn rfc3339_ms(s: &str) -> Option<u64> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .and_then(|t| u64::try_from(t.with_timezone(&Utc).timestamp_millis()).ok())
}

impl Nova {
    /// A client; nothing is sent until the first call.
    pub fn new(cfg: NovaConfig) -> Result<Self, CapacityError> {
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(unavailable)?;
        Ok(Self {
            cfg,
            http,
            session: tokio::sync::Mutex::new(None),
            deleted: Mutex::new(BTreeSet::new()),
        })
    }

    /// Keystone: a project-scoped token and the compute endpoint.
    async fn authenticate(&self) -> Result<Session, CapacityError> {
        let body = json!({
            "auth": {
                "identity": {
                    "methods": ["password"],
                    "password": {"user": {
                        "name": self.cfg.username,
                        "domain": {"name": self.cfg.user_domain},
                        "password": self.cfg.password,
                    }}
                },
                "scope": {"project": {
                    "name": self.cfg.project,
                    "domain": {"name": self.cfg.project_domain},
                }}
            }
        });
        let url = format!("{}/auth/tokens", self.cfg.auth_url.trim_end_matches('/'));
        let resp = self
            .http
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(|e| unavailable(format!("keystone: {e}")))?;
        let status = resp.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            let text = resp.text().await.unwrap_or_default();
            return Err(CapacityError::Auth {
                message: error_message(&text),
            });
        }
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(unavailable(format!(
                "keystone {status}: {}",
                error_message(&text)
            )));
        }
        let token = resp
            .headers()
            .get("X-Subject-Token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .ok_or_else(|| protocol("keystone: no X-Subject-Token header"))?;
        let body: TokenBody = resp
            .json()
            .await
            .map_err(|e| protocol(format!("keystone token body: {e}")))?;
        let compute: Vec<&Endpoint> = body
            .token
            .catalog
            .iter()
            .filter(|c| c.kind == "compute")
            .flat_map(|c| &c.endpoints)
            .filter(|e| e.interface == "public")
            .collect();
        let region_of = |e: &Endpoint| e.region_id.clone().or_else(|| e.region.clone());
        let mut regions: Vec<String> = compute.iter().filter_map(|e| region_of(e)).collect();
        regions.sort();
        regions.dedup();
        let url = compute
            .iter()
            .find(|e| region_of(e).as_deref() == Some(self.cfg.region.as_str()))
            .map(|e| e.url.trim_end_matches('/').to_string())
            .ok_or_else(|| {
                protocol(format!(
                    "the service catalog has no public compute endpoint in region {}",
                    self.cfg.region
                ))
            })?;
        Ok(Session {
            token,
            compute: url,
            regions,
        })
    }

    async fn session(&self, renew: bool) -> Result<Session, CapacityError> {
        let mut s = self.session.lock().await;
        if renew || s.is_none() {
            *s = Some(self.authenticate().await?);
        }
        s.clone().ok_or_else(|| protocol("no session"))
    }

    /// One compute API call; re-authenticates once on 401. Returns the
    /// status and body text.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, String), CapacityError> {
        let mut renew = false;
        loop {
            let s = self.session(renew).await?;
            let mut req = self
                .http
                .request(method.clone(), format!("{}{path}", s.compute))
                .header("X-Auth-Token", &s.token)
                .header("OpenStack-API-Version", format!("compute {MICROVERSION}"))
                .header("X-OpenStack-Nova-API-Version", MICROVERSION);
            if let Some(b) = body {
                req = req.json(b);
            }
            let resp = req
                .send()
                .await
                .map_err(|e| unavailable(format!("nova: {e}")))?;
            let status = resp.status();
            let text = resp
                .text()
                .await
                .map_err(|e| unavailable(format!("nova: {e}")))?;
            if status == StatusCode::UNAUTHORIZED && !renew {
                renew = true;
                continue;
            }
            if status == StatusCode::UNAUTHORIZED {
                return Err(CapacityError::Auth {
                    message: error_message(&text),
                });
            }
            if status.is_server_error() {
                return Err(unavailable(format!(
                    "nova {status}: {}",
                    error_message(&text)
                )));
            }
            return Ok((status, text));
        }
    }

    async fn get_json(&self, path: &str) -> Result<Value, CapacityError> {
        let (status, text) = self.call(Method::GET, path, None).await?;
        if !status.is_success() {
            return Err(CapacityError::Refused {
                message: format!("GET {path}: {status}: {}", error_message(&text)),
            });
        }
        serde_json::from_str(&text).map_err(|e| protocol(format!("GET {path}: {e}")))
    }

    async fn flavors(&self) -> Result<Vec<Flavor>, CapacityError> {
        let v = self.get_json("/flavors/detail").await?;
        serde_json::from_value(v.get("flavors").cloned().unwrap_or(Value::Null))
            .map_err(|e| protocol(format!("flavors: {e}")))
    }

    fn instance_type(&self, f: &Flavor) -> InstanceType {
        let (gpu_model, gpus) = gpus_of(&f.extra_specs, &self.cfg.gpu_aliases);
        InstanceType {
            name: f.name.clone(),
            gpu_model,
            gpus,
            vcpus: f.vcpus,
            ram_mib: f.ram,
            spot: f.extra_specs.get(PREEMPTIBLE_SPEC).map(String::as_str) == Some("true"),
        }
    }

    fn machine(&self, s: Server) -> Machine {
        let (name, specs) = s
            .flavor
            .map(|f| (f.original_name, f.extra_specs))
            .unwrap_or_default();
        let (_, gpus) = gpus_of(&specs, &self.cfg.gpu_aliases);
        let state = match s.status.as_str() {
            "BUILD" | "" => MachineState::Provisioning,
            "ERROR" => {
                let reason = s
                    .fault
                    .map(|f| f.message)
                    .filter(|m| !m.is_empty())
                    .unwrap_or_else(|| "the server went to ERROR".to_string());
                MachineState::Failed {
                    no_capacity: is_no_capacity(&reason),
                    reason,
                }
            }
            "DELETED" | "SOFT_DELETED" | "SHUTOFF" | "SHELVED" | "SHELVED_OFFLOADED" => {
                MachineState::Terminated
            }
            _ => MachineState::Running,
        };
        Machine {
            id: s.id,
            name: s.name,
            region: self.cfg.region.clone(),
            instance_type: name,
            gpus,
            spot: s.metadata.get(PREEMPTIBLE_SPEC).map(String::as_str) == Some("true"),
            state,
            ready_at_ms: None,
            preempt_at_ms: None,
        }
    }

    async fn provision_impl(&self, req: &ProvisionRequest) -> Result<Machine, CapacityError> {
        if let Some(r) = &req.region {
            if r != &self.cfg.region {
                return Err(CapacityError::Refused {
                    message: format!("this provider serves region {}, not {r}", self.cfg.region),
                });
            }
        }
        let flavors = self.flavors().await?;
        let flavor = flavors
            .iter()
            .find(|f| f.name == req.instance_type || f.id == req.instance_type)
            .ok_or_else(|| CapacityError::UnknownInstanceType {
                name: req.instance_type.clone(),
            })?;
        let itype = self.instance_type(flavor);
        if req.spot && !itype.spot {
            return Err(CapacityError::NoSpot {
                instance_type: req.instance_type.clone(),
            });
        }
        let mut metadata = serde_json::Map::new();
        metadata.insert("flotilla:name".into(), json!(req.name));
        if req.spot {
            metadata.insert(PREEMPTIBLE_SPEC.into(), json!("true"));
        }
        let mut server = json!({
            "name": req.name,
            "flavorRef": flavor.id,
            "imageRef": self.cfg.image,
            "networks": match &self.cfg.network {
                Some(n) => json!([{"uuid": n}]),
                None => json!("auto"),
            },
            "metadata": metadata,
            "tags": [TAG],
        });
        if let Some(join) = &req.join {
            server["user_data"] =
                json!(base64::engine::general_purpose::STANDARD.encode(join.boot_script()));
        }
        let (status, text) = self
            .call(Method::POST, "/servers", Some(&json!({ "server": server })))
            .await?;
        if status == StatusCode::FORBIDDEN || status == StatusCode::PAYLOAD_TOO_LARGE {
            let message = error_message(&text);
            if message.contains("Quota exceeded") {
                return Err(CapacityError::QuotaExceeded { message });
            }
            return Err(CapacityError::Refused { message });
        }
        if !status.is_success() {
            let message = error_message(&text);
            if is_no_capacity(&message) {
                return Err(CapacityError::NoCapacity {
                    instance_type: req.instance_type.clone(),
                    message,
                });
            }
            return Err(CapacityError::Refused {
                message: format!("POST /servers: {status}: {message}"),
            });
        }
        let v: Value = serde_json::from_str(&text).map_err(protocol)?;
        let id = v
            .pointer("/server/id")
            .and_then(Value::as_str)
            .ok_or_else(|| protocol("POST /servers: no server.id in the answer"))?;
        tracing::info!(server = id, name = %req.name, flavor = %flavor.name, spot = req.spot, "nova server requested");
        Ok(Machine {
            id: id.to_string(),
            name: req.name.clone(),
            region: self.cfg.region.clone(),
            instance_type: flavor.name.clone(),
            gpus: itype.gpus,
            spot: req.spot,
            state: MachineState::Provisioning,
            ready_at_ms: None,
            preempt_at_ms: None,
        })
    }

    async fn describe_impl(&self, id: &str) -> Result<Machine, CapacityError> {
        let path = format!("/servers/{id}");
        let (status, text) = self.call(Method::GET, &path, None).await?;
        if status == StatusCode::NOT_FOUND {
            return Err(CapacityError::NotFound { id: id.to_string() });
        }
        if !status.is_success() {
            return Err(CapacityError::Refused {
                message: format!("GET {path}: {status}: {}", error_message(&text)),
            });
        }
        #[derive(Deserialize)]
        struct One {
            server: Server,
        }
        let one: One =
            serde_json::from_str(&text).map_err(|e| protocol(format!("GET {path}: {e}")))?;
        Ok(self.machine(one.server))
    }

    async fn terminate_impl(&self, id: &str) -> Result<(), CapacityError> {
        if let Ok(mut d) = self.deleted.lock() {
            d.insert(id.to_string());
        }
        let path = format!("/servers/{id}");
        let (status, text) = self.call(Method::DELETE, &path, None).await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            return Ok(());
        }
        Err(CapacityError::Refused {
            message: format!("DELETE {path}: {status}: {}", error_message(&text)),
        })
    }

    async fn interruptions_impl(
        &self,
        now_ms: u64,
    ) -> Result<Vec<InterruptionNotice>, CapacityError> {
        let v = self
            .get_json(&format!("/servers/detail?tags={TAG}"))
            .await?;
        let servers: Vec<Server> =
            serde_json::from_value(v.get("servers").cloned().unwrap_or(Value::Null))
                .map_err(|e| protocol(format!("servers: {e}")))?;
        let deleted = self.deleted.lock().map(|d| d.clone()).unwrap_or_default();
        let mut out = Vec::new();
        for s in servers {
            if deleted.contains(&s.id) {
                continue;
            }
            let preemptible = s.metadata.get(PREEMPTIBLE_SPEC).map(String::as_str) == Some("true");
            if let Some(at) = s.metadata.get(INTERRUPT_AT_KEY) {
                let terminate_at_ms = rfc3339_ms(at).ok_or_else(|| {
                    protocol(format!(
                        "server {}: {INTERRUPT_AT_KEY} {at:?} is not RFC 3339",
                        s.id
                    ))
                })?;
                out.push(InterruptionNotice {
                    machine: s.id,
                    noticed_at_ms: now_ms.min(terminate_at_ms),
                    terminate_at_ms,
                });
            } else if preemptible
                && matches!(s.status.as_str(), "SHUTOFF" | "DELETED" | "SOFT_DELETED")
            {
                out.push(InterruptionNotice {
                    machine: s.id,
                    noticed_at_ms: now_ms,
                    terminate_at_ms: now_ms,
                });
            }
        }
        Ok(out)
    }
}

impl CapacityProvider for Nova {
    fn kind(&self) -> &'static str {
        "openstack"
    }

    fn regions(&self) -> BoxFuture<'_, Result<Vec<Region>, CapacityError>> {
        async move {
            let s = self.session(false).await?;
            Ok(s.regions.into_iter().map(|name| Region { name }).collect())
        }
        .boxed()
    }

    fn instance_types(&self) -> BoxFuture<'_, Result<Vec<InstanceType>, CapacityError>> {
        async move {
            Ok(self
                .flavors()
                .await?
                .iter()
                .map(|f| self.instance_type(f))
                .collect())
        }
        .boxed()
    }

    fn quota<'a>(&'a self, region: &'a str) -> BoxFuture<'a, Result<Quota, CapacityError>> {
        async move {
            if region != self.cfg.region {
                return Err(CapacityError::Refused {
                    message: format!(
                        "this provider serves region {}, not {region}",
                        self.cfg.region
                    ),
                });
            }
            let v = self.get_json("/limits").await?;
            let abs = v
                .pointer("/limits/absolute")
                .ok_or_else(|| protocol("GET /limits: no limits.absolute"))?;
            Ok(Quota {
                instances: limit(abs, "maxTotalInstances", "totalInstancesUsed"),
                vcpus: limit(abs, "maxTotalCores", "totalCoresUsed"),
                ram_mib: limit(abs, "maxTotalRAMSize", "totalRAMUsed"),
            })
        }
        .boxed()
    }

    fn provision<'a>(
        &'a self,
        _now_ms: u64,
        req: &'a ProvisionRequest,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        self.provision_impl(req).boxed()
    }

    fn describe<'a>(
        &'a self,
        _now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        self.describe_impl(id).boxed()
    }

    fn terminate<'a>(
        &'a self,
        _now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<(), CapacityError>> {
        self.terminate_impl(id).boxed()
    }

    fn interruptions(
        &self,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Vec<InterruptionNotice>, CapacityError>> {
        self.interruptions_impl(now_ms).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_flavors_are_read_from_pci_aliases() {
        let mut specs = BTreeMap::new();
        specs.insert(
            "pci_passthrough:alias".to_string(),
            "nic:1,h100-sxm:8".to_string(),
        );
        let mut aliases = BTreeMap::new();
        aliases.insert("h100-sxm".to_string(), "H100".to_string());
        assert_eq!(gpus_of(&specs, &aliases), (Some("H100".to_string()), 8));
        // Without a map, the alias is the model.
        specs.insert("pci_passthrough:alias".to_string(), "a100:2".to_string());
        assert_eq!(
            gpus_of(&specs, &BTreeMap::new()),
            (Some("A100".to_string()), 2)
        );
        assert_eq!(gpus_of(&BTreeMap::new(), &aliases), (None, 0));
    }

    #[test]
    fn error_bodies_give_their_message() {
        let body = r#"{"forbidden": {"code": 403, "message": "Quota exceeded for instances: Requested 1, but already used 10 of 10 instances"}}"#;
        assert!(error_message(body).starts_with("Quota exceeded for instances"));
        assert_eq!(error_message("plain"), "plain");
    }
}
