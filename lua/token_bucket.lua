-- token_bucket.lua: one atomic read-refill-clamp-spend-write of a token bucket.
-- The same integer fixed point as src/algorithm/token_bucket.rs; a
-- differential test demands identical answers from both.
--
-- KEYS[1]  the bucket: a string of three packed doubles (tokens, last,
--          expires), or absent (absent means full). One key, so it lives in
--          one cluster slot.
-- ARGV[1]  now: microseconds since the Unix epoch, from the caller. Never
--          the server clock: the script stays deterministic, so replicas and
--          the AOF replay it to the same state, whatever their clocks say.
-- ARGV[2]  cost: tokens this request spends (0 peeks)
-- ARGV[3]  unit: units per token (the reduced period in microseconds)
-- ARGV[4]  rate: units refilled per microsecond (the reduced rate)
-- ARGV[5]  capacity: burst x unit
-- ARGV[6]  ttl margin in microseconds
-- ARGV[7]  optional ceiling in units (at most capacity): after refill the
--          bucket holds at most this many. Passed while a bucket is handed
--          back from the local fallback, so Redis grants no fresh burst.
--          With ARGV[8], the capacity when there is no ceiling.
-- ARGV[8]  optional, a lease's take: once the request is admitted, take up
--          to this many whole tokens more in the same step...
-- ARGV[9]  ...but only if at most this many whole tokens remain after them
--          (a lease from a nearly full bucket could not be held); else none.
--
-- Returns "<allowed 1|0> <remaining> <retry_after_us> <reset_us>", one
-- string: Redis converts a returned Lua table to a reply at about twice the
-- cost of a string. retry_after_us is the wait before another request of
-- this cost is admitted (0 if one would be now), reset_us the wait until the
-- bucket is full again. With ARGV[8], a fifth number: the tokens taken
-- beyond the cost. Remaining and waits are those after the take.
--
-- Every integer formed here is at most 2^53 (capacity and rate are at most
-- 2^52, checked by the service), so doubles hold them exactly. Divisions are
-- corrected with exact products, because a double quotient near 2^53 can
-- round across an integer.
--
-- O(1): one GET, at most one SET or DEL; nothing else. A denial writes
-- nothing: the stored (tokens, last) refills to the same state later.
--
-- Expiry: the key must outlive the time its bucket takes to refill to full
-- (an expired bucket is exactly a full one, so expiry then loses nothing).
-- Setting a TTL costs Redis more than the rest of the write (SET ... PX is
-- rewritten for replication), so the value remembers when the key expires,
-- and the TTL is pushed out, by refill time + margin, only once fewer than
-- half the margin would remain; otherwise the write keeps the TTL. Clocks of
-- instances and server may differ by less than half the margin.

local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local unit = tonumber(ARGV[3])
local rate = tonumber(ARGV[4])
local cap = tonumber(ARGV[5])

local margin = tonumber(ARGV[6])

local raw = redis.call('GET', KEYS[1])
local tokens, last, expires = cap, now, 0
if raw and #raw == 24 then
  tokens, last, expires = struct.unpack('<d<d<d', raw)
  if tokens > cap then tokens = cap end
end

-- A clock behind the stored one refills nothing; waits are measured from now.
local at = now
if last > at then at = last end
if tokens < cap then
  -- Rounding is monotone, so a product too large to be exact is still
  -- >= the deficit, and the clamp makes the result exact.
  local refill = (at - last) * rate
  if refill >= cap - tokens then tokens = cap else tokens = tokens + refill end
end
local ceiling = tonumber(ARGV[7])
if ceiling and tokens > ceiling then tokens = ceiling end

local need = cost * unit
local allowed = 0
if tokens >= need then
  tokens = tokens - need
  allowed = 1
end
local remaining = 0
if tokens >= unit then
  remaining = math.floor(tokens / unit)
  while remaining * unit > tokens do remaining = remaining - 1 end
  while (remaining + 1) * unit <= tokens do remaining = remaining + 1 end
end
local most = tonumber(ARGV[8])
local extra = 0
if most and allowed == 1 then
  extra = most
  if remaining < extra then extra = remaining end
  if extra > 0 and remaining - extra <= tonumber(ARGV[9]) then
    tokens = tokens - extra * unit
    remaining = remaining - extra
  else
    extra = 0
  end
end
local skew = at - now

-- Waits: ceil(deficit / rate) + skew. The helpers are inlined (a local
-- function would be a new closure on every call). With rate 1 (10/s and
-- 100/min reduce to it) the division is exact; otherwise the double quotient
-- is corrected with exact products.
local reset = cap - tokens
if reset > 0 then
  if rate ~= 1 then
    local q = math.floor(reset / rate)
    while q * rate < reset do q = q + 1 end
    while q > 0 and (q - 1) * rate >= reset do q = q - 1 end
    reset = q
  end
  reset = reset + skew
end
local retry = need - tokens
if retry > 0 then
  if rate ~= 1 then
    local q = math.floor(retry / rate)
    while q * rate < retry do q = q + 1 end
    while q > 0 and (q - 1) * rate >= retry do q = q - 1 end
    retry = q
  end
  retry = retry + skew
else
  retry = 0
end

if allowed == 1 then
  if reset == 0 then
    -- Full (a zero-cost peek at a full bucket): keep no key at all.
    if raw then redis.call('DEL', KEYS[1]) end
  else
    local full_at = now + reset
    if expires >= full_at + margin / 2 then
      redis.call('SET', KEYS[1], struct.pack('<d<d<d', tokens, at, expires), 'KEEPTTL')
    else
      -- PX in whole milliseconds, rounded up: never shorter than asked.
      local ttl_ms = math.ceil((reset + margin) / 1000)
      redis.call('SET', KEYS[1], struct.pack('<d<d<d', tokens, at, now + ttl_ms * 1000), 'PX', ttl_ms)
    end
  end
end

if most then
  return string.format('%d %d %d %d %d', allowed, remaining, retry, reset, extra)
end
return string.format('%d %d %d %d', allowed, remaining, retry, reset)
