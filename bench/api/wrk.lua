-- One wrk scenario of scripts/bench api. Environment: FLOTILLA_KEY (the
-- bearer key), FLOTILLA_OP (create, list or show), FLOTILLA_ID (the
-- instance `show` reads). Prints one JSON line at the end.
local op = os.getenv("FLOTILLA_OP")
local key = os.getenv("FLOTILLA_KEY")
local id = os.getenv("FLOTILLA_ID") or ""

wrk.headers["Authorization"] = "Bearer " .. key
if op == "create" then
  wrk.method = "POST"
  wrk.path = "/v1/instances"
  wrk.headers["Content-Type"] = "application/json"
  wrk.body = '{"gpus": 1, "command": ["sleep", "60"]}'
elseif op == "list" then
  wrk.path = "/v1/instances?limit=100"
else
  wrk.path = "/v1/instances/" .. id
end

done = function(summary, latency, requests)
  local secs = summary.duration / 1e6
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "seconds": %.3f, "per_second": %.1f, "p50_ms": %.2f, "p99_ms": %.2f, "max_ms": %.2f, "non_2xx": %d, "socket_errors": %d}\n',
    summary.requests, secs, summary.requests / secs,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000,
    e.status, e.connect + e.read + e.write + e.timeout))
end
