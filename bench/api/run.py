"""scripts/bench api: sustained API load on a real `flotilla server` with
wrk. Per backend (SQLite file; PostgreSQL when it answers) and queue size
(100 pending instances, so that a list page is full; and
FLOTILLA_BENCH_API_QUEUED, 10,000 by default):
instance creates at 16 connections, then list (100 a page) and show at 64.
No node is registered, so every created instance stays queued: creates
measure the API and the store, and the reconcile loop runs its pass over a
growing queue as it would on a full cluster.

Arguments: the flotilla binary, the output directory. Environment:
FLOTILLA_BENCH_API_SECONDS (per scenario, 15), FLOTILLA_BENCH_API_QUEUED,
FLOTILLA_BENCH_PG (a PostgreSQL server URL without database, or empty),
FLOTILLA_BENCH_API_BASELINE (another flotilla binary, say one built from an
earlier commit, and FLOTILLA_BENCH_API_BASELINE_LABEL its name): when set,
every backend and queue size runs on both binaries back to back, the
baseline first, so that their ratio is measured minutes apart on the same
(shared, busy) machine rather than across runs.
"""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

BIN, OUT = sys.argv[1], sys.argv[2]
SECONDS = int(os.environ.get("FLOTILLA_BENCH_API_SECONDS", "15"))
QUEUED = int(os.environ.get("FLOTILLA_BENCH_API_QUEUED", "10000"))
PG = os.environ.get("FLOTILLA_BENCH_PG", "")
BASELINE = os.environ.get("FLOTILLA_BENCH_API_BASELINE", "")
BASELINE_LABEL = os.environ.get("FLOTILLA_BENCH_API_BASELINE_LABEL", "baseline")
# The servers' output (it carries each throwaway server's operator key), kept
# out of the recorded results.
LOG = os.path.join(tempfile.gettempdir(), "flotilla-bench-api-server.log")
LUA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrk.lua")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def call(url, key, method, path, body=None):
    req = urllib.request.Request(
        url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


class Server:
    def __init__(self, binary, database_url):
        self.dir = tempfile.TemporaryDirectory()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        for k in ("FLOTILLA_API_KEY", "FLOTILLA_SERVER", "FLOTILLA_DATABASE_URL"):
            env.pop(k, None)
        env.update(
            FLOTILLA_CONFIG_DIR=f"{self.dir.name}/config",
            FLOTILLA_DATA_DIR=f"{self.dir.name}/data",
            RUST_LOG="warn",
        )
        args = [binary, "server", "--bind", f"127.0.0.1:{self.port}", "--data-dir",
                f"{self.dir.name}/data", "--rate-limit", "1000000"]
        if database_url:
            args += ["--database-url", database_url]
        self.log = open(LOG, "a")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        creds = f"{self.dir.name}/config/credentials.json"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url + "/healthz", timeout=2)
                if os.path.exists(creds):
                    self.operator = json.load(open(creds))["api_key"]
                    return
            except Exception:
                pass
            time.sleep(0.25)
        raise SystemExit(f"the server did not start; see {LOG}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()
        self.dir.cleanup()


def wrk(url, key, op, connections, instance=""):
    env = dict(os.environ, FLOTILLA_KEY=key, FLOTILLA_OP=op, FLOTILLA_ID=instance)
    out = subprocess.run(
        ["wrk", "-t", str(min(connections, 4)), "-c", str(connections), "-d", f"{SECONDS}s",
         "--timeout", "10s", "-s", LUA, url],
        env=env, capture_output=True, text=True, check=True,
    ).stdout
    line = [l for l in out.splitlines() if l.startswith("{")][-1]
    return json.loads(line)


def fill(url, key, n):
    body = {"gpus": 1, "command": ["sleep", "60"]}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: call(url, key, "POST", "/v1/instances", body), range(n)))


def pg_database(name):
    base = PG.rstrip("/")
    subprocess.run(["psql", base + "/postgres", "-qc", f"DROP DATABASE IF EXISTS {name}"], check=True)
    subprocess.run(["psql", base + "/postgres", "-qc", f"CREATE DATABASE {name}"], check=True)
    return f"{base}/{name}"


rows = []
backends = [("sqlite", None)] + ([("postgres", "pg")] if PG else [])
servers = ([(BASELINE_LABEL, BASELINE)] if BASELINE else []) + [("this", BIN)]
for backend, pg in backends:
    for queued in (100, QUEUED):
        for label, binary in servers:
            url = pg_database("flotilla_bench_api") if pg else None
            s = Server(binary, url)
            try:
                t = call(s.url, s.operator, "POST", "/v1/tenants", {"name": "bench"})
                key = call(s.url, s.operator, "POST", "/v1/keys",
                           {"tenant_id": t["id"], "role": "tenant_admin", "name": "bench"})["secret"]
                started = time.time()
                fill(s.url, key, queued)
                filled = time.time() - started
                if pg:
                    # Statistics as autovacuum keeps them in steady state (it
                    # analyses a table once a tenth of it changed, within a
                    # minute): the planner otherwise plans for the table as
                    # it was before the fill (docs/operations.md: analyse
                    # after a bulk import).
                    subprocess.run(["psql", url, "-qc", "ANALYZE"], check=True)
                one = call(s.url, key, "POST", "/v1/instances", {"gpus": 1, "command": ["x"]})["id"]
                # Reads first, on the queue as filled; then creates add to it.
                for op, conns in (("list", 64), ("show", 64), ("create", 16)):
                    r = wrk(s.url, key, op, conns, one)
                    r.update(server=label, backend=backend, queued=queued, op=op,
                             connections=conns, fill_seconds=round(filled, 2))
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                s.stop()

json.dump({"seconds": SECONDS, "baseline": BASELINE_LABEL if BASELINE else None, "rows": rows},
          open(f"{OUT}/api.json.tmp", "w"), indent=2)
