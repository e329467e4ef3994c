local v = redis.call('GET', KEYS[1])
if not v then return 0 end
redis.call('DEL', KEYS[1])
if string.byte(v, 2) == 1 then
if string.byte(v, 67) == 1 then redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV]) end
end
return 1