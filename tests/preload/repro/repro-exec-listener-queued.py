#!/usr/bin/env python3
# A listener inherited across exec (systemd socket activation, inetd "wait" services):
# the process listens, waits until a client is queued, then execs the real server, which
# accepts that client from the inherited fd. Over TCP the queued client is served.
# Usage: repro-exec-listener-queued.py            -> runs the test (server + client)
import os, sys, socket, select, subprocess, time
if len(sys.argv) > 1 and sys.argv[1] == 'served':          # the exec'd program
    ls = socket.socket(fileno=int(sys.argv[2]))
    c, _ = ls.accept()
    try:
        d = c.recv(100)
        c.sendall(b'reply to ' + d)
        c.close()
        sys.exit(0)
    except OSError as e:
        print('server:', e, file=sys.stderr); sys.exit(1)
if len(sys.argv) > 1 and sys.argv[1] == 'activator':      # listens, waits, execs
    ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen(16)
    print(ls.getsockname()[1], flush=True)
    ls.set_inheritable(True)
    select.select([ls], [], [])                            # "Communication attempt on fd"
    os.execv(sys.executable, [sys.executable, __file__, 'served', str(ls.fileno())])
act = subprocess.Popen([sys.executable, __file__, 'activator'], stdout=subprocess.PIPE)
port = int(act.stdout.readline())
s = socket.create_connection(('127.0.0.1', port), timeout=5)
try:
    s.sendall(b'hello')
    got = b''
    while True:
        x = s.recv(100)
        if not x: break
        got += x
except OSError as e:
    got = repr(e).encode()
rc = act.wait(timeout=10)
print('client got', got, 'server rc', rc)
ok = got == b'reply to hello' and rc == 0
print('PASS' if ok else 'DIFF'); sys.exit(0 if ok else 1)
