/* syscall() and clone() are C-variadic, which stable Rust cannot define. A program that makes a
 * process by a raw clone or fork system call through syscall() (vsftpd: syscall(__NR_clone,
 * CLONE_NEWIPC|SIGCHLD)), or by glibc's clone() without CLONE_VM, runs no fork handlers: the
 * shim's are run around such a call (sdp_raw_fork, src/lib.rs), as glibc's fork runs them. Every
 * other call goes straight to libc's. The exported symbols are jumps to sdp_syscall and
 * sdp_clone (src/lib.rs). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/sched.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>

void sdp_raw_fork(int stage);
int sdp_preload_owns(int fd);
long sdp_fd_syscall(long nr, long a0, long a1, long a2);

/* Whether the call closes or dups an fd the shim owns (or is a close_range, which may): it goes
 * through the shim's hook of the same name (sdp_fd_syscall, src/lib.rs). */
static int closes_or_dups_owned(long nr, const long *a) {
    switch (nr) {
    case SYS_close:
    case SYS_dup:
        return sdp_preload_owns((int)a[0]);
#ifdef SYS_dup2
    case SYS_dup2:
#endif
    case SYS_dup3:
        return sdp_preload_owns((int)a[0]) || sdp_preload_owns((int)a[1]);
    case SYS_close_range:
        return 1;
    default:
        return 0;
    }
}

typedef long (*syscall_fn)(long, ...);
static syscall_fn real_syscall;
typedef int (*clone_fn)(int (*)(void *), void *, int, void *, ...);
static clone_fn real_clone;

/* Resolved at load, so a call never runs the dynamic loader (a futex wait, made through
 * syscall() by Rust's standard library, may come at any moment). */
__attribute__((constructor)) static void sdp_syscall_init(void) {
    real_syscall = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    real_clone = (clone_fn)dlsym(RTLD_NEXT, "clone");
}

/* Whether the call makes a process that copies ours (no shared memory) and goes on where the
 * call returns: what fork() makes. */
static int makes_fork_child(long nr, const long *a) {
#ifdef SYS_fork
    if (nr == SYS_fork)
        return 1;
#endif
    if (nr == SYS_clone)
        return !(a[0] & (CLONE_VM | CLONE_THREAD)) && a[1] == 0;
#ifdef SYS_clone3
    if (nr == SYS_clone3) {
        const struct clone_args *ca = (const struct clone_args *)a[0];
        return ca != NULL && (size_t)a[1] >= offsetof(struct clone_args, stack_size) + 8 &&
               !(ca->flags & (CLONE_VM | CLONE_THREAD)) && ca->stack == 0;
    }
#endif
    return 0;
}

long sdp_syscall(long nr, ...) {
    long a[6];
    va_list ap;
    va_start(ap, nr);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
    syscall_fn real = real_syscall;
    if (real == NULL)
        real = real_syscall = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    if (closes_or_dups_owned(nr, a))
        return sdp_fd_syscall(nr, a[0], a[1], a[2]);
    if (!makes_fork_child(nr, a))
        return real(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    sdp_raw_fork(0);
    long r = real(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    int e = errno;
    sdp_raw_fork(r == 0 ? 2 : 1);
    errno = e;
    return r;
}

/* A clone() child's start: the child's fork handlers, then the program's function. */
struct sdp_clone_start {
    int (*fn)(void *);
    void *arg;
};

static int sdp_clone_child(void *p) {
    /* The parent's copy of the struct, in the child's copy of the parent's memory. */
    struct sdp_clone_start *st = p;
    sdp_raw_fork(2);
    return st->fn(st->arg);
}

int sdp_clone(int (*fn)(void *), void *stack, int flags, void *arg, ...) {
    va_list ap;
    va_start(ap, arg);
    void *ptid = va_arg(ap, void *), *tls = va_arg(ap, void *), *ctid = va_arg(ap, void *);
    va_end(ap);
    clone_fn real = real_clone;
    if (real == NULL)
        real = real_clone = (clone_fn)dlsym(RTLD_NEXT, "clone");
    if (flags & (CLONE_VM | CLONE_THREAD))
        return real(fn, stack, flags, arg, ptid, tls, ctid);
    struct sdp_clone_start st = {fn, arg};
    sdp_raw_fork(0);
    int r = real(sdp_clone_child, stack, flags, &st, ptid, tls, ctid);
    int e = errno;
    sdp_raw_fork(1);
    errno = e;
    return r;
}
