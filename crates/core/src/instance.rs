//! Instances: N whole GPUs of a model rented by a tenant, running one
//! command. This module holds the lifecycle rules and the validation of a
//! create request; the server records, the agent executes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::catalog::Catalog;
use crate::error::FieldError;
use crate::placement::GpuShare;

/// Where an instance is in its life. Every change is recorded with a
/// timestamp and a reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Recorded, waiting for GPUs; the reason says why it is not placed.
    Pending,
    /// GPUs on a node are reserved; the node's agent has not started it.
    Scheduled,
    /// The agent is starting the command.
    Starting,
    /// The command runs.
    Running,
    /// The command exited with status 0.
    Succeeded,
    /// The command exited non-zero, could not start, or was killed.
    Failed,
    /// Stopped on request.
    Stopped,
    /// The node stopped answering; if its agent returns and the command
    /// still runs, the instance goes back to `running`.
    Lost,
}

impl InstanceState {
    /// Every state, in lifecycle order.
    pub const ALL: [InstanceState; 8] = [
        Self::Pending,
        Self::Scheduled,
        Self::Starting,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Stopped,
        Self::Lost,
    ];

    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Scheduled => "scheduled",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Stopped => "stopped",
            Self::Lost => "lost",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Final states: nothing runs and no GPU is held.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Stopped)
    }

    /// States in which the instance holds GPUs.
    pub fn holds_gpus(self) -> bool {
        matches!(self, Self::Scheduled | Self::Starting | Self::Running)
    }

    /// Whether the lifecycle allows going from `self` to `next`.
    pub fn can_transition_to(self, next: Self) -> bool {
        use InstanceState::*;
        match (self, next) {
            (Pending, Scheduled | Stopped | Failed) => true,
            (Scheduled, Starting | Running | Succeeded | Failed | Stopped | Lost) => true,
            (Starting, Running | Succeeded | Failed | Stopped | Lost) => true,
            (Running, Succeeded | Failed | Stopped | Lost) => true,
            // An agent that returns may report the command still running, or
            // its exit while the node was away.
            (Lost, Running | Succeeded | Failed | Stopped) => true,
            _ => false,
        }
    }
}

/// How the instance is to be billed; recorded now, priced by billing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BillingClass {
    /// Pay per second at the on-demand price.
    #[default]
    OnDemand,
    /// Cheaper, may be preempted.
    Spot,
    /// Drawn from a reserved commitment.
    Reserved,
}

impl BillingClass {
    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OnDemand => "on_demand",
            Self::Spot => "spot",
            Self::Reserved => "reserved",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::OnDemand, Self::Spot, Self::Reserved]
            .into_iter()
            .find(|b| b.as_str() == s)
    }
}

/// Largest GPU count one instance may ask for (one node).
pub const MAX_GPUS_PER_INSTANCE: u32 = 64;
/// Largest number of command words.
pub const MAX_COMMAND_WORDS: usize = 1024;
/// Largest number of environment variables.
pub const MAX_ENV_VARS: usize = 256;

/// Variables the agent sets itself; a user may not override them, or the
/// instance could see GPUs it does not own.
pub const RESERVED_ENV: [&str; 5] = [
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    // A fraction's MPS limits: overriding them would take more than the share.
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
];

crate::work::work_request! {
    /// What a tenant asks for when creating an instance: one member's work.
    pub struct CreateInstance {
        /// Whole GPUs, all of one model, on one node (1–64); 1 with a
        /// `gpu_fraction` or a `mig_profile`.
        pub gpus: u32,
    }
}

/// What an instance run from an image needs beyond the command. Limits
/// (`cpu_milli`, `memory_mb`) are the instance's own and are enforced by
/// the engine's cgroups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ImageSpec {
    /// Image reference (`registry/name:tag` or `name@sha256:…`).
    pub image: String,
    /// Container ports to publish.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Scratch space at `/scratch`, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scratch_mb: Option<u64>,
}

/// Where a container's only writable, tenant-visible space is mounted: a
/// working directory elsewhere is refused.
pub const SCRATCH_DIR: &str = "/scratch";
/// Most ports one instance may publish.
pub const MAX_PORTS: usize = 16;
/// Largest scratch space, MiB (1 TiB).
pub const MAX_SCRATCH_MB: u64 = 1024 * 1024;
/// Largest disk limit of an instance's directory, MiB (64 TiB).
pub const MAX_DISK_MB: u64 = 64 * 1024 * 1024;

/// Checks the container part of a create request: an image reference of
/// registry characters, distinct ports, a bounded scratch size, and a
/// working directory inside the scratch area. No field can name a host
/// path, a device, a capability or privileged mode: the request has none.
pub fn validate_image(
    image: Option<String>,
    ports: &[u16],
    scratch_mb: Option<u64>,
    workdir: Option<&str>,
) -> Result<Option<ImageSpec>, FieldError> {
    let Some(image) = image else {
        if !ports.is_empty() {
            return Err(FieldError::new(
                "ports",
                "publishing ports needs an image (`image`)",
            ));
        }
        if scratch_mb.is_some() {
            return Err(FieldError::new(
                "scratch_mb",
                "a scratch volume needs an image (`image`)",
            ));
        }
        return Ok(None);
    };
    let valid_char = |c: char| c.is_ascii_alphanumeric() || "./:_@-".contains(c);
    if image.is_empty()
        || image.len() > 255
        || image.starts_with(['-', '/', '.', ':', '@'])
        || !image.chars().all(valid_char)
        || image.contains("//")
    {
        return Err(FieldError::new(
            "image",
            "must be an image reference such as `registry.example/name:tag` (letters, digits, `./:_@-`, at most 255)",
        ));
    }
    if ports.len() > MAX_PORTS {
        return Err(FieldError::new(
            "ports",
            format!("at most {MAX_PORTS} ports"),
        ));
    }
    for (i, p) in ports.iter().enumerate() {
        if *p == 0 {
            return Err(FieldError::new(
                format!("ports[{i}]"),
                "must be a port between 1 and 65535",
            ));
        }
        if ports[..i].contains(p) {
            return Err(FieldError::new(
                format!("ports[{i}]"),
                format!("port {p} is listed twice"),
            ));
        }
    }
    if let Some(mb) = scratch_mb {
        if mb == 0 || mb > MAX_SCRATCH_MB {
            return Err(FieldError::new(
                "scratch_mb",
                format!("must be between 1 and {MAX_SCRATCH_MB}"),
            ));
        }
    }
    if let Some(w) = workdir {
        let inside = w == SCRATCH_DIR
            || (w.starts_with(&format!("{SCRATCH_DIR}/")) && !w.split('/').any(|c| c == ".."));
        if !inside {
            return Err(FieldError::new(
                "workdir",
                format!("a container's working directory must be inside its scratch area `{SCRATCH_DIR}`; host paths are never mounted"),
            ));
        }
    }
    let mut ports = ports.to_vec();
    ports.sort_unstable();
    Ok(Some(ImageSpec {
        image,
        ports,
        scratch_mb,
    }))
}

/// Largest absolute queue priority.
pub const MAX_PRIORITY: i32 = 1000;

/// A create request after validation: names resolved, defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceSpec {
    /// Display name.
    pub name: Option<String>,
    /// GPU count.
    pub gpus: u32,
    /// Canonical catalog names; empty: any.
    pub gpu_types: Vec<String>,
    /// CPU in milli-cores.
    pub cpu_milli: u32,
    /// Memory in MiB.
    pub memory_mb: u64,
    /// Disk in MiB; `None`: the node's default.
    pub disk_mb: Option<u64>,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Environment.
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub workdir: Option<String>,
    /// Billing class.
    pub billing_class: BillingClass,
    /// Queue priority, higher first.
    pub priority: i32,
    /// Service tier, 1..=3.
    pub tier: u8,
    /// May be preempted.
    pub preemptible: bool,
    /// Whole GPUs, a fraction of one, or one MIG instance.
    pub share: GpuShare,
    /// Run from this image in a container; `None`: the command on the node.
    pub image: Option<ImageSpec>,
}

/// Checks a share request (`gpu_fraction` or `mig_profile`) and narrows
/// `gpu_types` to the models that offer a MIG profile. Returns the share.
pub fn validate_share(
    catalog: &Catalog,
    gpus: u32,
    gpu_types: &mut Vec<String>,
    gpu_fraction: Option<f64>,
    mig_profile: Option<&str>,
) -> Result<GpuShare, FieldError> {
    let share = match (gpu_fraction, mig_profile) {
        (None, None) => return Ok(GpuShare::Whole),
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                "mig_profile",
                "ask for either gpu_fraction or mig_profile, not both",
            ))
        }
        (Some(f), None) => {
            let milli = f * 1000.0;
            if !f.is_finite() || !(1.0 - 1e-9..=1000.0 + 1e-9).contains(&milli) {
                return Err(FieldError::new(
                    "gpu_fraction",
                    format!("must be between 0.001 and 1, got {f}"),
                ));
            }
            if (milli - milli.round()).abs() > 1e-6 {
                return Err(FieldError::new(
                    "gpu_fraction",
                    format!("must be a multiple of 0.001, got {f}"),
                ));
            }
            // Range-checked above: 1..=1000.
            match milli.round() as u16 {
                1000 => GpuShare::Whole,
                m => GpuShare::Fraction { milli: m },
            }
        }
        (None, Some(name)) => {
            let with_mig: Vec<&str> = catalog
                .models()
                .iter()
                .filter(|m| m.mig_geometry.is_some())
                .map(|m| m.name.as_str())
                .collect();
            let Some((profile, models)) = catalog.mig_profile(name) else {
                return Err(FieldError::new(
                    "mig_profile",
                    format!(
                        "`{name}` is not a MIG profile of any catalog model; models with MIG: {}",
                        with_mig.join(", ")
                    ),
                ));
            };
            let offering: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
            if gpu_types.is_empty() {
                *gpu_types = offering;
            } else {
                let asked = gpu_types.join(", ");
                gpu_types.retain(|t| offering.contains(t));
                if gpu_types.is_empty() {
                    return Err(FieldError::new(
                        "mig_profile",
                        format!(
                            "{asked} offers no MIG profile `{name}`; it exists on: {}",
                            offering.join(", ")
                        ),
                    ));
                }
            }
            GpuShare::Mig(profile)
        }
    };
    if gpus != 1 && share != GpuShare::Whole {
        return Err(FieldError::new(
            "gpus",
            format!("a GPU share is part of one GPU: gpus must be 1, got {gpus}"),
        ));
    }
    Ok(share)
}

fn valid_env_name(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl CreateInstance {
    /// Validates against the catalog and fills in defaults. Every error
    /// names the JSON path of the value at fault.
    pub fn validate(self, catalog: &Catalog) -> Result<InstanceSpec, FieldError> {
        if let Some(name) = &self.name {
            crate::tenant::validate_name(name, "name")?;
        }
        if self.gpus == 0 || self.gpus > MAX_GPUS_PER_INSTANCE {
            return Err(FieldError::new(
                "gpus",
                format!(
                    "must be between 1 and {MAX_GPUS_PER_INSTANCE}, got {}",
                    self.gpus
                ),
            ));
        }
        let mut gpu_types = Vec::with_capacity(self.gpu_types.len());
        for (i, t) in self.gpu_types.iter().enumerate() {
            let name = catalog.resolve(t, &format!("gpu_types[{i}]"))?;
            if !gpu_types.contains(&name) {
                gpu_types.push(name);
            }
        }
        let share = validate_share(
            catalog,
            self.gpus,
            &mut gpu_types,
            self.gpu_fraction,
            self.mig_profile.as_deref(),
        )?;
        let cpu_milli = self.cpu_milli.unwrap_or(1000);
        if cpu_milli == 0 || cpu_milli > 1_024_000 {
            return Err(FieldError::new(
                "cpu_milli",
                "must be between 1 and 1024000",
            ));
        }
        let memory_mb = self.memory_mb.unwrap_or(1024);
        if memory_mb == 0 || memory_mb > 64 * 1024 * 1024 {
            return Err(FieldError::new(
                "memory_mb",
                "must be between 1 and 67108864",
            ));
        }
        if let Some(mb) = self.disk_mb {
            if mb == 0 || mb > MAX_DISK_MB {
                return Err(FieldError::new(
                    "disk_mb",
                    format!("must be between 1 and {MAX_DISK_MB}"),
                ));
            }
        }
        let image = validate_image(
            self.image,
            &self.ports,
            self.scratch_mb,
            self.workdir.as_deref(),
        )?;
        // An image brings its own default command.
        if (image.is_none() && self.command.is_empty())
            || self.command.first().is_some_and(|c| c.trim().is_empty())
        {
            return Err(FieldError::new("command", "must name a program to run"));
        }
        if self.command.len() > MAX_COMMAND_WORDS {
            return Err(FieldError::new(
                "command",
                format!("at most {MAX_COMMAND_WORDS} words"),
            ));
        }
        if let Some(i) = self.command.iter().position(|w| w.contains('\0')) {
            return Err(FieldError::new(
                format!("command[{i}]"),
                "must not contain NUL",
            ));
        }
        if self.env.len() > MAX_ENV_VARS {
            return Err(FieldError::new(
                "env",
                format!("at most {MAX_ENV_VARS} variables"),
            ));
        }
        for (k, v) in &self.env {
            if !valid_env_name(k) {
                return Err(FieldError::new(
                    format!("env.{k}"),
                    "variable names are letters, digits and '_', not starting with a digit",
                ));
            }
            if RESERVED_ENV.contains(&k.as_str()) {
                return Err(FieldError::new(
                    format!("env.{k}"),
                    "is set by flotilla to the instance's GPUs and cannot be overridden",
                ));
            }
            if v.contains('\0') {
                return Err(FieldError::new(format!("env.{k}"), "must not contain NUL"));
            }
        }
        if let Some(w) = &self.workdir {
            if !w.starts_with('/') || w.contains('\0') {
                return Err(FieldError::new("workdir", "must be an absolute path"));
            }
        }
        let priority = self.priority.unwrap_or(0);
        if !(-MAX_PRIORITY..=MAX_PRIORITY).contains(&priority) {
            return Err(FieldError::new(
                "priority",
                format!("must be between -{MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}"),
            ));
        }
        let spot = self.billing_class == BillingClass::Spot;
        let tier = self.tier.unwrap_or(if spot { 2 } else { 1 });
        if !(1..=3).contains(&tier) {
            return Err(FieldError::new(
                "tier",
                format!("must be 1 (dedicated), 2 (shared/spot) or 3 (queued), got {tier}"),
            ));
        }
        let preemptible = self.preemptible.unwrap_or(spot);
        if preemptible && tier == 1 {
            // Tier 1 is the promise of never being preempted; accepting both
            // would make one of them a lie.
            return Err(FieldError::new(
                "preemptible",
                "tier 1 (dedicated) work cannot be preemptible; use tier 2 or 3",
            ));
        }
        Ok(InstanceSpec {
            name: self.name,
            gpus: self.gpus,
            gpu_types,
            cpu_milli,
            memory_mb,
            disk_mb: self.disk_mb,
            command: self.command,
            env: self.env,
            workdir: self.workdir,
            billing_class: self.billing_class,
            priority,
            tier,
            preemptible,
            share,
            image,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> CreateInstance {
        CreateInstance {
            name: None,
            gpus: 2,
            gpu_types: vec!["h100".into()],
            cpu_milli: None,
            memory_mb: None,
            command: vec!["true".into()],
            env: BTreeMap::new(),
            workdir: None,
            billing_class: BillingClass::OnDemand,
            priority: None,
            tier: None,
            preemptible: None,
            gpu_fraction: None,
            mig_profile: None,
            image: None,
            ports: Vec::new(),
            scratch_mb: None,
            disk_mb: None,
        }
    }

    #[test]
    fn a_disk_limit_is_bounded_and_named_when_refused() {
        assert_eq!(req().validate(&Catalog::default()).unwrap().disk_mb, None);
        let ok = CreateInstance {
            disk_mb: Some(512),
            ..req()
        };
        assert_eq!(ok.validate(&Catalog::default()).unwrap().disk_mb, Some(512));
        for bad in [0, MAX_DISK_MB + 1] {
            let e = CreateInstance {
                disk_mb: Some(bad),
                ..req()
            }
            .validate(&Catalog::default())
            .unwrap_err();
            assert_eq!(e.field, "disk_mb", "{bad}");
        }
        // On the wire it is optional and left out when absent.
        let json = serde_json::to_value(req()).unwrap();
        assert!(json.get("disk_mb").is_none());
    }

    #[test]
    fn images_take_ports_and_scratch_and_refuse_host_paths() {
        let c = Catalog::default();
        let ok = CreateInstance {
            image: Some("registry.example/team/app:1.2".into()),
            ports: vec![8080, 22],
            scratch_mb: Some(512),
            command: Vec::new(),
            workdir: Some("/scratch/work".into()),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(
            ok.image,
            Some(ImageSpec {
                image: "registry.example/team/app:1.2".into(),
                ports: vec![22, 8080],
                scratch_mb: Some(512),
            })
        );
        let bad = |r: CreateInstance| r.validate(&c).unwrap_err().field;
        let img = || CreateInstance {
            image: Some("busybox".into()),
            ..req()
        };
        assert_eq!(
            bad(CreateInstance {
                workdir: Some("/etc".into()),
                ..img()
            }),
            "workdir"
        );
        assert_eq!(
            bad(CreateInstance {
                workdir: Some("/scratch/../etc".into()),
                ..img()
            }),
            "workdir"
        );
        assert_eq!(
            bad(CreateInstance {
                ports: vec![80, 80],
                ..img()
            }),
            "ports[1]"
        );
        assert_eq!(
            bad(CreateInstance {
                ports: vec![0],
                ..img()
            }),
            "ports[0]"
        );
        assert_eq!(
            bad(CreateInstance {
                scratch_mb: Some(0),
                ..img()
            }),
            "scratch_mb"
        );
        assert_eq!(
            bad(CreateInstance {
                image: Some("-rm".into()),
                ..req()
            }),
            "image"
        );
        assert_eq!(
            bad(CreateInstance {
                image: Some("a b".into()),
                ..req()
            }),
            "image"
        );
        assert_eq!(
            bad(CreateInstance {
                ports: vec![80],
                ..req()
            }),
            "ports"
        );
        assert_eq!(
            bad(CreateInstance {
                command: Vec::new(),
                ..req()
            }),
            "command"
        );
        // Nothing in a request can ask for privileges or a host mount.
        for field in ["privileged", "cap_add", "volumes", "mounts", "devices"] {
            let body = format!(r#"{{"gpus": 1, "image": "x", "{field}": true}}"#);
            let e = serde_json::from_str::<CreateInstance>(&body).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn valid_request_gets_defaults_and_canonical_names() {
        let s = req().validate(&Catalog::default()).unwrap();
        assert_eq!(s.gpu_types, vec!["H100".to_string()]);
        assert_eq!((s.cpu_milli, s.memory_mb), (1000, 1024));
        assert_eq!((s.priority, s.tier, s.preemptible), (0, 1, false));
        let spot = CreateInstance {
            billing_class: BillingClass::Spot,
            ..req()
        }
        .validate(&Catalog::default())
        .unwrap();
        assert_eq!((spot.tier, spot.preemptible), (2, true));
    }

    #[test]
    fn each_bad_value_names_its_field() {
        let c = Catalog::default();
        let mut cases: Vec<(CreateInstance, &str)> = vec![
            (CreateInstance { gpus: 0, ..req() }, "gpus"),
            (CreateInstance { gpus: 65, ..req() }, "gpus"),
            (
                CreateInstance {
                    gpu_types: vec!["H100".into(), "X1".into()],
                    ..req()
                },
                "gpu_types[1]",
            ),
            (
                CreateInstance {
                    command: vec![],
                    ..req()
                },
                "command",
            ),
            (
                CreateInstance {
                    cpu_milli: Some(0),
                    ..req()
                },
                "cpu_milli",
            ),
            (
                CreateInstance {
                    memory_mb: Some(0),
                    ..req()
                },
                "memory_mb",
            ),
            (
                CreateInstance {
                    workdir: Some("rel".into()),
                    ..req()
                },
                "workdir",
            ),
            (
                CreateInstance {
                    name: Some("Bad Name".into()),
                    ..req()
                },
                "name",
            ),
            (
                CreateInstance {
                    env: [("CUDA_VISIBLE_DEVICES".to_string(), "0".to_string())].into(),
                    ..req()
                },
                "env.CUDA_VISIBLE_DEVICES",
            ),
            (
                CreateInstance {
                    env: [("1X".to_string(), "v".to_string())].into(),
                    ..req()
                },
                "env.1X",
            ),
        ];
        cases_sched(&mut cases);
        cases_share(&mut cases);
        for (r, field) in cases {
            assert_eq!(r.validate(&c).unwrap_err().field, field);
        }
    }

    fn cases_sched(cases: &mut Vec<(CreateInstance, &str)>) {
        cases.push((
            CreateInstance {
                priority: Some(1001),
                ..req()
            },
            "priority",
        ));
        cases.push((
            CreateInstance {
                tier: Some(4),
                ..req()
            },
            "tier",
        ));
        cases.push((
            CreateInstance {
                tier: Some(0),
                ..req()
            },
            "tier",
        ));
        cases.push((
            CreateInstance {
                preemptible: Some(true),
                ..req()
            },
            "preemptible",
        ));
    }

    fn cases_share(cases: &mut Vec<(CreateInstance, &str)>) {
        let one = || CreateInstance { gpus: 1, ..req() };
        for (f, field) in [
            (0.0, "gpu_fraction"),
            (1.5, "gpu_fraction"),
            (0.0005, "gpu_fraction"),
        ] {
            cases.push((
                CreateInstance {
                    gpu_fraction: Some(f),
                    ..one()
                },
                field,
            ));
        }
        cases.push((
            CreateInstance {
                gpu_fraction: Some(0.5),
                ..req()
            },
            "gpus",
        ));
        // A profile of no model, a profile the asked model lacks, a model
        // without MIG, and both kinds of share at once.
        for (types, profile) in [
            (vec!["h100"], "9g.1gb"),
            (vec!["H200"], "1g.10gb"),
            (vec!["L40S"], "1g.10gb"),
        ] {
            cases.push((
                CreateInstance {
                    gpu_types: types.into_iter().map(String::from).collect(),
                    mig_profile: Some(profile.into()),
                    ..one()
                },
                "mig_profile",
            ));
        }
        cases.push((
            CreateInstance {
                gpu_fraction: Some(0.5),
                mig_profile: Some("1g.10gb".into()),
                ..one()
            },
            "mig_profile",
        ));
    }

    #[test]
    fn shares_validate_and_mig_narrows_the_models() {
        let c = Catalog::default();
        let s = CreateInstance {
            gpus: 1,
            gpu_fraction: Some(0.25),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.share, GpuShare::Fraction { milli: 250 });
        let s = CreateInstance {
            gpus: 1,
            gpu_fraction: Some(1.0),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.share, GpuShare::Whole);
        let s = CreateInstance {
            gpus: 1,
            gpu_types: vec![],
            mig_profile: Some("1G.10GB".into()),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.gpu_types, vec!["A100-80GB".to_string(), "H100".into()]);
        match s.share {
            GpuShare::Mig(p) => assert_eq!((p.name.as_str(), p.compute_slices), ("1g.10gb", 1)),
            other => panic!("{other:?}"),
        }
        let s = CreateInstance {
            gpus: 1,
            gpu_types: vec!["L40S".into(), "H100".into()],
            mig_profile: Some("3g.40gb".into()),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.gpu_types, vec!["H100".to_string()]);
    }

    #[test]
    fn lifecycle_rules() {
        use InstanceState::*;
        assert!(Pending.can_transition_to(Scheduled));
        assert!(Running.can_transition_to(Lost));
        assert!(Lost.can_transition_to(Running));
        assert!(!Succeeded.can_transition_to(Running));
        assert!(!Pending.can_transition_to(Running));
        for s in InstanceState::ALL {
            assert_eq!(InstanceState::parse(s.as_str()), Some(s));
            if s.is_terminal() {
                assert!(InstanceState::ALL.iter().all(|n| !s.can_transition_to(*n)));
            }
        }
    }
}
