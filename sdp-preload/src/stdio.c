/* dprintf, vdprintf and their _FORTIFY_SOURCE forms format into a FILE of their own whose
 * writes are libc's internal ones, which no hook sees: on an SDP stream's fd the bytes would go
 * into its readiness pair, not to the peer. On an fd the shim owns they are formatted here and
 * written through the shim's write (this library's, found first); any other fd goes to libc's.
 * The exported symbols are jumps to these (src/lib.rs, as for execl). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int sdp_preload_owns(int fd);

/* Write all of buf[0..n) as dprintf does (a short write goes on, EINTR is retried). */
static int write_all(int fd, const char *buf, int n) {
    int off = 0;
    while (off < n) {
        ssize_t w = write(fd, buf + off, (size_t)(n - off));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        off += (int)w;
    }
    return n;
}

static int format_and_write(int fd, const char *fmt, va_list ap) {
    char *buf;
    int n = vasprintf(&buf, fmt, ap);
    if (n < 0)
        return -1;
    int r = write_all(fd, buf, n);
    int e = errno;
    free(buf);
    errno = e;
    return r;
}

typedef int (*vdprintf_fn)(int, const char *, va_list);
typedef int (*vdprintf_chk_fn)(int, int, const char *, va_list);

int sdp_vdprintf(int fd, const char *fmt, va_list ap) {
    if (sdp_preload_owns(fd))
        return format_and_write(fd, fmt, ap);
    static vdprintf_fn real;
    if (!real)
        real = (vdprintf_fn)dlsym(RTLD_NEXT, "vdprintf");
    return real(fd, fmt, ap);
}

int sdp_vdprintf_chk(int fd, int flag, const char *fmt, va_list ap) {
    if (sdp_preload_owns(fd))
        return format_and_write(fd, fmt, ap);
    static vdprintf_chk_fn real;
    if (!real)
        real = (vdprintf_chk_fn)dlsym(RTLD_NEXT, "__vdprintf_chk");
    return real(fd, flag, fmt, ap);
}

int sdp_dprintf(int fd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = sdp_vdprintf(fd, fmt, ap);
    va_end(ap);
    return r;
}

int sdp_dprintf_chk(int fd, int flag, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = sdp_vdprintf_chk(fd, flag, fmt, ap);
    va_end(ap);
    return r;
}
