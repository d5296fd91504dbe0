#!/bin/sh
# Add Locker to Claude Code, either transport (run one of them).
# Streamable HTTP, straight to `locker serve`:
claude mcp add --transport http locker http://127.0.0.1:7070/mcp \
  --header "Authorization: Bearer $LOCKER_API_KEY"
# or stdio, through `locker mcp`:
# claude mcp add locker --env LOCKER_URL=http://127.0.0.1:7070 --env LOCKER_API_KEY=$LOCKER_API_KEY -- locker mcp
