# A server for the port proxy's tests, run inside a machine: one thread (asyncio), so
# hundreds of held connections cost the machine no processes. Well-behaved routes
# (/echo, /upload, /big, /echostream, /sse, /ws a WebSocket echo, /raw a raw echo after a 101) and hostile ones (/hang, /garbage, /hugeheaders,
# /hugeline, /cut, /cutchunked). Usage: python3 ports_srv.py PORT
import asyncio, base64, hashlib, json, sys

ZEROS = bytes(1 << 20)

async def read_body(r, headers):
    h = hashlib.sha256(); n = 0
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await r.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                await r.readline()
                break
            left = size
            while left:
                b = await r.read(min(left, 1 << 20))
                if not b:
                    raise ConnectionError("cut")
                h.update(b); n += len(b); left -= len(b)
            await r.readline()
    else:
        left = int(headers.get("content-length") or 0)
        while left:
            b = await r.read(min(left, 1 << 20))
            if not b:
                raise ConnectionError("cut")
            h.update(b); n += len(b); left -= len(b)
    return n, h.hexdigest()

async def websocket_echo(r, w, key):
    acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    await w.drain()
    while True:
        h = await r.readexactly(2)
        op, ln = h[0] & 0x0f, h[1] & 0x7f
        if ln == 126:
            ln = int.from_bytes(await r.readexactly(2), "big")
        elif ln == 127:
            ln = int.from_bytes(await r.readexactly(8), "big")
        mask = await r.readexactly(4) if h[1] & 0x80 else b"\0\0\0\0"
        data = bytearray(await r.readexactly(ln))
        for i in range(ln):
            data[i] ^= mask[i % 4]
        if op == 8:
            w.write(b"\x88\x00"); await w.drain(); return
        if ln < 126:
            hdr = bytes([0x80 | op, ln])
        elif ln < 65536:
            hdr = bytes([0x80 | op, 126]) + ln.to_bytes(2, "big")
        else:
            hdr = bytes([0x80 | op, 127]) + ln.to_bytes(8, "big")
        w.write(hdr + bytes(data)); await w.drain()

def query(path):
    q = {}
    if "?" in path:
        for kv in path.split("?", 1)[1].split("&"):
            k, _, v = kv.partition("=")
            q[k] = v
    return q

async def answer(w, status, body, ctype="application/json"):
    w.write(("HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
             % (status, ctype, len(body))).encode() + body)
    await w.drain()

async def handle(r, w):
    try:
        while True:
            line = await r.readline()
            if not line:
                return
            method, path, _ = line.decode().split(" ", 2)
            headers = {}
            while True:
                h = await r.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            route = path.split("?")[0]
            q = query(path)
            if route == "/hang":
                await asyncio.sleep(1e6)
                return
            if route == "/garbage":
                w.write(b"NOT HTTP AT ALL\r\n\r\n"); await w.drain(); return
            if route == "/hugeheaders":
                w.write(b"HTTP/1.1 200 OK\r\n")
                for i in range(20000):
                    w.write(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000))
                    if i % 100 == 0:
                        if w.is_closing():
                            return
                        await w.drain()
                w.write(b"Content-Length: 2\r\n\r\nok"); await w.drain(); return
            if route == "/hugeline":
                w.write(b"HTTP/1.1 200 OK\r\nX-Huge: " + b"b" * (10 << 20) + b"\r\nContent-Length: 2\r\n\r\nok")
                await w.drain(); return
            if route == "/big":
                n = int(q["n"])
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                while n > 0:
                    k = min(n, len(ZEROS)); w.write(ZEROS[:k]); n -= k
                    await w.drain()
                    if w.is_closing():
                        return
                continue
            if route == "/echostream":
                # The body back as it comes (Content-Length framing both ways).
                n = int(headers.get("content-length") or 0)
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                while n:
                    b = await r.read(min(n, 1 << 20))
                    if not b:
                        raise ConnectionError("cut")
                    w.write(b); n -= len(b)
                    await w.drain()
                continue
            if route == "/cut":
                n, at = int(q["n"]), int(q["at"])
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + bytes(at))
                await w.drain(); return
            if route == "/cutchunked":
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(4):
                    w.write(b"10000\r\n" + bytes(0x10000) + b"\r\n")
                await w.drain(); return
            if route == "/sse":
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                for i in range(3):
                    w.write(b"data: %d\n\n" % i); await w.drain(); await asyncio.sleep(0.7)
                return
            if route == "/raw" and headers.get("upgrade"):
                # Raw bytes both ways after the 101: the proxy relays, it does not parse.
                w.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: raw\r\nConnection: Upgrade\r\n\r\n")
                await w.drain()
                while True:
                    b = await r.read(1 << 16)
                    if not b:
                        return
                    w.write(b); await w.drain()
            if route == "/ws" and headers.get("upgrade"):
                await websocket_echo(r, w, headers["sec-websocket-key"])
                return
            if "ms" in q:
                await asyncio.sleep(int(q["ms"]) / 1000)
            n, digest = await read_body(r, headers)
            body = json.dumps({"method": method, "path": path, "length": n, "sha256": digest,
                               "headers": headers}).encode()
            await answer(w, "200 OK", body)
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        return
    finally:
        w.close()

async def main():
    srv = await asyncio.start_server(handle, "0.0.0.0", int(sys.argv[1]), backlog=1024)
    await srv.serve_forever()

asyncio.run(main())
