//! A local cloud: "provisions" a machine by starting a real `flotilla
//! agent` process on this host with simulated GPUs and the machine's
//! one-time join token, and terminates it by killing that process. The
//! whole node-pool path (provision, join, register, place, drain,
//! terminate) runs for real on one machine without a cloud account: the
//! server's node-pool test uses it, and so can a demo
//! (`flotilla server --node-pool gpu=2xH100,provider=local`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use futures::future::{self, BoxFuture, FutureExt};
use tokio::process::{Child, Command};

use super::{
    CapacityError, CapacityProvider, InstanceType, InterruptionNotice, Limit, Machine,
    MachineState, ProvisionRequest, Quota, Region,
};

/// The one region of a local cloud.
pub const LOCAL_REGION: &str = "local";

/// Settings of [`LocalAgents`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalAgentsConfig {
    /// The `flotilla` binary to run as `flotilla agent`.
    pub program: PathBuf,
    /// Each machine's agent gets a work directory under this one.
    pub work_root: PathBuf,
    /// Instance types on offer: `(name, GPU model, GPUs)`; the name is
    /// also the agent's `--simulate-gpus` spec (`2xH100`).
    pub types: Vec<(String, String, u32)>,
    /// Most machines alive at once (the quota).
    pub max_machines: u32,
}

struct Proc {
    machine: Machine,
    child: Child,
    killed: bool,
}

/// The local cloud (see the module doc).
pub struct LocalAgents {
    cfg: LocalAgentsConfig,
    procs: Mutex<BTreeMap<String, Proc>>,
    next: Mutex<u32>,
}

impl std::fmt::Debug for LocalAgents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalAgents")
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl LocalAgents {
    /// A local cloud with no machine yet.
    pub fn new(cfg: LocalAgentsConfig) -> Self {
        Self {
            cfg,
            procs: Mutex::new(BTreeMap::new()),
            next: Mutex::new(0),
        }
    }

    fn procs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Proc>> {
        self.procs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn live(procs: &mut BTreeMap<String, Proc>) -> u64 {
        let mut n = 0;
        for p in procs.values_mut() {
            if !p.killed && matches!(p.child.try_wait(), Ok(None)) {
                n += 1;
            }
        }
        n
    }

    fn types(&self) -> Vec<InstanceType> {
        self.cfg
            .types
            .iter()
            .map(|(name, model, gpus)| InstanceType {
                name: name.clone(),
                gpu_model: Some(model.clone()),
                gpus: *gpus,
                vcpus: 0,
                ram_mib: 0,
                spot: false,
            })
            .collect()
    }

    fn provision_now(&self, req: &ProvisionRequest) -> Result<Machine, CapacityError> {
        let itype = self
            .types()
            .into_iter()
            .find(|t| t.name == req.instance_type)
            .ok_or_else(|| CapacityError::UnknownInstanceType {
                name: req.instance_type.clone(),
            })?;
        if req.spot {
            return Err(CapacityError::NoSpot {
                instance_type: req.instance_type.clone(),
            });
        }
        let join = req.join.as_ref().ok_or_else(|| CapacityError::Refused {
            message: "a local machine needs a join token to start its agent".to_string(),
        })?;
        let mut procs = self.procs();
        let live = Self::live(&mut procs);
        if live >= u64::from(self.cfg.max_machines) {
            return Err(CapacityError::QuotaExceeded {
                message: format!(
                    "{live} of {} local machines are running",
                    self.cfg.max_machines
                ),
            });
        }
        let id = {
            let mut n = self.next.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            format!("local-{}-{}", std::process::id(), *n)
        };
        let work_dir = self.cfg.work_root.join(&id);
        std::fs::create_dir_all(&work_dir).map_err(|e| CapacityError::Unavailable {
            message: format!("cannot create {}: {e}", work_dir.display()),
        })?;
        let log = std::fs::File::create(work_dir.join("agent.log")).map_err(|e| {
            CapacityError::Unavailable {
                message: format!("cannot create the agent log: {e}"),
            }
        })?;
        let log_err = log.try_clone().map_err(|e| CapacityError::Unavailable {
            message: format!("cannot open the agent log: {e}"),
        })?;
        let mut command = Command::new(&self.cfg.program);
        // The control plane's pin (a public value: an argument is fine),
        // or none: never one inherited from the server's own environment.
        command
            .env_remove("FLOTILLA_TLS_FINGERPRINT")
            .env_remove("FLOTILLA_CA_CERT");
        if let Some(pin) = &join.tls_fingerprint {
            command.arg("--tls-fingerprint").arg(pin);
        }
        let child = command
            .arg("--server")
            .arg(&join.server_url)
            .arg("agent")
            .arg("--simulate-gpus")
            .arg(&req.instance_type)
            .arg("--work-dir")
            .arg(&work_dir)
            // The token travels in the environment, not in `ps` output.
            .env("FLOTILLA_JOIN_TOKEN", &join.token)
            .env_remove("FLOTILLA_AGENT_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| CapacityError::Unavailable {
                message: format!("cannot start {}: {e}", self.cfg.program.display()),
            })?;
        tracing::info!(machine = %id, name = %req.name, pid = child.id(), "local machine started");
        let machine = Machine {
            id: id.clone(),
            name: req.name.clone(),
            region: LOCAL_REGION.to_string(),
            instance_type: itype.name,
            gpus: itype.gpus,
            spot: false,
            state: MachineState::Running,
            ready_at_ms: None,
            preempt_at_ms: None,
        };
        procs.insert(
            id,
            Proc {
                machine: machine.clone(),
                child,
                killed: false,
            },
        );
        Ok(machine)
    }

    fn describe_now(&self, id: &str) -> Result<Machine, CapacityError> {
        let mut procs = self.procs();
        let p = procs
            .get_mut(id)
            .ok_or_else(|| CapacityError::NotFound { id: id.to_string() })?;
        let mut m = p.machine.clone();
        m.state = match (p.killed, p.child.try_wait()) {
            (true, _) => MachineState::Terminated,
            (false, Ok(None)) => MachineState::Running,
            (false, Ok(Some(status))) => MachineState::Failed {
                reason: format!("the agent exited: {status}"),
                no_capacity: false,
            },
            (false, Err(e)) => MachineState::Failed {
                reason: format!("cannot wait for the agent: {e}"),
                no_capacity: false,
            },
        };
        Ok(m)
    }

    fn terminate_now(&self, id: &str) {
        let mut procs = self.procs();
        if let Some(p) = procs.get_mut(id) {
            if !p.killed {
                // The machine is pulled: the agent gets no say, as when a
                // cloud deletes a server. Its fence stops its work.
                let _ = p.child.start_kill();
                p.killed = true;
                tracing::info!(machine = %id, "local machine terminated");
            }
        }
    }
}

impl CapacityProvider for LocalAgents {
    fn kind(&self) -> &'static str {
        "local"
    }

    fn regions(&self) -> BoxFuture<'_, Result<Vec<Region>, CapacityError>> {
        future::ready(Ok(vec![Region {
            name: LOCAL_REGION.to_string(),
        }]))
        .boxed()
    }

    fn instance_types(&self) -> BoxFuture<'_, Result<Vec<InstanceType>, CapacityError>> {
        future::ready(Ok(self.types())).boxed()
    }

    fn quota<'a>(&'a self, _region: &'a str) -> BoxFuture<'a, Result<Quota, CapacityError>> {
        let used = Self::live(&mut self.procs());
        let open = Limit { max: None, used: 0 };
        future::ready(Ok(Quota {
            instances: Limit {
                max: Some(u64::from(self.cfg.max_machines)),
                used,
            },
            vcpus: open,
            ram_mib: open,
        }))
        .boxed()
    }

    fn provision<'a>(
        &'a self,
        _now_ms: u64,
        req: &'a ProvisionRequest,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        future::ready(self.provision_now(req)).boxed()
    }

    fn describe<'a>(
        &'a self,
        _now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        future::ready(self.describe_now(id)).boxed()
    }

    fn terminate<'a>(
        &'a self,
        _now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<(), CapacityError>> {
        self.terminate_now(id);
        future::ready(Ok(())).boxed()
    }

    fn interruptions(
        &self,
        _now_ms: u64,
    ) -> BoxFuture<'_, Result<Vec<InterruptionNotice>, CapacityError>> {
        // This host never takes its own machines back.
        future::ready(Ok(Vec::new())).boxed()
    }
}
