/*
 * LD_PRELOAD shim for the rig: when RIG_CM_SRC=a.b.c.d is set, rdma_resolve_addr() calls made without a
 * source address get that source, so an rdma_cm client binds to the other rxe device and its traffic
 * crosses the veth pair instead of looping back inside the device that owns the destination address.
 *
 * Why: perftest 4.5-0.17 (Debian 12) has two long options named "source_ip"; getopt_long takes the
 * first, the raw-Ethernet one (-j), so the rdma_cm source address (--source_ip) is never set and
 * `ib_write_bw -R` cannot be told which device to use.  Used as:
 *   env LD_PRELOAD=/rig/lib/cm_src_preload.so RIG_CM_SRC=192.168.77.1 ib_write_bw -R ... 192.168.77.2
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

struct rdma_cm_id;
typedef int (*resolve_fn)(struct rdma_cm_id *, struct sockaddr *, struct sockaddr *, int);

int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src, struct sockaddr *dst, int timeout_ms)
{
	static resolve_fn real;
	struct sockaddr_in sin;
	const char *s = getenv("RIG_CM_SRC");

	if (!real)
		real = (resolve_fn)dlsym(RTLD_NEXT, "rdma_resolve_addr");
	if (!real) {
		fprintf(stderr, "cm_src_preload: rdma_resolve_addr not found\n");
		return -1;
	}
	if (s && *s && (!src || src->sa_family == AF_UNSPEC) && dst && dst->sa_family == AF_INET) {
		memset(&sin, 0, sizeof(sin));
		sin.sin_family = AF_INET;
		if (inet_pton(AF_INET, s, &sin.sin_addr) == 1)
			src = (struct sockaddr *)&sin;
		else
			fprintf(stderr, "cm_src_preload: bad RIG_CM_SRC '%s'\n", s);
	}
	return real(id, src, dst, timeout_ms);
}
