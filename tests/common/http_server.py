import base64, hashlib, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self): self.route()
    def do_POST(self): self.route()
    def do_PUT(self): self.route()
    def route(self):
        p = self.path
        if p.startswith("/big"):
            n = int(p.split("n=")[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                k = min(n, len(chunk)); self.wfile.write(chunk[:k]); n -= k
            return
        if p == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(("data: %d\n\n" % i).encode()); self.wfile.flush(); time.sleep(0.7)
            self.close_connection = True
            return
        if p == "/garbage":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n"); self.wfile.flush()
            self.close_connection = True
            return
        if p == "/ws":
            key = self.headers["Sec-WebSocket-Key"]
            acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket"); self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", acc); self.end_headers(); self.wfile.flush()
            r = self.rfile
            while True:
                h = r.read(2)
                if len(h) < 2: return
                op = h[0] & 0x0f; ln = h[1] & 0x7f
                if ln == 126: ln = int.from_bytes(r.read(2), "big")
                elif ln == 127: ln = int.from_bytes(r.read(8), "big")
                mask = r.read(4) if h[1] & 0x80 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(r.read(ln)))
                if op == 8:
                    self.wfile.write(b"\x88\x00"); self.wfile.flush(); self.close_connection = True; return
                if ln < 126: hdr = bytes([0x80 | op, ln])
                elif ln < 65536: hdr = bytes([0x80 | op, 126]) + ln.to_bytes(2, "big")
                else: hdr = bytes([0x80 | op, 127]) + ln.to_bytes(8, "big")
                self.wfile.write(hdr + data); self.wfile.flush()
        n = int(self.headers.get("Content-Length") or 0)
        h = hashlib.sha256(); left = n
        while left > 0:
            b = self.rfile.read(min(left, 1 << 20)); h.update(b); left -= len(b)
        body = json.dumps({"method": self.command, "path": self.path, "length": n,
                           "sha256": h.hexdigest(),
                           "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
