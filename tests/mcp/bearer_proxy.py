#!/usr/bin/env python3
# A tiny HTTP proxy for tests: adds `Authorization: Bearer KEY` to every request and
# forwards it to UPSTREAM, streaming the answer (for MCP clients that cannot set headers,
# such as @modelcontextprotocol/conformance). Usage: bearer_proxy.py UPSTREAM_URL KEY PORT
import http.server, http.client, sys, urllib.parse
UP = urllib.parse.urlparse(sys.argv[1]); KEY = sys.argv[2]; PORT = int(sys.argv[3])
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _fwd(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        hdr = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization", "connection", "content-length")}
        hdr["Authorization"] = "Bearer " + KEY
        c = http.client.HTTPConnection(UP.hostname, UP.port, timeout=60)
        c.request(self.command, UP.path, body=body, headers=hdr)
        r = c.getresponse()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked"); self.send_header("Connection", "close"); self.end_headers()
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk: break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk)); self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n"); self.close_connection = True
    do_POST = do_GET = do_DELETE = _fwd
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
