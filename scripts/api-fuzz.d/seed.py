"""Seeds the server scripts/api-fuzz runs against: two tenants with an
admin key each, and objects of the first (an instance, a member key, a
registry login) that the wrong-tenant run aims every path parameter at.
Prints shell assignments (OPERATOR, ADMIN_A, ADMIN_B) and writes the
schemathesis configuration of the wrong-tenant run."""

import json
import sys
import urllib.request

url, credentials, config_b = sys.argv[1:4]
operator = json.load(open(credentials))["api_key"]


def call(key, method, path, body=None):
    req = urllib.request.Request(
        url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def tenant(name):
    t = call(operator, "POST", "/v1/tenants", {"name": name})
    k = call(operator, "POST", "/v1/keys", {"tenant_id": t["id"], "role": "tenant_admin", "name": "fuzz"})
    return t["id"], k["secret"], k["key"]["id"]


a, admin_a, admin_a_id = tenant("fuzz-a")
b, admin_b, _ = tenant("fuzz-b")
inst = call(admin_a, "POST", "/v1/instances", {"gpus": 1, "command": ["sleep", "1"]})["id"]
member = call(admin_a, "POST", "/v1/keys", {"role": "tenant_member", "name": "m"})["key"]["id"]

# Every path parameter of the API, set to tenant A's objects (or ids of
# the right shape that exist nowhere): tenant B must see none of them.
params = {
    "tenant_id": a,
    "instance_id": inst,
    "key_id": member,
    "job_id": "job_01jd3x7k2q9v8m4n6p5r0s1t2w",
    "endpoint_id": "ep_01jd3x7k2q9v8m4n6p5r0s1t2w",
    "node_id": "node_01jd3x7k2q9v8m4n6p5r0s1t2w",
    "invoice_id": "inv_01jd3x7k2q9v8m4n6p5r0s1t2w",
    "credential_id": "rcred_01jd3x7k2q9v8m4n6p5r0s1t2w",
    "ssh_key_id": "sshk_01jd3x7k2q9v8m4n6p5r0s1t2w",
}
with open(config_b, "w") as f:
    f.write("[parameters]\n")
    for k, v in params.items():
        f.write(f'"path.{k}" = "{v}"\n')

print(f"OPERATOR={operator}")
print(f"ADMIN_A={admin_a}")
print(f"ADMIN_B={admin_b}")
