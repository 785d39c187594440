#!/usr/bin/env python3
# A connected TCP socket passed to another process with SCM_RIGHTS (multiprocessing.reduction
# .send_handle, node cluster, fd-passing servers): the receiver asks what it got
# (getsockname / getpeername / SO_DOMAIN / SO_TYPE; Python's socket(fileno=fd) does so to pick
# the family) and then talks on it. The receiver is forked while its parent holds a listening
# socket (multiprocessing's fork context: the parent listens, starts workers, hands them
# connections). Over kernel TCP it is an AF_INET stream to 127.0.0.1.
import socket, os, sys, array, struct, time
ls = socket.socket(); ls.bind(('127.0.0.1', 0)); ls.listen(4); port = ls.getsockname()[1]
if os.fork() == 0:                                   # the server: echoes upper-case
    c, _ = ls.accept(); d = c.recv(100); c.sendall(d.upper()); c.close(); os._exit(0)
if os.environ.get('CLOSE_LISTENER'): ls.close()   # with it closed first, the shim answers as TCP
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:                                         # the receiver
    a.close()
    msg, fds, _, _ = socket.recv_fds(b, 10, 1)
    fd = fds[0]
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fd)   # no auto-detection
    info = []
    for what, f in (('peer', lambda: raw.getpeername()[0]), ('name', lambda: raw.getsockname()[0])):
        try: info.append('%s=%r' % (what, f()))
        except Exception as e: info.append('%s=%r' % (what, e))
    info.append('SO_DOMAIN=%d' % raw.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN))
    info.append('SO_PROTOCOL=%d' % raw.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL))
    try: info.append('TCP_NODELAY=%d' % raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    except OSError as e: info.append('TCP_NODELAY=errno%d' % e.errno)
    auto = socket.socket(fileno=os.dup(fd))
    info.append('autofamily=%s' % auto.family.name); auto.close()
    raw.settimeout(5)
    try:
        raw.sendall(b'hello'); info.append('reply=%r' % raw.recv(100))
    except OSError as e: info.append('reply=%r' % e)
    print(' '.join(info)); sys.stdout.flush(); os._exit(0)
b.close()
c = socket.create_connection(('127.0.0.1', port))
socket.send_fds(a, [b'x'], [c.fileno()]); c.close()
os.waitpid(pid, 0)
