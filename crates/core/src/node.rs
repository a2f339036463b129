//! Nodes and their GPUs, as the control plane sees them.

use serde::{Deserialize, Serialize};

/// Whether a node can take work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Heartbeats arrive; the node takes work unless cordoned.
    Ready,
    /// Heartbeats stopped; its instances are `lost` until the agent returns.
    Unreachable,
}

impl NodeState {
    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Unreachable => "unreachable",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ready" => Some(Self::Ready),
            "unreachable" => Some(Self::Unreachable),
            _ => None,
        }
    }
}

/// Parses a simulated inventory such as `4xH100,2xL40S` into
/// `(count, canonical model)` pairs.
pub fn parse_simulated_gpus(
    spec: &str,
    catalog: &crate::catalog::Catalog,
) -> Result<Vec<(u32, String)>, crate::FieldError> {
    let field = "simulate_gpus";
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (count, model) = match part.split_once(['x', 'X']) {
            Some((n, m)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
                let n: u32 = n
                    .parse()
                    .map_err(|_| crate::FieldError::new(field, format!("bad count in `{part}`")))?;
                (n, m)
            }
            _ => (1, part),
        };
        if count == 0 || count > 64 {
            return Err(crate::FieldError::new(
                field,
                format!("count in `{part}` must be between 1 and 64"),
            ));
        }
        out.push((count, catalog.resolve(model, field)?));
    }
    if out.is_empty() {
        return Err(crate::FieldError::new(field, "expected e.g. 4xH100,2xL40S"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;

    #[test]
    fn simulated_inventory_parses() {
        let c = Catalog::default();
        assert_eq!(
            parse_simulated_gpus("4xH100, 2xl40s,T4", &c).unwrap(),
            vec![(4, "H100".into()), (2, "L40S".into()), (1, "T4".into())]
        );
        assert!(parse_simulated_gpus("0xH100", &c).is_err());
        assert!(parse_simulated_gpus("4xNOPE", &c).is_err());
        assert!(parse_simulated_gpus("", &c).is_err());
    }
}
