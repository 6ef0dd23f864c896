-- Takes the usage-only events (`"choices":[]` and a `"usage":{` on one `data:` line) out of a
-- stream the plugin marked (dynamic metadata hetero_gateway.strip_usage: it asked the engine for
-- usage on the client's behalf). Unmarked streams return before any chunk is read. Chunks are
-- scanned with plain finds; a partial last line that shows `"choices":[]` is held back and
-- completed by the next chunk, and an empty chunk (Envoy's end of a chunked body) sends whatever
-- is held, so a chunk boundary can at worst leave a usage event in the stream, never lose bytes
-- of anything else (tests/dataplane/test_strip_usage_lua.py).
-- The first line, `local NS, KEY = ...`, is prepended by plugin/adapters/envoy_config.py.
local function usage_only(s, from, to)
  if string.sub(s, from, from + 4) ~= "data:" then return false end
  local c = string.find(s, '"choices":[]', from, true)
  if c == nil or c > to then return false end
  local u = string.find(s, '"usage":{', from, true)
  return u ~= nil and u <= to
end

-- What to send now, what to hold for the next chunk, and whether a newline that opens the next
-- chunk ends an event taken out here.
local function strip(s)
  local out, pos, n = {}, 1, #s
  while pos <= n do
    local nl = string.find(s, "\n", pos, true)
    if nl == nil then
      if string.sub(s, pos, pos + 4) == "data:" and string.find(s, '"choices":[]', pos, true) then
        return table.concat(out), string.sub(s, pos), false
      end
      out[#out + 1] = string.sub(s, pos)
      break
    end
    if usage_only(s, pos, nl) then
      if nl == n then return table.concat(out), "", true end
      if string.sub(s, nl + 1, nl + 1) == "\n" then nl = nl + 1 end
    else
      out[#out + 1] = string.sub(s, pos, nl)
    end
    pos = nl + 1
  end
  return table.concat(out), "", false
end

function envoy_on_response(handle)
  local marks = handle:streamInfo():dynamicMetadata():get(NS)
  if marks == nil or marks[KEY] ~= true then return end
  local held, blank = "", false
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size == 0 then
      if held ~= "" then chunk:setBytes(held) end
      held, blank = "", false
    else
      local s = held .. chunk:getBytes(0, size)
      if blank or held ~= "" or string.find(s, '"choices":[]', 1, true) then
        if blank and string.sub(s, 1, 1) == "\n" then s = string.sub(s, 2) end
        local kept
        kept, held, blank = strip(s)
        chunk:setBytes(kept)
      end
    end
  end
end
