// The secrets test's HTTPS host: HTTP/2 and HTTP/1.1 on 443 (ALPN), HTTP/1.1 with an
// Upgrade echo on 8443, plain HTTP on 80. It answers each request with what it received
// (version, URL, headers, body) as JSON, with the secret's real values written as
// [value-1] / [value-2] so that the machine never reads a value back; every request's
// authorization header and URL are appended to a log file the test reads.
const fs = require('fs');
const http = require('http');
const https = require('https');
const http2 = require('http2');
const crypto = require('crypto');
const [addr, name, cert, key, log] = process.argv.slice(2);
const values = [process.env.SECRET_VALUE_1, process.env.SECRET_VALUE_2];
const mask = (s) => values.reduce((acc, v, i) => (v ? acc.split(v).join(`[value-${i + 1}]`) : acc), s);
const note = (req) => fs.appendFileSync(log, `${req.headers['authorization'] || ''} ${req.url}\n`);
function handler(req, res) {
  note(req);
  if (req.url.startsWith('/big')) {
    const mb = parseInt(new URL(req.url, 'https://x').searchParams.get('mb') || '1', 10);
    res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(mb << 20) });
    const chunk = Buffer.alloc(1 << 20, 120);
    let i = 0;
    const more = () => {
      while (i < mb) {
        i++;
        if (!res.write(chunk)) { res.once('drain', more); return; }
      }
      res.end();
    };
    more();
    return;
  }
  const body = [];
  req.on('data', (c) => body.push(c));
  req.on('end', () => {
    const out = JSON.stringify({ server: name, version: req.httpVersion, url: req.url, headers: req.headers, body: Buffer.concat(body).toString() });
    res.writeHead(200, { 'content-type': 'application/json' });
    res.end(mask(out) + '\n');
  });
}
const tls = { cert: fs.readFileSync(cert), key: fs.readFileSync(key) };
http2.createSecureServer({ ...tls, allowHTTP1: true }, handler).listen(443, addr);
const ws = https.createServer(tls, handler);
ws.on('upgrade', (req, socket) => {
  note(req);
  const accept = crypto.createHash('sha1').update(req.headers['sec-websocket-key'] + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest('base64');
  const seen = mask(req.headers['authorization'] || '');
  socket.write(`HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: ${accept}\r\nX-Authorization-Seen: ${seen}\r\n\r\n`);
  socket.on('data', (d) => socket.write(mask(d.toString()).toUpperCase()));
});
ws.listen(8443, addr);
http.createServer(handler).listen(80, addr, () => console.log('ready'));
