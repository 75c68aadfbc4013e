"""The MCP surface: the streamable HTTP endpoint at ``/mcp`` (server.py, inside the web
process) and the stdio bridge (bridge.py, a local command that forwards to it and needs no
Django settings or database). README "MCP"."""

SERVER_NAME = "zeromem"
INSTRUCTIONS = (
    "ZeroMem: long-term memory. Save what is worth keeping with memory_write under a ':'-separated key "
    "(user:<id>:<name>, task:<id>:<name>); find it again with memory_search or memory_recall; "
    "memory_read, memory_list, memory_update, memory_delete, memory_summarize do what they say."
)
