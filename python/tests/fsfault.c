/* A fault-injecting shim for the L3 fault tests, loaded with LD_PRELOAD: reads and writes of
 * files whose path contains $HICACHE_FAULT_PATH fail as a full disk or a failing disk would.
 *
 *   HICACHE_FAULT_PATH          only descriptors opened on a path containing this string
 *   HICACHE_FAULT_WRITE_ERRNO   writes fail with this errno (28: ENOSPC) once
 *   HICACHE_FAULT_WRITE_BUDGET  bytes (default 0) have been written to such files: the write
 *                               that crosses it is short, as on a disk that just filled
 *   HICACHE_FAULT_READ_ERRNO    reads fail with this errno (5: EIO) once
 *   HICACHE_FAULT_READ_BUDGET   bytes (default 0) have been read from such files
 *
 * The variables are read at every call, so a process can turn faults on and off (Python's
 * os.environ writes the C environment). Budgets count from the moment a fault is turned on
 * (setting HICACHE_FAULT_EPOCH to a new value restarts them).
 *
 * Build: cc -shared -fPIC -O2 -o fsfault.so fsfault.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FD 65536
static unsigned char faulty[MAX_FD];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static long long written, readn;
static char epoch[64];

static void *real(const char *name) { return dlsym(RTLD_NEXT, name); }

static long long env_ll(const char *name, long long dflt) {
    const char *v = getenv(name);
    return v && *v ? atoll(v) : dflt;
}

static void mark(int fd, const char *path) {
    const char *want = getenv("HICACHE_FAULT_PATH");
    if (fd >= 0 && fd < MAX_FD) faulty[fd] = want && *want && path && strstr(path, want) != NULL;
}

/* How many of `n` bytes may move on `fd` (n when no fault applies), or -1 with errno set. */
static ssize_t allowance(int fd, size_t n, int write) {
    if (fd < 0 || fd >= MAX_FD || !faulty[fd]) return (ssize_t)n;
    int err = (int)env_ll(write ? "HICACHE_FAULT_WRITE_ERRNO" : "HICACHE_FAULT_READ_ERRNO", 0);
    if (!err) return (ssize_t)n;
    long long budget = env_ll(write ? "HICACHE_FAULT_WRITE_BUDGET" : "HICACHE_FAULT_READ_BUDGET", 0);
    pthread_mutex_lock(&lock);
    const char *e = getenv("HICACHE_FAULT_EPOCH");
    if (strncmp(epoch, e ? e : "", sizeof epoch - 1) != 0) {
        strncpy(epoch, e ? e : "", sizeof epoch - 1);
        written = readn = 0;
    }
    long long *used = write ? &written : &readn;
    long long left = budget - *used;
    ssize_t out;
    if (left <= 0) {
        out = -1;
    } else {
        out = (size_t)left < n ? (ssize_t)left : (ssize_t)n;
        *used += out;
    }
    pthread_mutex_unlock(&lock);
    if (out < 0) errno = err;
    return out;
}

static int open_common(const char *sym, int dirfd, const char *path, int flags, mode_t mode, int at) {
    int fd;
    if (at) {
        int (*f)(int, const char *, int, ...) = real(sym);
        fd = f(dirfd, path, flags, mode);
    } else {
        int (*f)(const char *, int, ...) = real(sym);
        fd = f(path, flags, mode);
    }
    mark(fd, path);
    return fd;
}

#define MODE_ARG                                      \
    mode_t mode = 0;                                  \
    if (flags & (O_CREAT | O_TMPFILE)) {              \
        va_list ap;                                   \
        va_start(ap, flags);                          \
        mode = (mode_t)va_arg(ap, int);               \
        va_end(ap);                                   \
    }

int open(const char *path, int flags, ...) { MODE_ARG return open_common("open", 0, path, flags, mode, 0); }
int open64(const char *path, int flags, ...) { MODE_ARG return open_common("open64", 0, path, flags, mode, 0); }
int openat(int d, const char *path, int flags, ...) { MODE_ARG return open_common("openat", d, path, flags, mode, 1); }
int openat64(int d, const char *path, int flags, ...) { MODE_ARG return open_common("openat64", d, path, flags, mode, 1); }

int close(int fd) {
    int (*f)(int) = real("close");
    if (fd >= 0 && fd < MAX_FD) faulty[fd] = 0;
    return f(fd);
}

static size_t iov_total(const struct iovec *iov, int cnt) {
    size_t n = 0;
    for (int i = 0; i < cnt; i++) n += iov[i].iov_len;
    return n;
}

/* A vectored call cut to `allow` bytes: the leading iovecs that fit, the last one shortened. */
static int iov_cut(const struct iovec *iov, int cnt, size_t allow, struct iovec *out) {
    int k = 0;
    for (; k < cnt && allow; k++) {
        out[k] = iov[k];
        if (out[k].iov_len > allow) out[k].iov_len = allow;
        allow -= out[k].iov_len;
    }
    return k;
}

#define DEF_RW(name, write, ...)                                                              \
    {                                                                                         \
        ssize_t allow = allowance(fd, n, write);                                              \
        if (allow < 0) return -1;                                                             \
        return f(fd, buf, (size_t)allow, ##__VA_ARGS__);                                      \
    }

ssize_t write(int fd, const void *buf, size_t n) {
    ssize_t (*f)(int, const void *, size_t) = real("write");
    DEF_RW(write, 1)
}
ssize_t read(int fd, void *buf, size_t n) {
    ssize_t (*f)(int, void *, size_t) = real("read");
    DEF_RW(read, 0)
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    ssize_t (*f)(int, const void *, size_t, off_t) = real("pwrite");
    DEF_RW(pwrite, 1, off)
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    ssize_t (*f)(int, const void *, size_t, off_t) = real("pwrite64");
    DEF_RW(pwrite64, 1, off)
}
ssize_t pread(int fd, void *buf, size_t n, off_t off) {
    ssize_t (*f)(int, void *, size_t, off_t) = real("pread");
    DEF_RW(pread, 0, off)
}
ssize_t pread64(int fd, void *buf, size_t n, off_t off) {
    ssize_t (*f)(int, void *, size_t, off_t) = real("pread64");
    DEF_RW(pread64, 0, off)
}

#define DEF_V(sym, write)                                                                     \
    {                                                                                         \
        ssize_t (*f)(int, const struct iovec *, int, off_t) = real(sym);                      \
        if (cnt < 0 || cnt > 1024) return f(fd, iov, cnt, off);                               \
        ssize_t allow = allowance(fd, iov_total(iov, cnt), write);                            \
        if (allow < 0) return -1;                                                             \
        struct iovec cut[1024];                                                               \
        int k = iov_cut(iov, cnt, (size_t)allow, cut);                                        \
        return k ? f(fd, cut, k, off) : 0;                                                    \
    }

ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) DEF_V("pwritev", 1)
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) DEF_V("pwritev64", 1)
ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off) DEF_V("preadv", 0)
ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off_t off) DEF_V("preadv64", 0)
