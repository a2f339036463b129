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
    /// The server certificate's pinned fingerprint (`sha256:…`), for an
    /// `https://` server with a self-signed certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_fingerprint: Option<String>,
    /// A CA certificate file that vouches for an `https://` server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<PathBuf>,
}

impl Credentials {
    /// Credentials for `server` with `api_key` and no TLS settings.
    pub fn new(server: impl Into<String>, api_key: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            api_key: api_key.into(),
            tls_fingerprint: None,
            ca_cert: None,
        }
    }

    /// The trust these credentials place in the server (the system's
    /// roots unless a fingerprint or CA file is set).
    pub fn trust(&self) -> Result<flotilla_client::Trust> {
        trust(self.tls_fingerprint.as_deref(), self.ca_cert.as_deref())
    }
}

/// The trust named by `--tls-fingerprint` or `--ca-cert` (at most one),
/// else the system's roots.
pub fn trust(fingerprint: Option<&str>, ca_cert: Option<&Path>) -> Result<flotilla_client::Trust> {
    let fingerprint = fingerprint.map(str::trim).filter(|f| !f.is_empty());
    match (fingerprint, ca_cert) {
        (Some(_), Some(_)) => Err(anyhow!(
            "pass either --tls-fingerprint or --ca-cert, not both"
        )),
        (Some(f), None) => {
            let pin = f
                .parse::<flotilla_client::Fingerprint>()
                .map_err(|e| anyhow!("--tls-fingerprint: {e}"))?;
            Ok(flotilla_client::Trust::Pinned(pin))
        }
        (None, Some(path)) => {
            flotilla_client::Trust::ca_file(path).map_err(|e| anyhow!("--ca-cert: {e}"))
        }
        (None, None) => Ok(flotilla_client::Trust::System),
    }
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

/// The server address(es) a node command was given, each normalised
/// (several comma-separated URLs are replicas of one control plane, which
/// the agent fails over between), or the default server when none is.
pub fn server_urls(server: Option<String>) -> String {
    server
        .map(|s| {
            s.split(',')
                .filter(|u| !u.trim().is_empty())
                .map(normalize_server)
                .collect::<Vec<_>>()
                .join(",")
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_SERVER.to_string())
}

/// The TLS flags a client command was given (`--tls-fingerprint`,
/// `--ca-cert`, or their environment variables).
#[derive(Debug, Clone, Copy, Default)]
pub struct TlsFlags<'a> {
    /// `--tls-fingerprint`.
    pub fingerprint: Option<&'a str>,
    /// `--ca-cert`.
    pub ca_cert: Option<&'a Path>,
}

impl TlsFlags<'_> {
    fn given(&self) -> bool {
        self.fingerprint.is_some_and(|f| !f.trim().is_empty()) || self.ca_cert.is_some()
    }
}

/// Resolves the server, key and TLS trust for a client command: flags and
/// environment first (clap already merged them), then the credentials
/// file.
pub fn resolve(
    server: Option<&str>,
    api_key: Option<&str>,
    tls: TlsFlags<'_>,
) -> Result<Credentials> {
    let path = credentials_path()?;
    let saved = if server.is_some() && api_key.is_some() {
        None
    } else {
        load(&path)?
    };
    resolve_with(server, api_key, tls, saved)
}

fn resolve_with(
    server: Option<&str>,
    api_key: Option<&str>,
    tls: TlsFlags<'_>,
    saved: Option<Credentials>,
) -> Result<Credentials> {
    let given_server = server
        .filter(|s| !s.trim().is_empty())
        .map(normalize_server);
    // The saved TLS settings belong to the saved server: they apply when
    // no other server is named and no TLS flag replaces them.
    let (saved_fingerprint, saved_ca) = match &saved {
        Some(c)
            if !tls.given()
                && given_server
                    .as_ref()
                    .is_none_or(|s| *s == normalize_server(&c.server)) =>
        {
            (c.tls_fingerprint.clone(), c.ca_cert.clone())
        }
        _ => (None, None),
    };
    let server = given_server
        .or_else(|| saved.as_ref().map(|c| normalize_server(&c.server)))
        .unwrap_or_else(|| DEFAULT_SERVER.to_string());
    let api_key = api_key
        .filter(|k| !k.trim().is_empty())
        .map(|k| k.trim().to_string())
        .or_else(|| saved.map(|c| c.api_key))
        .ok_or_else(|| anyhow!("no API key: run `flotilla up` or `flotilla login`"))?;
    Ok(Credentials {
        server,
        api_key,
        tls_fingerprint: tls
            .fingerprint
            .map(|f| f.trim().to_string())
            .filter(|f| !f.is_empty())
            .or(saved_fingerprint),
        ca_cert: tls.ca_cert.map(Path::to_path_buf).or(saved_ca),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> Credentials {
        Credentials::new("http://127.0.0.1:7420", "flt_secret")
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
            tls_fingerprint: Some(format!("sha256:{}", "0".repeat(64))),
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
        let none = TlsFlags::default();
        let c = resolve_with(Some("localhost:9000/"), None, none, saved.clone()).unwrap();
        assert_eq!(c.server, "http://localhost:9000");
        let c = resolve_with(Some(" a:1/, https://b/v1 "), None, none, saved.clone()).unwrap();
        assert_eq!(c.server, "http://a:1,https://b");
        assert_eq!(c.api_key, "flt_secret");
        let c = resolve_with(None, Some("flt_flag"), none, saved).unwrap();
        assert_eq!(
            (c.server.as_str(), c.api_key.as_str()),
            ("http://127.0.0.1:7420", "flt_flag")
        );
        let e = resolve_with(None, None, none, None)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "no API key: run `flotilla up` or `flotilla login`");
    }

    #[test]
    fn a_saved_pin_applies_to_its_own_server_unless_a_flag_replaces_it() {
        let pin = format!("sha256:{}", "ab".repeat(32));
        let other = format!("sha256:{}", "cd".repeat(32));
        let saved = Some(Credentials {
            tls_fingerprint: Some(pin.clone()),
            ..Credentials::new("https://10.0.0.1:7420", "flt_secret")
        });
        let none = TlsFlags::default();
        let c = resolve_with(None, None, none, saved.clone()).unwrap();
        assert_eq!(c.tls_fingerprint.as_deref(), Some(pin.as_str()));
        assert!(
            matches!(c.trust().unwrap(), flotilla_client::Trust::Pinned(p) if p.to_string() == pin)
        );
        let c = resolve_with(Some("https://10.0.0.1:7420/"), None, none, saved.clone()).unwrap();
        assert_eq!(c.tls_fingerprint.as_deref(), Some(pin.as_str()));
        // Another server: the saved pin is not its pin.
        let c = resolve_with(Some("https://10.0.0.2:7420"), None, none, saved.clone()).unwrap();
        assert_eq!(c.tls_fingerprint, None);
        let flag = TlsFlags {
            fingerprint: Some(&other),
            ca_cert: None,
        };
        let c = resolve_with(None, None, flag, saved.clone()).unwrap();
        assert_eq!(c.tls_fingerprint.as_deref(), Some(other.as_str()));
        let ca = TlsFlags {
            fingerprint: None,
            ca_cert: Some(Path::new("/etc/ca.pem")),
        };
        let c = resolve_with(None, None, ca, saved).unwrap();
        assert_eq!(
            (c.tls_fingerprint, c.ca_cert),
            (None, Some(PathBuf::from("/etc/ca.pem")))
        );
    }

    #[test]
    fn tls_flags_are_checked() {
        let e = trust(Some("sha256:12"), None).unwrap_err().to_string();
        assert!(
            e.starts_with("--tls-fingerprint: invalid TLS fingerprint `sha256:12`"),
            "{e}"
        );
        let e = trust(Some(&"ab".repeat(32)), Some(Path::new("/x")))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "pass either --tls-fingerprint or --ca-cert, not both");
        let e = trust(None, Some(Path::new("/nonexistent/ca.pem")))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--ca-cert: cannot read the CA certificate /nonexistent/ca.pem"),
            "{e}"
        );
        assert!(matches!(
            trust(Some(" "), None).unwrap(),
            flotilla_client::Trust::System
        ));
    }

    #[test]
    fn old_credentials_files_still_read() {
        let c: Credentials =
            serde_json::from_str(r#"{"server":"http://a:1","api_key":"k"}"#).unwrap();
        assert_eq!(c, Credentials::new("http://a:1", "k"));
        // And no TLS keys are written when there are none.
        assert_eq!(
            serde_json::to_string(&c).unwrap(),
            r#"{"server":"http://a:1","api_key":"k"}"#
        );
    }
}
