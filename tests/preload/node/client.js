// Requests to server.js (tests/preload/programs.sh): 12 on fresh connections, 12 on a
// keep-alive agent of two sockets, each line its status, length and digest; then a raw TCP
// exchange of 1 MB through `net`, half-closed, echoed back. `node client.js PORT ECHO_PORT`.
'use strict';
const http = require('http');
const net = require('net');
const crypto = require('crypto');
const [port, echoPort] = process.argv.slice(2).map(Number);
const keepAlive = new http.Agent({ keepAlive: true, maxSockets: 2 });
function request(path, body, agent) {
  return new Promise((ok, fail) => {
    const r = http.request({ host: '127.0.0.1', port, path, method: 'POST', agent }, (res) => {
      const h = crypto.createHash('sha256');
      let n = 0;
      res.on('data', (d) => { h.update(d); n += d.length; });
      res.on('end', () => ok(`${res.statusCode} ${n} ${h.digest('hex').slice(0, 16)}`));
    });
    r.on('error', fail);
    r.end(body);
  });
}
function echo() {
  return new Promise((ok, fail) => {
    const data = crypto.createHash('sha512').update('seed').digest();
    const blob = Buffer.concat(Array(1 << 14).fill(data)); // 1 MiB
    const h = crypto.createHash('sha256');
    let n = 0;
    const s = net.connect(echoPort, '127.0.0.1', () => s.end(blob));
    s.on('data', (d) => { h.update(d); n += d.length; });
    s.on('end', () => ok(`echo ${n} ${h.digest('hex').slice(0, 16)}`));
    s.on('error', fail);
  });
}
(async () => {
  const out = [];
  for (let i = 0; i < 12; i++) out.push(await request(i % 2 ? '/big' : '/', 'body' + i, false));
  for (let i = 0; i < 12; i++) out.push(await request('/big', 'kept' + i, keepAlive));
  keepAlive.destroy();
  out.push(await echo());
  console.log(out.join('\n'));
})().catch((e) => { console.log('client error ' + e.code); process.exit(1); });
