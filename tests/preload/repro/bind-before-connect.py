# client binds an explicit local port, then connects: getsockname() and the server's accept() address must show that port
import socket
l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen()
c=socket.socket(); c.bind(('127.0.0.1',0)); bound=c.getsockname()[1]
c.connect(l.getsockname()); s,a=l.accept()
print('bound port == client getsockname:',c.getsockname()[1]==bound,'| == server accept peer port:',a[1]==bound,'| == server getpeername:',s.getpeername()[1]==bound)
print('bound',bound,'client getsockname',c.getsockname()[1],'server sees',a[1])
