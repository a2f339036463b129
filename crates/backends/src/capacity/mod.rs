//! Capacity providers: where a node pool's machines come from.
//!
//! One trait, [`CapacityProvider`], fronts every source of GPU machines: the
//! simulated cloud ([`simulated::SimulatedCloud`], shared by the simulator
//! and the server), a real cloud API ([`openstack::Nova`]) and a local cloud
//! that "provisions" by starting `flotilla agent` processes on this machine
//! ([`local::LocalAgents`], for tests and demos). The node-pool autoscaler
//! decides how many machines a pool wants (`flotilla_scale::nodepool`);
//! the server's loop asks a provider for them and gives them back through
//! this trait, and never names a provider.
//!
//! The trait is asynchronous because a real client waits on the network.
//! Every method takes `now_ms`, the caller's clock in milliseconds since an
//! origin the caller picks: a real cloud ignores it, the simulated one runs
//! on it, so the simulator drives it from its virtual clock (its futures are
//! ready at once; the simulator polls them with
//! [`futures::executor::block_on`], which never parks for them).

pub mod local;
pub mod openstack;
pub mod simulated;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

pub use simulated::{ProvisionDelay, RegionLimit, SimulatedCloud, SimulatedCloudConfig};

/// A region of a provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// The provider's name for it.
    pub name: String,
}

/// A kind of machine a provider rents (a Nova flavor, a cloud's instance
/// type), with the GPUs it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceType {
    /// The provider's name for it (what [`ProvisionRequest::instance_type`]
    /// names).
    pub name: String,
    /// GPU model in Flotilla's catalog spelling (`H100`), `None` for a
    /// machine without GPUs.
    pub gpu_model: Option<String>,
    /// GPUs per machine.
    pub gpus: u32,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub ram_mib: u64,
    /// Whether the provider may take machines of this type back at short
    /// notice (spot, preemptible).
    pub spot: bool,
}

/// One limit of a quota: how much may be held and how much is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    /// The most that may be held; `None`: unlimited.
    pub max: Option<u64>,
    /// Held now.
    pub used: u64,
}

impl Limit {
    /// What is left; `None`: unlimited.
    pub fn left(&self) -> Option<u64> {
        self.max.map(|m| m.saturating_sub(self.used))
    }
}

/// The account's quota in a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    /// Machines.
    pub instances: Limit,
    /// Virtual CPUs.
    pub vcpus: Limit,
    /// Memory, MiB.
    pub ram_mib: Limit,
}

impl Quota {
    /// How many more machines of `t` the quota admits; `None`: unlimited.
    pub fn admits(&self, t: &InstanceType) -> Option<u64> {
        let per = |left: Option<u64>, each: u64| match (left, each) {
            (None, _) => None,
            (Some(_), 0) => None,
            (Some(l), e) => Some(l / e),
        };
        [
            self.instances.left(),
            per(self.vcpus.left(), u64::from(t.vcpus)),
            per(self.ram_mib.left(), t.ram_mib),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// How a new machine joins the control plane: its agent runs
/// `flotilla agent --server URL --join-token TOKEN` at boot.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Join {
    /// The control plane's URL as the machine reaches it.
    pub server_url: String,
    /// The one-time join token (a secret).
    pub token: String,
    /// The fingerprint the machine pins the control plane's certificate
    /// by, for an `https://` URL with a self-signed certificate; `None`:
    /// the machine's system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_fingerprint: Option<String>,
}

impl std::fmt::Debug for Join {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Join")
            .field("server_url", &self.server_url)
            .field("token", &"***")
            .field("tls_fingerprint", &self.tls_fingerprint)
            .finish()
    }
}

impl Join {
    /// The boot script a cloud machine runs (cloud-init runs a user-data
    /// file that starts with `#!` as a script): start the agent with the
    /// join token. The agent binary must be in the machine's image.
    pub fn boot_script(&self) -> String {
        let pin = self
            .tls_fingerprint
            .as_deref()
            .map(|f| format!(" --tls-fingerprint '{}'", f.replace('\'', "")))
            .unwrap_or_default();
        format!(
            "#!/bin/sh\n# flotilla node-pool machine: join the control plane once\n\
             exec flotilla agent --server '{}'{pin} --join-token '{}'\n",
            self.server_url.replace('\'', ""),
            self.token.replace('\'', "")
        )
    }
}

/// What a pool asks a provider for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionRequest {
    /// The machine's name (the Flotilla node name its agent takes).
    pub name: String,
    /// Instance type ([`InstanceType::name`]).
    pub instance_type: String,
    /// Region; `None`: the provider's choice.
    pub region: Option<String>,
    /// Spot (preemptible) capacity rather than on-demand.
    pub spot: bool,
    /// How the machine joins; `None`: it does not (the simulator).
    pub join: Option<Join>,
}

/// Where a machine is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum MachineState {
    /// Asked for, not yet running.
    Provisioning,
    /// Running (its agent may still be starting).
    Running,
    /// The provider could not make it; `no_capacity` when it said it has
    /// none (Nova's "No valid host was found").
    Failed { reason: String, no_capacity: bool },
    /// Gone: terminated, or taken back by the provider.
    Terminated,
}

/// A machine a provider granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// The provider's id for it.
    pub id: String,
    /// The name it was asked for with.
    pub name: String,
    /// Region it is in.
    pub region: String,
    /// Its instance type.
    pub instance_type: String,
    /// GPUs on it.
    pub gpus: u32,
    /// Spot capacity.
    pub spot: bool,
    /// Its state when last seen.
    pub state: MachineState,
    /// When it is ready for work, when the provider knows in advance (the
    /// simulated cloud); a real cloud says so through `state` instead.
    pub ready_at_ms: Option<u64>,
    /// When the provider will take it back, when it knows in advance (the
    /// simulated cloud decides a spot machine's fate when granting it; the
    /// simulator schedules the preemption from it). Real clouds report
    /// through [`CapacityProvider::interruptions`].
    pub preempt_at_ms: Option<u64>,
}

/// A provider's warning that it is taking a spot machine back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptionNotice {
    /// The machine's provider id.
    pub machine: String,
    /// When the warning was given (caller's clock, ms).
    pub noticed_at_ms: u64,
    /// When the machine goes (caller's clock, ms); at or before
    /// `noticed_at_ms` when it is already gone.
    pub terminate_at_ms: u64,
}

/// Why a provider call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// No machine of this kind can be had now (every region at its limit,
    /// or the cloud found no host).
    #[error("no capacity for {instance_type}: {message}")]
    NoCapacity {
        /// The instance type (or GPU) asked for.
        instance_type: String,
        /// What the provider said.
        message: String,
    },
    /// No spot capacity is on offer right now.
    #[error("no spot capacity for {instance_type}")]
    NoSpot {
        /// The instance type (or GPU) asked for.
        instance_type: String,
    },
    /// The account's quota does not admit another machine.
    #[error("quota exceeded: {message}")]
    QuotaExceeded {
        /// What the provider said.
        message: String,
    },
    /// The instance type is not one the provider offers.
    #[error("unknown instance type {name:?}")]
    UnknownInstanceType {
        /// The name asked for.
        name: String,
    },
    /// No machine with this id.
    #[error("no machine {id}")]
    NotFound {
        /// The provider id asked for.
        id: String,
    },
    /// The provider refused the credentials.
    #[error("authentication failed: {message}")]
    Auth {
        /// What the provider said.
        message: String,
    },
    /// The provider could not be reached or failed on its side; retry later.
    #[error("provider unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
    },
    /// The provider refused the request for another reason.
    #[error("provider refused: {message}")]
    Refused {
        /// What it said.
        message: String,
    },
    /// The provider's answer could not be understood.
    #[error("unexpected answer from the provider: {message}")]
    Protocol {
        /// What was wrong with it.
        message: String,
    },
}

impl CapacityError {
    /// Whether asking again later may succeed without anyone acting
    /// (capacity frees up, the API comes back).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::NoCapacity { .. } | Self::NoSpot { .. } | Self::Unavailable { .. }
        )
    }
}

/// Something that hands out GPU machines. Object safe: the server holds an
/// `Arc<dyn CapacityProvider>` chosen by configuration. `now_ms` is the
/// caller's clock (see the module doc).
pub trait CapacityProvider: Send + Sync {
    /// A short name for logs (`simulated`, `openstack`, `local`).
    fn kind(&self) -> &'static str;

    /// The regions the account may use.
    fn regions(&self) -> BoxFuture<'_, Result<Vec<Region>, CapacityError>>;

    /// The instance types on offer.
    fn instance_types(&self) -> BoxFuture<'_, Result<Vec<InstanceType>, CapacityError>>;

    /// The account's quota in `region`.
    fn quota<'a>(&'a self, region: &'a str) -> BoxFuture<'a, Result<Quota, CapacityError>>;

    /// Ask for one machine. A real cloud answers once it accepted the
    /// request (the machine is `Provisioning`); a failure to build it later
    /// shows in [`CapacityProvider::describe`].
    fn provision<'a>(
        &'a self,
        now_ms: u64,
        req: &'a ProvisionRequest,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>>;

    /// A machine as the provider sees it now.
    fn describe<'a>(
        &'a self,
        now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>>;

    /// Give a machine back. Idempotent: a machine already gone is fine.
    fn terminate<'a>(
        &'a self,
        now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<(), CapacityError>>;

    /// The spot machines the provider is taking back (or took back without
    /// being asked), as of `now_ms`.
    fn interruptions(
        &self,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Vec<InterruptionNotice>, CapacityError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_admits_the_tightest_limit() {
        let t = InstanceType {
            name: "g".into(),
            gpu_model: Some("H100".into()),
            gpus: 8,
            vcpus: 16,
            ram_mib: 1024,
            spot: false,
        };
        let q = Quota {
            instances: Limit {
                max: Some(10),
                used: 2,
            },
            vcpus: Limit {
                max: Some(64),
                used: 16,
            },
            ram_mib: Limit { max: None, used: 0 },
        };
        assert_eq!(q.admits(&t), Some(3));
        let open = Quota {
            instances: Limit { max: None, used: 0 },
            vcpus: Limit { max: None, used: 0 },
            ram_mib: Limit { max: None, used: 0 },
        };
        assert_eq!(open.admits(&t), None);
    }

    #[test]
    fn a_join_never_prints_its_token() {
        let j = Join {
            server_url: "http://cp:7420".into(),
            token: "fjt_secret".into(),
            tls_fingerprint: None,
        };
        assert!(!format!("{j:?}").contains("secret"));
        assert!(j.boot_script().contains("--join-token 'fjt_secret'"));
        assert!(!j.boot_script().contains("--tls-fingerprint"));
        let pinned = Join {
            server_url: "https://cp:7420".into(),
            tls_fingerprint: Some("sha256:ab12".into()),
            ..j
        };
        assert!(
            pinned.boot_script().contains(
                "--server 'https://cp:7420' --tls-fingerprint 'sha256:ab12' --join-token"
            ),
            "{}",
            pinned.boot_script()
        );
    }
}
