#!/bin/sh
# The serverless call with curl: a volume, a file, a run that changes it, the result.
# Needs a running `locker serve` and its key:  LOCKER_URL (default http://127.0.0.1:7070), LOCKER_API_KEY.
set -eu
URL=${LOCKER_URL:-http://127.0.0.1:7070}
AUTH="Authorization: Bearer $LOCKER_API_KEY"

# 1. A volume: a named persistent disk (409 if the name exists; that is fine here).
curl -s -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"name": "demo", "size_mb": 256}' "$URL/v1/volumes"; echo

# 2. Put a file in it, no machine needed (paths are relative to the volume's root).
printf 'print("hello from the volume")\n' |
  curl -s -H "$AUTH" -X PUT --data-binary @- "$URL/v1/volumes/demo/files?path=/hello.py"; echo

# 3. Run one command in a fresh machine with the volume at /workspace (also the cwd).
#    The machine is destroyed afterwards; what the command wrote is committed to the volume
#    ("commit": "always" | "on_success" | "never") and listed in "changes".
curl -s -H "$AUTH" -H 'Content-Type: application/json' \
  -d '{"shell": "python3 hello.py | tee out.txt", "timeout_ms": 30000, "commit": "on_success"}' \
  "$URL/v1/volumes/demo/run"; echo
#    -> {"exit_code":0,"reason":"exited","stdout":"hello from the volume\n", ...,
#        "changes":{"added":["/out.txt"],"modified":[],"deleted":[],"committed":true,"conflicts":[]}}
#    A non-zero exit is still HTTP 200: read exit_code and reason.

# 4. The file the run wrote is on the volume.
curl -s -H "$AUTH" "$URL/v1/volumes/demo/files?path=/out.txt"
