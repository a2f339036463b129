"""scripts/bench fleet: the control plane under a simulated fleet, real on
the wire. Per size (FLOTILLA_BENCH_FLEET_SIZES, nodes, default 500,1000):
a fresh PostgreSQL database, three `flotilla server` replicas on it, one
`flotilla agent --simulate-fleet N` process (8 simulated H100s per node;
N agents with their own names, registrations and sync loops, sharing one
connection pool) given every server's URL, and a tenant load driver:

- fill: 1-GPU instances (`sleep` of 15-30 min, simulated) created through
  the API, 16 at a time across the servers, until FLOTILLA_BENCH_FLEET_FILL
  (0.75) of the GPUs run work;
- window (FLOTILLA_BENCH_FLEET_SECONDS, 60 s): a second tenant creates a
  short instance (`sleep 10`) every 0.5 s and stops one long one as often;
  a prober times list, show and create calls throughout; the fleet's
  statistics file gives the syncs' timings; the leader's /metrics gives
  the placement passes'; /proc gives the servers' RSS and CPU;
  pg_stat_activity and pg_stat_user_tables give connections and rows.
- at the largest size, last: the leader is paused (SIGSTOP) and then killed;
  the takeover time is measured, then every instance's GPU holdings are
  checked for overlaps and every ended instance's bill against its run.

Arguments: the flotilla binary, the output directory (writes fleet.json.tmp).
Environment: FLOTILLA_BENCH_PG (server URL without database; required).
"""

import concurrent.futures
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

BIN, OUT = sys.argv[1], sys.argv[2]
SIZES = [int(s) for s in os.environ.get("FLOTILLA_BENCH_FLEET_SIZES", "500,1000").split(",") if s]
FILL = float(os.environ.get("FLOTILLA_BENCH_FLEET_FILL", "0.75"))
WINDOW = int(os.environ.get("FLOTILLA_BENCH_FLEET_SECONDS", "60"))
# Longest wait for the fill to run before the window starts anyway.
FILL_WAIT = int(os.environ.get("FLOTILLA_BENCH_FLEET_FILL_WAIT", "240"))
PG = os.environ.get("FLOTILLA_BENCH_PG", "").rstrip("/")
HEARTBEAT_TIMEOUT = 15  # the server's default: heartbeat interval 5 s
GPUS = 8
LOG = os.path.join(tempfile.gettempdir(), "flotilla-bench-fleet.log")
DB = "flotilla_bench_fleet"
CLK = os.sysconf("SC_CLK_TCK")


def now():
    return datetime.now(timezone.utc)


def ts(s):
    return datetime.fromisoformat(s.replace("Z", "+00:00")) if s else None


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def call(url, key, method, path, body=None, timeout=60):
    req = urllib.request.Request(
        url + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
        return json.loads(text) if text[:1] in (b"{", b"[") else text.decode()


def call_any(urls, key, method, path, body=None):
    """The first answer from any server, trying each in turn."""
    last = None
    for u in random.sample(urls, len(urls)):
        try:
            return call(u, key, method, path, body)
        except urllib.error.HTTPError as e:
            if e.code < 500:
                raise
            last = e
        except Exception as e:  # a paused or killed server
            last = e
    raise last


def psql(sql, db="postgres"):
    return subprocess.run(["psql", f"{PG}/{db}", "-Atqc", sql], check=True,
                          capture_output=True, text=True).stdout.strip()


def pages(urls, key, path):
    out, cursor = [], None
    while True:
        sep = "&" if "?" in path else "?"
        p = path + (f"{sep}cursor={cursor}" if cursor else "")
        page = call_any(urls, key, "GET", p)
        out += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 1)) - 1))]


class Cluster:
    def __init__(self, nodes):
        self.nodes = nodes
        self.dir = tempfile.TemporaryDirectory()
        d = self.dir.name
        psql(f"DROP DATABASE IF EXISTS {DB}")
        psql(f"CREATE DATABASE {DB}")
        self.db_url = f"{PG}/{DB}"
        self.env = dict(os.environ)
        for k in ("FLOTILLA_API_KEY", "FLOTILLA_SERVER", "FLOTILLA_DATABASE_URL"):
            self.env.pop(k, None)
        self.env.update(FLOTILLA_CONFIG_DIR=f"{d}/config", FLOTILLA_DATA_DIR=f"{d}/data",
                        RUST_LOG=os.environ.get("FLOTILLA_BENCH_FLEET_LOG", "warn"))
        self.log = open(LOG, "a")
        self.ports = [free_port() for _ in range(3)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers = {}
        for i in range(3):  # one after the other: the first bootstraps the database
            self.start_server(i)
        self.operator = json.load(open(f"{d}/config/credentials.json"))["api_key"]
        self.agent_token = open(f"{d}/data/agent.token").read().strip()
        self.stats_file = f"{d}/fleet-stats.json"
        self.fleet = None

    def start_server(self, i):
        args = [BIN, "server", "--bind", f"127.0.0.1:{self.ports[i]}", "--data-dir",
                f"{self.dir.name}/data", "--database-url", self.db_url,
                "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--rate-limit", "1000000"]
        self.servers[i] = subprocess.Popen(args, env=self.env, stdout=self.log, stderr=self.log,
                                           stdin=subprocess.DEVNULL, preexec_fn=raise_nofile)
        wait(f"server {i} answers", 120, lambda: health(self.urls[i]) is not None)
        if i == 0:
            wait("credentials", 60,
                 lambda: os.path.exists(f"{self.dir.name}/config/credentials.json"))

    def start_fleet(self):
        args = [BIN, "agent", "--server", ",".join(self.urls), "--token", self.agent_token,
                "--simulate-fleet", str(self.nodes), "--simulate-gpus", f"{GPUS}xH100",
                "--simulate-cpus", "128", "--simulate-memory-gb", "2048", "--name", "fleet",
                "--work-dir", f"{self.dir.name}/fleet", "--fleet-stats", self.stats_file]
        self.fleet = subprocess.Popen(args, env=self.env, stdout=self.log, stderr=self.log,
                                      stdin=subprocess.DEVNULL, preexec_fn=raise_nofile)

    def stats(self):
        try:
            return json.load(open(self.stats_file))
        except Exception:
            return {}

    def leader(self):
        for i, u in enumerate(self.urls):
            if i in self.servers and (health(u) or {}).get("role") == "leader":
                return i
        return None

    def live_urls(self):
        return [self.urls[i] for i in self.servers]

    def stop(self):
        if self.fleet:
            self.fleet.send_signal(signal.SIGTERM)
            try:
                self.fleet.wait(timeout=180)
            except subprocess.TimeoutExpired:
                self.fleet.kill()
        for p in self.servers.values():
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in self.servers.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.log.close()
        self.dir.cleanup()
        psql(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


def health(url):
    try:
        with urllib.request.urlopen(url + "/v1/health", timeout=2) as r:
            return json.load(r)
    except Exception:
        return None


def wait(what, limit, f, every=0.5):
    deadline = time.time() + limit
    while time.time() < deadline:
        if f():
            return
        time.sleep(every)
    raise SystemExit(f"scripts/bench fleet: timed out waiting for {what}; see {LOG}")


def tenant(c, name):
    t = call(c.urls[0], c.operator, "POST", "/v1/tenants", {"name": name})
    return call(c.urls[0], c.operator, "POST", "/v1/keys",
                {"tenant_id": t["id"], "role": "tenant_admin", "name": name})["secret"]


def proc_sample(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return ticks, rss


def leader_metrics(c):
    """The leader's /metrics lines (none while no replica leads)."""
    i = c.leader()
    if i is None:
        return []
    return call(c.urls[i], c.operator, "GET", "/metrics").splitlines()


def pass_histogram(c):
    """The leader's placement-pass histogram: {le: count}."""
    out = {}
    for line in leader_metrics(c):
        if line.startswith("flotilla_placement_pass_duration_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def leader_passes(c):
    """The leader's passes so far: {pass: (seconds, count)}, from
    flotilla_leader_pass_duration_seconds (absent before that series)."""
    out = {}
    for line in leader_metrics(c):
        for part, k in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("flotilla_leader_pass_duration_seconds" + part):
                name = line.split('pass="')[1].split('"')[0]
                got = out.setdefault(name, [0.0, 0])
                got[k] = float(line.rsplit(" ", 1)[1])
        # The planner's share of the placement passes that had work.
        for part, k in (("_sum ", 0), ("_count ", 1)):
            if line.startswith("flotilla_placement_plan_duration_seconds" + part):
                got = out.setdefault("plan", [0.0, 0])
                got[k] = float(line.rsplit(" ", 1)[1])
    return out


def passes_over(before, after):
    """Per pass over the window: count and mean milliseconds."""
    out = {}
    for name, (total, n) in after.items():
        t0, n0 = before.get(name, (0.0, 0))
        if n > n0:
            out[name] = {"count": int(n - n0), "mean_ms": round((total - t0) * 1000 / (n - n0), 1)}
    return out


def histogram_pct(before, after, q):
    les = sorted(after)
    delta = [(le, after[le] - before.get(le, 0)) for le in les]
    total = delta[-1][1] if delta else 0
    if total <= 0:
        return None, 0
    for le, n in delta:
        if n >= q * total:
            return le * 1000, int(total)
    return None, int(total)


def server_sync_parts(c):
    """Every live server's flotilla_agent_sync_duration_seconds, merged:
    {part: ({le: count}, sum_s, count)}."""
    out = {}
    for i in c.servers:
        try:
            lines = call(c.urls[i], c.operator, "GET", "/metrics").splitlines()
        except Exception:
            continue
        for line in lines:
            if not line.startswith("flotilla_agent_sync_duration_seconds"):
                continue
            part = line.split('part="')[1].split('"')[0]
            buckets, total, n = out.setdefault(part, ({}, 0.0, 0))
            v = float(line.rsplit(" ", 1)[1])
            if "_bucket{" in line:
                le = line.split('le="')[1].split('"')[0]
                le = float("inf") if le == "+Inf" else float(le)
                buckets[le] = buckets.get(le, 0) + v
            elif "_sum{" in line:
                out[part] = (buckets, total + v, n)
            elif "_count{" in line:
                out[part] = (buckets, total, n + int(v))
    return out


def sync_parts_over(before, after):
    """Per part over the window: count, mean ms, and p50/p99 bucket bounds."""
    out = {}
    for part, (buckets, total, n) in after.items():
        b0, t0, n0 = before.get(part, ({}, 0.0, 0))
        if n <= n0:
            continue
        p50, _ = histogram_pct(b0, buckets, 0.5)
        p99, _ = histogram_pct(b0, buckets, 0.99)
        out[part] = {"count": n - n0, "mean_ms": round((total - t0) * 1000 / (n - n0), 1),
                     "p50_ms": p50, "p99_ms": p99}
    return out


def machine_ticks():
    """The machine's CPU ticks: (busy, all), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def postgres_ticks():
    """CPU ticks of every PostgreSQL process alive now: {pid: ticks} (a
    backend that exits inside the window takes its ticks with it; one that
    starts inside it counts whole)."""
    total = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        if comm.startswith("postgres"):
            fields = raw.rsplit(")", 1)[1].split()
            total[d] = int(fields[11]) + int(fields[12])
    return total


def own_ticks():
    t = os.times()
    return round((t.user + t.system) * CLK)


def perf_profile(pid, seconds):
    """Starts `perf record` on `pid` for `seconds` (flat, 199 Hz); returns a
    function that waits for it and gives the top symbols as [(percent,
    symbol)], or None where perf is missing or not allowed."""
    if not os.environ.get("FLOTILLA_BENCH_FLEET_PERF") or not shutil.which("perf"):
        return lambda: None
    data = os.path.join(tempfile.gettempdir(), f"flotilla-fleet-perf-{pid}.data")
    p = subprocess.Popen(["perf", "record", "-F", "199", "-p", str(pid), "-o", data, "--",
                          "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def done():
        if p.wait() != 0:
            return None
        out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "symbol",
                              "--stdio", "--percent-limit", "1.5"],
                             capture_output=True, text=True).stdout
        top = []
        for line in out.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or "%" not in line.split()[0]:
                continue
            pct_s, rest = line.split(None, 1)
            sym = rest.split("] ", 1)[-1].strip()
            top.append((float(pct_s.rstrip("%")), " ".join(sym.split())[:90]))
        os.remove(data)
        return top[:15]
    return done


def rows_inserted():
    return int(psql("SELECT coalesce(sum(n_tup_ins),0) FROM pg_stat_user_tables", DB) or 0)


def pg_connections():
    return int(psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname='{DB}'"))


def fill(c, key, works):
    body = lambda: {"gpus": 1, "cpu_milli": 100, "memory_mb": 256,
                    "command": ["sleep", str(random.randint(900, 1800))]}
    lat = []

    def one(_):
        t = time.time()
        v = call_any(c.urls, key, "POST", "/v1/instances", body())
        lat.append(time.time() - t)
        return v["id"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(one, range(works)))
    return ids, lat


def measure(c, key, churn_key, long_ids):
    """The steady window: churn, probes and the counters around them."""
    stop = threading.Event()
    api = []  # (op, seconds)
    churn = []  # ids of the short instances
    stopped = []

    def prober():
        while not stop.is_set():
            for op, path in (("list", "/v1/instances?limit=100"),
                             ("show", f"/v1/instances/{random.choice(long_ids)}"),
                             ("gpu-types", "/v1/gpu-types")):
                t = time.time()
                try:
                    call_any(c.live_urls(), key, "GET", path)
                    api.append((op, time.time() - t))
                except Exception:
                    api.append((op + " failed", time.time() - t))
            time.sleep(0.1)

    def churner():
        left = list(long_ids)
        random.shuffle(left)
        while not stop.is_set():
            t = time.time()
            try:
                v = call_any(c.live_urls(), churn_key, "POST", "/v1/instances",
                             {"gpus": 1, "cpu_milli": 100, "memory_mb": 256,
                              "command": ["sleep", "10"]})
                api.append(("create", time.time() - t))
                churn.append(v["id"])
                if left:
                    victim = left.pop()
                    call_any(c.live_urls(), key, "POST", f"/v1/instances/{victim}/stop", {})
                    stopped.append(victim)
            except Exception:
                api.append(("create failed", time.time() - t))
            stop.wait(max(0.0, 0.5 - (time.time() - t)))

    pids = {i: p.pid for i, p in c.servers.items()}
    before = {i: proc_sample(pid) for i, pid in pids.items()}
    pass_before, rows_before = pass_histogram(c), rows_inserted()
    leader_before = leader_passes(c)
    parts_before = server_sync_parts(c)
    others_before = (proc_sample(c.fleet.pid)[0], postgres_ticks(), own_ticks(), machine_ticks())
    lead = c.leader()
    profile = perf_profile(c.servers[lead].pid, max(10, WINDOW // 2)) if lead is not None else (lambda: None)
    t0 = time.time()
    threads = [threading.Thread(target=prober), threading.Thread(target=churner)]
    for t in threads:
        t.start()
    peak_conn, peak_rss = 0, {}
    while time.time() - t0 < WINDOW:
        time.sleep(2)
        peak_conn = max(peak_conn, pg_connections())
        for i, pid in pids.items():
            peak_rss[i] = max(peak_rss.get(i, 0), proc_sample(pid)[1])
    stop.set()
    for t in threads:
        t.join()
    took = time.time() - t0
    after = {i: proc_sample(pid) for i, pid in pids.items()}
    others_after = (proc_sample(c.fleet.pid)[0], postgres_ticks(), own_ticks(), machine_ticks())
    pass_after, rows_after = pass_histogram(c), rows_inserted()
    leader_after = leader_passes(c)
    parts_after = server_sync_parts(c)
    stats = c.stats()
    cpu = {i: (after[i][0] - before[i][0]) / CLK / took * 100 for i in pids}
    pg_before, pg_after = others_before[1], others_after[1]
    pg_ticks = sum(t - pg_before.get(pid, 0) for pid, t in pg_after.items())
    others_before = (others_before[0], 0) + others_before[2:]
    others_after = (others_after[0], pg_ticks) + others_after[2:]
    share = lambda k: round((others_after[k] - others_before[k]) / CLK / took * 100)
    (busy0, all0), (busy1, all1) = others_before[3], others_after[3]
    machine = {"servers_pct": round(sum(cpu.values())), "fleet_pct": share(0),
               "postgres_pct": share(1), "driver_pct": share(2),
               "busy_pct_of_all_cores": round((busy1 - busy0) * 100 / max(1, all1 - all0)),
               "cores": os.cpu_count()}
    leader_profile = profile()
    p50, _ = histogram_pct(pass_before, pass_after, 0.5)
    p99, passes = histogram_pct(pass_before, pass_after, 0.99)
    # Create to running, and metering lag, of the churn instances: from
    # the server's records once they ended.
    time.sleep(15)
    c2r, lag = [], []
    usage = {}
    since = (now() - timedelta(minutes=10)).isoformat().replace("+00:00", "Z")
    until = (now() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    for e in pages(c.live_urls(), churn_key, f"/v1/usage?limit=1000&from={since}&to={until}"):
        if e["meter"]["meter"] == "gpu_seconds":
            usage.setdefault(e["subject"]["id"], []).append(e)
    for iid in churn:
        inst = call_any(c.live_urls(), churn_key, "GET", f"/v1/instances/{iid}")
        if inst.get("started_at"):
            c2r.append((ts(inst["started_at"]) - ts(inst["created_at"])).total_seconds())
    lag = metering_lag(c, churn_key, churn)
    ok = [s for op, s in api if "failed" not in op]
    return {
        "window_s": round(took, 1),
        "sync_overhead_p50_ms": stats.get("overhead", {}).get("p50_ms"),
        "sync_overhead_p99_ms": stats.get("overhead", {}).get("p99_ms"),
        "sync_early_p50_ms": stats.get("early", {}).get("p50_ms"),
        "sync_early_p99_ms": stats.get("early", {}).get("p99_ms"),
        "syncs_per_s": None,
        "sync_failures": stats.get("syncs_failed"),
        "syncs_busy": stats.get("syncs_busy"),
        "pass_p50_ms": p50, "pass_p99_ms": p99, "passes": passes,
        "leader_passes": passes_over(leader_before, leader_after),
        "server_sync_parts": sync_parts_over(parts_before, parts_after),
        "cpu": machine,
        "leader_profile": leader_profile,
        "create_to_running_p50_s": pct(c2r, 0.5), "create_to_running_p99_s": pct(c2r, 0.99),
        "created_in_window": len(churn), "never_ran": len(churn) - len(c2r),
        "api_p50_ms": (pct(ok, 0.5) or 0) * 1000, "api_p99_ms": (pct(ok, 0.99) or 0) * 1000,
        "api_calls": len(api), "api_failed": len(api) - len(ok),
        "metering_lag_p50_s": pct(lag, 0.5), "metering_lag_max_s": max(lag) if lag else None,
        "server_rss_mib": [round(peak_rss[i] / 2**20) for i in sorted(peak_rss)],
        "server_cpu_pct": [round(cpu[i]) for i in sorted(cpu)],
        "pg_connections_peak": peak_conn,
        "rows_per_hour": round((rows_after - rows_before) * 3600 / took),
        "running_workloads": stats.get("running_workloads"),
    }


def metering_lag(c, churn_key, churn):
    """For each churn instance that ended: how long after its end the
    ledger held its last event, found by polling the ledger every second
    for 90 s from now (so this reads a lower bound of 0 for what was
    metered before; what was not yet metered is timed)."""
    ended = {}
    for iid in churn:
        inst = call_any(c.live_urls(), churn_key, "GET", f"/v1/instances/{iid}")
        if inst.get("finished_at") and inst.get("started_at"):
            ended[iid] = ts(inst["finished_at"])
    lag = {}
    deadline = time.time() + 90
    since = (now() - timedelta(minutes=10)).isoformat().replace("+00:00", "Z")
    until = (now() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    first = True
    while ended.keys() - lag.keys() and time.time() < deadline:
        seen = now()
        for e in pages(c.live_urls(), churn_key, f"/v1/usage?limit=1000&from={since}&to={until}"):
            iid = e["subject"]["id"]
            if iid in ended and iid not in lag and ts(e["end"]) >= ended[iid]:
                # Metered before the first look: 0 (a lower bound), not
                # the time since its end.
                lag[iid] = 0.0 if first else max(0.0, (seen - ended[iid]).total_seconds())
        first = False
        time.sleep(1)
    return list(lag.values())


def usage_check(c, keys, insts):
    billed = {}
    since = (now() - timedelta(hours=2)).isoformat().replace("+00:00", "Z")
    until = (now() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    for k in keys:
        events = pages(c.live_urls(), k, f"/v1/usage?limit=1000&from={since}&to={until}")
        voided = {(e["corrects"]["source"], e["corrects"]["id"]) for e in events if e.get("corrects")}
        for e in events:
            if e["meter"]["meter"] != "gpu_seconds" or (e["key"]["source"], e["key"]["id"]) in voided:
                continue
            ms = (ts(e["end"]) - ts(e["start"])) / timedelta(milliseconds=1)
            billed[e["subject"]["id"]] = billed.get(e["subject"]["id"], 0) + round(ms) * int(float(e["amount"]))
    missed = doubled = checked = 0
    trunc = lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000)
    for i in insts:
        if i["state"] not in ("succeeded", "stopped", "failed") or not i.get("started_at") or not i.get("finished_at"):
            continue
        # The documented end (crates/server/src/metering.rs): the exit, or,
        # for work the server ended while lost with no exit reported, the
        # loss (not billed past it).
        end = ts(i["finished_at"])
        states = i.get("events") or []
        if i.get("exit_code") is None and len(states) >= 2 and states[-2]["state"] == "lost":
            end = max(ts(states[-2]["at"]), ts(i["started_at"]))
        want = round((trunc(end) - trunc(ts(i["started_at"]))) / timedelta(milliseconds=1)) * i["gpus"]
        got = billed.get(i["id"], 0)
        checked += 1
        missed += got < want
        doubled += got > want
    return missed, doubled, checked


def failover(c, key, churn_key):
    """Pause the leader, measure the takeover, kill it, then check that no
    GPU was held twice and that every ended instance is billed its run."""
    old = c.leader()
    p = c.servers[old]
    p.send_signal(signal.SIGSTOP)
    t0 = time.time()
    others = [i for i in c.servers if i != old]
    took = None
    while time.time() - t0 < 60:
        if any((health(c.urls[i]) or {}).get("role") == "leader" for i in others):
            took = time.time() - t0
            break
        time.sleep(0.05)
    time.sleep(5)
    p.kill()
    p.wait()
    del c.servers[old]
    # Work goes on through the survivors: short instances, then their ends.
    churn = []
    for _ in range(20):
        churn.append(call_any(c.live_urls(), churn_key, "POST", "/v1/instances",
                              {"gpus": 1, "cpu_milli": 100, "memory_mb": 256,
                               "command": ["sleep", "5"]})["id"])
        time.sleep(0.25)
    # Bounded, and not fatal: what did not end in time is counted.
    ended = lambda i: call_any(c.live_urls(), churn_key, "GET", f"/v1/instances/{i}")["state"] \
        in ("succeeded", "failed", "stopped", "lost")
    deadline = time.time() + 180
    while not all(ended(i) for i in churn) and time.time() < deadline:
        time.sleep(2)
    not_ended = sum(1 for i in churn if not ended(i))
    insts = pages(c.live_urls(), key, "/v1/instances?limit=1000") + \
        pages(c.live_urls(), churn_key, "/v1/instances?limit=1000")
    # GPUs held twice: per GPU, intervals from placement to the end.
    holds = {}
    for i in insts:
        frm = next((ts(e["at"]) for e in i.get("events", []) if e["state"] == "scheduled"), None)
        if frm is None:
            continue
        to = ts(i.get("finished_at")) or now()
        for g in i.get("gpu_ids") or []:
            holds.setdefault(g, []).append((frm, to, i["id"]))
    twice = 0
    for g, hs in holds.items():
        hs.sort()
        for a, b in zip(hs, hs[1:]):
            if b[0] < a[1]:
                twice += 1
    # Usage missed or doubled: each ended instance billed exactly its run,
    # looked at until nothing is missing or 3 minutes passed (metering
    # runs behind under load: what it still lacks then is missed).
    deadline = time.time() + 180
    while True:
        missed, doubled, checked = usage_check(c, [key, churn_key], insts)
        if missed == 0 or time.time() > deadline:
            break
        time.sleep(10)
    return {"takeover_s": took, "gpus_held_twice": twice, "made_after_kill": len(churn),
            "made_after_kill_not_ended": not_ended, "usage_checked": checked,
            "usage_missed": missed, "usage_doubled": doubled,
            "lost": sum(1 for i in insts if i["state"] == "lost")}


def run_size(nodes, last):
    works = int(nodes * GPUS * FILL)
    print(f"fleet: {nodes} nodes, {works} works", flush=True)
    c = Cluster(nodes)
    try:
        t0 = time.time()
        c.start_fleet()
        wait("every node registered", 600, lambda: c.stats().get("registered", 0) >= nodes)
        registered = time.time() - t0
        key, churn_key = tenant(c, "bench"), tenant(c, "churn")
        wait("every GPU free", 300, lambda: next(
            (t["free"] for t in call_any(c.urls, key, "GET", "/v1/gpu-types")["items"]
             if t["name"] == "H100"), 0) >= nodes * GPUS, every=2)
        t1 = time.time()
        ids, create_lat = fill(c, key, works)
        created = time.time() - t1
        # Bounded: a control plane that cannot place the fill in time is
        # measured with what runs (the row says how much).
        deadline = time.time() + FILL_WAIT
        while c.stats().get("running_workloads", 0) < works and time.time() < deadline:
            time.sleep(2)
        filled = time.time() - t1
        print(f"  registered in {registered:.0f} s, {works} created in {created:.0f} s, running after {filled:.0f} s", flush=True)
        row = {"nodes": nodes, "gpus": nodes * GPUS, "works": works,
               "register_s": round(registered, 1), "fill_create_s": round(created, 1),
               "fill_running_s": round(filled, 1),
               "fill_running": c.stats().get("running_workloads", 0),
               "fill_create_p99_ms": round(pct(create_lat, 0.99) * 1000, 1)}
        s0 = c.stats().get("syncs_answered", 0)
        t2 = time.time()
        row.update(measure(c, key, churn_key, ids))
        row["syncs_per_s"] = round((c.stats().get("syncs_answered", 0) - s0) / (time.time() - t2), 1)
        print("  " + json.dumps(row), flush=True)
        if last:
            try:
                row["failover"] = failover(c, key, churn_key)
            except (Exception, SystemExit) as e:  # recorded, not lost with the rows
                row["failover"] = {"error": str(e)}
            print("  failover " + json.dumps(row["failover"]), flush=True)
        return row
    finally:
        c.stop()


if not PG:
    raise SystemExit("scripts/bench fleet needs PostgreSQL (FLOTILLA_BENCH_PG)")
rows = [run_size(n, i == len(SIZES) - 1) for i, n in enumerate(SIZES)]
json.dump({"sizes": SIZES, "fill": FILL, "window_s": WINDOW, "gpus_per_node": GPUS,
           "heartbeat_timeout_s": HEARTBEAT_TIMEOUT, "rows": rows},
          open(os.path.join(OUT, "fleet.json.tmp"), "w"), indent=2)
