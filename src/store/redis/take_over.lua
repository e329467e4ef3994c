local function unflagged(x)
  if string.byte(x, 2) == 1 and #x > 66 then return string.sub(x, 1, 66) .. string.sub(x, 68) end
  return x
end
local v = redis.call('GET', KEYS[1])
if v and unflagged(v) == unflagged(ARGV[2]) then return 1 end
if (not v) or unflagged(v) ~= unflagged(ARGV[1]) then return 0 end
local new = ARGV[2]
if string.byte(v, 2) == 1 and string.byte(v, 67) == 1 and string.byte(new, 2) == 1 then
  new = string.sub(new, 1, 66) .. '\1' .. string.sub(new, 68)
end
redis.call('SET', KEYS[1], new, 'PX', ARGV[3])
return 1
