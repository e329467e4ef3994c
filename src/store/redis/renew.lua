
local v = redis.call('GET', KEYS[1])
if (not v) or string.byte(v, 2) ~= 1 or string.sub(v, 43, 58) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], string.sub(v, 1, 58) .. ARGV[2] .. string.sub(v, 67), 'KEEPTTL')
return 1