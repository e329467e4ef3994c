local v = redis.call('GET', KEYS[1])
if v ~= ARGV[1] and v ~= ARGV[1] .. '\1' then return 0 end
redis.call('SET', KEYS[1], ARGV[2] .. string.sub(v, #ARGV[1] + 1), 'PX', ARGV[3])
return 1