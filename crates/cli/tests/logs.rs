//! Output is never dropped silently, never miscounted, never acts on the
//! reader's terminal, and leaves nothing behind: a workload's lines that
//! together far exceed the server's 1 MiB limit on a request all arrive in
//! its log, in order (the agent ships them in batches that fit); a burst
//! of 50 MB is held back rather than dropped (kept + reported lost =
//! written, exactly); control characters reach `flotilla logs` as text;
//! an ended instance's directory is removed once its output was shipped.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use flotilla_testkit::process::{wait_until, Home};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// The count a lost-lines marker states.
fn lost_in(line: &str) -> Option<u64> {
    flotilla_agent::runtime::parse_lost_marker(line)
}

fn state_of(home: &Home, key: &str, id: &str) -> String {
    home.get(key, &format!("/v1/instances/{id}"))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

fn wait_ended(home: &Home, key: &str, id: &str, limit: Duration) {
    wait_until("the instance ends", limit, || {
        matches!(
            state_of(home, key, id).as_str(),
            "succeeded" | "failed" | "stopped" | "lost"
        )
    });
}

/// One raw HTTP/1.1 request to the console: the answer's headers and
/// body as text (the body's bytes are checked by the caller).
fn console_request(
    url: &str,
    method: &str,
    path: &str,
    cookie: &str,
    form: &str,
) -> (String, Vec<u8>) {
    use std::io::{Read, Write};
    let host = url.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nCookie: {cookie}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    (head, raw[split + 4..].to_vec())
}

/// The value of cookie `name` an answer sets.
fn set_cookie(head: &str, name: &str) -> String {
    head.lines()
        .filter_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or_else(|| l.strip_prefix("Set-Cookie: "))
        })
        .find_map(|c| c.strip_prefix(&format!("{name}=")))
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no cookie {name} in {head}"))
        .to_string()
}

/// The console's log view of instance `id`, signed in with `key`.
fn console_logs(home: &Home, key: &str, id: &str) -> Vec<u8> {
    let url = home.url();
    let (head, _) = console_request(&url, "GET", "/login", "", "");
    let token = set_cookie(&head, "flotilla_login");
    let (head, _) = console_request(
        &url,
        "POST",
        "/login",
        &format!("flotilla_login={token}"),
        &format!("csrf={token}&api_key={key}"),
    );
    let session = set_cookie(&head, "flotilla_session");
    let (head, body) = console_request(
        &url,
        "GET",
        &format!("/instances/{id}/logs"),
        &format!("flotilla_session={session}"),
        "",
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body
}

/// The agent's work directory of a [`Home`].
fn agent_dir(home: &Home) -> PathBuf {
    home.data().parent().unwrap().join("agent")
}

#[test]
fn forty_lines_of_sixty_kib_and_a_marker_all_arrive() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("logs-node", "1xH100");
    let (_, key) = home.tenant("chatty");
    let key = key.as_str();
    let out = home.cli(
        Some(key),
        &[
            "run",
            "--detach",
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "for i in $(seq 1 40); do printf '%05d' $i; head -c 61435 /dev/zero | tr '\\0' x; echo; done; echo the-end",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    wait_ended(&home, key, &id, Duration::from_secs(90));
    let inst = home.get(key, &format!("/v1/instances/{id}"));
    assert_eq!(inst["state"], "succeeded", "{inst}");
    let logs = home.get(key, &format!("/v1/instances/{id}/logs?limit=100"));
    let lines: Vec<&str> = logs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_str().unwrap())
        .collect();
    assert_eq!(lines.len(), 41, "every line arrives");
    for (i, line) in lines[..40].iter().enumerate() {
        assert_eq!(line.len(), 61_440, "line {i} whole");
        assert!(
            line.starts_with(&format!("{:05}", i + 1)),
            "line {i} in order"
        );
    }
    assert_eq!(lines[40], "the-end");
}

/// 500,000 numbered lines of 100 bytes (50 MB), written as fast as the
/// workload can: the relay holds it back while the agent ships, so every
/// line arrives; the test checks the exact equation (kept + the markers'
/// counts = written) and the numbering against the markers, whatever
/// they say.
#[test]
fn a_burst_of_fifty_megabytes_is_held_back_not_dropped() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    const WRITTEN: u64 = 500_000;
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("burst-node", "1xH100");
    let (_, key) = home.tenant("bursty");
    let key = key.as_str();
    // Each line: 8 digits, a space, 90 letters, a newline: 100 bytes.
    let script = format!(
        "date +%s%N >&2; awk 'BEGIN {{ p = sprintf(\"%90s\", \"\"); gsub(/ /, \"x\", p); for (i = 0; i < {WRITTEN}; i++) printf \"%08d %s\\n\", i, p }}'; date +%s%N >&2"
    );
    let t0 = Instant::now();
    let id = home.run_detached(key, &["--gpus", "1", "--", "sh", "-c", &script]);
    wait_ended(&home, key, &id, Duration::from_secs(600));
    let shipped_in = t0.elapsed();
    assert_eq!(state_of(&home, key, &id), "succeeded");

    let out = home.cli(Some(key), &["--json", "logs", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut kept = 0u64;
    let mut lost = 0u64;
    let mut markers = 0u64;
    let mut expect = 0u64; // the next number the workload wrote
    let mut times = Vec::new();
    for l in &log {
        let text = l["line"].as_str().unwrap();
        if let Some(n) = lost_in(text) {
            lost += n;
            markers += 1;
            // The marker's own gap: those numbers are missing, no others.
            expect += n;
            continue;
        }
        if l["stream"] == "stderr" {
            times.push(text.parse::<u128>().expect("a time"));
            continue;
        }
        let (number, pad) = text.split_once(' ').expect("a numbered line");
        assert_eq!(
            number.parse::<u64>().unwrap(),
            expect,
            "line {text:.20}…: a gap no marker states"
        );
        assert_eq!(pad.len(), 90);
        kept += 1;
        expect += 1;
    }
    assert_eq!(
        expect, WRITTEN,
        "the numbering ends where the workload stopped"
    );
    assert_eq!(
        kept + lost,
        WRITTEN,
        "kept {kept} + lost {lost} (in {markers} markers)"
    );
    assert_eq!(lost, 0, "back-pressure: nothing dropped");
    assert_eq!(times.len(), 2);
    let wrote_in = Duration::from_nanos((times[1] - times[0]) as u64);
    eprintln!(
        "{WRITTEN} lines of 100 bytes: written in {:.1} s (held back by the relay), shipped and ended in {:.1} s ({:.0} lines/s end to end)",
        wrote_in.as_secs_f64(),
        shipped_in.as_secs_f64(),
        WRITTEN as f64 / shipped_in.as_secs_f64()
    );
}

/// Escape sequences and other controls a workload prints reach `flotilla
/// logs` as text (tabs kept), on both streams; `--json` keeps them raw
/// for scripts, and so does the store.
#[test]
fn control_characters_reach_the_reader_as_text() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("esc-node", "1xH100");
    let (_, key) = home.tenant("painter");
    let key = key.as_str();
    let id = home.run_detached(
        key,
        &[
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "printf 'clear\\033[2Jtitle\\033]0;owned\\007bell\\a\\tcol\\bDEL\\177c1\\302\\233end\\n'; printf 'err\\033[31mred\\r\\n' >&2",
        ],
    );
    wait_ended(&home, key, &id, Duration::from_secs(90));
    let out = home.cli(Some(key), &["logs", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let raw: Vec<&u8> = bytes
            .iter()
            .filter(|&&b| (b < 0x20 && b != b'\t' && b != b'\n') || b == 0x7f)
            .collect();
        assert!(
            raw.is_empty(),
            "{name}: raw controls {raw:?} in {:?}",
            String::from_utf8_lossy(bytes)
        );
        assert!(
            !String::from_utf8_lossy(bytes).contains('\u{9b}'),
            "{name}: a raw C1 CSI"
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "clear\\x1b[2Jtitle\\x1b]0;owned\\x07bell\\x07\tcol\\x08DEL\\x7fc1\\x9bend\n"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("err\\x1b[31mred"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The console's log view likewise (chunked or not, the body holds
    // the line's text).
    let html = console_logs(&home, key, &id);
    let raw: Vec<&u8> = html
        .iter()
        .filter(|&&b| (b < 0x20 && b != b'\t' && b != b'\n' && b != b'\r') || b == 0x7f)
        .collect();
    assert!(raw.is_empty(), "console: raw controls {raw:?}");
    let html = String::from_utf8_lossy(&html);
    assert!(!html.contains('\u{9b}'), "console: a raw C1 CSI");
    assert!(
        html.contains("clear\\x1b[2Jtitle\\x1b]0;owned\\x07bell"),
        "{html}"
    );
    // The precondition: the workload did print them, and the store kept
    // them as they were.
    let json = home.cli_json(Some(key), &["logs", &id]);
    let lines: Vec<&str> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_str().unwrap())
        .collect();
    assert!(
        lines.contains(
            &"clear\u{1b}[2Jtitle\u{1b}]0;owned\u{7}bell\u{7}\tcol\u{8}DEL\u{7f}c1\u{9b}end"
        ),
        "{lines:?}"
    );
}

/// A workload's files are in its directory while it runs; once it ended
/// and its output was shipped, the directory and the agent's state for it
/// are gone. With `--keep-workdirs` the directory stays that long.
#[test]
fn an_ended_instance_leaves_nothing_behind() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("tidy-node", "1xH100");
    let (_, key) = home.tenant("tidy");
    let key = key.as_str();
    let work = agent_dir(&home);
    let script =
        "echo secret > model.bin; mkdir -p out; echo ready; while [ ! -e go ]; do sleep 0.1; done";
    let id = home.run_detached(key, &["--gpus", "1", "--", "sh", "-c", script]);
    let dir = work.join("instances").join(&id);
    let state = work.join("state").join("tidy-node").join(&id);
    wait_until("the workload's file", Duration::from_secs(60), || {
        dir.join("model.bin").exists()
    });
    assert!(
        state.join("stdout").exists(),
        "the agent's state while it runs"
    );
    std::fs::write(dir.join("go"), "").unwrap();
    wait_ended(&home, key, &id, Duration::from_secs(60));
    wait_until("the directory is removed", Duration::from_secs(60), || {
        !dir.exists() && !state.exists()
    });
    let logs = home.get(key, &format!("/v1/instances/{id}/logs"));
    assert_eq!(
        logs["items"][0]["line"], "ready",
        "its output was shipped first"
    );
}

#[test]
fn kept_workdirs_go_once_their_time_passed() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _server = home.server();
    let url = home.url();
    let _agent = home.agent_with("keep-node", "1xH100", &url, &["--keep-workdirs", "8s"]);
    let (_, key) = home.tenant("debugger");
    let key = key.as_str();
    let work = agent_dir(&home);
    let id = home.run_detached(key, &["--gpus", "1", "--", "sh", "-c", "echo kept > notes"]);
    let dir = work.join("instances").join(&id);
    let state = work.join("state").join("keep-node").join(&id);
    wait_ended(&home, key, &id, Duration::from_secs(60));
    wait_until("the agent released it", Duration::from_secs(60), || {
        !state.exists()
    });
    let released = Instant::now();
    assert_eq!(
        std::fs::read_to_string(dir.join("notes")).unwrap(),
        "kept\n",
        "kept for debugging"
    );
    wait_until(
        "the kept directory is removed",
        Duration::from_secs(60),
        || !dir.exists(),
    );
    assert!(
        released.elapsed() >= Duration::from_secs(5),
        "kept about 8 s, gone after {:?}",
        released.elapsed()
    );
}
