# after a connection to a listener WITHOUT SO_REUSEADDR is closed server-side first, the port is in TIME_WAIT:
# a new listener binding it (even with SO_REUSEADDR) gets EADDRINUSE over kernel TCP.
import socket,errno
l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(); p=l.getsockname()
c=socket.create_connection(p); s,_=l.accept(); s.close(); c.close(); l.close()
l2=socket.socket(); l2.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)
try: l2.bind(p); print('bind ok')
except OSError as e: print('bind',errno.errorcode[e.errno])
