/* test_emu: the emulator's own tests. Each checker is shown to fire on a
   small deliberately broken kernel or call sequence (the report must come,
   and is then taken so the run stays clean), and the emulated cuBLAS is
   checked against hand-worked products written from its documentation;
   so is the emulated cuBLASLt (block-scaled FP8), each of its rules firing.
   Prints "ok/FAIL - name" lines; exits 1 on any failure. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <functional>
#include <mutex>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "emu.h"

static int g_fail;
static char g_why[512];

static void result(const char *name, bool ok, const char *why) {
    printf("%s - %s%s%s\n", ok ? "ok" : "FAIL", name, ok ? "" : ": ", ok ? "" : why);
    if (!ok) g_fail = 1;
}
/* the check fired: at least one report whose text has `want` */
static void expect_report(const char *name, const char *want) {
    long n = moept_emu_take_reports(g_why, sizeof g_why);
    bool ok = n > 0 && strstr(g_why, want) != nullptr;
    char why[600];
    snprintf(why, sizeof why, "%ld report(s), last: '%s' (wanted '%s')", n, g_why, want);
    result(name, ok, why);
}
static double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static void expect_clean(const char *name) {
    long n = moept_emu_take_reports(g_why, sizeof g_why);
    result(name, n == 0, g_why);
}

/* ---- kernels, right and broken ---- */
__global__ void k_sum_ok(const float *x, float *out) { /* block tree sum of 64 values */
    __shared__ float sh[64];
    sh[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    for (int w = 32; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = sh[0];
}
__global__ void k_sum_nosync(const float *x, float *out) { /* the first barrier is missing */
    __shared__ float sh2[64];
    sh2[threadIdx.x] = x[threadIdx.x];
    for (int w = 32; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh2[threadIdx.x] += sh2[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = sh2[0];
}
__global__ void k_divergent(float *out) { /* a barrier only half the block reaches */
    __shared__ float sh3[64];
    sh3[threadIdx.x] = 1.0f;
    if (threadIdx.x < 32) __syncthreads();
    out[threadIdx.x] = sh3[threadIdx.x];
}
__global__ void k_oob(float *p, int n) { p[threadIdx.x + n] = 1.0f; } /* writes one past the end */
__global__ void k_ld128(const char *p, uint4 *out) { out[threadIdx.x] = *(const uint4 *)(p + 16 * threadIdx.x); }
__global__ void k_ld32(const char *p, float *out) { out[threadIdx.x] = *(const float *)(p + 4 * threadIdx.x); }
__global__ void k_fill(float *p, float v, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}
__global__ void k_copy(const float *a, float *b, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) b[i] = a[i];
}

static void kernels() {
    float *x, *out, h[64], r = 0;
    for (int i = 0; i < 64; i++) h[i] = (float)i;
    cudaMalloc((void **)&x, 64 * 4);
    cudaMalloc((void **)&out, 64 * 4);
    cudaMemcpy(x, h, 64 * 4, cudaMemcpyHostToDevice);
    MOEPT__LAUNCH(k_sum_ok, 1, 64, 0, 0)(x, out);
    cudaMemcpy(&r, out, 4, cudaMemcpyDeviceToHost);
    expect_clean("a correct block reduction runs clean");
    result("... and sums 0..63 to 2016", r == 2016.0f, "wrong sum");
    MOEPT__LAUNCH(k_sum_nosync, 1, 64, 0, 0)(x, out);
    cudaDeviceSynchronize();
    expect_report("racecheck: a missing __syncthreads", "racecheck");
    MOEPT__LAUNCH(k_divergent, 1, 64, 0, 0)(out);
    cudaDeviceSynchronize();
    expect_report("synccheck: __syncthreads reached by half the block", "synccheck");
    MOEPT__LAUNCH(k_oob, 1, 64, 0, 0)(out, 1);
    cudaError_t e = cudaDeviceSynchronize();
    expect_report("memcheck: an out-of-bounds write", "past the end");
    result("... faults: the synchronize returns cudaErrorIllegalAddress (the context is lost)",
           e == cudaErrorIllegalAddress, cudaGetErrorString(e));
    moept_emu_recover(0); /* a new process, for what follows */
    cudaMalloc((void **)&x, 64 * 4);
    cudaMalloc((void **)&out, 64 * 4);
    cudaMemcpy(x, h, 64 * 4, cudaMemcpyHostToDevice);
    MOEPT__LAUNCH(k_ld128, 1, 2, 0, 0)((const char *)x, (uint4 *)out);
    cudaDeviceSynchronize();
    expect_clean("16-byte loads at 16-byte aligned addresses run clean");
    /* (x86 faults on a misaligned 16-byte vector load itself: a 4-byte one shows the check) */
    MOEPT__LAUNCH(k_ld32, 1, 2, 0, 0)((const char *)x + 2, out);
    e = cudaDeviceSynchronize();
    expect_report("memcheck: a 4-byte load at a 2-byte aligned address (a GPU faults)", "misaligned read of 4");
    result("... faults: cudaErrorMisalignedAddress", e == cudaErrorMisalignedAddress, cudaGetErrorString(e));
    moept_emu_recover(0);
    cudaMalloc((void **)&x, 64 * 4);
    cudaMalloc((void **)&out, 64 * 4);
    MOEPT__LAUNCH(k_fill, 1, 2048, 0, 0)(out, 0.0f, 64);
    result("launch limits: 2048 threads a block is a launch error",
           cudaGetLastError() == cudaErrorInvalidConfiguration, "accepted");
    MOEPT__LAUNCH(k_fill, dim3(1, 70000), 32, 0, 0)(out, 0.0f, 64);
    result("launch limits: grid.y 70000 is a launch error", cudaGetLastError() == cudaErrorInvalidConfiguration,
           "accepted");
    cudaFree(x);
    cudaFree(out);
}

/* A kernel fault loses its device's context (CUDA Runtime API, enum
   cudaError: cudaErrorIllegalAddress is sticky): the synchronize that ran it
   returns the error, so does every later call on that device (memory,
   streams, events, copies, launches, cuBLAS, NCCL), cudaGetLastError does
   not clear it, the work queued behind the fault never runs; the other
   device goes on; moept_emu_recover (a new process) ends it. */
static void lost_context() {
    float *p, *q, hv[64], one = 1.0f;
    cudaStream_t a, b;
    cudaEvent_t ev;
    cublasHandle_t bh;
    ncclComm_t nc;
    ncclUniqueId id;
    cudaSetDevice(1);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaMalloc((void **)&q, 64 * 4);
    cudaSetDevice(0);
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    cudaMalloc((void **)&p, 64 * 4);
    cublasCreate(&bh);
    cublasSetStream(bh, a);
    ncclGetUniqueId(&id);
    ncclCommInitRank(&nc, 1, id, 0);
    cudaDeviceSynchronize();
    moept_emu_counts_reset();
    moept_emu_fault_next_kernel(0);
    MOEPT__LAUNCH(k_fill, 1, 64, 0, a)(p, 1.0f, 64); /* faults */
    MOEPT__LAUNCH(k_fill, 1, 64, 0, a)(p, 2.0f, 64); /* queued behind it: never runs */
    bool launched = cudaGetLastError() == cudaSuccess; /* the launches themselves were fine */
    cudaError_t e = cudaStreamSynchronize(a);
    expect_report("context: an injected kernel fault is reported", "injected");
    const cudaError_t L = cudaErrorIllegalAddress;
    result("... the synchronize that ran it returns cudaErrorIllegalAddress", launched && e == L,
           cudaGetErrorString(e));
    /* the thread's last error is reset by the read, the context stays lost (tests/cuda_rules.txt) */
    bool reset = cudaGetLastError() == L && cudaGetLastError() == cudaSuccess &&
                 cudaPeekAtLastError() == cudaSuccess;
    result("... cudaGetLastError returns it once and resets it, as CUDA does", reset, "not reset");
    void *m = nullptr;
    cudaStream_t c2h = nullptr;
    bool calls = cudaMalloc(&m, 64) == L && cudaMemcpy(hv, p, 64 * 4, cudaMemcpyDeviceToHost) == L &&
                 cudaMemsetAsync(p, 0, 64, a) == L && cudaStreamQuery(a) == L &&
                 cudaEventRecord(ev, a) == L && cudaDeviceSynchronize() == L &&
                 cudaStreamCreateWithFlags(&c2h, 0) == L && cudaEventSynchronize(ev) == L && cudaFree(p) == L;
    MOEPT__LAUNCH(k_fill, 1, 64, 0, a)(p, 3.0f, 64);
    calls = calls && cudaPeekAtLastError() == L;
    result("... so does every later call on the device (memory, copies, streams, events, launches)", calls,
           "a call succeeded");
    result("... cuBLAS: CUBLAS_STATUS_EXECUTION_FAILED, NCCL: ncclUnhandledCudaError",
           cublasSscal_v2_64(bh, 64, &one, p, 1) == CUBLAS_STATUS_EXECUTION_FAILED &&
           ncclAllReduce(p, p, 64, ncclFloat32, ncclSum, nc, a) == ncclUnhandledCudaError, "accepted");
    moept_emu_counts sum;
    moept_emu_counts_get(0, nullptr, &sum);
    result("... the kernel queued behind the fault never ran", sum.kernels == 1, "it ran");
    cudaSetDevice(1); /* the other device goes on */
    cudaGetLastError(); /* what the calls on device 0 left in this thread */
    MOEPT__LAUNCH(k_fill, 1, 64, 0, b)(q, 3.0f, 64);
    e = cudaMemcpyAsync(hv, q, sizeof hv, cudaMemcpyDeviceToHost, b);
    if (e == cudaSuccess) e = cudaStreamSynchronize(b);
    result("... device 1 goes on", e == cudaSuccess && hv[7] == 3.0f && cudaGetLastError() == cudaSuccess,
           cudaGetErrorString(e));
    cudaFree(q);
    cudaStreamDestroy(b);
    cudaSetDevice(0);
    ncclCommDestroy(nc);
    cublasDestroy(bh);
    cudaEventDestroy(ev);
    cudaStreamDestroy(a);
    moept_emu_recover(0);
    e = cudaGetLastError();
    cudaMalloc((void **)&p, 64 * 4);
    MOEPT__LAUNCH(k_fill, 1, 64, 0, 0)(p, 4.0f, 64);
    cudaError_t e2 = cudaMemcpy(hv, p, sizeof hv, cudaMemcpyDeviceToHost);
    snprintf(g_why, sizeof g_why, "%s, %s, %g", cudaGetErrorString(e), cudaGetErrorString(e2), hv[63]);
    result("moept_emu_recover: device 0 runs again (a new process's context)",
           e == cudaSuccess && e2 == cudaSuccess && hv[63] == 4.0f, g_why);
    expect_clean("... clean");
    cudaFree(p);
}

/* the bug, outside the instrumented code (as in moept.c): only the page
   protection can see it */
__attribute__((no_sanitize_thread, noinline)) static float read_device(const float *d) { return d[3]; }

/* fn() in a child, which must die with the emulator's memcheck exit (70)
   and a message containing `want`; stderr collected through a pipe */
static void child_dies(const char *name, void (*fn)(float *), float *d, const char *want) {
    fflush(stdout);
    int fd[2];
    if (pipe(fd) != 0) { result(name, false, "pipe"); return; }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        fn(d);
        _exit(0);
    }
    close(fd[1]);
    char buf[4096] = "";
    size_t len = 0;
    ssize_t n;
    while (len < sizeof buf - 1 && (n = read(fd[0], buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)n;
    buf[len] = 0;
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 70 && strstr(buf, want);
    result(name, ok, len ? buf : "the child read device memory and exited normally");
}

static void read_now(float *d) {
    volatile float v = read_device(d);
    (void)v;
}

/* the same read while an op of the device runs on its stream's worker (an
   NCCL receive waiting for a peer that posts its send 300 ms later): the
   pages are mapped for that op, so only the per-thread guard can see it */
static void read_while_op_runs(float *d) {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    std::thread peer([&] {
        cudaSetDevice(1);
        ncclComm_t c;
        cudaStream_t s;
        float *buf;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        ncclCommInitRank(&c, 2, id, 1);
        cudaMalloc((void **)&buf, 64);
        usleep(300000);
        ncclSend(buf, 16, ncclFloat32, 0, c, s);
        cudaStreamSynchronize(s);
    });
    ncclComm_t c;
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    ncclCommInitRank(&c, 2, id, 0);
    ncclRecv(d + 16, 16, ncclFloat32, 1, c, s);
    cudaStreamQuery(s); /* releases it: the worker runs it, waiting for the send */
    usleep(100000);
    read_now(d);
    peer.join();
}

/* a host read of device memory faults: in a child, which must die saying so */
static void host_read() {
    float *d;
    cudaMalloc((void **)&d, 256);
    const char *want = "host code dereferenced device memory";
    child_dies("memcheck: a host read of device memory faults and is named", read_now, d, want);
    if (moept_emu_per_thread_guard())
        child_dies("memcheck: ... also while an op of its device runs on another thread", read_while_op_runs, d,
                   want);
    else
        printf("skip - memcheck: ... also while an op of its device runs on another thread (no protection keys "
               "on this CPU or kernel: the guard is per process)\n");
    cudaFree(d);
}

/* stream order: a read on stream b of what stream a wrote needs an event */
static void streams() {
    cudaStream_t a, b;
    cudaEvent_t ev;
    float *p, *q;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    cudaMalloc((void **)&p, 256 * 4);
    cudaMalloc((void **)&q, 256 * 4);
    MOEPT__LAUNCH(k_fill, 1, 128, 0, a)(p, 1.0f, 256);
    cudaEventRecord(ev, a);
    cudaStreamWaitEvent(b, ev, 0);
    MOEPT__LAUNCH(k_copy, 1, 128, 0, b)(p, q, 256);
    cudaDeviceSynchronize();
    expect_clean("an event orders a cross-stream read");
    MOEPT__LAUNCH(k_fill, 1, 128, 0, a)(p, 2.0f, 256);
    MOEPT__LAUNCH(k_copy, 1, 128, 0, b)(p, q, 256); /* no cudaStreamWaitEvent */
    cudaDeviceSynchronize();
    expect_report("hazard: a cross-stream read without cudaStreamWaitEvent", "is not ordered after");
    float *h; /* pinned: the copy reads it when it runs (a pageable source is staged at the call) */
    cudaMallocHost((void **)&h, 256 * 4);
    for (int i = 0; i < 256; i++) h[i] = 1.0f;
    cudaMemcpyAsync(p, h, 256 * 4, cudaMemcpyHostToDevice, a);
    h[7] = 5.0f; /* reused before the copy ran */
    cudaStreamSynchronize(a);
    expect_report("hazard: a pinned host buffer reused before its async copy ran", "host source buffer");
    cudaFreeHost(h);
    /* cudaEventElapsedTime's documented cases (bench_cuda times with it) */
    cudaEvent_t t0, t1, never;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    cudaEventCreate(&never);
    float ms = -1.0f;
    cudaEventRecord(t0, a);
    MOEPT__LAUNCH(k_fill, 1, 128, 0, a)(p, 3.0f, 256);
    cudaEventRecord(t1, a);
    bool not_ready = cudaEventElapsedTime(&ms, t0, t1) == cudaErrorNotReady; /* nothing forced it to run yet */
    cudaEventSynchronize(t1);
    bool ok = not_ready && cudaEventElapsedTime(&ms, t0, t1) == cudaSuccess && ms >= 0.0f &&
              cudaEventElapsedTime(&ms, t0, never) == cudaErrorInvalidResourceHandle &&
              cudaEventElapsedTime(&ms, ev, t1) == cudaErrorInvalidResourceHandle; /* ev: timing disabled */
    cudaGetLastError();
    result("events: cudaEventElapsedTime as documented (not ready, not recorded, timing disabled)", ok, "");
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    cudaEventDestroy(never);
    cudaFree(p);
    cudaFree(q);
    cudaEventDestroy(ev);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
}

__global__ void k_add(float *p, float v, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] += v;
}

/* Stream capture: a fork (a's event waited by b) and join, captured, runs
   nothing; each launch of the graph runs it all again, in order; a host
   sync inside a capture is rejected and the capture ends invalidated. */
/* ---- copies and host memory kinds (CUDA Runtime API, "API synchronization behavior") ---- */
__global__ void k_sleep(int ms) { /* a stream busy for ms: the copies behind it wait */
    if (threadIdx.x == 0) usleep((useconds_t)ms * 1000);
}
static void copies() {
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    float *d, *pinned, page[16], reg[16];
    cudaMalloc((void **)&d, 64);
    cudaMallocHost((void **)&pinned, 64);
    cudaMemsetAsync(d, 0, 64, s);
    cudaStreamSynchronize(s);
    MOEPT__LAUNCH(k_sleep, 1, 1, 0, s)(300);
    double t0 = now_s();
    cudaMemcpyAsync(pinned, d, 64, cudaMemcpyDeviceToHost, s);
    double t_pinned = now_s() - t0;
    cudaMemcpyAsync(page, d, 64, cudaMemcpyDeviceToHost, s);
    double t_page = now_s() - t0;
    result("copies: device to pinned host returns at once", t_pinned < 0.1, "it waited");
    result("copies: device to pageable host returns only once done (after the 300 ms kernel)",
           t_page >= 0.29 && page[3] == 0.0f, "it returned early");
    for (int i = 0; i < 16; i++) page[i] = 7.0f;
    MOEPT__LAUNCH(k_sleep, 1, 1, 0, s)(200);
    t0 = now_s();
    cudaMemcpyAsync(d, page, 64, cudaMemcpyHostToDevice, s);
    double t_h2d = now_s() - t0;
    for (int i = 0; i < 16; i++) page[i] = -1.0f; /* staged at the call: this changes nothing */
    cudaMemcpyAsync(pinned, d, 64, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    result("copies: pageable host to device waits for the stream's earlier work, takes the bytes at the call",
           t_h2d >= 0.19 && pinned[5] == 7.0f, "it did not wait, or read the bytes later");
    result("copies: cudaHostRegister makes a range pinned (device to it returns at once)",
           cudaHostRegister(reg, sizeof reg, 0) == cudaSuccess, "refused");
    MOEPT__LAUNCH(k_sleep, 1, 1, 0, s)(300);
    t0 = now_s();
    cudaMemcpyAsync(reg, d, 64, cudaMemcpyDeviceToHost, s);
    result("... device to the registered range returns at once", now_s() - t0 < 0.1, "it waited");
    cudaStreamSynchronize(s);
    cudaHostUnregister(reg);
    cudaGraph_t g = nullptr;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaError_t e = cudaMemcpyAsync(page, d, 64, cudaMemcpyDeviceToHost, s);
    cudaError_t e2 = cudaMemcpyAsync(pinned, d, 64, cudaMemcpyDeviceToHost, s);
    cudaError_t end = cudaStreamEndCapture(s, &g);
    result("copies: a pageable copy in a capture is rejected, a pinned one is not",
           e == cudaErrorStreamCaptureUnsupported && e2 == cudaSuccess, "wrong status");
    expect_report("... reported, and the capture invalidated", "pageable host memory on a capturing stream");
    result("... cudaStreamEndCapture fails", end == cudaErrorStreamCaptureInvalidated && !g, "capture ended valid");
    cudaGetLastError();
    cudaFree(d);
    cudaFreeHost(pinned);
    cudaStreamDestroy(s);
    expect_clean("copies: no other report");
}

static void capture() {
    cudaStream_t a, b;
    cudaEvent_t fork, join;
    float *p, *q, h[64];
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
    cudaMalloc((void **)&p, 64 * 4);
    cudaMalloc((void **)&q, 64 * 4);
    cudaMemset(p, 0, 64 * 4);
    cudaMemset(q, 0, 64 * 4);
    cudaDeviceSynchronize();
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    bool ok = cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal) == cudaSuccess;
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    cudaEventRecord(fork, a);
    cudaStreamWaitEvent(b, fork, 0); /* b joins the capture */
    MOEPT__LAUNCH(k_copy, 1, 64, 0, b)(p, q, 64);
    cudaEventRecord(join, b);
    cudaStreamWaitEvent(a, join, 0);
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 10.0f, 64);
    ok = ok && cudaStreamEndCapture(a, &g) == cudaSuccess && g && cudaGraphInstantiate(&x, g, 0) == cudaSuccess;
    cudaMemcpy(h, p, sizeof h, cudaMemcpyDeviceToHost);
    result("capture: the captured work does not run", ok && h[0] == 0.0f, "ran at capture");
    for (int i = 0; i < 2 && ok; i++) ok = cudaGraphLaunch(x, a) == cudaSuccess;
    cudaStreamSynchronize(a);
    float hq[64];
    cudaMemcpy(h, p, sizeof h, cudaMemcpyDeviceToHost);
    cudaMemcpy(hq, q, sizeof hq, cudaMemcpyDeviceToHost);
    expect_clean("capture: two launches of a forked and joined graph run clean (no hazard)");
    result("... and in order: p = 2 x 11, q = p after the first add of the second launch", ok && h[5] == 22.0f &&
           hq[5] == 12.0f, "wrong values");
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal);
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    cudaError_t e = cudaStreamSynchronize(a);
    expect_report("capture: a cudaStreamSynchronize inside a capture is rejected", "captures: rejected");
    cudaError_t e2 = cudaMalloc((void **)&q, 4);
    expect_report("... so is a cudaMalloc", "cudaMalloc on device 0 while this thread captures (global");
    g = nullptr;
    cudaError_t e3 = cudaStreamEndCapture(a, &g);
    result("... with cudaErrorStreamCaptureUnsupported, and the capture ends invalidated",
           e == cudaErrorStreamCaptureUnsupported && e2 == cudaErrorStreamCaptureUnsupported &&
           e3 == cudaErrorStreamCaptureInvalidated && !g, "not rejected");
    cudaGetLastError();
    cudaStreamBeginCapture(a, cudaStreamCaptureModeGlobal); /* b forks off and never rejoins */
    cudaEventRecord(fork, a);
    cudaStreamWaitEvent(b, fork, 0);
    MOEPT__LAUNCH(k_add, 1, 64, 0, b)(p, 1.0f, 64);
    e = cudaStreamEndCapture(a, &g);
    expect_report("capture: a forked stream that does not rejoin", "did not rejoin");
    result("... ends the capture with cudaErrorStreamCaptureUnjoined", e == cudaErrorStreamCaptureUnjoined && !g,
           "accepted");
    cudaGetLastError();
    cudaFree(p);
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
}

/* the call on a new thread on device dev, its capture interaction mode
   exchanged for mode first (Global: as a thread starts) */
static cudaError_t on_thread(int dev, cudaStreamCaptureMode mode, const std::function<cudaError_t()> &call) {
    cudaError_t r = cudaErrorUnknown;
    std::thread t([&] {
        cudaSetDevice(dev);
        cudaStreamCaptureMode m = mode;
        if (cudaThreadExchangeStreamCaptureMode(&m) != cudaSuccess || m != cudaStreamCaptureModeGlobal)
            return;
        r = call();
        cudaGetLastError();
    });
    t.join();
    return r;
}
static cudaError_t malloc_free() {
    void *q = nullptr;
    cudaError_t e = cudaMalloc(&q, 256);
    if (e == cudaSuccess) e = cudaFree(q);
    return e;
}

/* Capture modes (CUDA Runtime API, cudaThreadExchangeStreamCaptureMode):
   this thread captures on device 0 while another thread, on device 1,
   allocates and frees. A global-mode capture refuses that (process-wide)
   and ends invalidated; a thread-local or a relaxed one does not, nor does
   a global one where the other thread exchanged its mode for relaxed or
   thread-local. The capturing thread's own allocation is refused in
   thread-local mode, not in relaxed mode, where a sync of the capturing
   stream still is. In every mode a device sync from another thread of
   the capturing device is refused, and a non-relaxed capture ends only on
   the thread that began it. */
static void capture_modes() {
    const cudaStreamCaptureMode G = cudaStreamCaptureModeGlobal, TL = cudaStreamCaptureModeThreadLocal,
                                R = cudaStreamCaptureModeRelaxed;
    cudaSetDevice(0);
    cudaStream_t a;
    float *p;
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaMalloc((void **)&p, 64 * 4);
    cudaMemset(p, 0, 64 * 4);
    cudaDeviceSynchronize();
    struct {
        cudaStreamCaptureMode cap, other;
        bool refused;
        const char *name;
    } cases[] = {
        {G, G, true, "capture modes: global, another thread's cudaMalloc on device 1 refused: invalidated"},
        {TL, G, false, "capture modes: thread-local, another thread's cudaMalloc/cudaFree on device 1 run"},
        {R, G, false, "capture modes: relaxed, another thread's cudaMalloc/cudaFree on device 1 run"},
        {G, R, false, "capture modes: global, the other thread's mode exchanged for relaxed: they run"},
        {G, TL, false, "capture modes: global, the other thread's mode exchanged for thread-local: they run"},
    };
    for (const auto &c : cases) {
        cudaGraph_t g = nullptr;
        bool ok = cudaStreamBeginCapture(a, c.cap) == cudaSuccess;
        MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
        cudaError_t e = on_thread(1, c.other, malloc_free);
        long n = moept_emu_take_reports(g_why, sizeof g_why);
        cudaError_t end = cudaStreamEndCapture(a, &g);
        cudaGetLastError();
        ok = ok && (c.refused ? e == cudaErrorStreamCaptureUnsupported && n == 1 &&
                                    strstr(g_why, "another thread's global-mode capture") &&
                                    end == cudaErrorStreamCaptureInvalidated && !g
                              : e == cudaSuccess && n == 0 && end == cudaSuccess && g);
        char why[700];
        snprintf(why, sizeof why, "call %d, %ld report(s) '%s', end %d", (int)e, n, n ? g_why : "", (int)end);
        result(c.name, ok, why);
        if (g) cudaGraphDestroy(g);
    }
    void *q = nullptr;
    cudaStreamBeginCapture(a, TL);
    cudaError_t e = cudaMalloc(&q, 4);
    expect_report("capture modes: thread-local, the capturing thread's own cudaMalloc is refused",
                  "this thread captures (thread-local mode");
    cudaGraph_t g = nullptr;
    cudaError_t end = cudaStreamEndCapture(a, &g);
    result("... with cudaErrorStreamCaptureUnsupported, and the capture ends invalidated",
           e == cudaErrorStreamCaptureUnsupported && end == cudaErrorStreamCaptureInvalidated && !g,
           "not refused");
    cudaStreamBeginCapture(a, R);
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    e = cudaMalloc(&q, 4);
    expect_clean("capture modes: relaxed, the capturing thread's own cudaMalloc runs");
    cudaFree(q);
    cudaError_t e2 = cudaStreamSynchronize(a);
    expect_report("... but a cudaStreamSynchronize of the capturing stream is refused", "captures: rejected");
    end = cudaStreamEndCapture(a, &g);
    result("... and invalidates the capture", e == cudaSuccess && e2 == cudaErrorStreamCaptureUnsupported &&
           end == cudaErrorStreamCaptureInvalidated && !g, "wrong errors");
    cudaStreamBeginCapture(a, TL);
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    e = on_thread(0, G, [] { return cudaDeviceSynchronize(); });
    expect_report("capture modes: thread-local, another thread's cudaDeviceSynchronize of the capturing "
                  "device is refused (every mode)", "a stream of device 0 captures");
    end = cudaStreamEndCapture(a, &g);
    result("... and invalidates the capture", e == cudaErrorStreamCaptureUnsupported &&
           end == cudaErrorStreamCaptureInvalidated && !g, "not refused");
    cudaStreamBeginCapture(a, G);
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    e = on_thread(0, G, [&] { return cudaStreamEndCapture(a, &g); });
    end = cudaStreamEndCapture(a, &g);
    result("capture modes: a global capture ended on another thread: cudaErrorStreamCaptureWrongThread",
           e == cudaErrorStreamCaptureWrongThread && end == cudaSuccess && g, "accepted");
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    expect_clean("capture modes: no other report");
    /* a thread that allocated and still runs, nothing ordering it with the capture (it waits on an
       condition variable the emulator does not see): a global capture takes the call as inside it */
    struct {
        cudaStreamCaptureMode cap, other;
        bool refused;
        const char *name;
    } live[] = {
        {G, G, true, "capture modes: global, a running thread's earlier unordered cudaMalloc invalidates it"},
        {TL, G, false, "capture modes: thread-local, it does not"},
        {G, TL, false, "capture modes: global, the other thread in thread-local mode: it does not"},
    };
    for (const auto &c : live) {
        std::mutex mu;
        std::condition_variable cv;
        int step = 0;
        auto set = [&](int k) {
            std::lock_guard<std::mutex> lk(mu);
            step = k;
            cv.notify_all();
        };
        auto wait = [&](int k) {
            std::unique_lock<std::mutex> lk(mu);
            cv.wait(lk, [&] { return step == k; });
        };
        std::thread t([&] {
            cudaSetDevice(1);
            cudaStreamCaptureMode m = c.other;
            cudaThreadExchangeStreamCaptureMode(&m);
            malloc_free();
            set(1);
            wait(2);
        });
        wait(1);
        cudaStreamBeginCapture(a, c.cap);
        MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
        long n = moept_emu_take_reports(g_why, sizeof g_why);
        g = nullptr;
        end = cudaStreamEndCapture(a, &g);
        set(2);
        t.join();
        bool ok = c.refused ? n == 1 && strstr(g_why, "still running, called cudaFree (device 1)") &&
                                  end == cudaErrorStreamCaptureInvalidated && !g
                            : n == 0 && end == cudaSuccess && g;
        char why[700];
        snprintf(why, sizeof why, "%ld report(s) '%s', end %d", n, n ? g_why : "", (int)end);
        result(c.name, ok, why);
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
    }
    cudaStreamBeginCapture(a, G); /* the last of those threads has ended: its calls came before */
    MOEPT__LAUNCH(k_add, 1, 64, 0, a)(p, 1.0f, 64);
    g = nullptr;
    end = cudaStreamEndCapture(a, &g);
    result("capture modes: global, after the thread that allocated has ended: valid", end == cudaSuccess && g,
           "invalidated");
    if (g) cudaGraphDestroy(g);
    expect_clean("capture modes: no other report");
    cudaFree(p);
    cudaStreamDestroy(a);
}

/* Any thread's synchronize may release an op the moment it is queued: what
   the emulator notes about an op (a D2H's poisoned destination, an event
   wait's dependency) must be in place before then. Another thread keeps
   synchronizing the device while this one copies and waits. */
static void released_at_once() {
    const int n = 4096;
    cudaStream_t a, b;
    cudaEvent_t ev;
    float *p, *q;
    unsigned char *big;
    std::vector<unsigned char> h(n);
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    cudaMalloc((void **)&p, 256 * 4);
    cudaMalloc((void **)&q, 256 * 4);
    cudaMalloc((void **)&big, n);
    volatile bool stop = false;
    std::thread other([&] {
        cudaSetDevice(0);
        while (!stop) cudaDeviceSynchronize();
    });
    int bad = 0;
    for (int i = 0; i < 1500 && !bad; i++) {
        MOEPT__LAUNCH(k_fill, 1, 128, 0, a)(p, (float)i, 256);
        cudaEventRecord(ev, a);
        cudaStreamWaitEvent(b, ev, 0);
        MOEPT__LAUNCH(k_copy, 1, 128, 0, b)(p, q, 256);
        cudaMemsetAsync(big, i & 0x7f, n, b);
        cudaMemcpyAsync(h.data(), big, n, cudaMemcpyDeviceToHost, b);
        cudaStreamSynchronize(b);
        for (int j = 0; j < n; j++) bad |= h[j] != (i & 0x7f);
    }
    stop = true;
    other.join();
    result("streams: ops released by another thread at once keep their D2H results", !bad,
           "a D2H result was lost (the destination poisoned after the copy ran)");
    expect_clean("... and their event waits (no hazard reported)");
    cudaFree(p);
    cudaFree(q);
    cudaFree(big);
    cudaEventDestroy(ev);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
}

/* ---- cuBLAS against hand-worked products ---- */
static float bf(float v) { /* to bf16 and back, round to nearest even */
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

static void blas() {
    cublasHandle_t h;
    cublasCreate(&h);
    /* A (2x3, op T of a 3x2 stored with lda 4), B (3x2 with ldb 5), C (2x2, ldc 3):
       column-major, C = 1 * op(A) op(B) + 0 * C */
    float A[4 * 2] = {1, 2, 3, -9, 4, 5, 6, -9};       /* columns (1,2,3) and (4,5,6): A^T = [[1,2,3],[4,5,6]] */
    float B[5 * 2] = {1, 0, 2, -9, -9, -1, 3, 1, -9, -9}; /* columns (1,0,2) and (-1,3,1) */
    float C[3 * 2] = {7, 7, 7, 7, 7, 7};
    float want[3 * 2] = {7, 16, 7, 8, 17, 7};             /* [[1+0+6, -1+6+3], [4+0+12, -4+15+6]]; row 2 untouched */
    float *dA, *dB, *dC;
    cudaMalloc((void **)&dA, sizeof A); cudaMalloc((void **)&dB, sizeof B); cudaMalloc((void **)&dC, sizeof C);
    cudaMemcpy(dA, A, sizeof A, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B, sizeof B, cudaMemcpyHostToDevice);
    cudaMemcpy(dC, C, sizeof C, cudaMemcpyHostToDevice);
    want[0] = 1 * 1 + 2 * 0 + 3 * 2; want[1] = 4 * 1 + 5 * 0 + 6 * 2;
    want[3] = 1 * -1 + 2 * 3 + 3 * 1; want[4] = 4 * -1 + 5 * 3 + 6 * 1;
    want[2] = want[5] = 7;
    float one = 1, zero = 0;
    cublasStatus_t s = cublasGemmEx_64(h, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, 3, &one, dA, CUDA_R_32F, 4, dB, CUDA_R_32F, 5,
                                       &zero, dC, CUDA_R_32F, 3, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    float got[6];
    cudaMemcpy(got, dC, sizeof got, cudaMemcpyDeviceToHost);
    result("cublasGemmEx: op T, op N, padded lda/ldb/ldc, beta 0", s == 0 && memcmp(got, want, sizeof got) == 0,
           "wrong product");
    /* the same transposed the other way: C^T = op(B)^T op(A)^T, with beta 1 accumulating */
    float Ct[2 * 2] = {1, 1, 1, 1}, *dCt;
    cudaMalloc((void **)&dCt, sizeof Ct);
    cudaMemcpy(dCt, Ct, sizeof Ct, cudaMemcpyHostToDevice);
    s = cublasGemmEx_64(h, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, 3, &one, dB, CUDA_R_32F, 5, dA, CUDA_R_32F, 4, &one, dCt,
                        CUDA_R_32F, 2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaMemcpy(Ct, dCt, sizeof Ct, cudaMemcpyDeviceToHost);
    bool ok = s == 0 && Ct[0] == want[0] + 1 && Ct[1] == want[3] + 1 && Ct[2] == want[1] + 1 && Ct[3] == want[4] + 1;
    result("cublasGemmEx: the transposed product with beta 1", ok, "wrong product");
    /* bf16 in, bf16 out: the fp32 sum rounded once */
    uint16_t a16[2] = {0x3f80, 0x3f81}, b16[2] = {0x3f80, 0x3f80}, c16 = 0; /* 1, 1.0078125 */
    void *da16, *db16, *dc16;
    cudaMalloc(&da16, 4); cudaMalloc(&db16, 4); cudaMalloc(&dc16, 2);
    cudaMemcpy(da16, a16, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(db16, b16, 4, cudaMemcpyHostToDevice);
    s = cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &one, da16, CUDA_R_16BF, 1, db16, CUDA_R_16BF, 2, &zero,
                        dc16, CUDA_R_16BF, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaMemcpy(&c16, dc16, 2, cudaMemcpyDeviceToHost);
    uint32_t u = (uint32_t)c16 << 16;
    float cv;
    memcpy(&cv, &u, 4);
    result("cublasGemmEx: bf16 x bf16 -> bf16, fp32 sum", s == 0 && cv == bf(1.0f + 1.0078125f), "wrong bf16 product");
    /* wrong lda (below max(1, k) for op T): CUBLAS_STATUS_INVALID_VALUE and a report */
    s = cublasGemmEx_64(h, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, 3, &one, dA, CUDA_R_32F, 2, dB, CUDA_R_32F, 5, &zero, dC,
                        CUDA_R_32F, 3, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    result("cublas: a wrong lda is CUBLAS_STATUS_INVALID_VALUE", s == CUBLAS_STATUS_INVALID_VALUE, "accepted");
    expect_report("cublas: ... and reported", "INVALID_VALUE");
    /* grouped: parameter arrays on the host, pointer arrays on the device; the other side is an error */
    cublasOperation_t ta[1] = {CUBLAS_OP_T}, tb[1] = {CUBLAS_OP_N};
    int64_t m[1] = {2}, n[1] = {2}, k[1] = {3}, lda[1] = {4}, ldb[1] = {5}, ldc[1] = {3}, gs[1] = {1};
    float al[1] = {1}, be[1] = {0};
    const void *hp[3] = {dA, dB, dC};
    void **dp;
    cudaMalloc((void **)&dp, sizeof hp);
    cudaMemcpy(dp, hp, sizeof hp, cudaMemcpyHostToDevice);
    cudaMemcpy(dC, C, sizeof C, cudaMemcpyHostToDevice);
    s = cublasGemmGroupedBatchedEx_64(h, ta, tb, m, n, k, al, (const void *const *)dp, CUDA_R_32F, lda,
                                      (const void *const *)dp + 1, CUDA_R_32F, ldb, be, (void *const *)dp + 2,
                                      CUDA_R_32F, ldc, 1, gs, CUBLAS_COMPUTE_32F);
    cudaMemcpy(got, dC, sizeof got, cudaMemcpyDeviceToHost);
    result("cublasGemmGroupedBatchedEx: one group, the same product", s == 0 && memcmp(got, want, sizeof got) == 0,
           "wrong product");
    s = cublasGemmGroupedBatchedEx_64(h, ta, tb, m, n, k, al, hp, CUDA_R_32F, lda, hp + 1, CUDA_R_32F, ldb, be,
                                      (void *const *)hp + 2, CUDA_R_32F, ldc, 1, gs, CUBLAS_COMPUTE_32F);
    result("cublasGemmGroupedBatchedEx: host pointer arrays rejected", s == CUBLAS_STATUS_INVALID_VALUE, "accepted");
    expect_report("cublas: ... and reported", "device memory");
    cudaFree(dA); cudaFree(dB); cudaFree(dC); cudaFree(dCt); cudaFree(dp);
    cudaFree(da16); cudaFree(db16); cudaFree(dc16);
    cublasDestroy(h);
}

/* bf16 bits of a value bf16 holds exactly */
static uint16_t bits16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}
static float from16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* one grouped problem (group of 1): C (m x 1) = A (m x k) B (k x 1), bf16 or fp32 in and out, the
   pointers as given (A, B, C at byte offsets off[3] into one device block) */
static cublasStatus_t grouped_one(cublasHandle_t h, cudaDataType_t t, int64_t m, int64_t k, char *base,
                                  const int off[3]) {
    cublasOperation_t ta[1] = {CUBLAS_OP_N}, tb[1] = {CUBLAS_OP_N};
    int64_t mm[1] = {m}, nn[1] = {1}, kk[1] = {k}, lda[1] = {m}, ldb[1] = {k}, ldc[1] = {m}, gs[1] = {1};
    float al[1] = {1}, be[1] = {0};
    const void *hp[3] = {base + off[0], base + off[1], base + off[2]};
    void **dp;
    cudaMalloc((void **)&dp, sizeof hp);
    cudaMemcpy(dp, hp, sizeof hp, cudaMemcpyHostToDevice);
    const void *const *pa = (const void *const *)dp;
    cublasStatus_t s = cublasGemmGroupedBatchedEx_64(h, ta, tb, mm, nn, kk, al, pa, t, lda, pa + 1, t, ldb, be,
                                                     (void *const *)dp + 2, t, ldc, 1, gs, CUBLAS_COMPUTE_32F);
    cudaDeviceSynchronize();
    cudaFree(dp);
    return s;
}

/* The cuBLAS documentation's rules beyond the products: each call's type
   table, the batched forms' pointer alignment, reductions in the output type
   where the math mode allows them, and the workspace (alignment, size,
   cublasSetStream's reset, graph capture, one stream at a time). */
static void blas_rules() {
    cublasHandle_t h;
    cublasCreate(&h);
    const float one = 1, zero = 0;
    char *blk;
    cudaMalloc((void **)&blk, 4096);
    cudaMemset(blk, 0, 4096);
    cudaDeviceSynchronize();
    /* types: bf16 A and B with fp32 C is in cublasGemmEx's table and the strided-batched one's, not in the
       grouped call's */
    uint16_t a2[2] = {bits16(1.5f), bits16(2.0f)};
    cudaMemcpy(blk, a2, 4, cudaMemcpyHostToDevice);
    cudaMemcpy(blk + 64, a2, 4, cudaMemcpyHostToDevice);
    cublasStatus_t s = cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &one, blk, CUDA_R_16BF, 1, blk + 64,
                                       CUDA_R_16BF, 2, &zero, blk + 128, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT);
    float c32 = 0;
    cudaMemcpy(&c32, blk + 128, 4, cudaMemcpyDeviceToHost);
    result("cublas types: cublasGemmEx takes bf16 x bf16 -> fp32", s == 0 && c32 == 1.5f * 1.5f + 4.0f,
           "refused or wrong");
    s = cublasGemmStridedBatchedEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 2, &one, blk, CUDA_R_16BF, 1, 0, blk + 64,
                                      CUDA_R_16BF, 2, 0, &zero, blk + 128, CUDA_R_32F, 1, 4, 1, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    result("cublas types: ... so does cublasGemmStridedBatchedEx", s == 0, "refused");
    const int off0[3] = {0, 64, 128};
    s = grouped_one(h, CUDA_R_16BF, 1, 2, blk, off0);
    result("cublas types: cublasGemmGroupedBatchedEx takes bf16 -> bf16", s == 0, "refused");
    cublasOperation_t ta[1] = {CUBLAS_OP_N};
    int64_t one64[1] = {1}, two64[1] = {2};
    float al[1] = {1}, be[1] = {0};
    s = cublasGemmGroupedBatchedEx_64(h, ta, ta, one64, one64, two64, al, (const void *const *)blk, CUDA_R_16BF,
                                      one64, (const void *const *)blk, CUDA_R_16BF, two64, be, (void *const *)blk,
                                      CUDA_R_32F, one64, 1, one64, CUBLAS_COMPUTE_32F);
    result("cublas types: ... not bf16 -> fp32 (outside its table): CUBLAS_STATUS_NOT_SUPPORTED",
           s == CUBLAS_STATUS_NOT_SUPPORTED, "accepted");
    expect_report("cublas types: ... and reported (a caller picks by the table, never by probing)",
                  "not in its documented type table");
    s = cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                        blk + 128, CUDA_R_16BF, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    result("cublas types: cublasGemmEx fp32 -> bf16 is NOT_SUPPORTED", s == CUBLAS_STATUS_NOT_SUPPORTED,
           "accepted");
    expect_report("cublas types: ... and reported", "not in its documented type table");
    s = cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                        blk + 128, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
    result("cublas types: a documented combination the emulator does not compute (TF32) is declined",
           s == CUBLAS_STATUS_NOT_SUPPORTED, "accepted");
    expect_report("cublas types: ... and reported", "not emulated");

    /* alignment of the grouped call's matrix pointers (bf16: the rule applies; fp32 default math: not) */
    const int a16[3] = {0, 64, 132}, a4[3] = {0, 64, 130}, a_none[3] = {2, 66, 130};
    s = grouped_one(h, CUDA_R_16BF, 2, 8, blk, a16); /* k * 2 = 16: every pointer 16-byte aligned */
    expect_report("cublas alignment: grouped bf16, k 8, C 4-byte aligned: reported (a GPU faults)",
                  "C pointer");
    s = grouped_one(h, CUDA_R_16BF, 2, 2, blk, a4); /* k * 2 = 4: 4-byte aligned */
    expect_report("cublas alignment: grouped bf16, k 2, C 2-byte aligned: reported", "not 4-byte aligned");
    s = grouped_one(h, CUDA_R_16BF, 2, 3, blk, a_none); /* k * 2 = 6: no rule */
    expect_clean("cublas alignment: grouped bf16, k 3 (6 bytes a column): 2-byte pointers are fine");
    const int f4[3] = {4, 68, 132};
    s = grouped_one(h, CUDA_R_32F, 2, 4, blk, f4);
    expect_clean("cublas alignment: grouped fp32 with default math: 4-byte pointers are fine");
    s = grouped_one(h, CUDA_R_16BF, 2, 8, blk, off0);
    expect_clean("cublas alignment: grouped bf16, k 8, 64-byte aligned pointers: clean");

    /* reductions in the output type: 1 + 3 (1.5 2^-9) sums to 1 + 2^-7 in fp32 (bf16 rounds 1.0087890625
       there), but stays 1 when each partial sum is held in bf16 */
    uint16_t av[4] = {bits16(1.0f), bits16(0.0029296875f), bits16(0.0029296875f), bits16(0.0029296875f)};
    uint16_t bv[4] = {bits16(1.0f), bits16(1.0f), bits16(1.0f), bits16(1.0f)};
    cudaMemcpy(blk, av, 8, cudaMemcpyHostToDevice);
    cudaMemcpy(blk + 64, bv, 8, cudaMemcpyHostToDevice);
    auto dot = [&](cudaDataType_t ct) {
        cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 4, &one, blk, CUDA_R_16BF, 1, blk + 64, CUDA_R_16BF, 4,
                        &zero, blk + 128, ct, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (ct == CUDA_R_32F) {
            float v = 0;
            cudaMemcpy(&v, blk + 128, 4, cudaMemcpyDeviceToHost);
            return v;
        }
        uint16_t v = 0;
        cudaMemcpy(&v, blk + 128, 2, cudaMemcpyDeviceToHost);
        return from16(v);
    };
    const float exact = from16(bits16(1.0078125f));
    float off_v = dot(CUDA_R_16BF);
    moept_emu_blas_reduced_reduction(1);
    float red_v = dot(CUDA_R_16BF), red32 = dot(CUDA_R_32F);
    cublasSetMathMode(h, (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    float dis_v = dot(CUDA_R_16BF);
    moept_emu_blas_reduced_reduction(0);
    cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    result("cublas reduced-precision reduction: off, the fp32 sum rounded once", off_v == exact, "wrong value");
    result("cublas reduced-precision reduction: on with CUBLAS_DEFAULT_MATH, bf16 partial sums", red_v == 1.0f,
           "not reduced in bf16");
    result("cublas reduced-precision reduction: ... not with CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION",
           dis_v == exact, "reduced anyway");
    result("cublas reduced-precision reduction: ... nor with an fp32 C", red32 == 1.0087890625f, "reduced anyway");

    /* the workspace */
    int bare = -1;
    int nh = moept_emu_blas_handles(0, &bare);
    result("cublas workspace: a new handle has none set", nh >= 1 && bare == nh, "counted wrong");
    char *ws;
    cudaMalloc((void **)&ws, 65536);
    s = cublasSetWorkspace(h, ws + 16, 32768);
    result("cublas workspace: a pointer not 256-byte aligned is CUBLAS_STATUS_INVALID_VALUE",
           s == CUBLAS_STATUS_INVALID_VALUE, "accepted");
    expect_report("cublas workspace: ... and reported", "256-byte");
    cublasSetWorkspace(h, ws, 8192);
    s = cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                        blk + 128, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    result("cublas workspace: under 16 KiB, a GEMM may answer CUBLAS_STATUS_ALLOC_FAILED (taken as it does)",
           s == CUBLAS_STATUS_ALLOC_FAILED, "accepted");
    expect_report("cublas workspace: ... and reported", "16 KiB");
    cudaStream_t sa, sb;
    cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking);
    cublasSetWorkspace(h, ws, 32768);
    cublasSetStream(h, sa); /* resets the workspace to the default pool */
    moept_emu_blas_handles(0, &bare);
    result("cublas workspace: cublasSetStream resets it", bare == nh, "kept");
    auto captured_gemm = [&](cublasHandle_t hh, cudaStream_t st) {
        cudaGraph_t g = nullptr;
        cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
        cublasGemmEx_64(hh, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                        blk + 128, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cudaStreamEndCapture(st, &g);
        if (g) cudaGraphDestroy(g);
    };
    captured_gemm(h, sa);
    expect_report("cublas workspace: a GEMM captured without one is reported (memory nodes in the graph)",
                  "no cublasSetWorkspace");
    cublasSetWorkspace(h, ws, 32768);
    captured_gemm(h, sa);
    expect_clean("cublas workspace: ... and with one set after cublasSetStream, clean");
    /* two handles on two streams sharing one workspace, their calls unordered */
    cublasHandle_t h2;
    cublasCreate(&h2);
    cublasSetStream(h2, sb);
    cublasSetWorkspace(h2, ws, 32768);
    cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                    blk + 256, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx_64(h2, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                    blk + 384, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    expect_report("cublas workspace: one workspace used by two streams at once is a hazard", "cuBLAS workspace");
    cublasSetWorkspace(h2, ws + 32768, 32768); /* each its own */
    cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                    blk + 256, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx_64(h2, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, blk, CUDA_R_32F, 1, blk, CUDA_R_32F, 1, &zero,
                    blk + 384, CUDA_R_32F, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    expect_clean("cublas workspace: ... one each, clean");
    cublasDestroy(h2);
    cublasDestroy(h);
    cudaStreamDestroy(sa);
    cudaStreamDestroy(sb);
    cudaFree(ws);
    cudaFree(blk);
}

/* NCCL: an ncclSend the peer never receives waits for ever, as on a GPU
   (no error by itself); ncclCommAbort on its rank ends it. An injected
   transport failure instead gives the asynchronous error. */
static void nccl_unmatched(int inject) {
    moept_emu_nccl_inject_error(inject ? 300 : 0);
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclResult_t async[2] = {ncclSuccess, ncclSuccess};
    cudaError_t later[2] = {cudaSuccess, cudaSuccess};
    bool ended[2] = {false, false};
    volatile bool aborted0 = false; /* not std::atomic: this unit has tsan's hooks but not its runtime */
    auto rank = [&](int r) {
        cudaSetDevice(r);
        ncclComm_t c;
        cudaStream_t s;
        float *buf;
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        ncclCommInitRank(&c, 2, id, r);
        cudaMalloc((void **)&buf, 64);
        if (r == 0) ncclSend(buf, 16, ncclFloat32, 1, c, s); /* rank 1 posts no ncclRecv */
        double t0 = now_s();
        while (cudaStreamQuery(s) == cudaErrorNotReady && now_s() - t0 < 1.0) usleep(1000);
        later[r] = cudaStreamQuery(s);
        ncclCommGetAsyncError(c, &async[r]);
        if (r == 0) {
            ncclCommAbort(c); /* the one way to end it */
            aborted0 = true;
        } else {
            while (!aborted0) usleep(1000); /* its unreceived message is then no report */
            ncclCommDestroy(c);
        }
        t0 = now_s();
        while (cudaStreamQuery(s) == cudaErrorNotReady && now_s() - t0 < 5.0) usleep(1000);
        ended[r] = cudaStreamQuery(s) == cudaSuccess;
        cudaFree(buf);
        cudaStreamDestroy(s);
    };
    std::thread t0(rank, 0), t1(rank, 1);
    t0.join();
    t1.join();
    if (inject) {
        result("nccl: an injected transport failure gives an asynchronous error",
               async[0] == ncclRemoteError && later[0] == cudaSuccess, "no error");
    } else {
        result("nccl: an unmatched ncclSend is still waiting after 1 s, no error by itself",
               later[0] == cudaErrorNotReady && async[0] == ncclSuccess, "it ended or erred by itself");
        result("nccl: ... and ncclCommAbort on its rank ends it", ended[0] && ended[1], "still waiting");
    }
    moept_emu_nccl_inject_error(0);
}

/* NCCL: n ranks of one communicator, rank r a thread on device devs[r],
   initialise (and destroy what formed); res gets each rank's
   ncclCommInitRank result, msg the last error of the first that failed.
   Returns the seconds the initialisation took. */
static double nccl_init_on(int n, const int *devs, ncclResult_t *res, char *msg, size_t len) {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    std::vector<ncclComm_t> comms((size_t)n, nullptr);
    std::mutex mu;
    msg[0] = 0;
    auto rank = [&](int r) {
        cudaSetDevice(devs[r]);
        res[r] = ncclCommInitRank(&comms[(size_t)r], n, id, r);
        std::lock_guard<std::mutex> lk(mu);
        if (res[r] != ncclSuccess && !msg[0]) snprintf(msg, len, "%s", ncclGetLastError(nullptr));
    };
    const double t0 = now_s();
    std::vector<std::thread> ts;
    for (int r = 0; r < n; r++) ts.emplace_back(rank, r);
    for (auto &t : ts) t.join();
    const double dt = now_s() - t0;
    for (int r = 0; r < n; r++)
        if (comms[(size_t)r]) ncclCommDestroy(comms[(size_t)r]);
    return dt;
}

/* NCCL before 2.30 (the headers here: NCCL_VERSION_CODE) refuses two ranks
   of a communicator on one GPU: each of them gets ncclInvalidUsage from
   ncclCommInitRank, "Duplicate GPU detected" its last error, at once (no
   wait; a rank with a GPU of its own ncclRemoteError);
   NCCL_MULTI_RANK_GPU_ENABLE=1 does nothing before 2.30. On two GPUs the
   communicator forms. From 2.30 every rank fails, unless the variable is 1. */
static void nccl_dup_gpu() {
    char msg[256], why[400];
    ncclResult_t res[3];
    const int same[2] = {0, 0}, two[2] = {0, 1};
    double dt = nccl_init_on(2, same, res, msg, sizeof msg);
    snprintf(why, sizeof why, "results %d, %d in %.1f s, last error '%s'", res[0], res[1], dt, msg);
    result("nccl: two ranks on one GPU fail ncclCommInitRank with ncclInvalidUsage at once",
           res[0] == ncclInvalidUsage && res[1] == ncclInvalidUsage && dt < 5 &&
               strstr(msg, "Duplicate GPU detected : rank ") && strstr(msg, " both on CUDA device "), why);
    expect_clean("nccl: ... as a result, not a report");
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
    dt = nccl_init_on(2, same, res, msg, sizeof msg);
    unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
    snprintf(why, sizeof why, "results %d, %d in %.1f s", res[0], res[1], dt);
    result("nccl: ... NCCL_MULTI_RANK_GPU_ENABLE=1 does not allow it before NCCL 2.30",
           NCCL_VERSION_CODE >= 23000 || (res[0] == ncclInvalidUsage && res[1] == ncclInvalidUsage), why);
    dt = nccl_init_on(2, two, res, msg, sizeof msg);
    snprintf(why, sizeof why, "results %d, %d, last error '%s'", res[0], res[1], msg);
    const bool formed = res[0] == ncclSuccess && res[1] == ncclSuccess;
    result("nccl: two ranks on two GPUs form the communicator", formed, why);
    const int three[3] = {1, 0, 1}; /* ranks 0 and 2 share device 1; rank 1 has its own */
    dt = nccl_init_on(3, three, res, msg, sizeof msg);
    snprintf(why, sizeof why, "results %d, %d, %d in %.1f s", res[0], res[1], res[2], dt);
    result("nccl: ... of three, the two sharing a GPU ncclInvalidUsage, the third ncclRemoteError, at once",
           NCCL_VERSION_CODE >= 23000 ||
               (res[0] == ncclInvalidUsage && res[2] == ncclInvalidUsage && res[1] == ncclRemoteError &&
                dt < 5),
           why);
    expect_clean("nccl: ... with no report");
    /* as if NCCL 2.30.7 were loaded */
    moept_emu_nccl_version(23007);
    int v = 0;
    ncclGetVersion(&v);
    dt = nccl_init_on(3, three, res, msg, sizeof msg);
    snprintf(why, sizeof why, "version %d: results %d, %d, %d in %.1f s, last error '%s'", v, res[0], res[1],
             res[2], dt, msg);
    result("nccl: 2.30, every rank fails ncclCommInitRank when two share a GPU",
           v == 23007 && res[0] == ncclInvalidUsage && res[1] == ncclInvalidUsage &&
               res[2] == ncclInvalidUsage && strstr(msg, "Set NCCL_MULTI_RANK_GPU_ENABLE=1"), why);
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
    dt = nccl_init_on(2, same, res, msg, sizeof msg);
    unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
    snprintf(why, sizeof why, "results %d, %d, last error '%s'", res[0], res[1], msg);
    result("nccl: 2.30, ... NCCL_MULTI_RANK_GPU_ENABLE=1 allows it",
           res[0] == ncclSuccess && res[1] == ncclSuccess, why);
    moept_emu_nccl_version(0);
    expect_clean("nccl: ... with no report");
}

/* ---- cuBLASLt (emu_lt.cc): block-scaled FP8 matmuls. tests/lt_rules.txt
   holds what a real H200 answered to the layouts, sizes and alignments
   (build/emu/lt_rules prints the same); here each of the emulator's other
   rules fires on a call that breaks it alone, with its status and report,
   and a hand-worked product comes out right. ---- */
struct LtArgs {
    cublasComputeType_t comp = CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = CUDA_R_32F, at = CUDA_R_8F_E4M3, ct = CUDA_R_32F, dt = CUDA_R_32F;
    int32_t amode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    int32_t bmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    int64_t m = 16, n = 16, k = 128;
    size_t aoff = 0, wsoff = 0;
    bool no_scale = false, epilogue = false, batch = false, bad_algo = false, dev_alpha = false;
};

/* A [m][k] and B [n][k] of 1.0, A's scales 2, B's 0.5 (every element of D: k); the matmul's status */
static cublasStatus_t lt_call(const LtArgs &a, float *d00) {
    cublasLtHandle_t h;
    cublasLtCreate(&h);
    char *blk;
    cudaMalloc((void **)&blk, 1 << 16);
    cudaMemset(blk, 0x38, 8192); /* E4M3 0x38 = 1.0: A at 0, B at 4096 */
    float sa[8] = {2, 2, 2, 2, 2, 2, 2, 2}, sb[64];
    for (float &v : sb) v = 0.5f;
    float *dsa = (float *)(blk + 8192), *dsb = (float *)(blk + 8448), *one = (float *)(blk + 9000);
    cudaMemcpy(dsa, sa, sizeof sa, cudaMemcpyHostToDevice);
    cudaMemcpy(dsb, sb, sizeof sb, cudaMemcpyHostToDevice);
    char *D = blk + 12288;
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, a.comp, a.scale);
    int32_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    const float *pa = a.no_scale ? nullptr : dsa, *pb = dsb;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, 4);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, 4);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a.amode, 4);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &a.bmode, 4);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb);
    if (a.epilogue) {
        cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_RELU;
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e);
    }
    cublasLtMatrixLayout_t la, lb, lc, ld;
    cublasLtMatrixLayoutCreate(&la, a.at, a.k, a.m, a.k);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, a.k, a.n, a.k);
    cublasLtMatrixLayoutCreate(&lc, a.ct, a.m, a.n, a.m);
    cublasLtMatrixLayoutCreate(&ld, a.dt, a.m, a.n, a.m);
    if (a.batch) {
        int32_t two = 2;
        cublasLtMatrixLayoutSetAttribute(lb, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, 4);
    }
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int nres = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, ld, pref, 1, &res, &nres);
    if (a.bad_algo) res.algo.data[0] = 0;
    float al = 1, be = 0;
    if (a.dev_alpha) cudaMemcpy(one, &al, 4, cudaMemcpyHostToDevice);
    const float *alpha = a.dev_alpha ? one : &al;
    cublasStatus_t st = cublasLtMatmul(h, op, alpha, blk + a.aoff, la, blk + 4096, lb, &be, D, lc, D, ld,
                                       nres ? &res.algo : nullptr, blk + 16384 * 2 + a.wsoff, 0, 0);
    cudaDeviceSynchronize();
    if (d00) cudaMemcpy(d00, D, 4, cudaMemcpyDeviceToHost);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc); cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    cudaFree(blk);
    cublasLtDestroy(h);
    return st;
}

static void lt_rules() {
    float d = 0;
    cublasStatus_t st = lt_call(LtArgs(), &d);
    result("cublasLt: E4M3 1.0 x 1.0 over k 128, scales 2 and 0.5: D = 128", st == 0 && d == 128.0f,
           "refused or wrong");
    struct {
        const char *name, *want;
        cublasStatus_t st;
        std::function<void(LtArgs &)> set;
    } cs[] = {
        {"a TF32 compute type", "CUBLAS_COMPUTE_32F and scaleType", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.comp = CUBLAS_COMPUTE_32F_FAST_TF32; }},
        {"an fp16 scale type", "CUBLAS_COMPUTE_32F and scaleType", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.scale = CUDA_R_16F; }},
        {"an E5M2 A", "E5M2 operands are documented but not emulated", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.at = CUDA_R_8F_E5M2; }},
        {"an fp16 C and D", "an fp16 D is documented but not emulated", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.ct = a.dt = CUDA_R_16F; }},
        {"an FP8 D with block scales", "D must be CUDA_R_16BF", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.ct = a.dt = CUDA_R_8F_E4M3; }},
        {"C fp32, D bf16", "C's type must be D's", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.dt = CUDA_R_16BF; }},
        {"tensor-wide scaling on A", "scale modes other than", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.amode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F; }},
        {"a bf16 D of 4 rows (8 bytes a column)", "leading dimensions of C and D",
         CUBLAS_STATUS_NOT_SUPPORTED, [](LtArgs &a) { a.m = 4; a.ct = a.dt = CUDA_R_16BF; }},
        {"a workspace off 256 bytes", "256-byte aligned", CUBLAS_STATUS_INVALID_VALUE,
         [](LtArgs &a) { a.wsoff = 128; }},
        {"a block mode without its scales", "without its scales", CUBLAS_STATUS_INVALID_VALUE,
         [](LtArgs &a) { a.no_scale = true; }},
        {"A 8 bytes off 16", "A, B, C and D must be 16-byte aligned", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.aoff = 8; }},
        {"an algo no heuristic returned", "an algo no heuristic", CUBLAS_STATUS_INVALID_VALUE,
         [](LtArgs &a) { a.bad_algo = true; }},
        {"an epilogue", "documented but not emulated", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.epilogue = true; }},
        {"a batched B", "order or batch", CUBLAS_STATUS_NOT_SUPPORTED, [](LtArgs &a) { a.batch = true; }},
        {"a device alpha", "POINTER_MODE_DEVICE", CUBLAS_STATUS_NOT_SUPPORTED,
         [](LtArgs &a) { a.dev_alpha = true; }},
    };
    for (auto &c : cs) {
        LtArgs a;
        c.set(a);
        char name[160];
        snprintf(name, sizeof name, "cublasLt rules: %s is refused", c.name);
        result(name, lt_call(a, nullptr) == c.st, "another status");
        expect_report(name, c.want);
    }
}

/* ---- Hopper: mbarrier, TMA, wgmma (tests/emu/emu_hopper.cc) ----
   A matrix descriptor for a K-major operand at p (PTX ISA, wgmma "Matrix Descriptor Format"): start
   address, leading and stride byte offsets (each >> 4), swizzle mode (0 none, 1 128B, 2 64B, 3 32B),
   base offset (bits 49-51). */
static uint64_t hdesc(const void *p, int mode, unsigned lbo, unsigned sbo, int base = 0) {
    const uint64_t a = __cvta_generic_to_shared(p);
    return ((a & 0x3ffff) >> 4) | ((uint64_t)((lbo & 0x3ffff) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3ffff) >> 4) << 32) | ((uint64_t)base << 49) | ((uint64_t)mode << 62);
}
static uint16_t hbf(float v) { /* exact for the small integers and bf16 values used here */
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}
/* the no-swizzle canonical K-major layout (8x16-byte core matrices, LBO 128 between the two along K,
   SBO 256 between 8-row groups): the byte offset of element (r, k) */
static unsigned kmaj(int r, int k) {
    return (unsigned)((r / 8) * 256 + (k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2);
}

/* the PTX ISA's worked example "MN-Major, 64B swizzling and bf16 type" (wgmma, "Canonical Layouts"):
   Swizzle<2,4,3> o ((8,4,2),(8,2)):((1,8,256),(32,512)), 64 of MN by 16 of K, LBO 256 and SBO 512
   elements: the byte offset of element (c, k) */
static unsigned mn64(int c, int k) {
    const unsigned e = (unsigned)(c % 8 + (c / 8 % 4) * 8 + (c / 32) * 256 + (k % 8) * 32 + (k / 8) * 512);
    return (2 * e) ^ (((2 * e) >> 7 & 3) << 4);
}

/* the canonical MN-major layout with the 128B swizzle ("Canonical Layouts": ((T,8,m),(8,k)):((1,T,LBO),
   (8T,SBO)), Swizzle<3,4,3>), 128 of N by 16 of K: LBO 2048 bytes (the second 64 of N), SBO 1024 (the
   second 8 of K); the grouped kernel's B tiles are this with LBO 8192 */
static unsigned mn128(int c, int k) {
    const unsigned b = (unsigned)((c / 64) * 2048 + (k / 8) * 1024 + (k % 8) * 128 + (c % 64) * 2);
    return b ^ ((b >> 7 & 7) << 4);
}

/* m64nNk16 with A[r][k] = (k == 0 ? r : k == 1 ? 1 : 0), B[c][k] = (k == 0 ? N : k == 1 ? c : 0):
   D[r][c] = N r + c, each register's value names its place. Stores by the threads, fence.proxy.async
   (unless fence is 0), barrier (fence 2: none; 3: bar.sync 1, 128 in place of __syncthreads; 4: then a
   store elsewhere, fenced, with no barrier after it), one
   wgmma; out[t * N/2 + i] = thread t's d[i]. bad: 1 writes d after the wgmma.fence, 2 reads d before the
   wait, 3 returns without waiting, 4 N = 12, 5 B N-major as mn64 (N 64; imm-trans-b 1), 6 as mn128 (N 128),
   7 leaves A's element (4, 13) unstored */
__global__ void k_wg_frag(float *out, int n, int fence, int bad) {
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x;
    for (int e = t; e < 64 * 16; e += 128) {
        const int r = e / 16, k = e % 16;
        if (bad == 7 && e == 4 * 16 + 13) continue;
        *(uint16_t *)(sm + kmaj(r, k)) = hbf(k == 0 ? (float)r : k == 1 ? 1.0f : 0.0f);
    }
    for (int e = t; e < n * 16; e += 128) {
        const int c = e / 16, k = e % 16;
        *(uint16_t *)(sm + 8192 + (bad == 5 ? mn64(c, k) : bad == 6 ? mn128(c, k) : kmaj(c, k))) =
            hbf(k == 0 ? (float)n : k == 1 ? (float)c : 0.0f);
    }
    if (fence) moept_emu_fence_proxy_async();
    if (fence == 3) moept_emu_bar_sync(1, 128);
    else if (fence != 2) __syncthreads();
    if (fence == 4) { /* (the operands' stores stay ordered by the barrier above) */
        *(float *)(sm + 11264 + 4 * t) = 1.0f;
        moept_emu_fence_proxy_async();
    }
    float d[128];
    moept_emu_wgmma_fence();
    if (bad == 1 && t == 7) d[3] = 1.0f;
    const uint64_t db = bad == 5 ? hdesc(sm + 8192, 2, 512, 1024)
                        : bad == 6 ? hdesc(sm + 8192, 1, 2048, 1024) : hdesc(sm + 8192, 0, 128, 256);
    moept_emu_wgmma_bf16(d, bad == 4 ? 12 : n, hdesc(sm, 0, 128, 256), db, 0, 0, bad >= 5);
    moept_emu_wgmma_commit();
    if (bad == 2 && t == 9) out[0] = d[1];
    if (bad == 3) return;
    moept_emu_wgmma_wait(0);
    for (int i = 0; i < n / 2; i++) out[t * (n / 2) + i] = d[i];
}

/* k_wg_frag's operands (n 16) handed from a producer warpgroup to a consumer one by an mbarrier, as
   the grouped kernel's own loads are: warpgroup 0 stores them, fences them (mode 0), arrives on the
   mbarrier (count 128); warpgroup 1 waits on its phase and multiplies (out as k_wg_frag's). mode 1: no
   fence; 2: the fence after the arrival; 3: the consumers wait on another mbarrier, which thread 0
   alone arrives on (after its fence): the other threads' stores are not ordered */
__global__ void k_wg_handoff(float *out, int mode) {
    __shared__ uint64_t bar, bar0;
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        moept_emu_mbar_init(&bar, 128);
        moept_emu_mbar_init(&bar0, 1);
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        for (int e = t; e < 64 * 16; e += 128) {
            const int r = e / 16, k = e % 16;
            *(uint16_t *)(sm + kmaj(r, k)) = hbf(k == 0 ? (float)r : k == 1 ? 1.0f : 0.0f);
            const int c = r % 16; /* (B's 16 rows, each stored by four threads alike) */
            *(uint16_t *)(sm + 8192 + kmaj(c, k)) = hbf(k == 0 ? 16.0f : k == 1 ? (float)c : 0.0f);
        }
        if (mode != 1 && mode != 2) moept_emu_fence_proxy_async();
        moept_emu_mbar_arrive(&bar);
        if (mode == 2) moept_emu_fence_proxy_async();
        if (mode == 3 && t == 0) moept_emu_mbar_arrive(&bar0);
        return;
    }
    moept_emu_mbar_wait(mode == 3 ? &bar0 : &bar, 0);
    float d[8];
    moept_emu_wgmma_fence();
    moept_emu_wgmma_bf16(d, 16, hdesc(sm, 0, 128, 256), hdesc(sm + 8192, 0, 128, 256), 0, 0, 0);
    moept_emu_wgmma_commit();
    moept_emu_wgmma_wait(0);
    for (int i = 0; i < 8; i++) out[t * 8 + i] = d[i];
}

/* E4M3's byte for v: 0, or 2^e (1 + m/8) (PTX ISA, "Alternate Floating-Point Data Formats": exponent
   bias 7); exact for the integers up to 16 and the powers of two used here */
static uint8_t he4m3(int v) {
    if (v == 0) return 0;
    int e = 0;
    while ((2 << e) <= v) e++;
    return (uint8_t)((e + 7) << 3 | ((v << 3 >> e) & 7));
}

/* m64nNk32 in E4M3 (wgmma .e4m3.e4m3): A[r][0..3] = (r / 8, r % 8, 8, 1), B[c][0..3] = (128, 16, c / 8,
   c % 8), the other k 0: D[r][c] = 16 r + c. swz 0: the no-swizzle canonical K-major layout (core
   matrices of 8 rows x 16 bytes: LBO 128, SBO 256); swz 1: the grouped kernel's, rows of 128 bytes in
   the 128B swizzle (SBO 1024), the k32 slice at byte 32 s of each row (the descriptor's start advanced
   32 s), the row's other bytes 1.0 (a slice read in the wrong place gives other sums). out as k_wg_frag's */
__global__ void k_wg_e4m3(float *out, int n, int swz, int s) {
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x, kb = swz ? 128 : 32; /* bytes a row holds */
    for (int e = t; e < (64 + n) * kb; e += 128) { /* A's 64 rows, then B's n at byte 8192 */
        const int b = e >= 64 * kb, r = b ? e / kb - 64 : e / kb, j = e % kb, k = j - (swz ? 32 * s : 0);
        int v = -1;                               /* (-1: outside the slice) */
        if (k >= 0 && k < 32) {
            const int a4[4] = {r / 8, r % 8, 8, 1}, b4[4] = {128, 16, r / 8, r % 8};
            v = k < 4 ? (b ? b4[k] : a4[k]) : 0;
        }
        const unsigned o = swz ? (unsigned)((r / 8) * 1024 + (r % 8) * 128 + j)
                               : (unsigned)((r / 8) * 256 + (j / 16) * 128 + (r % 8) * 16 + j % 16);
        sm[(b ? 8192 : 0) + (swz ? o ^ ((o >> 7 & 7) << 4) : o)] = (char)(v < 0 ? 0x38 : he4m3(v));
    }
    moept_emu_fence_proxy_async();
    __syncthreads();
    float d[64];
    moept_emu_wgmma_fence();
    const int st = swz ? 32 * s : 0;
    moept_emu_wgmma_e4m3(d, n, hdesc(sm + st, swz, 128, swz ? 1024 : 256),
                         hdesc(sm + 8192 + st, swz, 128, swz ? 1024 : 256), 0);
    moept_emu_wgmma_commit();
    moept_emu_wgmma_wait(0);
    for (int i = 0; i < n / 2; i++) out[t * (n / 2) + i] = d[i];
}

/* bar.sync 1 misused: bad 1 a count of 48 (not whole warps), 2 threads 64-127 give another count, 3
   threads 64-127 return (the barrier never completes) */
__global__ void k_bar(int bad) {
    const int t = threadIdx.x;
    if (bad == 3 && t >= 64) return;
    moept_emu_bar_sync(1, bad == 1 ? 48 : bad == 2 && t >= 64 ? 64 : 128);
}

/* each half of the block exchanges words of shared memory through its own named barrier (bar.sync 1 +
   half, 64 threads): each thread writes its word, reads its 4-thread group's, writes its word again,
   reads a neighbour's: clean; bad 1 reads the other half's words (no barrier of its own orders them),
   bad 2 writes again with no barrier after the group's reads (write after read) */
__global__ void k_nbar_xchg(int bad, float *out) {
    __shared__ float shx[128];
    const int t = threadIdx.x, h = t / 64;
    shx[t] = (float)t;
    moept_emu_bar_sync(1 + h, 64);
    float v = 0.0f;
    for (int u = 0; u < 4; u++) v += shx[((t & ~3) + u + (bad == 1 ? 64 : 0)) % 128];
    if (bad != 2) moept_emu_bar_sync(1 + h, 64);
    shx[t] = v;
    moept_emu_bar_sync(1 + h, 64);
    out[t] = shx[t ^ 1];
}

/* more than four readers of a word ordered by a named barrier (racecheck's readers past its four): at
   step k one thread of each half writes the half's word k & 1, its bar.sync, then all 64 read it, so the
   write two steps on follows their reads by the barrier between (a double buffer, as WGRAD8's column
   scales): clean; bad 1 one word (the next step's write follows the reads by no barrier) */
__global__ void k_nbar_many(int bad, float *out) {
    __shared__ float shm[2][2]; /* [half][step & 1] */
    const int t = threadIdx.x, h = t / 64;
    float acc = 0.0f;
    for (int k = 0; k < 4; k++) {
        const int b = bad == 1 ? 0 : k & 1;
        if (t % 64 == k) shm[h][b] = (float)k;
        moept_emu_bar_sync(1 + h, 64);
        acc += shm[h][b];
    }
    out[t] = acc;
}

/* ... the readers the shadow keeps (its first four) ordered before the write, the ones after not: threads
   0-3 read a word, the block's bar.sync, threads 4-127 read it, then (bad 0: after another bar.sync)
   thread 0 writes it: with bad 1 a race only the readers past four show */
__global__ void k_nbar_late(int bad, float *out) {
    __shared__ float w1;
    const int t = threadIdx.x;
    if (t == 0) w1 = 1.0f;
    __syncthreads();
    float v = t < 4 ? w1 : 0.0f;
    moept_emu_bar_sync(1, 128);
    if (t >= 4) v = w1;
    if (!bad) moept_emu_bar_sync(1, 128);
    if (t == 0) w1 = 2.0f;
    out[t] = v;
}

/* ... a barrier that orders them hidden behind more than four of each half's own: all 128 threads read a
   word, bar.sync 1 (bad 1: none), then six of each half's own (bar.sync 2 + half, 64), then thread 0
   writes it: the block's barrier still orders the write after the other half's reads (as GATE8's k-steps'
   barriers of a warpgroup lie between its tiles' ones of both) */
__global__ void k_nbar_hist(int bad, float *out) {
    __shared__ float w1;
    const int t = threadIdx.x, h = t / 64;
    if (t == 0) w1 = 1.0f;
    __syncthreads();
    const float v = w1;
    if (!bad) moept_emu_bar_sync(1, 128);
    for (int k = 0; k < 6; k++) moept_emu_bar_sync(2 + h, 64);
    if (t == 0) w1 = 2.0f;
    out[t] = v;
}

/* a racecheck kernel k (its name) of one block of 128 threads, bad 0 then 1: clean, then a write after
   read reported */
#define MOEPT__KERNEL(k) k, #k
static void nbar_pair(void (*k)(int, float *), const char *name, float *out, const char *clean,
                      const char *racy) {
    for (int bad = 0; bad < 2; bad++) {
        moept_emu_kernel(k, 1, 128, 0, 0, name)(bad, out);
        cudaDeviceSynchronize();
        if (bad) expect_report(racy, "write after read");
        else expect_clean(clean);
    }
}

/* whether k_wg_frag's out (thread t's d[i] at t n/2 + i) holds D[r][c] = mul r + c (mul: n, or given)
   at the places of the m64nNk16 D fragment (a copy to the host: it waits for the kernel) */
static bool frag_is(const float *out, int n, int mul = 0) {
    std::vector<float> h((size_t)(64 * n), -1.0f);
    cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost);
    for (int t = 0; t < 128; t++)
        for (int i = 0; i < n / 2; i++) {
            const int r = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1);
            const int c = 8 * (i >> 2) + 2 * (t % 4) + (i & 1);
            if (h[(size_t)t * (size_t)(n / 2) + (size_t)i] != (float)((mul ? mul : n) * r + c)) return false;
        }
    return true;
}

/* only part of the warpgroup reaches wgmma.fence (the others return), or a block of 64 threads */
__global__ void k_wg_partial(int keep) {
    if ((int)threadIdx.x >= keep) return;
    moept_emu_wgmma_fence();
}

/* The GEMM: C[M][128] = A[M][K] B[128][K]^T, bf16 in, fp32 out; A and B K-major in global memory,
   loaded by TMA in boxes of (span / 2) x 128 (K x rows, one swizzle span a row) into 2 stages of
   dynamic shared memory (stage s: A at 32768 s, B at 32768 s + 16384), full[s] (the producer's
   arrive.expect_tx and the TMA's bytes) and empty[s] (the 256 consumer threads) mbarriers; warpgroups
   0 and 1 each compute 64 rows with m64n128k16 (the descriptor's start advanced 32 bytes a k16 step
   within the swizzled row), warp 8's first thread produces. bug selects a broken variant. */
enum { HB_NONE, HB_ACC_READ, HB_ACC_WRITE, HB_SMEM_WRITE, HB_PHASE, HB_OUTSIDE, HB_BASE, HB_DIVERGE,
       HB_DIVERGE_KIND, HB_NO_WAIT };
__global__ void k_hgemm(const CUtensorMap tma, const CUtensorMap tmb, float *C, int M, int KT, int span,
                        int bug) {
    __shared__ uint64_t full[2], empty[2];
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x, mode = span == 128 ? 1 : span == 64 ? 2 : 3;
    if (t == 0) {
        for (int s = 0; s < 2; s++) {
            moept_emu_mbar_init(&full[s], 1);
            moept_emu_mbar_init(&empty[s], 256);
        }
        moept_emu_fence_mbar_init();
    }
    __syncthreads();
    if (t >= 256) {
        if (t == 256)
            for (int kt = 0; kt < KT; kt++) {
                const int s = kt % 2;
                moept_emu_mbar_wait(&empty[s], ((kt / 2) & 1) ^ 1);
                moept_emu_mbar_arrive_expect_tx(&full[s], (unsigned)(2 * 128 * span));
                moept_emu_tma_load_2d(sm + 32768 * s, &tma, kt * span / 2, 0, &full[s]);
                moept_emu_tma_load_2d(sm + 32768 * s + 16384, &tmb, kt * span / 2, 0, &full[s]);
            }
        return;
    }
    const int wg = t / 128;
    float d[64];
    for (int kt = 0; kt < KT; kt++) {
        const int s = kt % 2;
        if (bug != HB_NO_WAIT || kt != 1 || t != 9) moept_emu_mbar_wait(&full[s], (kt / 2) & 1);
        moept_emu_wgmma_fence();
        if (bug == HB_ACC_WRITE && kt == 1 && t == 3) d[5] = 0.0f;
        for (int ks = 0; ks < span / 32; ks++) {
            const char *a = sm + 32768 * s + wg * 64 * span + ks * 32, *b = sm + 32768 * s + 16384 + ks * 32;
            uint64_t da = hdesc(a, mode, 16, 8 * span), db = hdesc(b, mode, 16, 8 * span);
            if (bug == HB_PHASE) da = hdesc(a + 128, mode, 16, 8 * span);
            if (bug == HB_OUTSIDE) da = hdesc(sm + 65536, mode, 16, 8 * span);
            if (bug == HB_BASE) da = hdesc(a, mode, 16, 8 * span, 1);
            if (bug == HB_DIVERGE && t == 5) db += 2;
            if (bug == HB_DIVERGE_KIND && t == 70 && kt == 1) moept_emu_wgmma_commit();
            moept_emu_wgmma_bf16(d, 128, da, db, kt > 0 || ks > 0, 0, 0);
        }
        moept_emu_wgmma_commit();
        if (bug == HB_ACC_READ && kt == 0 && t == 1) C[0] = d[2];
        if (bug == HB_SMEM_WRITE && kt == 0 && t == 2) sm[16384 + 64] = 0;
        moept_emu_wgmma_wait(0);
        moept_emu_mbar_arrive(&empty[s]);
    }
    const int l = t % 128, w = l / 32, g = (l % 32) / 4, q = l % 4;
    for (int i = 0; i < 64; i++) {
        const int row = wg * 64 + 16 * w + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * q + (i & 1);
        if (row < M) C[row * 128 + col] = d[i];
    }
}

/* one TMA load of box (c0, c1) into dynamic shared memory, its raw bytes copied to out. With early, a
   thread reads the bytes before any thread waited on the mbarrier; with one_waits, thread 0 alone
   waits and a __syncthreads orders the others after it. dst_off: where the box lands. */
__global__ void k_tma_box(const CUtensorMap tm, char *out, int c0, int c1, int bytes, int dst_off, int early,
                          int one_waits) {
    __shared__ uint64_t bar;
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x;
    if (t == 0) moept_emu_mbar_init(&bar, 1);
    __syncthreads();
    if (t == 0) {
        moept_emu_mbar_arrive_expect_tx(&bar, (unsigned)bytes);
        moept_emu_tma_load_2d(sm + dst_off, &tm, c0, c1, &bar);
    }
    __syncthreads();
    if (early && t == 1) out[0] = sm[dst_off];
    if (!one_waits || t == 0) moept_emu_mbar_wait(&bar, 0);
    if (one_waits) __syncthreads();
    for (int i = t; i < bytes; i += blockDim.x) out[i] = sm[dst_off + i];
}

/* mbarrier misuse, one per case: 0 a second wait on a completed phase, 1 a TMA load before the bytes
   were expected (tx-count below zero), 2 an arrive on an uninitialised mbarrier, 3 a wait that never
   completes (count 2, one arrival), 4 an arrive by another thread with no barrier after the init, 5
   init count 0 */
__global__ void k_mbar_bad(const CUtensorMap tm, int what) {
    __shared__ uint64_t mb[2];
    char *sm = (char *)moept_emu_dyn_smem();
    const int t = threadIdx.x;
    if (what == 0 && t == 0) {
        moept_emu_mbar_init(&mb[0], 1);
        moept_emu_mbar_arrive(&mb[0]);
        moept_emu_mbar_wait(&mb[0], 0);
        moept_emu_mbar_wait(&mb[0], 0);
    }
    if (what == 1 && t == 0) {
        moept_emu_mbar_init(&mb[0], 1);
        moept_emu_tma_load_2d(sm, &tm, 0, 0, &mb[0]);
        moept_emu_mbar_arrive_expect_tx(&mb[0], 256);
        moept_emu_mbar_wait(&mb[0], 0);
    }
    if (what == 2 && t == 0) moept_emu_mbar_arrive(&mb[1]);
    if (what == 3) {
        if (t == 0) moept_emu_mbar_init(&mb[0], 2);
        __syncthreads();
        if (t == 0) moept_emu_mbar_arrive(&mb[0]);
        moept_emu_mbar_wait(&mb[0], 0);
    }
    if (what == 4) { /* (an empty wgmma group: it orders the threads' steps, not their memory) */
        if (t == 0) moept_emu_mbar_init(&mb[0], 2);
        moept_emu_wgmma_commit();
        if (t == 1) moept_emu_mbar_arrive(&mb[0]);
    }
    if (what == 5 && t == 0) moept_emu_mbar_init(&mb[0], 0);
    if (what >= 6 && t == 0) { /* the bytes expected alone, the TMA, then (7) the arrival */
        moept_emu_mbar_init(&mb[0], 1);
        moept_emu_mbar_expect_tx(&mb[0], 256);
        moept_emu_tma_load_2d(sm, &tm, 0, 0, &mb[0]);
        if (what == 7) moept_emu_mbar_arrive(&mb[0]);
        moept_emu_mbar_wait(&mb[0], 0);
    }
}

/* a store one byte past the launch's dynamic shared memory */
__global__ void k_dyn_past(int bytes) {
    char *sm = (char *)moept_emu_dyn_smem();
    if (threadIdx.x == 0) sm[bytes] = 1;
}

typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                              CUtensorMapFloatOOBfill);
static encode_fn g_encode;

/* a 2-D tensor map: rows x cols elements of es bytes at p (row pitch ld elements), box bc x br */
static CUresult tmap2(CUtensorMap *m, void *p, CUtensorMapDataType dt, int es, uint64_t cols, uint64_t rows,
                      uint64_t ld, unsigned bc, unsigned br, CUtensorMapSwizzle sw) {
    cuuint64_t dim[2] = {cols, rows}, str[1] = {ld * (uint64_t)es};
    cuuint32_t box[2] = {bc, br}, est[2] = {1, 1};
    return g_encode(m, dt, 2, p, dim, str, box, est, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                    CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

static void hopper_runtime() {
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    void *fn = nullptr;
    const char *sym = "cuTensorMapEncodeTiled";
    cudaError_t e = cudaGetDriverEntryPointByVersion(sym, &fn, 12000, cudaEnableDefault, &q);
    g_encode = (encode_fn)fn;
    result("driver entry point: cuTensorMapEncodeTiled at 12.0",
           e == cudaSuccess && fn && q == cudaDriverEntryPointSuccess, "not found");
    e = cudaGetDriverEntryPointByVersion(sym, &fn, 11080, cudaEnableDefault, &q);
    result("... asked as of 11.8: cudaSuccess, NULL, cudaDriverEntryPointVersionNotSufficent",
           e == cudaSuccess && !fn && q == cudaDriverEntryPointVersionNotSufficent, "another answer");
    e = cudaGetDriverEntryPointByVersion(sym, &fn, CUDART_VERSION + 10, cudaEnableDefault, &q);
    result("... a version past the driver's: cudaErrorInvalidValue", e == cudaErrorInvalidValue,
           cudaGetErrorString(e));
    cudaGetLastError();
    e = cudaGetDriverEntryPointByVersion("cuMemAlloc", &fn, 12000, cudaEnableDefault, &q);
    result("... another symbol: cudaSuccess, NULL, cudaDriverEntryPointSymbolNotFound",
           e == cudaSuccess && !fn && q == cudaDriverEntryPointSymbolNotFound, "another answer");
    expect_report("... and reported (not emulated)", "not emulated");
    if (!g_encode) return;

    /* cuTensorMapEncodeTiled's requirements (CUDA Driver API), each refused alone */
    void *g;
    cudaMalloc(&g, 1 << 20);
    struct Case {
        const char *name, *want;
        int dt;
        cuuint32_t rank;
        size_t addr_off, map_off;
        cuuint64_t dim0, dim1, stride;
        cuuint32_t box0, box1, est1;
        CUtensorMapInterleave il;
        CUtensorMapSwizzle sw;
        CUtensorMapFloatOOBfill oob;
    };
    const int BF = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const CUtensorMapInterleave IN = CU_TENSOR_MAP_INTERLEAVE_NONE;
    const CUtensorMapSwizzle S0 = CU_TENSOR_MAP_SWIZZLE_NONE, S128 = CU_TENSOR_MAP_SWIZZLE_128B;
    const CUtensorMapFloatOOBfill O0 = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
    const int F32 = CU_TENSOR_MAP_DATA_TYPE_FLOAT32, U16 = CU_TENSOR_MAP_DATA_TYPE_UINT16;
    const int U4 = CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B;
    const CUtensorMapInterleave I16 = CU_TENSOR_MAP_INTERLEAVE_16B;
    const CUtensorMapSwizzle S32 = CU_TENSOR_MAP_SWIZZLE_32B;
    const CUtensorMapFloatOOBfill ONAN = CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA;
    const Case cs[] = { /* name, the report's words; type, rank, offsets; dims, stride; box, estride; modes */
        {"a valid bf16 map (128B swizzle)", nullptr, BF, 2, 0, 0, 200, 100, 400, 64, 128, 1, IN, S128, O0},
        {"a valid fp32 map", nullptr, F32, 2, 0, 0, 24, 10, 96, 8, 4, 1, IN, S0, O0},
        {"tensorMap not 64-byte aligned", "aligned to 64", BF, 2, 0, 16, 200, 100, 400, 64, 128, 1, IN, S128,
         O0},
        {"tensorRank 0", "tensorRank", BF, 0, 0, 0, 200, 100, 400, 64, 128, 1, IN, S128, O0},
        {"tensorRank 6", "tensorRank", BF, 6, 0, 0, 200, 100, 400, 64, 128, 1, IN, S128, O0},
        {"globalAddress 8-byte aligned", "globalAddress", BF, 2, 8, 0, 200, 100, 400, 64, 128, 1, IN, S128,
         O0},
        {"globalDim 0", "globalDim", BF, 2, 0, 0, 200, 0, 400, 64, 128, 1, IN, S128, O0},
        {"globalDim 2^32 + 1", "globalDim", BF, 2, 0, 0, 200, (1ull << 32) + 1, 400, 64, 128, 1, IN, S128,
         O0},
        {"globalStrides not a multiple of 16", "globalStrides", BF, 2, 0, 0, 200, 100, 408, 64, 128, 1, IN,
         S128, O0},
        {"globalStrides 2^40", "globalStrides", BF, 2, 0, 0, 200, 100, 1ull << 40, 64, 128, 1, IN, S128, O0},
        {"globalStrides below its row's bytes", "below", BF, 2, 0, 0, 200, 100, 384, 64, 128, 1, IN, S128,
         O0},
        {"boxDim 257", "boxDim", BF, 2, 0, 0, 200, 300, 400, 64, 257, 1, IN, S128, O0},
        {"boxDim 0", "boxDim", BF, 2, 0, 0, 200, 100, 400, 0, 128, 1, IN, S128, O0},
        {"boxDim[0] of 8 bytes (not a multiple of 16)", "multiple of 16", BF, 2, 0, 0, 200, 100, 400, 4, 128,
         1, IN, S0, O0},
        {"elementStrides 9", "elementStrides", BF, 2, 0, 0, 200, 100, 400, 64, 128, 9, IN, S128, O0},
        {"elementStrides 0", "elementStrides", BF, 2, 0, 0, 200, 100, 400, 64, 128, 0, IN, S128, O0},
        {"a 256-byte box row with the 128B swizzle", "swizzle span", BF, 2, 0, 0, 200, 100, 400, 128, 128, 1,
         IN, S128, O0},
        {"a 64-byte box row with the 32B swizzle", "swizzle span", BF, 2, 0, 0, 200, 100, 400, 32, 128, 1, IN,
         S32, O0},
        {"interleave at rank 2", ">= 3", BF, 2, 0, 0, 200, 100, 400, 64, 128, 1, I16, S0, O0},
        {"the NaN fill on an integer type", "floating-point", U16, 2, 0, 0, 200, 100, 400, 64, 128, 1, IN,
         S128, ONAN},
        {"a packed 4-bit type", "not emulated", U4, 2, 0, 0, 256, 100, 400, 64, 128, 1, IN, S0, O0},
        {"tensorDataType 99", "not a type", 99, 2, 0, 0, 200, 100, 400, 64, 128, 1, IN, S0, O0},
    };
    alignas(128) static char maps[2 * sizeof(CUtensorMap)];
    for (const Case &c : cs) {
        cuuint64_t dim[6] = {c.dim0, c.dim1, 4, 4, 4, 4}, str[5] = {c.stride, c.stride * 4096, 0, 0, 0};
        for (int i = 2; i < 5; i++) str[i] = str[i - 1] * 4;
        cuuint32_t box[6] = {c.box0, c.box1, 1, 1, 1, 1}, est[6] = {1, c.est1, 1, 1, 1, 1};
        CUresult r = g_encode((CUtensorMap *)(maps + c.map_off), (CUtensorMapDataType)c.dt, c.rank,
                              (char *)g + c.addr_off, dim, str, box, est, c.il, c.sw,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, c.oob);
        char name[160];
        snprintf(name, sizeof name, "cuTensorMapEncodeTiled: %s %s", c.name,
                 c.want ? "is refused" : "is taken");
        result(name, c.want ? r == CUDA_ERROR_INVALID_VALUE : r == CUDA_SUCCESS, "another status");
        if (c.want) expect_report(name, c.want);
    }
    cudaFree(g);

    /* dynamic shared memory: 48 KiB without the attribute, up to sm_90's 227 KiB with it */
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    result("cudaDevAttrMaxSharedMemoryPerBlockOptin: 232448 (sm_90)", optin == 232448, "another value");
    float *p;
    cudaMalloc((void **)&p, 256);
    MOEPT__LAUNCH(k_fill, 1, 32, 49152, 0)(p, 0.0f, 64);
    result("a launch with 48 KiB of dynamic shared memory runs without the attribute",
           cudaGetLastError() == cudaSuccess, "refused");
    MOEPT__LAUNCH(k_fill, 1, 32, 49153, 0)(p, 0.0f, 64);
    result("... one byte more is refused (cudaErrorInvalidValue)",
           cudaGetLastError() == cudaErrorInvalidValue, "accepted");
    const cudaFuncAttribute MAXDYN = cudaFuncAttributeMaxDynamicSharedMemorySize;
    result("cudaFuncSetAttribute(MaxDynamicSharedMemorySize) above 232448 is refused",
           cudaFuncSetAttribute(k_fill, MAXDYN, 232449) == cudaErrorInvalidValue, "accepted");
    cudaGetLastError();
    result("... 232448 is taken", cudaFuncSetAttribute(k_fill, MAXDYN, 232448) == cudaSuccess, "refused");
    MOEPT__LAUNCH(k_fill, 1, 32, 232448, 0)(p, 0.0f, 64);
    result("... and the kernel launches with 232448 bytes", cudaGetLastError() == cudaSuccess, "refused");
    MOEPT__LAUNCH(k_copy, 1, 32, 65536, 0)(p, p + 32, 16);
    result("... another kernel still may not (the attribute is the kernel's)",
           cudaGetLastError() == cudaErrorInvalidValue, "accepted");
    result("cudaFuncSetAttribute of no function: cudaErrorInvalidDeviceFunction",
           cudaFuncSetAttribute((const void *)nullptr, MAXDYN, 1024) == cudaErrorInvalidDeviceFunction,
           "another status");
    cudaGetLastError();
    cudaDeviceSynchronize();
    expect_clean("... clean");
    cudaFree(p);
}

static float bfv(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* the GEMM with each swizzle: bitwise the fp32 reference summed in k order (the emulator's order), A's
   rows past M and K past 200 read as zeros (the TMA's out-of-bounds fill) */
static bool hgemm_run(int span, int bug, char *why, size_t len) {
    const int M = 100, N = 128, K = 200, BK = span / 2, KT = (K + BK - 1) / BK;
    std::vector<uint16_t> a((size_t)M * K), b((size_t)N * K);
    uint32_t s = 12345;
    for (auto *v : {&a, &b})
        for (uint16_t &x : *v) {
            s = s * 1664525u + 1013904223u;
            x = hbf((float)((int)(s >> 24) - 128) / 64.0f);
        }
    void *da, *db;
    float *dc;
    cudaMalloc(&da, a.size() * 2);
    cudaMalloc(&db, b.size() * 2);
    cudaMalloc((void **)&dc, (size_t)M * N * 4);
    cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
    CUtensorMapSwizzle sw = span == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                            : span == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;
    CUtensorMap ta, tb;
    CUresult r1 = tmap2(&ta, da, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, K, M, K, BK, 128, sw);
    CUresult r2 = tmap2(&tb, db, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, K, N, K, BK, 128, sw);
    cudaFuncSetAttribute(k_hgemm, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    MOEPT__LAUNCH(k_hgemm, 1, 288, 65536, 0)(ta, tb, dc, M, KT, span, bug);
    cudaError_t e = cudaGetLastError();
    std::vector<float> c((size_t)M * N);
    cudaMemcpy(c.data(), dc, c.size() * 4, cudaMemcpyDeviceToHost);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    if (r1 != CUDA_SUCCESS || r2 != CUDA_SUCCESS || e != cudaSuccess) {
        snprintf(why, len, "maps %d %d, launch %s", (int)r1, (int)r2, cudaGetErrorString(e));
        return false;
    }
    long bad = 0;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float ref = 0.0f;
            for (int k = 0; k < K; k++) ref += bfv(a[(size_t)i * K + k]) * bfv(b[(size_t)j * K + k]);
            if (c[(size_t)i * N + j] != ref && bad++ == 0)
                snprintf(why, len, "C[%d][%d] = %.9g, the reference %.9g", i, j, c[(size_t)i * N + j], ref);
        }
    return bad == 0;
}

/* each of n threads stores float i % m (m = n: each once; m = n / 2: each twice, by two threads) */
__global__ void k_store_mod(float *out, int m) { out[threadIdx.x % m] = (float)threadIdx.x; }
/* each thread stores byte i (a byte store) of p, i = t % m, and byte 128 + t % m of it */
__global__ void k_store_byte(char *p, int m) { p[threadIdx.x % m] = 1, p[128 + threadIdx.x % m] = 2; }
/* the bytes a launch stores again (moept_emu_stored_again, by kernel): whole floats and single bytes, each
   stored once, or twice by two threads, or the neighbours of a 2-byte granule each once */
static void stores_twice() {
    char *p;
    cudaMalloc((void **)&p, 256);
    long long n[4];
    for (int i = 0; i < 4; i++) {
        cudaDeviceSynchronize();
        moept_emu_counts_reset();
        if (i < 2) MOEPT__LAUNCH(k_store_mod, 1, 64, 0, 0)((float *)p, i ? 32 : 64);
        else MOEPT__LAUNCH(k_store_byte, 1, 64, 0, 0)(p, i == 2 ? 64 : 32);
        cudaDeviceSynchronize();
        n[i] = moept_emu_stored_again(i < 2 ? "k_store_mod" : "k_store_byte");
    }
    char why[120];
    snprintf(why, sizeof why, "again: %lld, %lld (floats), %lld, %lld (bytes)", n[0], n[1], n[2], n[3]);
    result("stored again: 64 floats once 0, 32 twice 128 bytes; 128 single bytes once 0, 64 twice 64",
           n[0] == 0 && n[1] == 128 && n[2] == 0 && n[3] == 64 && moept_emu_stored_again(NULL) == 64, why);
    cudaFree(p);
}

/* sm_89's FP8 conversions (cvt): pairs through .e4m3x2 and back, and f16 to f32 */
__global__ void k_cvt8(const float *in, int n, uint16_t *enc, const uint16_t *bytes, uint32_t *f16,
                       float *f32) {
    const int i = (int)threadIdx.x;
    if (i < n) enc[i] = moept_emu_cvt_e4m3x2_f32(in[2 * i], in[2 * i + 1]);
    if (i < 3) f16[i] = moept_emu_cvt_f16x2_e4m3x2(bytes[i]);
    if (i < 3) f32[i] = moept_emu_cvt_f32_f16(bytes[3 + i]);
}
/* hand-worked from the OCP FP8 E4M3 encoding and the PTX ISA's cvt (a's byte high): .rn's ties to the
   even code, .satfinite's sign-preserved 448 (0x7e) for 464, 1e9 and infinities and 0x7f for a NaN of
   either sign, zeros keeping the sign; each byte pair back to two f16, and f16 to f32 */
static void conversions() {
    const float in[16] = {1.0f, -1.0f, 448.0f, 1e9f, -INFINITY, NAN, -NAN, 464.0f, 0x1p-10f, -0x1p-10f,
                          0x3p-10f, 17.0f, 19.0f, 0x1.2p-6f, 0x1.ep-7f, 0x1.fp-7f};
    const uint16_t want[8] = {0x38b8, 0x7e7e, 0xfe7f, 0x7f7e, 0x0080, 0x0258, 0x5a09, 0x0808};
    const uint16_t bytes[6] = {0x7e01, 0x80ff, 0x38b9, 0x7fff, 0x5f00, 0x8000};
    const uint32_t w16[3] = {0x5f001800u, 0x80007fffu, 0x3c00bc80u};
    float *din, *f32;
    uint16_t *enc, *db;
    uint32_t *f16;
    cudaMalloc((void **)&din, sizeof in), cudaMalloc((void **)&enc, sizeof want);
    cudaMalloc((void **)&db, sizeof bytes), cudaMalloc((void **)&f16, 12), cudaMalloc((void **)&f32, 12);
    cudaMemcpy(din, in, sizeof in, cudaMemcpyHostToDevice);
    cudaMemcpy(db, bytes, sizeof bytes, cudaMemcpyHostToDevice);
    MOEPT__LAUNCH(k_cvt8, 1, 32, 0, 0)(din, 8, enc, db, f16, f32); /* (compute capability 8.0) */
    cudaDeviceSynchronize();
    expect_report("arch: cvt's .e4m3x2 forms on a device below sm_89 (its binary cannot hold them)",
                  "needs sm_89");
    setenv("MOEPT_EMU_CC", "90", 1);
    MOEPT__LAUNCH(k_cvt8, 1, 32, 0, 0)(din, 8, enc, db, f16, f32);
    cudaDeviceSynchronize();
    unsetenv("MOEPT_EMU_CC");
    expect_clean("cvt.rn.satfinite.e4m3x2.f32, cvt.rn.f16x2.e4m3x2 and cvt.f32.f16 on sm_90: clean");
    uint16_t got[8];
    uint32_t g16[3], g32[3];
    cudaMemcpy(got, enc, sizeof got, cudaMemcpyDeviceToHost);
    cudaMemcpy(g16, f16, sizeof g16, cudaMemcpyDeviceToHost);
    cudaMemcpy(g32, f32, sizeof g32, cudaMemcpyDeviceToHost);
    char why[200] = "";
    for (int i = 7; i >= 0; i--)
        if (got[i] != want[i])
            snprintf(why, sizeof why, "(%a, %a) -> 0x%04x, want 0x%04x", (double)in[2 * i],
                     (double)in[2 * i + 1], got[i], want[i]);
    result("... each pair's bytes: ties to even, saturation, NaN 0x7f, signed zeros", !*why, why);
    *why = 0;
    for (int i = 2; i >= 0; i--)
        if (g16[i] != w16[i])
            snprintf(why, sizeof why, "0x%04x -> 0x%08x, want 0x%08x", bytes[i], g16[i], w16[i]);
    result("... E4M3 pairs to f16 pairs: 448, 2^-9, -0, NaN 0x7fff, 1, -1.125", !*why, why);
    const uint32_t w32[3] = {0x7fffffffu, 0x43e00000u, 0x80000000u};
    *why = 0;
    for (int i = 2; i >= 0; i--)
        if (g32[i] != w32[i])
            snprintf(why, sizeof why, "0x%04x -> 0x%08x, want 0x%08x", bytes[3 + i], g32[i], w32[i]);
    result("... f16 to f32: NaN canonical 0x7fffffff, 448, -0", !*why, why);
    cudaFree(din), cudaFree(enc), cudaFree(db), cudaFree(f16), cudaFree(f32);
}

static void hopper_kernels() {
    char why[300] = "";
    /* the D fragment of m64n16k16, hand-worked from the PTX ISA's figure: thread lane l (warp w = l / 32,
       g = (l % 32) / 4, q = l % 4) holds d[i] = D[16 w + g + 8 ((i >> 1) & 1)][8 (i >> 2) + 2 q + (i & 1)],
       here D[r][c] = 16 r + c */
    float *out;
    cudaMalloc((void **)&out, 128 * 128 * 4);
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 0);
    std::vector<float> h(128 * 8);
    cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost);
    expect_clean("wgmma m64n16k16 from generic stores, fence.proxy.async, __syncthreads: clean");
    /* thread 0: rows 0, 8, cols 0, 1, 8, 9; thread 5: rows 1, 9, cols 2, 3, 10, 11; thread 37 (warp 1):
       rows 17, 25, cols 2, 3, 10, 11; thread 127 (warp 3, lane 31): rows 55, 63, cols 6, 7, 14, 15 */
    const float want[4][8] = {{0, 1, 128, 129, 8, 9, 136, 137},
                              {18, 19, 146, 147, 26, 27, 154, 155},
                              {274, 275, 402, 403, 282, 283, 410, 411},
                              {886, 887, 1014, 1015, 894, 895, 1022, 1023}};
    const int who[4] = {0, 5, 37, 127};
    bool ok = true;
    for (int x = 0; x < 4; x++)
        for (int i = 0; i < 8; i++) ok = ok && h[(size_t)who[x] * 8 + (size_t)i] == want[x][i];
    std::vector<int> seen(64 * 16, 0);
    for (float v : h)
        if (v >= 0 && v < 1024 && v == (int)v) seen[(size_t)v]++;
    for (int v : seen) ok = ok && v == 1;
    result("... the D fragment: threads 0, 5, 37, 127 hold the hand-worked elements, every element once", ok,
           "wrong layout");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 64, 3, 5);
    ok = frag_is(out, 64);
    expect_clean("wgmma with B N-major (imm-trans-b), stores fenced, bar.sync 1, 128: clean");
    result("... B laid out as the PTX ISA's worked example (MN-major, 64B swizzle, LBO 512, SBO 1024 bytes): "
           "every element of D", ok, "wrong MN-major layout");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 128, 1, 6);
    ok = frag_is(out, 128);
    expect_clean("wgmma m64n128k16 with B N-major in the 128B swizzle (the grouped kernel's): clean");
    result("... B in the canonical MN-major 128B layout (two atoms of 64 along N: LBO 2048, SBO 1024 bytes): "
           "every element of D", ok, "wrong MN-major layout");
    MOEPT__LAUNCH(k_wg_e4m3, 1, 128, 12288, 0)(out, 16, 0, 0);
    ok = frag_is(out, 16);
    expect_clean("wgmma m64n16k32 .e4m3, no swizzle (core matrices of 8 rows x 16 e4m3): clean");
    result("... every element of D (the k32 shape's D fragment is k16's)", ok, "wrong result");
    MOEPT__LAUNCH(k_wg_e4m3, 1, 128, 24576, 0)(out, 128, 1, 2);
    ok = frag_is(out, 128, 16);
    expect_clean("wgmma m64n128k32 .e4m3, the 128B swizzle's third k32 slice (the grouped kernel's layout): "
                 "clean");
    result("... every element of D", ok, "wrong result: another slice read");
    MOEPT__LAUNCH(k_bar, 1, 128, 0, 0)(1);
    cudaDeviceSynchronize();
    expect_report("synccheck: bar.sync with a count not of whole warps", "a multiple of 32");
    MOEPT__LAUNCH(k_bar, 1, 128, 0, 0)(2);
    cudaDeviceSynchronize();
    expect_report("synccheck: bar.sync's threads give different counts", "wait there with the count");
    MOEPT__LAUNCH(k_bar, 1, 128, 0, 0)(3);
    cudaDeviceSynchronize();
    expect_report("hang: half of bar.sync's threads return", "wait in bar.sync");
    MOEPT__LAUNCH(k_nbar_xchg, 1, 128, 0, 0)(0, out);
    std::vector<float> hx(128);
    cudaMemcpy(hx.data(), out, 128 * 4, cudaMemcpyDeviceToHost);
    expect_clean("shared memory exchanged within each half of the block through its own bar.sync: clean");
    ok = true;
    for (int t = 0; t < 128; t++) ok = ok && hx[(size_t)t] == (float)(16 * ((t ^ 1) / 4) + 6);
    result("... each thread holds its neighbour's group's sum", ok, "wrong sum");
    MOEPT__LAUNCH(k_nbar_xchg, 1, 128, 0, 0)(1, out);
    cudaDeviceSynchronize();
    expect_report("racecheck: words read that another half's barrier orders", "racecheck");
    MOEPT__LAUNCH(k_nbar_xchg, 1, 128, 0, 0)(2, out);
    cudaDeviceSynchronize();
    expect_report("racecheck: a word written again with no barrier after its group's reads", "racecheck");
    MOEPT__LAUNCH(k_nbar_many, 1, 128, 0, 0)(0, out);
    cudaMemcpy(hx.data(), out, 128 * 4, cudaMemcpyDeviceToHost);
    expect_clean("a word of 64 readers written again two barriers on (a double buffer): clean");
    ok = true;
    for (int t = 0; t < 128; t++) ok = ok && hx[(size_t)t] == 6.0f;
    result("... each thread read each step's word", ok, "wrong sum");
    MOEPT__LAUNCH(k_nbar_many, 1, 128, 0, 0)(1, out);
    cudaDeviceSynchronize();
    expect_report("racecheck: a word of 64 readers written again with no barrier after their reads",
                  "write after read");
    nbar_pair(MOEPT__KERNEL(k_nbar_late), out,
              "a word read by 4 threads, a barrier, 124 more, a barrier, then written: clean",
              "racecheck: ... written with no barrier after the readers past the first four");
    nbar_pair(MOEPT__KERNEL(k_nbar_hist), out,
              "a word read by all, the block's barrier, six of each half's own, then written: clean",
              "racecheck: ... without the block's barrier");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 2, 0);
    cudaDeviceSynchronize();
    expect_report("proxy: generic stores fenced but no barrier before the wgmma", "no barrier that it passed");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 4, 0);
    cudaDeviceSynchronize();
    expect_clean("wgmma after a fence and barrier, then another store fenced with no barrier: clean");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 0, 0);
    cudaDeviceSynchronize();
    expect_report("proxy: wgmma reads generic stores with no fence.proxy.async", "no fence.proxy.async");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 7);
    cudaDeviceSynchronize();
    expect_report("initcheck: wgmma reads a shared byte that nothing of the block wrote",
                  "that no thread or TMA load of the block wrote");
    MOEPT__LAUNCH(k_wg_handoff, 1, 256, 12288, 0)(out, 0);
    ok = frag_is(out, 16);
    expect_clean("wgmma by one warpgroup on another's stores, fenced, then an mbarrier arrival it waited on: "
                 "clean");
    result("... every element of D", ok, "wrong result");
    MOEPT__LAUNCH(k_wg_handoff, 1, 256, 12288, 0)(out, 1);
    cudaDeviceSynchronize();
    expect_report("proxy: another warpgroup's stores handed over by an mbarrier with no fence.proxy.async",
                  "no fence.proxy.async");
    MOEPT__LAUNCH(k_wg_handoff, 1, 256, 12288, 0)(out, 2);
    cudaDeviceSynchronize();
    expect_report("proxy: ... the fence after the mbarrier arrival (nothing orders it before the wgmma)",
                  "nor an mbarrier phase");
    MOEPT__LAUNCH(k_wg_handoff, 1, 256, 12288, 0)(out, 3);
    cudaDeviceSynchronize();
    expect_report("proxy: ... the consumers wait on an mbarrier only thread 0 arrived on (the others' stores "
                  "unordered)", "thread 1 stored, but no barrier");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 1);
    cudaDeviceSynchronize();
    expect_report("wgmma: accumulators written between wgmma.fence and wgmma.mma_async",
                  "since its last wgmma.fence");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 2);
    cudaDeviceSynchronize();
    expect_report("wgmma: an accumulator read before wgmma.wait_group retires the mma",
                  "while the wgmma.mma_async");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 3);
    cudaDeviceSynchronize();
    expect_report("wgmma: threads return with a wgmma.mma_async in flight", "in flight (no wgmma.wait_group");
    MOEPT__LAUNCH(k_wg_frag, 1, 128, 12288, 0)(out, 16, 1, 4);
    cudaDeviceSynchronize();
    expect_report("wgmma: N = 12 is no .m64nNk16 shape", "multiple of 8");
    MOEPT__LAUNCH(k_wg_partial, 1, 128, 0, 0)(64);
    cudaDeviceSynchronize();
    expect_report("wgmma: half a warpgroup reaches wgmma.fence (the others return)",
                  "not every thread of a warpgroup executes wgmma.fence");
    MOEPT__LAUNCH(k_wg_partial, 1, 64, 0, 0)(64);
    cudaDeviceSynchronize();
    expect_report("wgmma: a block of 64 threads has no whole warpgroup", "of the 128 threads");

    static const int spans[3] = {128, 64, 32};
    for (int sp : spans) {
        char name[160];
        snprintf(name, sizeof name, "TMA + mbarrier + wgmma GEMM 100x128x200, %dB swizzle, 2 stages: bitwise "
                 "the fp32 reference (rows and K past the tensor zero)", sp);
        bool good = hgemm_run(sp, HB_NONE, why, sizeof why);
        result(name, good, why);
        expect_clean("... clean");
    }
    struct Bug { int bug; const char *name, *want; };
    const Bug bugs[] = {
        {HB_ACC_READ, "wgmma: a thread reads its accumulator between commit and wait",
         "while the wgmma.mma_async"},
        {HB_ACC_WRITE, "wgmma: a thread writes an accumulator after wgmma.fence (next k-tile)",
         "since its last wgmma.fence"},
        {HB_SMEM_WRITE, "wgmma: a thread stores to an operand while the mma is in flight", "in flight reads"},
        {HB_PHASE, "wgmma: an A descriptor one 128-byte row into the 128B swizzle pattern",
         "base offset is 0"},
        {HB_OUTSIDE, "wgmma: an A descriptor past the launch's dynamic shared memory", "outside the block"},
        {HB_BASE, "wgmma: a non-zero base offset (not emulated)", "not emulated"},
        {HB_DIVERGE, "wgmma: one thread of the warpgroup passes another B descriptor",
         "must execute the same"},
        {HB_DIVERGE_KIND, "wgmma: one thread commits where the others issue an mma", "must execute the same"},
        {HB_NO_WAIT, "tma: a wgmma reads a TMA load's bytes one thread of its warpgroup did not wait for",
         "thread 9 did not wait on the mbarrier phase"},
    };
    for (const Bug &b : bugs) {
        hgemm_run(128, b.bug, why, sizeof why);
        expect_report(b.name, b.want);
    }
    cudaFree(out);

    /* TMA boxes: the swizzle layouts and the out-of-bounds fill */
    void *g;
    char *o;
    cudaMalloc(&g, 1 << 16);
    cudaMalloc((void **)&o, 4096);
    std::vector<uint16_t> v(4096);
    for (size_t i = 0; i < v.size(); i++) v[i] = (uint16_t)i;
    cudaMemcpy(g, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
    const struct { CUtensorMapSwizzle sw; int span; } sws[] = {
        {CU_TENSOR_MAP_SWIZZLE_128B, 128}, {CU_TENSOR_MAP_SWIZZLE_64B, 64}, {CU_TENSOR_MAP_SWIZZLE_32B, 32}};
    for (const auto &s : sws) {
        const int cols = s.span / 2; /* a row: one span */
        CUtensorMap m;
        tmap2(&m, g, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, (uint64_t)cols, 8, (uint64_t)cols, (unsigned)cols, 8,
              s.sw);
        MOEPT__LAUNCH(k_tma_box, 1, 64, 4096, 0)(m, o, 0, 0, 8 * s.span, 1024, 0, 0);
        std::vector<uint16_t> r((size_t)4 * s.span);
        cudaMemcpy(r.data(), o, r.size() * 2, cudaMemcpyDeviceToHost);
        /* the 16-byte chunk c of row j (bytes 16 c of the row at s.span j) lands at chunk c ^ (address bits
           7 and up, as many as the span has chunks); hand-worked: element 72 (byte 144) holds the first
           element of row 1 (128B: chunk 1 = 0 ^ 1), row 2 (64B: byte 128 is row 2, bits [7:8] = 1) and
           row 4 (32B: byte 128 is row 4, bit 7 = 1), which is element 64 each time */
        bool good = r[72] == 64 && r[0] == 0;
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < s.span / 16; c++) {
                const unsigned lin = (unsigned)(j * s.span + c * 16);
                const unsigned phys = lin ^ (((lin >> 7) & (unsigned)(s.span / 16 - 1)) << 4);
                for (unsigned e = 0; e < 8; e++) good = good && r[phys / 2 + e] == (uint16_t)(lin / 2 + e);
            }
        char name[120];
        snprintf(name, sizeof name, "TMA: the %dB swizzle layout (16-byte chunks XOR the address's row bits)",
                 s.span);
        result(name, good, "another layout");
    }
    {   /* fp32 [10][24], box 8 x 4 at (-4, 8): columns -4..-1 and rows 10, 11 are zeros, still 128 bytes */
        std::vector<float> f(240);
        for (int i = 0; i < 240; i++) f[(size_t)i] = (float)(i + 1);
        cudaMemcpy(g, f.data(), 240 * 4, cudaMemcpyHostToDevice);
        CUtensorMap m;
        tmap2(&m, g, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 24, 10, 24, 8, 4, CU_TENSOR_MAP_SWIZZLE_NONE);
        MOEPT__LAUNCH(k_tma_box, 1, 32, 1024, 0)(m, o, -4, 8, 128, 128, 0, 0);
        float r[32];
        cudaMemcpy(r, o, sizeof r, cudaMemcpyDeviceToHost);
        bool good = true;
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) {
                const int row = 8 + j, col = i - 4;
                const float w = row < 10 && col >= 0 ? (float)(row * 24 + col + 1) : 0.0f;
                good = good && r[j * 8 + i] == w;
            }
        result("TMA: out-of-bounds elements (a negative column, rows past the end) read as zeros, the box's "
               "full bytes complete the phase", good && r[4] == 193.0f && r[16] == 0.0f, "wrong box");
        expect_clean("... clean");
        MOEPT__LAUNCH(k_tma_box, 1, 32, 1024, 0)(m, o, 0, 0, 128, 128, 0, 1);
        cudaDeviceSynchronize();
        expect_clean("TMA: one thread waits, a __syncthreads orders the others after it: clean");
        MOEPT__LAUNCH(k_tma_box, 1, 32, 1024, 0)(m, o, 0, 0, 128, 128, 1, 0);
        cudaDeviceSynchronize();
        expect_report("tma: a thread reads the TMA's bytes before waiting on the mbarrier",
                      "before it waited");
        MOEPT__LAUNCH(k_tma_box, 1, 32, 1024, 0)(m, o, 0, 0, 128, 144, 0, 0);
        cudaDeviceSynchronize();
        expect_report("tma: a destination 16 bytes off 128-byte alignment", "not 128-byte aligned");
        CUtensorMap m128;
        tmap2(&m128, g, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, 64, 8, 64, 64, 8, CU_TENSOR_MAP_SWIZZLE_128B);
        MOEPT__LAUNCH(k_tma_box, 1, 32, 4096, 0)(m128, o, 0, 0, 1024, 128, 0, 0);
        cudaDeviceSynchronize();
        expect_report("tma: a 128B-swizzled destination off the pattern's 1024-byte repeat", "repeat");
        CUtensorMap m32;
        tmap2(&m32, g, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, 64, 8, 64, 16, 8, CU_TENSOR_MAP_SWIZZLE_32B);
        const struct { int what; const char *name, *want; } mb[] = {
            {0, "mbarrier: a second wait on a phase that already completed",
             "a second time in the same phase"},
            {1, "mbarrier: a TMA load before its bytes were expected (tx-count below zero)", "goes negative"},
            {2, "mbarrier: an arrive on an uninitialised mbarrier", "uninitialised mbarrier"},
            {3, "mbarrier: a wait that can never complete (count 2, one arrival): deadlock", "deadlock"},
            {4, "mbarrier: another thread arrives with no __syncthreads after the init", "no __syncthreads"},
            {5, "mbarrier: init count 0", "outside [1, 2^20 - 1]"},
            {6, "mbarrier: a TMA's bytes expected (mbarrier.expect_tx) but no arrival: deadlock", "deadlock"},
        };
        for (const auto &c : mb) {
            MOEPT__LAUNCH(k_mbar_bad, 1, 128, 1024, 0)(m32, c.what);
            cudaDeviceSynchronize();
            expect_report(c.name, c.want);
        }
        MOEPT__LAUNCH(k_mbar_bad, 1, 128, 1024, 0)(m32, 7);
        cudaDeviceSynchronize();
        expect_clean("mbarrier: a TMA's bytes expected alone before the copy, the arrival after: clean");
    }
    cudaFree(g);
    cudaFree(o);
    MOEPT__LAUNCH(k_dyn_past, 1, 32, 1024, 0)(1024);
    cudaError_t e = cudaDeviceSynchronize();
    expect_report("memcheck: a store past the launch's dynamic shared memory",
                  "past the launch's 1024 bytes");
    result("... faults: cudaErrorIllegalAddress (the context is lost)", e == cudaErrorIllegalAddress,
           cudaGetErrorString(e));
    moept_emu_recover(0);
}

int main() {
    kernels();
    lost_context();
    host_read();
    streams();
    released_at_once();
    copies();
    blas();
    blas_rules();
    lt_rules();
    nccl_unmatched(0);
    nccl_unmatched(1);
    nccl_dup_gpu();
    capture();
    capture_modes();
    hopper_runtime();
    hopper_kernels();
    conversions();
    stores_twice();
    return g_fail;
}
