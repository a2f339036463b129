//! `flotilla ssh`: an SSH `ProxyCommand` that carries an SSH client's
//! connection to the server's SSH endpoint for an instance (see
//! `docs/access.md`), and `flotilla ssh-keys`, the tenant's registered
//! public keys that endpoint lets in.
//!
//! As a `ProxyCommand` this is a pipe and nothing else: standard input
//! and output are the connection's bytes, untouched (no terminal mode, no
//! line handling); messages go to standard error, which `ssh` shows.

use std::io::Read as _;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context as _, Result};
use chrono::Utc;
use clap::Subcommand;
use flotilla_core::id::SshKeyId;
use flotilla_core::ssh_key::CreateSshKey;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::access::{instance, until_running};
use crate::ctx::Ctx;
use crate::output::{age, outln, print_json, print_table, table};

/// `flotilla ssh-keys …`.
#[derive(Debug, Subcommand)]
pub enum SshKeysCommand {
    /// List the tenant's registered SSH public keys.
    List,
    /// Register a public key (`~/.ssh/id_ed25519.pub`, or `-` for stdin):
    /// `ssh` through `flotilla ssh` logs in to the tenant's running
    /// instances with its private half.
    Add {
        /// The public key file (`KEY.pub`), or `-` to read it from stdin.
        file: String,
        /// A name to tell it apart (default: the key's comment).
        #[arg(long)]
        name: Option<String>,
    },
    /// Remove a key: it logs in no more.
    Remove {
        /// Key id (`sshk_…`).
        id: String,
    },
}

/// Runs an `ssh-keys` command (`list` when none is given).
pub async fn keys(ctx: &Ctx, command: Option<SshKeysCommand>) -> Result<ExitCode> {
    match command {
        None | Some(SshKeysCommand::List) => list(ctx).await,
        Some(SshKeysCommand::Add { file, name }) => add(ctx, &file, name).await,
        Some(SshKeysCommand::Remove { id }) => remove(ctx, &id).await,
    }
}

async fn list(ctx: &Ctx) -> Result<ExitCode> {
    let keys = ctx.client.ssh_keys().await?;
    if ctx.json {
        print_json(&keys)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table(["ID", "NAME", "TYPE", "FINGERPRINT", "AGE"]);
    for k in keys {
        t.add_row([
            k.id.to_string(),
            k.name,
            k.algorithm,
            k.fingerprint,
            age(now, k.created_at),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

async fn add(ctx: &Ctx, file: &str, name: Option<String>) -> Result<ExitCode> {
    let public_key = if file == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        s
    } else {
        if !file.ends_with(".pub") && std::path::Path::new(&format!("{file}.pub")).exists() {
            bail!("{file} looks like a private key: give {file}.pub");
        }
        std::fs::read_to_string(file).with_context(|| format!("cannot read {file}"))?
    };
    // Never send a private key anywhere, not even to be refused.
    if public_key.contains("PRIVATE KEY") {
        bail!("that is a private key: give the public one (KEY.pub)");
    }
    let req = CreateSshKey {
        name,
        public_key: public_key.trim().to_string(),
    };
    let made = ctx.client.add_ssh_key(&req).await?;
    if ctx.json {
        print_json(&made)?;
    } else {
        outln!(
            "ssh key {} registered: {} {} ({})",
            made.id,
            made.algorithm,
            made.fingerprint,
            made.name
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn remove(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = SshKeyId::parse(id.trim(), "ssh key id").map_err(|e| anyhow!("{e}"))?;
    ctx.client.remove_ssh_key(&id).await?;
    if ctx.json {
        print_json(&serde_json::json!({ "id": id, "removed": true }))?;
    } else {
        outln!("ssh key {id} removed")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla ssh ID`: the `ProxyCommand`. Waits for an instance that is
/// still starting, then pipes standard input to the tunnel and the tunnel
/// to standard output until either ends.
pub async fn proxy(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = instance(id)?;
    until_running(ctx, &id).await?;
    let tunnel = ctx
        .client
        .ssh(id.as_str())
        .await
        .with_context(|| format!("cannot reach {id} over ssh"))?;
    let (mut tx, mut rx) = tunnel.split();
    let up = tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).await.is_err() {
                        return;
                    }
                }
            }
        }
        // ssh closed our input: the connection is over on its side.
        tx.close().await;
    });
    let mut stdout = tokio::io::stdout();
    let mut result = Ok(ExitCode::SUCCESS);
    while let Some(chunk) = rx.recv().await {
        match chunk {
            Ok(bytes) => {
                if stdout.write_all(&bytes).await.is_err() || stdout.flush().await.is_err() {
                    break;
                }
            }
            Err(e) => {
                result = Err(anyhow::Error::from(e).context(format!("ssh to {id}")));
                break;
            }
        }
    }
    up.abort();
    result
}

/// `flotilla ssh --config`: an `ssh_config` block that makes `ssh inst_…`
/// (and `scp`, `sftp`, VS Code Remote) go through `flotilla ssh`. `exe`
/// is this binary; `server` the `--server` given, if any (without one,
/// the saved login's is used when ssh runs it).
pub fn config_snippet(exe: &str, server: Option<&str>) -> String {
    // ssh runs the ProxyCommand with the user's shell.
    let quote = |s: &str| {
        if s.chars()
            .any(|c| c.is_whitespace() || "'\"$`\\;&|<>()".contains(c))
        {
            format!("'{}'", s.replace('\'', "'\\''"))
        } else {
            s.to_string()
        }
    };
    let exe = quote(exe);
    let server_arg = server
        .map(|s| format!(" --server {}", quote(s)))
        .unwrap_or_default();
    format!(
        "# Flotilla instances: `ssh inst_…` through the control plane.\n\
         # Keys: register yours with `flotilla ssh-keys add ~/.ssh/id_ed25519.pub`.\n\
         Host inst_*\n\
         \x20   ProxyCommand {exe}{server_arg} ssh %h\n\
         \x20   # Any user name: the session runs as the instance's own user.\n\
         \x20   User flotilla\n\
         \x20   # One host key for every instance (the control plane's).\n\
         \x20   HostKeyAlias flotilla-control-plane\n"
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("flotilla").chain(args.iter().copied()))
    }

    #[test]
    fn ssh_takes_an_instance_or_prints_the_config() {
        let cli = parse(&["ssh", "inst_1"]).unwrap();
        assert!(
            matches!(cli.command, Command::Ssh { ref id, config: false } if id.as_deref() == Some("inst_1"))
        );
        let cli = parse(&["ssh", "--config"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Ssh {
                id: None,
                config: true
            }
        ));
        assert!(parse(&["ssh"]).is_err(), "an instance or --config");
        assert!(parse(&["ssh", "--config", "inst_1"]).is_err());
    }

    #[test]
    fn ssh_keys_parse() {
        let cli = parse(&["ssh-keys", "add", "--name", "laptop", "-"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::SshKeys {
                command: Some(super::SshKeysCommand::Add { ref file, ref name })
            } if file == "-" && name.as_deref() == Some("laptop")
        ));
        assert!(parse(&["ssh-keys", "remove", "sshk_1"]).is_ok());
        assert!(matches!(
            parse(&["ssh-keys"]).unwrap().command,
            Command::SshKeys { command: None }
        ));
    }

    #[test]
    fn the_config_proxies_instances_through_this_binary() {
        let c = super::config_snippet("/usr/bin/flotilla", Some("https://gpu.example"));
        assert!(c.contains("Host inst_*\n"), "{c}");
        assert!(
            c.contains("ProxyCommand /usr/bin/flotilla --server https://gpu.example ssh %h\n"),
            "{c}"
        );
        let c = super::config_snippet("flotilla", None);
        assert!(c.contains("ProxyCommand flotilla ssh %h\n"), "{c}");
        let c = super::config_snippet("/opt/my tools/flotilla", None);
        assert!(
            c.contains("ProxyCommand '/opt/my tools/flotilla' ssh %h\n"),
            "{c}"
        );
    }
}
