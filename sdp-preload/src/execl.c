/* execl, execlp and execle take their arguments as C varargs, which stable Rust cannot define:
 * the shim exports them as jumps to these (src/exec.rs), which gather the arguments into an argv
 * array and call execv, execvp or execve. Those resolve to the shim's own hooks (this library
 * comes first), which do the shim's work before an exec. */
#include <stdarg.h>
#include <stddef.h>
#include <errno.h>
#include <unistd.h>

/* The most arguments gathered (glibc allows more; a longer list fails with E2BIG). */
#define SDP_EXECL_MAX 4096

#define GATHER(argv, arg, ap, envp_out)                          \
    do {                                                         \
        size_t n_ = 0;                                           \
        argv[n_++] = (char *)arg;                                \
        while (argv[n_ - 1] != NULL) {                           \
            if (n_ == SDP_EXECL_MAX) {                           \
                va_end(ap);                                      \
                errno = E2BIG;                                   \
                return -1;                                       \
            }                                                    \
            argv[n_++] = va_arg(ap, char *);                     \
        }                                                        \
        envp_out;                                                \
        va_end(ap);                                              \
    } while (0)

int sdp_execl(const char *path, const char *arg, ...) {
    char *argv[SDP_EXECL_MAX];
    va_list ap;
    va_start(ap, arg);
    GATHER(argv, arg, ap, (void)0);
    return execv(path, argv);
}

int sdp_execlp(const char *file, const char *arg, ...) {
    char *argv[SDP_EXECL_MAX];
    va_list ap;
    va_start(ap, arg);
    GATHER(argv, arg, ap, (void)0);
    return execvp(file, argv);
}

int sdp_execle(const char *path, const char *arg, ...) {
    char *argv[SDP_EXECL_MAX];
    char *const *envp;
    va_list ap;
    va_start(ap, arg);
    GATHER(argv, arg, ap, envp = va_arg(ap, char *const *));
    return execve(path, argv, envp);
}
