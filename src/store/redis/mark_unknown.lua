local v = redis.call('GET', KEYS[1])
if (not v) or string.byte(v, 2) ~= 1 or string.sub(v, 43, 58) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], string.sub(v, 1, 1) .. '\3' .. string.sub(v, 3, 42) .. ARGV[2] .. string.sub(v, 68), 'KEEPTTL')
if string.byte(v, 67) == 1 then redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV]) end
return 1
