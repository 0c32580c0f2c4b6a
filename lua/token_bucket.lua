-- token_bucket.lua: one atomic read-refill-clamp-spend-write of a token bucket.
-- The same integer fixed point as src/bucket.rs; a differential test demands
-- identical answers from both.
--
-- KEYS[1]  the bucket: a string of two packed doubles (tokens, last), or absent
--          (absent means full). One key, so it lives in one cluster slot.
-- ARGV[1]  now: microseconds since the Unix epoch, from the caller. Never
--          redis.call('TIME'): the script stays deterministic, so replicas and
--          the AOF replay it to the same state, whatever their clocks say.
-- ARGV[2]  cost: tokens this request spends (0 peeks)
-- ARGV[3]  unit: units per token (the reduced period in microseconds)
-- ARGV[4]  rate: units refilled per microsecond (the reduced rate)
-- ARGV[5]  capacity: burst x unit
-- ARGV[6]  ttl margin in milliseconds, added to the time until full
--
-- Returns {allowed (1|0), remaining whole tokens, retry_after_us, reset_us}:
-- retry_after_us is the wait before another request of this cost is admitted
-- (0 if one would be now), reset_us the wait until the bucket is full again.
--
-- Every integer formed here is at most 2^53 (capacity and rate are at most
-- 2^52, checked by the service), so doubles hold them exactly. Divisions are
-- floored and then corrected with exact products, because a double quotient
-- near 2^53 can round across an integer.
--
-- O(1): one GET, at most one SET (with PX) or DEL; nothing else. A denial
-- writes nothing: the stored (tokens, last) refills to the same state later.
-- The TTL is the time to refill to full plus a margin: an expired bucket is
-- exactly a full one, so expiry loses nothing.

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local unit = tonumber(ARGV[3])
local rate = tonumber(ARGV[4])
local cap = tonumber(ARGV[5])
local margin = tonumber(ARGV[6])

local raw = redis.call('GET', KEYS[1])
local tokens, last
if raw then
  tokens, last = struct.unpack('<d<d', raw)
  if tokens > cap then tokens = cap end
else
  tokens, last = cap, now
end

-- floor(a / b) and ceil(a / b) for integers 0 <= a <= 2^52, 1 <= b <= 2^52.
local function div_floor(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function div_ceil(a, b)
  local q = div_floor(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- A clock behind the stored one refills nothing; waits are measured from now.
local at = now
if last > at then at = last end
local missing = cap - tokens
if missing > 0 then
  -- Rounding is monotone, so a product too large to be exact is still
  -- >= missing and the clamp makes it exact.
  local refill = (at - last) * rate
  if refill > missing then refill = missing end
  tokens = tokens + refill
end

local cost_units = cost * unit
local allowed = 0
if tokens >= cost_units then
  tokens = tokens - cost_units
  allowed = 1
end

local skew = at - now
local function wait(deficit)
  if deficit <= 0 then return 0 end
  return div_ceil(deficit, rate) + skew
end
local reset = wait(cap - tokens)

if allowed == 1 then
  if reset == 0 then
    -- Full (a zero-cost peek at a full bucket): keep no key at all.
    if raw then redis.call('DEL', KEYS[1]) end
  else
    local ttl_ms = div_ceil(reset, 1000) + margin
    redis.call('SET', KEYS[1], struct.pack('<d<d', tokens, at), 'PX', ttl_ms)
  end
end

local remaining = 0
if tokens >= unit then remaining = div_floor(tokens, unit) end
return {allowed, remaining, wait(cost_units - tokens), reset}
