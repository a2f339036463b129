//! What every kind of work shares. An instance is work of one member; a
//! job is a gang of members, each of which is an instance. Both are asked
//! for, validated, stored and shown with the same fields, so those fields
//! are declared once here and every request, spec and record that carries
//! them is declared through these macros: a field added here (an image, a
//! port) reaches instances and jobs alike, with one doc and one wire name.
//!
//! Macros rather than a nested struct because the wire format is flat
//! (`{"gpus": 2, "command": [...]}`, not `{"work": {...}}`) and a serde
//! `flatten` would lose both `deny_unknown_fields` and the JSON path that
//! a 422 names.

/// Declares a work request (`CreateInstance`, `CreateJob`): the struct's
/// own fields, then every field one member asks for. Also derives the
/// wire traits and refuses unknown fields, and gives the request
/// `to_member(gpus)`, the request of one of its members.
macro_rules! work_request {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field : $ty, )*
            /// Optional DNS-label name, for display (a job's members are
            /// named `NAME-RANK`).
            #[serde(default)]
            pub name: Option<String>,
            /// Acceptable GPU models (any of them); empty or absent: any model.
            #[serde(default)]
            pub gpu_types: Vec<String>,
            /// CPU per member in thousandths of a core (default 1000).
            #[serde(default)]
            pub cpu_milli: Option<u32>,
            /// Memory per member in MiB (default 1024).
            #[serde(default)]
            pub memory_mb: Option<u64>,
            /// Disk per member in MiB: how large its working directory
            /// may grow on a process node before it is stopped (default:
            /// the node's, `flotilla agent --default-disk`).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub disk_mb: Option<u64>,
            /// Program and arguments, run without a shell (by every member);
            /// with `image`, replaces the image's default command and may be
            /// left out.
            #[serde(default)]
            pub command: Vec<String>,
            /// Extra environment variables (`FLOTILLA_JOB_*` and the GPU
            /// selection variables are set by Flotilla and reserved).
            #[serde(default)]
            pub env: std::collections::BTreeMap<String, String>,
            /// Working directory on the node (absolute path); default: the
            /// agent's per-instance directory.
            #[serde(default)]
            pub workdir: Option<String>,
            /// Billing class (default `on_demand`).
            #[serde(default)]
            pub billing_class: $crate::instance::BillingClass,
            /// Queue priority, higher first (default 0, -1000..=1000). Work of
            /// a higher priority may preempt preemptible work of a lower one.
            #[serde(default)]
            pub priority: Option<i32>,
            /// Service tier: 1 dedicated, 2 shared/spot, 3 queued. Default: 2
            /// for `spot`, 1 otherwise. Tier-1 work is never preempted.
            #[serde(default)]
            pub tier: Option<u8>,
            /// Whether the scheduler may stop this work (with a notice) to
            /// make room for more important work, requeuing it; a job is
            /// stopped and requeued whole. Default: true only for `spot`.
            /// Tier 1 cannot be preemptible.
            #[serde(default)]
            pub preemptible: Option<bool>,
            /// Each member takes this share of one GPU (0.001..=1, steps of
            /// 0.001) instead of whole GPUs: it shares a GPU that is not in
            /// MIG mode with other fractions, gets that part of its compute
            /// (MPS thread percentage) and of its memory (a memory cap), and
            /// is billed that share. One GPU per member.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub gpu_fraction: Option<f64>,
            /// Each member takes one MIG instance of this profile (e.g.
            /// `1g.10gb`) on a GPU in MIG mode, instead of whole GPUs. The
            /// profile must exist on one of `gpu_types` (or, when absent, on
            /// some catalog model). One GPU per member.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub mig_profile: Option<String>,
            /// An OCI image to run each member from, in a container (on
            /// nodes whose agent runs the container runtime), instead of a
            /// command on the node.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub image: Option<String>,
            /// Container ports (TCP) to publish; the node picks the host
            /// ports, reported with their URLs. Needs `image`.
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            pub ports: Vec<u16>,
            /// Size of the container's scratch space at `/scratch` (its
            /// only writable place besides its root filesystem), MiB;
            /// default 1024. Needs `image`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub scratch_mb: Option<u64>,
        }

        impl $name {
            /// This work from what each member asks for (`member`, whose
            /// `gpus` is ignored) and this kind's own fields, in order.
            #[allow(clippy::too_many_arguments, reason = "one parameter per own field, in declaration order")]
            pub fn from_member(
                member: $crate::instance::CreateInstance,
                $( $field : $ty, )*
            ) -> Self {
                Self {
                    $( $field, )*
                    name: member.name,
                    gpu_types: member.gpu_types,
                    cpu_milli: member.cpu_milli,
                    memory_mb: member.memory_mb,
                    disk_mb: member.disk_mb,
                    command: member.command,
                    env: member.env,
                    workdir: member.workdir,
                    billing_class: member.billing_class,
                    priority: member.priority,
                    tier: member.tier,
                    preemptible: member.preemptible,
                    gpu_fraction: member.gpu_fraction,
                    mig_profile: member.mig_profile,
                    image: member.image,
                    ports: member.ports,
                    scratch_mb: member.scratch_mb,
                }
            }

            /// What one member of this work asks for, holding `gpus`.
            pub fn to_member(&self, gpus: u32) -> $crate::instance::CreateInstance {
                $crate::instance::CreateInstance {
                    gpus,
                    name: self.name.clone(),
                    gpu_types: self.gpu_types.clone(),
                    cpu_milli: self.cpu_milli,
                    memory_mb: self.memory_mb,
                    disk_mb: self.disk_mb,
                    command: self.command.clone(),
                    env: self.env.clone(),
                    workdir: self.workdir.clone(),
                    billing_class: self.billing_class,
                    priority: self.priority,
                    tier: self.tier,
                    preemptible: self.preemptible,
                    gpu_fraction: self.gpu_fraction,
                    mig_profile: self.mig_profile.clone(),
                    image: self.image.clone(),
                    ports: self.ports.clone(),
                    scratch_mb: self.scratch_mb,
                }
            }
        }
    };
}
pub(crate) use work_request;

/// Declares a stored or shown form of work (the `Instance` record, a
/// `JobSpec`): its own fields, then what every member runs with, resolved
/// (catalog names, defaults applied).
macro_rules! resolved_work {
    (
        from_spec;
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $crate::work::resolved_work! {
            $(#[$meta])*
            pub struct $name {
                $( $(#[$fmeta])* pub $field : $ty, )*
            }
        }

        impl $name {
            /// This from one member's validated spec and this type's own
            /// fields, in order.
            #[allow(clippy::too_many_arguments, reason = "one parameter per own field, in declaration order")]
            pub fn from_spec(spec: $crate::instance::InstanceSpec, $( $field : $ty, )*) -> Self {
                let (gpu_fraction, mig_profile) = spec.share.as_request();
                Self {
                    $( $field, )*
                    gpu_types: spec.gpu_types,
                    cpu_milli: spec.cpu_milli,
                    memory_mb: spec.memory_mb,
                    disk_mb: spec.disk_mb,
                    command: spec.command,
                    env: spec.env,
                    workdir: spec.workdir,
                    billing_class: spec.billing_class,
                    priority: spec.priority,
                    tier: spec.tier,
                    preemptible: spec.preemptible,
                    gpu_fraction,
                    mig_profile,
                    image: spec.image,
                }
            }
        }
    };
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( $(#[$fmeta])* pub $field : $ty, )*
            /// Acceptable models, canonical catalog names (empty: any).
            pub gpu_types: Vec<String>,
            /// CPU per member, milli-cores.
            pub cpu_milli: u32,
            /// Memory per member, MiB.
            pub memory_mb: u64,
            /// Disk per member, MiB (absent: the node's default).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub disk_mb: Option<u64>,
            /// Program and arguments.
            pub command: Vec<String>,
            /// Extra environment (without the variables Flotilla sets).
            pub env: std::collections::BTreeMap<String, String>,
            /// Working directory.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub workdir: Option<String>,
            /// Billing class.
            pub billing_class: $crate::instance::BillingClass,
            /// Queue priority, higher first.
            #[serde(default)]
            pub priority: i32,
            /// Service tier: 1 dedicated, 2 shared/spot, 3 queued.
            #[serde(default = "crate::work::default_tier")]
            pub tier: u8,
            /// The scheduler may preempt it (with a notice) for more
            /// important work.
            #[serde(default)]
            pub preemptible: bool,
            /// The share of one GPU each member asked for (absent: whole
            /// GPUs or MIG).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub gpu_fraction: Option<f64>,
            /// The MIG profile each member asked for (canonical name).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub mig_profile: Option<String>,
            /// The image each member runs from, in a container (absent: a
            /// command on the node).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub image: Option<$crate::instance::ImageSpec>,
        }
    };
}
pub(crate) use resolved_work;

/// The tier of work recorded before tiers existed: dedicated.
pub(crate) fn default_tier() -> u8 {
    1
}
