//! The credentials file: where the CLI keeps the server URL and API key
//! between commands (`credentials.json` in `FLOTILLA_CONFIG_DIR`, or the
//! platform config directory + `flotilla`).
//!
//! The file holds a bearer secret, so it is written owner-only (0600, in a
//! 0700 directory) and replaced atomically: a crash mid-write never leaves
//! a half-written key behind. This module never prints the key.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};

/// Where `flotilla up` listens unless told otherwise, and where client
/// commands go when nothing else names a server.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7420";

/// The file's name inside the config directory.
pub const CREDENTIALS_FILE: &str = "credentials.json";

/// What `credentials.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    /// Base URL of the API, e.g. `http://127.0.0.1:7420`.
    pub server: String,
    /// Bearer secret.
    pub api_key: String,
}

/// The config directory: `FLOTILLA_CONFIG_DIR`, else the platform's config
/// directory + `flotilla`.
pub fn config_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("FLOTILLA_CONFIG_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    dirs::config_dir()
        .map(|d| d.join("flotilla"))
        .ok_or_else(|| anyhow!("cannot find a config directory: set FLOTILLA_CONFIG_DIR"))
}

/// Path of the credentials file.
pub fn credentials_path() -> Result<PathBuf> {
    Ok(config_dir()?.join(CREDENTIALS_FILE))
}

/// Reads the credentials file; `None` when it does not exist.
pub fn load(path: &Path) -> Result<Option<Credentials>> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let creds = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid credentials file", path.display()))?;
    Ok(Some(creds))
}

/// Writes the credentials file owner-only, creating its directory (0700)
/// when needed. The file is written to a temporary sibling and renamed
/// over the old one.
pub fn save(path: &Path, creds: &Credentials) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."));
    create_private_dir(dir)?;
    let mut text = serde_json::to_string_pretty(creds)?;
    text.push('\n');
    let tmp = dir.join(format!(".{CREDENTIALS_FILE}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = private_file(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        anyhow!("writing {}: {e}", path.display())
    })
}

/// Creates `dir` (and parents) with mode 0700 on Unix; an existing `dir`
/// loses group and other access.
pub fn create_private_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir)?.permissions().mode();
            if mode & 0o077 != 0 {
                fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                    .with_context(|| format!("making {} private", dir.display()))?;
            }
        }
        return Ok(());
    }
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

fn private_file(path: &Path) -> std::io::Result<fs::File> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        opts.mode(0o600);
        let f = opts.open(path)?;
        // The mode only applies to a new file; a stale temp file from a
        // crashed run may have been created with other bits.
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        Ok(f)
    }
    #[cfg(not(unix))]
    {
        opts.open(path)
    }
}

/// Normalises a server URL, or a comma-separated list of them (replicas
/// the client fails over between): adds `http://` where no scheme is given
/// and drops trailing slashes (and a trailing `/v1`).
pub fn normalize_server(url: &str) -> String {
    flotilla_client::parse_servers(url).join(",")
}

/// Resolves the server and key for a client command: flags and environment
/// first (clap already merged them), then the credentials file.
pub fn resolve(server: Option<&str>, api_key: Option<&str>) -> Result<Credentials> {
    let path = credentials_path()?;
    let saved = if server.is_some() && api_key.is_some() {
        None
    } else {
        load(&path)?
    };
    resolve_with(server, api_key, saved)
}

fn resolve_with(
    server: Option<&str>,
    api_key: Option<&str>,
    saved: Option<Credentials>,
) -> Result<Credentials> {
    let server = server
        .filter(|s| !s.trim().is_empty())
        .map(normalize_server)
        .or_else(|| saved.as_ref().map(|c| normalize_server(&c.server)))
        .unwrap_or_else(|| DEFAULT_SERVER.to_string());
    let api_key = api_key
        .filter(|k| !k.trim().is_empty())
        .map(|k| k.trim().to_string())
        .or_else(|| saved.map(|c| c.api_key))
        .ok_or_else(|| anyhow!("no API key: run `flotilla up` or `flotilla login`"))?;
    Ok(Credentials { server, api_key })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> Credentials {
        Credentials {
            server: "http://127.0.0.1:7420".into(),
            api_key: "flt_secret".into(),
        }
    }

    #[test]
    fn round_trip_creates_private_dir_and_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("nested/flotilla").join(CREDENTIALS_FILE);
        assert_eq!(load(&path).unwrap(), None);
        save(&path, &creds()).unwrap();
        assert_eq!(load(&path).unwrap(), Some(creds()));

        let other = Credentials {
            api_key: "flt_other".into(),
            ..creds()
        };
        save(&path, &other).unwrap();
        assert_eq!(load(&path).unwrap(), Some(other));

        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&path), 0o600);
            assert_eq!(mode(path.parent().unwrap()), 0o700);
        }
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(CREDENTIALS_FILE)]);
    }

    #[test]
    fn a_corrupt_file_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(CREDENTIALS_FILE);
        fs::write(&path, "{not json").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("not a valid credentials file"), "{e}");
    }

    #[test]
    fn flags_win_over_the_file_and_a_missing_key_says_what_to_do() {
        let saved = Some(creds());
        let c = resolve_with(Some("localhost:9000/"), None, saved.clone()).unwrap();
        assert_eq!(c.server, "http://localhost:9000");
        let c = resolve_with(Some(" a:1/, https://b/v1 "), None, saved.clone()).unwrap();
        assert_eq!(c.server, "http://a:1,https://b");
        assert_eq!(c.api_key, "flt_secret");
        let c = resolve_with(None, Some("flt_flag"), saved).unwrap();
        assert_eq!(
            (c.server.as_str(), c.api_key.as_str()),
            ("http://127.0.0.1:7420", "flt_flag")
        );
        let e = resolve_with(None, None, None).unwrap_err().to_string();
        assert_eq!(e, "no API key: run `flotilla up` or `flotilla login`");
    }
}
