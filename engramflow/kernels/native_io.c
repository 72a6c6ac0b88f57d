/* Batched positional reads at queue depth: io_uring through raw syscalls (no liburing).
 *
 * One call submits a whole batch of reads (offset, length, buffer) on one file descriptor,
 * keeps up to `qd` of them in flight, and returns when every one has completed: per read the
 * byte count or -errno, and its latency (submit to completion) in nanoseconds. ctypes releases
 * the GIL for the call, so other Python threads run while the device works.
 *
 * A ring is not thread-safe: each thread uses its own (engramflow/kernels/native_io.py).
 * Without <linux/io_uring.h> at build time, or on a kernel that refuses io_uring (disabled by
 * sysctl, seccomp, old kernel), efio_ring_open fails with the errno and callers fall back to a
 * thread pool of preads.
 *
 * Built and loaded like every kernel library (kernel_common.h, native_build.py): the common
 * flags, one object (no variants: nothing here is arithmetic).
 */
#define _GNU_SOURCE
#include "kernel_common.h"
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EFIO_ABI_VERSION 1
#ifndef EK_SOURCE_HASH
#define EK_SOURCE_HASH "unknown"
#endif

int efio_abi_version(void) { return EFIO_ABI_VERSION; }
const char *efio_source_hash(void) { return EK_SOURCE_HASH; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#if defined(__linux__) && defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#define EFIO_HAVE_URING 1
#endif
#endif

#ifdef EFIO_HAVE_URING
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif

typedef struct {
    int fd;
    unsigned entries;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len;
    struct io_uring_sqe *sqes;
    size_t sqes_len;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
} ring_t;

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

/* A ring of `entries` slots; NULL and *err = errno when the kernel refuses. */
void *efio_ring_open(unsigned entries, int *err) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    *err = 0;
    int fd = sys_setup(entries, &p);
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    ring_t *r = calloc(1, sizeof *r);
    if (!r) {
        close(fd);
        *err = ENOMEM;
        return NULL;
    }
    r->fd = fd;
    r->entries = p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_len > r->sq_len) r->sq_len = r->cq_len;
    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) goto fail;
    if (single) {
        r->cq_ptr = r->sq_ptr;
        r->cq_len = 0;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) { r->cq_ptr = NULL; goto fail; }
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) { r->sqes = NULL; goto fail; }
    char *sq = r->sq_ptr, *cq = r->cq_ptr;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return r;
fail:
    *err = errno ? errno : ENOMEM;
    if (r->sqes) munmap(r->sqes, r->sqes_len);
    if (r->cq_ptr && r->cq_len) munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED) munmap(r->sq_ptr, r->sq_len);
    close(fd);
    free(r);
    return NULL;
}

void efio_ring_close(void *h) {
    ring_t *r = h;
    if (!r) return;
    munmap(r->sqes, r->sqes_len);
    if (r->cq_len) munmap(r->cq_ptr, r->cq_len);
    munmap(r->sq_ptr, r->sq_len);
    close(r->fd);
    free(r);
}

unsigned efio_ring_entries(void *h) { return ((ring_t *)h)->entries; }

/* Read n ranges: read i fills lens[i] bytes of bufs[i] from byte offsets[i] of fds[i]. At most `qd`
 * (capped at the ring's size) in flight. results[i] = bytes read or -errno; lat_ns[i] (may be
 * NULL) = submit-to-completion time. `async_punt`: IOSQE_ASYNC on every read (always via the
 * kernel's worker threads; measured no faster here, so callers pass 0). Returns 0, or -errno when the ring itself failed (then
 * results of unfinished reads are -EIO). */
int efio_ring_read(void *h, const int32_t *fds, int64_t n, const int64_t *offsets, const int64_t *lens, const uint64_t *bufs,
                   int qd, int async_punt, int64_t *results, int64_t *lat_ns) {
    ring_t *r = h;
    if (qd < 1) qd = 1;
    if ((unsigned)qd > r->entries) qd = (int)r->entries;
    int64_t next = 0, done = 0, inflight = 0;
    int64_t *t0 = lat_ns;  /* submit times are kept in lat_ns until completion */
    for (int64_t i = 0; i < n; i++) results[i] = -EIO;  /* completions overwrite; a ring failure leaves these */
    while (done < n) {
        unsigned tail = *r->sq_tail, to_submit = 0;
        while (next < n && inflight < qd) {
            unsigned idx = tail & *r->sq_mask;
            struct io_uring_sqe *sqe = &r->sqes[idx];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = IORING_OP_READ;
            sqe->fd = fds[next];
            sqe->off = (uint64_t)offsets[next];
            sqe->addr = bufs[next];
            sqe->len = (uint32_t)lens[next];
            sqe->user_data = (uint64_t)next;
            if (async_punt) sqe->flags = IOSQE_ASYNC;
            r->sq_array[idx] = idx;
            tail++;
            to_submit++;
            if (t0) t0[next] = now_ns();
            next++;
            inflight++;
        }
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        /* everything the kernel has not consumed yet (a short submission leaves some behind) */
        to_submit = tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        int rc;
        for (;;) {
            rc = sys_enter(r->fd, to_submit, 1, IORING_ENTER_GETEVENTS);
            if (rc >= 0 || errno != EINTR) break;
            /* interrupted: resubmit only what the kernel has not consumed yet */
            to_submit = tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        }
        if (rc < 0 && (errno == EAGAIN || errno == EBUSY)) {
            rc = 0;  /* the kernel is short of resources or completions are pending: reap, then submit again */
        }
        if (rc < 0) return -errno;
        unsigned head = *r->cq_head;
        unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        int64_t t = t0 ? now_ns() : 0;
        while (head != ctail) {
            struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            int64_t i = (int64_t)cqe->user_data;
            results[i] = cqe->res;
            if (t0) lat_ns[i] = t - t0[i];
            head++;
            done++;
            inflight--;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return 0;
}

#else  /* no io_uring header at build time: the entry points exist and report ENOSYS */

void *efio_ring_open(unsigned entries, int *err) { (void)entries; *err = ENOSYS; return NULL; }
void efio_ring_close(void *h) { (void)h; }
unsigned efio_ring_entries(void *h) { (void)h; return 0; }
int efio_ring_read(void *h, const int32_t *fds, int64_t n, const int64_t *offsets, const int64_t *lens, const uint64_t *bufs,
                   int qd, int async_punt, int64_t *results, int64_t *lat_ns) {
    (void)h; (void)async_punt; (void)fds; (void)offsets; (void)lens; (void)bufs; (void)qd; (void)lat_ns;
    for (int64_t i = 0; i < n; i++) results[i] = -ENOSYS;
    return -ENOSYS;
}

#endif

/* The thread-free baseline in C: the same batch with one blocking pread after another (qd 1). */
int efio_pread_batch(const int32_t *fds, int64_t n, const int64_t *offsets, const int64_t *lens, const uint64_t *bufs,
                     int64_t *results, int64_t *lat_ns) {
    for (int64_t i = 0; i < n; i++) {
        int64_t t = lat_ns ? now_ns() : 0;
        ssize_t got = pread(fds[i], (void *)(uintptr_t)bufs[i], (size_t)lens[i], (off_t)offsets[i]);
        results[i] = got < 0 ? -errno : got;
        if (lat_ns) lat_ns[i] = now_ns() - t;
    }
    return 0;
}
