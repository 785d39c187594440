# ForkingTCPServer + 16 concurrent clients: max connect+reply latency. Over TCP: well under 0.5 s.
import socketserver,socket,threading,time,os,sys
class H(socketserver.StreamRequestHandler):
    def handle(self): self.wfile.write(self.rfile.readline())
socketserver.ForkingTCPServer.allow_reuse_address=True
srv=socketserver.ForkingTCPServer(('127.0.0.1',0),H); port=srv.server_address[1]
threading.Thread(target=srv.serve_forever,daemon=True).start()
lat=[]
def one(i):
    t=time.time(); s=socket.create_connection(('127.0.0.1',port)); s.sendall(b'hi %d\n'%i); r=s.makefile('rb').readline(); lat.append(time.time()-t); assert r==b'hi %d\n'%i
for rnd in range(3):
    ts=[threading.Thread(target=one,args=(i,)) for i in range(16)]; [t.start() for t in ts]; [t.join() for t in ts]
print('n',len(lat),'max latency %.2fs'%max(lat),'over 0.9s:',sum(1 for x in lat if x>0.9))
srv.shutdown()
