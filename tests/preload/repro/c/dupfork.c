/* An accepted (or connected) socket with a second fd (dup) at fork: fork() should take
   microseconds. Under the shim it took ~0.25 s (git daemon: cld.out = dup(incoming)). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int argc,char**argv){
  int sep = argc>1 && argv[1][0]=='p';   /* 'p': the client in another process */
  int ls=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={.sin_family=AF_INET,.sin_addr.s_addr=htonl(0x7f000001)};
  bind(ls,(void*)&a,sizeof a); listen(ls,4); socklen_t l=sizeof a; getsockname(ls,(void*)&a,&l);
  int c=-1; pid_t cp=0;
  if(sep){ cp=fork(); if(cp==0){ c=socket(AF_INET,SOCK_STREAM,0); if(connect(c,(void*)&a,sizeof a)) _exit(2); write(c,"req",3); char b[16]; int n=read(c,b,16); _exit(n==5?0:3);} }
  else { c=socket(AF_INET,SOCK_STREAM,0); if(connect(c,(void*)&a,sizeof a)){perror("connect");return 2;} write(c,"req",3); }
  int s=accept(ls,0,0);
  int s2=dup(s);
  double worst=0;
  for(int i=0;i<3;i++){
    double t0=now(); pid_t p=fork(); if(p==0) _exit(0);
    double t=now()-t0; if(t>worst) worst=t; printf("fork %d took %.3f s\n",i,t); waitpid(p,0,0);
  }
  char b[8]; read(s,b,3); write(s2,"reply",5); close(s); close(s2);
  int st=0; if(cp) waitpid(cp,&st,0); else { int n=read(c,b,8); if(n!=5) st=1; }
  int ok=worst<0.1 && st==0; puts(ok?"PASS":"DIFF"); return !ok;
}
