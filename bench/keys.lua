-- wrk script: POST a small JSON body with an Idempotency-Key on every request.
--   wrk ... -s bench/keys.lua URL -- PATH MODE
-- PATH defaults to /payments. MODE "new" (default) sends a new key on every request;
-- "replay" cycles through 64 keys, so after the first 64 every request is a replay.

local counter = 0
local path = "/payments"
local mode = "new"
local prefix = ""
local body = '{"amount":100,"currency":"EUR","customer":"cus_42"}'

function setup(thread)
  thread:set("seed", tostring(math.random(1, 1000000000)))
end

function init(args)
  if args[1] then path = args[1] end
  if args[2] then mode = args[2] end
  -- Unique per thread and per run, so "new" keys are really new.
  prefix = (seed or "0") .. "-" .. tostring(os.time())
end

function request()
  counter = counter + 1
  local key
  if mode == "replay" then
    key = "replay-" .. tostring(counter % 64)
  else
    key = prefix .. "-" .. tostring(counter)
  end
  return wrk.format("POST", path, {
    ["Idempotency-Key"] = key,
    ["Content-Type"] = "application/json",
  }, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT requests=%d seconds=%.3f p50_ms=%.3f p99_ms=%.3f non2xx=%d socket_errors=%d\n",
    summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    e.status, e.connect + e.read + e.write + e.timeout))
end
