-- sliding_log.lua: an exact sliding window as a log of admitted tokens
-- (src/algorithm/sliding_log.rs). A differential test demands the same
-- answers as the Rust core.
--
-- KEYS[1]  a sorted set: one member per admitted token, scored by its
--          timestamp, named "<t>:<n>" with n numbering the members at that
--          same t from 1 (members at one t are trimmed together, so the
--          numbers in use at t are always 1..k and the next is k + 1).
-- ARGV[1]  now, microseconds since the epoch, from the caller (never TIME)
-- ARGV[2]  cost in tokens
-- ARGV[3]  limit: tokens in any window
-- ARGV[4]  window, microseconds
-- ARGV[5]  ttl margin, microseconds
--
-- Returns "<allowed 1|0> <remaining> <retry_after_us> <reset_us>"; reset is
-- when the log is empty again. Cost: trimming is O(log n + expired) (each
-- entry is trimmed once); the rest O(log n) per token; memory one member per
-- token admitted in the last window. A now older than the newest entry is
-- read as that entry's instant. The key's TTL (W + margin) counts from the
-- caller's now: instances' clocks must agree within the margin, as for the
-- token bucket.

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local w = tonumber(ARGV[4])
local margin = tonumber(ARGV[5])
local key = KEYS[1]

local at = now
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if newest[2] then
  local t = tonumber(newest[2])
  if t > at then at = t end
end
-- An entry at t counts in (at - W, at]: gone once t <= at - W.
redis.call('ZREMRANGEBYSCORE', key, '-inf', at - w)
local count = redis.call('ZCARD', key)

local allowed = 0
if count + cost <= limit then
  allowed = 1
  local same = 0
  if cost > 0 then same = redis.call('ZCOUNT', key, at, at) end
  local i = 0
  while i < cost do
    local args = {}
    local n = 0
    while i < cost and n < 256 do
      i = i + 1
      n = n + 1
      args[2 * n - 1] = at
      args[2 * n] = string.format('%d:%d', at, same + i)
    end
    redis.call('ZADD', key, unpack(args))
  end
  count = count + cost
  if cost > 0 then
    redis.call('PEXPIRE', key, math.ceil((w + margin) / 1000))
  end
end

local retry = 0
local excess = count + cost - limit
if excess > 0 then
  local e = redis.call('ZRANGE', key, excess - 1, excess - 1, 'WITHSCORES')
  retry = tonumber(e[2]) + w - now
end
local reset = 0
if count > 0 then
  local n = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  reset = tonumber(n[2]) + w - now
end

-- More entries than the limit (the policy was lowered) leave nothing.
local remaining = limit - count
if remaining < 0 then remaining = 0 end

return string.format('%d %d %d %d', allowed, remaining, retry, reset)
