// A `net` echo server for client.js: echoes each connection's bytes, then ends it when the
// client half-closes. `node echo.js PORT`.
'use strict';
require('net').createServer({ allowHalfOpen: true }, (s) => {
  s.pipe(s);
}).listen(Number(process.argv[2]), '127.0.0.1');
