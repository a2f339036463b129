//! Prefixed, sortable identifiers (`ten_01J…`). The prefix names the kind so
//! an id pasted in the wrong place is caught at the edge, and the ULID body
//! sorts by creation time, which gives keyset pagination for free.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::FieldError;

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, utoipa::ToSchema)]
        #[schema(value_type = String, example = json!(concat!($prefix, "01jd3x7k2q9v8m4n6p5r0s1t2w")))]
        pub struct $name(String);

        impl $name {
            /// The prefix every id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A new id whose ULID body encodes `now_ms` and `random`.
            /// Callers pass time and randomness so this stays pure.
            pub fn generate(now_ms: u64, random: u128) -> Self {
                let ulid = ulid::Ulid::from_parts(now_ms, random);
                // One allocation: the gateway makes an id per request.
                let mut body = [0u8; ulid::ULID_LEN];
                let body = ulid.array_to_str(&mut body);
                body.make_ascii_lowercase();
                let mut id = String::with_capacity($prefix.len() + ulid::ULID_LEN);
                id.push_str($prefix);
                id.push_str(body);
                Self(id)
            }

            /// Parses and validates an id; `field` names the value in errors.
            pub fn parse(s: &str, field: &str) -> Result<Self, FieldError> {
                let body = s.strip_prefix($prefix).ok_or_else(|| {
                    FieldError::new(field, format!("must be an id starting with `{}`", $prefix))
                })?;
                ulid::Ulid::from_string(body)
                    .map_err(|_| FieldError::new(field, format!("`{s}` is not a valid id")))?;
                Ok(Self(s.to_ascii_lowercase()))
            }

            /// The id as stored and sent.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// Wraps a value read back from the store, which only ever holds
            /// ids this type produced.
            pub fn from_trusted(s: String) -> Self {
                Self(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = FieldError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s, "id")
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::parse(&s, "id").map_err(|e| serde::de::Error::custom(e.message))
            }
        }
    };
}

prefixed_id!(
    /// A tenant: the unit of isolation, quota and billing.
    TenantId, "ten_");
prefixed_id!(
    /// An API key (the public half; the secret is never stored).
    KeyId, "key_");
prefixed_id!(
    /// A node: one machine running a Flotilla agent.
    NodeId, "node_");
prefixed_id!(
    /// One physical GPU on a node.
    GpuId, "gpu_");
prefixed_id!(
    /// An instance: GPUs rented by a tenant, running one command.
    InstanceId, "inst_");
prefixed_id!(
    /// A job: batch or training work run by a gang of instances.
    JobId, "job_");
prefixed_id!(
    /// A node pool: a group of alike nodes in a region.
    PoolId, "pool_");
prefixed_id!(
    /// A serverless inference endpoint: a model served by replicas the
    /// autoscaler adds and removes, reached through the gateway.
    EndpointId, "ep_");
prefixed_id!(
    /// One inference request through the gateway: the idempotency key of
    /// its metered usage.
    RequestId, "req_");
prefixed_id!(
    /// An invoice: one tenant's bill for one period, derived from the ledger.
    InvoiceId, "inv_");
prefixed_id!(
    /// A provider: an owner of nodes who offers their GPUs and is paid for
    /// the usage they carry.
    ProviderId, "prov_");
prefixed_id!(
    /// A tenant's credentials for one container registry.
    RegistryCredentialId, "rcred_");
prefixed_id!(
    /// One entry of the audit log: a mutating API call, who made it and
    /// how it ended.
    AuditId, "aud_");
prefixed_id!(
    /// A session into a running instance (exec, shell, port-forward),
    /// from the tenant's WebSocket to the agent's.
    AccessSessionId, "acc_");
prefixed_id!(
    /// An SSH public key a tenant registered: `flotilla ssh` lets in
    /// whoever proves they hold its private half.
    SshKeyId, "sshk_");

/// A piece of queued work: an instance or a job. Names what a preemption
/// made room for (`preempted_by`); sent as the plain id.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkId {
    /// An instance.
    Instance(InstanceId),
    /// A job (its gang).
    Job(JobId),
}

impl WorkId {
    /// Parses an instance or a job id, by its prefix.
    pub fn parse(s: &str, field: &str) -> Result<Self, FieldError> {
        if s.starts_with(JobId::PREFIX) {
            JobId::parse(s, field).map(Self::Job)
        } else if s.starts_with(InstanceId::PREFIX) {
            InstanceId::parse(s, field).map(Self::Instance)
        } else {
            Err(FieldError::new(
                field,
                format!(
                    "must be an id starting with `{}` or `{}`",
                    InstanceId::PREFIX,
                    JobId::PREFIX
                ),
            ))
        }
    }

    /// Wraps a value read back from the store, by its prefix.
    pub fn from_trusted(s: String) -> Self {
        if s.starts_with(JobId::PREFIX) {
            Self::Job(JobId::from_trusted(s))
        } else {
            Self::Instance(InstanceId::from_trusted(s))
        }
    }

    /// The id as stored and sent.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Instance(i) => i.as_str(),
            Self::Job(j) => j.as_str(),
        }
    }
}

impl From<InstanceId> for WorkId {
    fn from(i: InstanceId) -> Self {
        Self::Instance(i)
    }
}

impl From<JobId> for WorkId {
    fn from(j: JobId) -> Self {
        Self::Job(j)
    }
}

impl PartialEq<InstanceId> for WorkId {
    fn eq(&self, other: &InstanceId) -> bool {
        matches!(self, Self::Instance(i) if i == other)
    }
}

impl fmt::Display for WorkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for WorkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for WorkId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for WorkId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s, "id").map_err(|e| serde::de::Error::custom(e.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sort_by_time() {
        let a = InstanceId::generate(1_000, 7);
        let b = InstanceId::generate(2_000, 1);
        assert!(a.as_str().starts_with("inst_"));
        assert!(a < b, "later ids sort after earlier ones");
        assert_eq!(InstanceId::parse(a.as_str(), "id").unwrap(), a);
    }

    #[test]
    fn generated_ids_are_the_prefix_and_the_lowercase_ulid() {
        for (ms, r) in [
            (0, 0),
            (1_700_000_000_000, u128::MAX >> 48),
            (42, 0xdead_beef),
        ] {
            let ulid = ulid::Ulid::from_parts(ms, r);
            let expected = format!("req_{}", ulid.to_string().to_lowercase());
            assert_eq!(RequestId::generate(ms, r).as_str(), expected);
        }
    }

    #[test]
    fn wrong_prefix_and_garbage_name_the_field() {
        let t = TenantId::generate(1, 1);
        let e = InstanceId::parse(t.as_str(), "instance_id").unwrap_err();
        assert_eq!(e.field, "instance_id");
        assert!(e.message.contains("inst_"));
        let e = InstanceId::parse("inst_notaulid", "instance_id").unwrap_err();
        assert!(e.message.contains("not a valid id"));
    }

    #[test]
    fn work_ids_are_told_apart_by_prefix_and_sent_plain() {
        let i = InstanceId::generate(1, 1);
        let j = JobId::generate(1, 2);
        let wi = WorkId::parse(i.as_str(), "by").unwrap();
        let wj = WorkId::parse(j.as_str(), "by").unwrap();
        assert_eq!(wi, i);
        assert_eq!(wj, WorkId::Job(j.clone()));
        assert_eq!(
            serde_json::to_value(&wj).unwrap(),
            serde_json::json!(j.as_str())
        );
        let back: WorkId = serde_json::from_value(serde_json::json!(i.as_str())).unwrap();
        assert_eq!(back, WorkId::Instance(i));
        assert_eq!(WorkId::from_trusted(j.to_string()), WorkId::Job(j));
        assert_eq!(WorkId::parse("ten_x", "by").unwrap_err().field, "by");
    }
}
