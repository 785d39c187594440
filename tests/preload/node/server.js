// An HTTP server on node's cluster module (tests/preload/programs.sh): the primary accepts
// each connection and hands it to one of two workers (SCM_RIGHTS), closing its own copy by a
// raw close(2) system call, as libuv does. A worker answers with the sha256 of the request's
// body, and 200 KB more for /big. `node server.js PORT`.
'use strict';
const cluster = require('cluster');
const http = require('http');
const crypto = require('crypto');
const port = Number(process.argv[2]);
cluster.schedulingPolicy = cluster.SCHED_RR;
if (cluster.isPrimary) {
  for (let i = 0; i < 2; i++) cluster.fork();
  process.on('SIGTERM', () => {
    for (const w of Object.values(cluster.workers)) w.kill();
    process.exit(0);
  });
} else {
  const big = Buffer.alloc(200000, 'x');
  http.createServer((req, res) => {
    const h = crypto.createHash('sha256');
    req.on('data', (d) => h.update(d));
    req.on('end', () => {
      res.end(h.digest('hex') + '\n' + (req.url === '/big' ? big.toString() : ''));
    });
  }).listen(port, '127.0.0.1');
}
