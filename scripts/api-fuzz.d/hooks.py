"""Schemathesis hooks of scripts/api-fuzz.

Two checks beside schemathesis' own:

- store_unchanged_by_rejected_calls: a call answered 4xx left the store as
  it was. The store's desired state (tenants, keys, quotas, instances,
  jobs, endpoints, registry logins, SSH keys, billing terms, budgets,
  nodes) is read from the SQLite file before each call and compared after
  a refusal. What the server writes for every call by design is left out:
  the audit log (refusals included), idempotency records, leases and the
  meters the background loops keep.
- only_refusals (FLOTILLA_FUZZ_EXPECT=refused): every answer is 401 or
  429 (or 405, for a method the route does not have), for the run without
  a valid key; routes documented with no security requirement excepted.

The run uses one worker, so "before the call" is well defined.
"""

import hashlib
import os
import sqlite3

import schemathesis

DB = os.environ["FLOTILLA_FUZZ_DB"]
EXPECT = os.environ.get("FLOTILLA_FUZZ_EXPECT", "")

# Whole tables of desired state, compared row by row.
WHOLE = [
    "tenants",
    "api_keys",
    "registry_credentials",
    "ssh_keys",
    "budgets",
    "discounts",
    "credit_grants",
    "commitments",
    "price_versions",
    "providers",
]
# Tables the loops also write: only what a call could change.
PARTS = {
    "instances": "SELECT id, tenant_id, state FROM instances",
    "jobs": "SELECT id, tenant_id, state FROM jobs",
    "endpoints": "SELECT id, tenant_id, name FROM endpoints",
    "nodes": "SELECT id, name FROM nodes",
    "invoices": "SELECT id, tenant_id FROM invoices",
    "instance_logs": "SELECT COUNT(*) FROM instance_logs",
    "usage_events": "SELECT COUNT(*) FROM usage_events",
}


def snapshot():
    con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True, timeout=30)
    try:
        out = {}
        for table in WHOLE:
            rows = con.execute(f"SELECT * FROM {table}").fetchall()
            out[table] = hashlib.sha256(repr(sorted(map(repr, rows))).encode()).hexdigest()
        for table, sql in PARTS.items():
            rows = con.execute(sql).fetchall()
            out[table] = hashlib.sha256(repr(sorted(map(repr, rows))).encode()).hexdigest()
        return out
    finally:
        con.close()


_before = {}


@schemathesis.hook
def before_call(context, case, kwargs):
    _before["store"] = snapshot()


@schemathesis.check
def store_unchanged_by_rejected_calls(ctx, response, case):
    if not 400 <= response.status_code < 500 or "store" not in _before:
        return None
    after = snapshot()
    changed = [t for t, h in after.items() if _before["store"].get(t) != h]
    if changed:
        raise AssertionError(
            f"a call answered {response.status_code} changed the store: {', '.join(changed)}"
        )
    return None


@schemathesis.check
def only_refusals(ctx, response, case):
    # Routes whose entry asks for no bearer key (`security: []`, e.g. an
    # agent joining with a one-time token in its body) answer on their own
    # terms.
    security = case.operation.definition.raw.get("security")
    if security is not None and all(not s for s in security):
        return None
    if EXPECT == "refused" and response.status_code not in (401, 405, 429):
        raise AssertionError(
            f"a call without a valid key was answered {response.status_code}, not 401 or 429"
        )
    return None
