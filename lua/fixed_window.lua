-- fixed_window.lua: a counter per window [k*W, (k+1)*W), windows aligned to
-- the epoch (src/algorithm/fixed_window.rs). A differential test demands the
-- same answers as the Rust core.
--
-- KEYS[1]  "<window index> <count> <window length>" as three packed
--          doubles, or absent. The classic form is INCR on a key named after
--          the window; storing the index beside the count instead keeps one
--          key per client and lets a clock that steps back keep counting in
--          the stored window rather than reopen an earlier one. A value made
--          under another window length (the policy changed) reads as absent:
--          its index would name a window decades away.
-- ARGV[1]  now, microseconds since the epoch, from the caller (never TIME)
-- ARGV[2]  cost in tokens
-- ARGV[3]  limit: tokens per window
-- ARGV[4]  window, microseconds
-- ARGV[5]  ttl margin, microseconds
--
-- Returns "<allowed 1|0> <remaining> <retry_after_us> <reset_us>"; reset is
-- when the window's count starts again from zero. O(1): one GET, at most
-- one SET; a denial writes nothing; the key expires at the window's end
-- (plus the margin).

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local w = tonumber(ARGV[4])
local margin = tonumber(ARGV[5])

local current = math.floor(now / w)
while current * w > now do current = current - 1 end
while (current + 1) * w <= now do current = current + 1 end

local index, count = current, 0
local raw = redis.call('GET', KEYS[1])
if raw and #raw == 24 then
  local si, sc, sw = struct.unpack('<d<d<d', raw)
  if sw == w and si >= current then index, count = si, sc end
end

local allowed = 0
if count + cost <= limit then
  allowed = 1
  count = count + cost
end
local ends = (index + 1) * w - now
local retry = 0
if count + cost > limit then retry = ends end
local reset = 0
if count > 0 then reset = ends end

if allowed == 1 and cost > 0 then
  redis.call('SET', KEYS[1], struct.pack('<d<d<d', index, count, w), 'PX', math.ceil((ends + margin) / 1000))
end

-- A count above the limit (the policy was lowered) leaves nothing.
local remaining = limit - count
if remaining < 0 then remaining = 0 end

return string.format('%d %d %d %d', allowed, remaining, retry, reset)
