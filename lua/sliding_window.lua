-- sliding_window.lua: the sliding-window counter, the current window's count
-- plus the previous one's weighted by how much of it the sliding window
-- still covers (src/algorithm/sliding_window.rs). A differential test
-- demands the same answers as the Rust core.
--
-- KEYS[1]  "<window index> <count> <previous count> <window length>" as
--          four packed doubles, or absent (a value made under another window
--          length, after a policy change, reads as absent).
-- ARGV[1]  now, microseconds since the epoch, from the caller (never TIME)
-- ARGV[2]  cost in tokens
-- ARGV[3]  limit: tokens per window
-- ARGV[4]  window W, microseconds
-- ARGV[5]  ttl margin, microseconds
--
-- Admits while prev x (W - e) + (cur + cost) x W <= limit x W (e: time into
-- the current window): the estimate multiplied through by W, in integers,
-- exact because the service keeps limit x W <= 2^53. Returns
-- "<allowed 1|0> <remaining> <retry_after_us> <reset_us>"; reset is when
-- the estimate is 0 again. O(1): one GET, at most one SET; a denial writes
-- nothing; the key expires when both counts have left the window.

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local w = tonumber(ARGV[4])
local margin = tonumber(ARGV[5])

local raw = redis.call('GET', KEYS[1])
local si, scur, sprev, sw
if raw and #raw == 32 then
  si, scur, sprev, sw = struct.unpack('<d<d<d<d', raw)
  if sw ~= w then raw = nil end
else
  raw = nil
end
local at = now
if raw and si * w > at then at = si * w end
local index = math.floor(at / w)
while index * w > at do index = index - 1 end
while (index + 1) * w <= at do index = index + 1 end

local cur, prev = 0, 0
if raw then
  if si == index then
    cur, prev = scur, sprev
  elseif si + 1 == index then
    prev = scur
  end
end
local e = at - index * w
local lw = limit * w

local allowed = 0
if prev * (w - e) + (cur + cost) * w <= lw then
  allowed = 1
  cur = cur + cost
end

local used = prev * (w - e) + cur * w
local remaining = 0
if lw > used then
  local left = lw - used
  remaining = math.floor(left / w)
  while remaining * w > left do remaining = remaining - 1 end
  while (remaining + 1) * w <= left do remaining = remaining + 1 end
end

local start = index * w
local retry_at = at
if prev * (w - e) + (cur + cost) * w > lw then
  local found = false
  local room = limit - cur - cost
  if room >= 0 and prev > 0 then
    -- first e2 with prev x (W - e2) <= room x W: W - floor(room x W / prev)
    local x = room * w
    local most = math.floor(x / prev)
    while most * prev > x do most = most - 1 end
    while (most + 1) * prev <= x do most = most + 1 end
    local e2 = w - most
    if e2 < 0 then e2 = 0 end
    if e2 < w then
      retry_at = start + e2
      found = true
    end
  end
  if not found then
    local e2 = 0
    if cur > 0 then
      local x = (limit - cost) * w
      local most = math.floor(x / cur)
      while most * cur > x do most = most - 1 end
      while (most + 1) * cur <= x do most = most + 1 end
      e2 = w - most
      if e2 < 0 then e2 = 0 end
    end
    retry_at = start + w + e2
  end
end
local reset_at = now
if cur > 0 then
  reset_at = start + 2 * w
elseif prev > 0 then
  reset_at = start + w
end

if allowed == 1 and cost > 0 then
  redis.call('SET', KEYS[1], struct.pack('<d<d<d<d', index, cur, prev, w), 'PX',
    math.ceil((start + 2 * w - now + margin) / 1000))
end

return string.format('%d %d %d %d', allowed, remaining, retry_at - now, reset_at - now)
