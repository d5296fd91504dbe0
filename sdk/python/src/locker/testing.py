"""Stand-ins for model APIs, to run an agent with no model and no API key: scripted
model functions for `run_agent` (`Scripted`, `endless`), and `MessagesStandIn`, a tiny
HTTP server that speaks enough of Anthropic's Messages API (`POST /v1/messages`) to drive
code written for the real one (examples/python_agent.py --offline, the SDK's tests).

    from locker.testing import MessagesStandIn, anthropic_turn, text, tool_use
    srv = MessagesStandIn(lambda body: anthropic_turn(text("done")))
    # point the client at srv.url with x-api-key srv.api_key; srv.requests keeps each request
    srv.close()

Nothing here is a model: the answers are whatever the script returns.
"""

import http.server
import itertools
import json
import threading

_ids = itertools.count(1)


def tool_use(name, input):  # noqa: A002
    return {"type": "tool_use", "id": f"toolu_{next(_ids):04d}", "name": name, "input": input}


def text(t):
    return {"type": "text", "text": t}


def anthropic_turn(*blocks, stop_reason=None):
    blocks = list(blocks)
    if stop_reason is None:
        stop_reason = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    return {"id": f"msg_{next(_ids)}", "type": "message", "role": "assistant", "model": "stand-in",
            "content": blocks, "stop_reason": stop_reason}


class Scripted:
    """A model function playing `turns` in order; each turn is a function of the messages
    so far (to check what the loop sent back) returning the answer. `seen` keeps a copy of
    every request."""

    def __init__(self, *turns):
        self.turns = list(turns)
        self.seen = []

    def __call__(self, messages, tools):
        self.seen.append((json.loads(json.dumps(messages)), tools))
        if not self.turns:
            raise AssertionError("the loop called the model after the script ended")
        return self.turns.pop(0)(messages)


def endless(messages, tools=None):
    """A model stuck in a loop: it always asks for one more command."""
    return anthropic_turn(tool_use("bash", {"command": "echo again"}))


class MessagesStandIn:
    """`POST /v1/messages` answered by `script(request_body) -> response dict`; checks the
    x-api-key and anthropic-version headers like the real API would."""

    def __init__(self, script, api_key="sk-standin"):
        self.script = script
        self.api_key = api_key
        self.requests = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path != "/v1/messages":
                    return self._send(404, {"type": "error", "error": {"type": "not_found_error", "message": self.path}})
                if self.headers.get("x-api-key") != outer.api_key or not self.headers.get("anthropic-version"):
                    return self._send(401, {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}})
                try:
                    self._send(200, outer.script(body))
                except Exception as e:  # noqa: BLE001
                    self._send(500, {"type": "error", "error": {"type": "api_error", "message": repr(e)}})

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
