#!/usr/bin/env python3
# inetd "wait" style (xinetd wait=yes, systemd Accept=no): a daemon listens, polls the
# listener, and when a client is queued it starts the real server with the listener
# inherited (fork + exec; or exec in place with EXEC_IN_PLACE=1, as systemd-socket-activate),
# which accepts the client. Over kernel TCP the queued client is served.
import os, sys, socket, select, subprocess, time
if len(sys.argv) > 1 and sys.argv[1] == 'served':        # the exec'd program
    ls = socket.socket(fileno=int(sys.argv[2]))
    ls.settimeout(3)
    for _ in range(int(sys.argv[3])):
        c, _ = ls.accept(); c.settimeout(3)
        try:
            d = c.recv(100); c.sendall(b'reply to ' + d); c.close()
        except OSError as e:
            print('server:', e, file=sys.stderr); sys.exit(1)
    sys.exit(0)
if len(sys.argv) > 1 and sys.argv[1] == 'daemon':        # listens, waits, starts the server
    ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen(16)
    print(ls.getsockname()[1], flush=True)
    ls.set_inheritable(True)
    select.select([ls], [], [])
    argv = [sys.executable, __file__, 'served', str(ls.fileno()), sys.argv[2]]
    if os.environ.get('EXEC_IN_PLACE'):
        os.execv(sys.executable, argv)
    pid = os.fork()
    if pid == 0:
        os.execv(sys.executable, argv)
    _, st = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(st))
N = 3
d = subprocess.Popen([sys.executable, __file__, 'daemon', str(N)], stdout=subprocess.PIPE)
port = int(d.stdout.readline())
res = []
for i in range(N):
    t = time.time()
    try:
        s = socket.create_connection(('127.0.0.1', port), timeout=5)
        s.sendall(b'c%d' % i); got = s.recv(100)
    except OSError as e:
        got = repr(e).encode()
    res.append(got); print('client %d got %r in %.2f s' % (i, got, time.time() - t))
try: rc = d.wait(timeout=10)
except subprocess.TimeoutExpired: d.kill(); rc = 'hung'
print('server rc', rc)
ok = res == [b'reply to c%d' % i for i in range(N)] and rc == 0
print('PASS' if ok else 'DIFF'); sys.exit(0 if ok else 1)
