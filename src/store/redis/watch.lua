local v = redis.call('GET', KEYS[1])
if v and string.byte(v, 2) == 1 and string.byte(v, 67) ~= 1 then redis.call('SETRANGE', KEYS[1], 66, '\1') end
return v
