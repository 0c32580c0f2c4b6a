-- gcra.lua: GCRA, the token bucket as one instant (src/algorithm/gcra.rs).
-- A differential test demands the same answers as the Rust core.
--
-- KEYS[1]  the theoretical arrival time (TAT): three packed doubles, whole
--          microseconds, a remainder in units (TAT = tat + rem / rate) and
--          when the key expires; or absent (a full bucket). A value of two
--          doubles (no expiry) is read as one whose TTL must be set.
-- ARGV[1]  now, microseconds since the epoch, from the caller (never TIME)
-- ARGV[2]  cost in tokens
-- ARGV[3]  unit: units per token
-- ARGV[4]  rate: units refilled per microsecond
-- ARGV[5]  capacity: burst x unit
-- ARGV[6]  ttl margin, microseconds
--
-- Returns "<allowed 1|0> <remaining> <retry_after_us> <reset_us>".
-- O(1): one GET, at most one SET or DEL; a denial writes nothing. The key
-- outlives the instant its bucket is full again (plus the margin): an
-- expired TAT is exactly a full bucket. As in token_bucket.lua, the value
-- remembers its expiry and the TTL is pushed out only once fewer than half
-- the margin would remain (a new TTL costs Redis more than the rest of the
-- write). Integers stay at or below 2^53 (checked limits).

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local unit = tonumber(ARGV[3])
local rate = tonumber(ARGV[4])
local cap = tonumber(ARGV[5])
local margin = tonumber(ARGV[6])

local raw = redis.call('GET', KEYS[1])
local tat, rem, expires = now, 0, 0
if raw then
  if #raw == 24 then
    tat, rem, expires = struct.unpack('<d<d<d', raw)
  elseif #raw == 16 then
    tat, rem = struct.unpack('<d<d', raw)
  end
end

-- How far the stored TAT lies ahead of now, in units (0 if behind).
local given_ahead = 0
if tat >= now then given_ahead = (tat - now) * rate + rem end
local btat, brem = tat, rem
if given_ahead == 0 then btat, brem = now, 0 end

-- Move the TAT by cost x unit / rate microseconds, exactly.
local r2 = brem + cost * unit
local q = r2
if rate ~= 1 then
  q = math.floor(r2 / rate)
  while q * rate > r2 do q = q - 1 end
  while (q + 1) * rate <= r2 do q = q + 1 end
end
local mtat = btat + q
local mrem = r2 - q * rate
local mahead = (mtat - now) * rate + mrem

local allowed = 0
local ahead = given_ahead
if mahead <= cap then
  allowed = 1
  ahead = mahead
end

local tokens = 0
if ahead < cap then tokens = cap - ahead end
local remaining = 0
if tokens >= unit then
  remaining = math.floor(tokens / unit)
  while remaining * unit > tokens do remaining = remaining - 1 end
  while (remaining + 1) * unit <= tokens do remaining = remaining + 1 end
end
-- ceil(x / rate), corrected, for the two waits.
local retry = ahead + cost * unit - cap
if retry < 0 then retry = 0 end
if retry > 0 and rate ~= 1 then
  local c = math.floor(retry / rate)
  while c * rate < retry do c = c + 1 end
  while c > 0 and (c - 1) * rate >= retry do c = c - 1 end
  retry = c
end
local reset = ahead
if reset > 0 and rate ~= 1 then
  local c = math.floor(reset / rate)
  while c * rate < reset do c = c + 1 end
  while c > 0 and (c - 1) * rate >= reset do c = c - 1 end
  reset = c
end

if allowed == 1 then
  if ahead == 0 then
    if raw then redis.call('DEL', KEYS[1]) end
  elseif expires >= now + reset + margin / 2 then
    redis.call('SET', KEYS[1], struct.pack('<d<d<d', mtat, mrem, expires), 'KEEPTTL')
  else
    -- PX in whole milliseconds, rounded up: never shorter than asked.
    local ttl_ms = math.ceil((reset + margin) / 1000)
    redis.call('SET', KEYS[1], struct.pack('<d<d<d', mtat, mrem, now + ttl_ms * 1000), 'PX', ttl_ms)
  end
end

return string.format('%d %d %d %d', allowed, remaining, retry, reset)
