//! `flotilla registries`: the tenant's logins to private container
//! registries, and `flotilla nodes show`, which lists a node's image cache.
//! The secret is read from stdin or the environment, never from an
//! argument (arguments are visible to every user of the machine).

use std::io::Read as _;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Result};
use chrono::Utc;
use clap::Subcommand;
use flotilla_core::id::{NodeId, RegistryCredentialId};
use flotilla_core::registry::CreateRegistryCredential;

use crate::ctx::Ctx;
use crate::output::{self, age, outln, print_answer, print_json, print_table, table};

/// Environment variable `registries add` reads the secret from.
pub const SECRET_ENV: &str = "FLOTILLA_REGISTRY_SECRET";

/// `flotilla registries …`.
#[derive(Debug, Subcommand)]
pub enum RegistriesCommand {
    /// List the tenant's registry logins (never their secrets).
    List,
    /// Store a login for one registry; instances whose image is on it are
    /// pulled with it. The secret comes from stdin (`--secret-stdin`) or
    /// `FLOTILLA_REGISTRY_SECRET`.
    Add {
        /// Registry host, with its port when not 443
        /// (`registry.example.com:5000`; `docker.io` for Docker Hub).
        registry: String,
        /// User name at the registry.
        #[arg(long, short = 'u')]
        username: String,
        /// Read the secret (password or token) from stdin.
        #[arg(long)]
        secret_stdin: bool,
    },
    /// Remove a login.
    Remove {
        /// Credential id (`rcred_…`).
        id: String,
    },
}

/// Runs a `registries` command (`list` when none is given).
pub async fn dispatch(ctx: &Ctx, command: Option<RegistriesCommand>) -> Result<ExitCode> {
    match command {
        None | Some(RegistriesCommand::List) => list(ctx).await,
        Some(RegistriesCommand::Add {
            registry,
            username,
            secret_stdin,
        }) => {
            let secret = if secret_stdin {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s)?;
                s.trim_end_matches(['\n', '\r']).to_string()
            } else {
                std::env::var(SECRET_ENV).map_err(|_| {
                    anyhow!("give the secret on stdin with --secret-stdin, or in {SECRET_ENV}")
                })?
            };
            add(ctx, registry, username, secret).await
        }
        Some(RegistriesCommand::Remove { id }) => remove(ctx, &id).await,
    }
}

async fn list(ctx: &Ctx) -> Result<ExitCode> {
    let items = ctx.client.registry_credentials().await?;
    if ctx.json {
        print_answer(&items)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table(["ID", "REGISTRY", "USERNAME", "AGE"]);
    for c in items {
        t.add_row([
            c.id.to_string(),
            c.registry,
            c.username,
            age(now, c.created_at),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

async fn add(ctx: &Ctx, registry: String, username: String, secret: String) -> Result<ExitCode> {
    if secret.is_empty() {
        bail!("the secret is empty");
    }
    let req = CreateRegistryCredential {
        registry,
        username,
        secret,
    };
    let made = ctx.client.add_registry_credential(&req).await?;
    if ctx.json {
        print_answer(&made)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "login {} stored for {} as {}",
        made.id,
        made.registry,
        made.username
    )?;
    Ok(ExitCode::SUCCESS)
}

async fn remove(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = RegistryCredentialId::parse(id.trim(), "credential id").map_err(|e| anyhow!("{e}"))?;
    ctx.client.remove_registry_credential(&id).await?;
    if ctx.json {
        print_json(&serde_json::json!({ "id": id, "removed": true }))?;
    } else {
        outln!("login {id} removed")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes show ID`: the node, its GPUs and its image cache.
pub async fn node_show(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = NodeId::parse(id.trim(), "node id").map_err(|e| anyhow!("{e}"))?;
    let n = ctx.client.node(&id).await?;
    if ctx.json {
        print_answer(&n)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    outln!("node:      {} ({})", n.id, n.name)?;
    outln!("state:     {}", output::node_state(&n))?;
    outln!("region:    {} / pool {}", n.region, n.pool)?;
    outln!("gpus:      {}", output::node_gpus(&n))?;
    outln!("heartbeat: {} ago", age(now, n.last_heartbeat_at))?;
    for why in &n.unenforced_limits {
        outln!("limits:    not enforced: {why}")?;
    }
    if let Some(net) = &n.network {
        outln!("network:   {}", net.detail)?;
        if !net.allow_egress.is_empty() {
            outln!("egress:    also allowed: {}", net.allow_egress.join(", "))?;
        }
    }
    for g in &n.gpus {
        if let Some(fault) = &g.fault {
            outln!("fault:     gpu {} ({}): {fault}", g.index, g.id)?;
        }
    }
    if n.images.is_empty() {
        outln!("images:    none reported")?;
        return Ok(ExitCode::SUCCESS);
    }
    let total: u64 = n.images.iter().map(|i| i.size_bytes).sum();
    outln!("images:    {} cached, {}", n.images.len(), size(total))?;
    let mut t = table(["IMAGE", "ID", "SIZE", "LAST USED"]);
    for i in &n.images {
        let short = i.id.strip_prefix("sha256:").unwrap_or(&i.id);
        t.add_row([
            i.image.clone(),
            short.chars().take(12).collect(),
            size(i.size_bytes),
            i.last_used
                .map_or_else(|| "never".into(), |at| format!("{} ago", age(now, at))),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// Bytes in decimal units, as image sizes are usually given.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1000.0 && unit < UNITS.len() - 1 {
        v /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::size;

    #[test]
    fn sizes_are_in_decimal_units() {
        assert_eq!(size(999), "999 B");
        assert_eq!(size(1_500), "1.5 kB");
        assert_eq!(size(12_345_678_901), "12.3 GB");
    }
}
