//! Tenants and the roles an API key can carry.

use serde::{Deserialize, Serialize};

/// What an API key may do. Checked on every route by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Runs the platform: sees and changes every tenant, sets quotas.
    Operator,
    /// Manages one tenant: its keys and its work.
    TenantAdmin,
    /// Uses one tenant: rents GPUs and runs work, reads its own resources.
    TenantMember,
    /// Offers machines: registers nodes and runs the agent protocol.
    Provider,
}

impl Role {
    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::TenantAdmin => "tenant_admin",
            Role::TenantMember => "tenant_member",
            Role::Provider => "provider",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "operator" => Role::Operator,
            "tenant_admin" => Role::TenantAdmin,
            "tenant_member" => Role::TenantMember,
            "provider" => Role::Provider,
            _ => return None,
        })
    }

    /// Whether a key with this role may mint a key with role `other`.
    /// Only operators mint operator and provider keys; tenant admins mint
    /// keys for their own tenant; members mint none.
    pub fn may_grant(self, other: Role) -> bool {
        match self {
            Role::Operator => true,
            Role::TenantAdmin => matches!(other, Role::TenantAdmin | Role::TenantMember),
            Role::TenantMember | Role::Provider => false,
        }
    }
}

/// Validates a tenant or instance name: 1–63 characters of lowercase
/// letters, digits and `-`, starting with a letter or digit (a DNS label,
/// so names can later become hostnames of endpoints).
pub fn validate_name(name: &str, field: &str) -> Result<(), crate::FieldError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(crate::FieldError::new(
            field,
            "must be 1-63 lowercase letters, digits or '-', not starting or ending with '-'",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_round_trip_and_grant_rules() {
        for r in [
            Role::Operator,
            Role::TenantAdmin,
            Role::TenantMember,
            Role::Provider,
        ] {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert!(Role::TenantAdmin.may_grant(Role::TenantMember));
        assert!(!Role::TenantAdmin.may_grant(Role::Operator));
        assert!(!Role::TenantMember.may_grant(Role::TenantMember));
    }

    #[test]
    fn names_are_dns_labels() {
        assert!(validate_name("acme-ai", "name").is_ok());
        for bad in ["", "Acme", "-x", "x-", "a b", &"a".repeat(64)] {
            assert_eq!(validate_name(bad, "name").unwrap_err().field, "name");
        }
    }
}
