/* cuda_rules: what CUDA answers to the calls the emulator has rules for,
   printed one line a case, so that a real GPU's answers and the emulated
   GPU's can be compared line by line (tests/cuda_rules.txt holds a real
   GPU's, with its date and device; make test runs build/emu/cuda_rules
   against it, tests/suites).

   capture: each case begins a capture on a non-blocking stream A of device
   0 in one mode, launches a kernel into it, makes one call (from this
   thread, or from a second thread in a given interaction mode: CUDA Runtime
   API, cudaThreadExchangeStreamCaptureMode), launches again and ends the
   capture. The line gives the call's error and cudaStreamEndCapture's
   (cudaErrorStreamCaptureInvalidated when the call broke the capture).
   fault: a kernel writes where no memory is (the emulator: its fault
   injection), then the calls made after a sticky error, each one's answer.

   usage: cuda_rules capture | fault        (no device: prints "skip") */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#ifdef MOEPT_EMU
#include "emu/emu.h"
#endif
#ifndef MOEPT__LAUNCH /* nvcc; the emulator's is in tests/emu/cuda_emu.h */
#define MOEPT__LAUNCH(k, g, b, smem, s) k<<<(g), (b), (smem), (s)>>>
#endif

__global__ void rules_nop(int *p) {
    if (p) p[threadIdx.x] = 1;
}

/* what a case has to hand: A captures, B is idle (non-blocking, device 0) */
typedef struct ctx {
    cudaStream_t a, b;
    cudaEvent_t done, ext; /* recorded on B before the capture: complete */
    int *dev, *pinned, *freeme, *made;
    int pageable[64];
} ctx;

/* the enum's name (the emulator's cudaGetErrorName gives a description) */
static const char *ename(cudaError_t e) {
    static char buf[4][32];
    static int i;
    switch (e) {
#define N(x) case x: return #x;
    N(cudaSuccess) N(cudaErrorInvalidValue) N(cudaErrorMemoryAllocation) N(cudaErrorInvalidResourceHandle)
    N(cudaErrorNotReady) N(cudaErrorIllegalAddress) N(cudaErrorLaunchFailure)
    N(cudaErrorStreamCaptureUnsupported) N(cudaErrorStreamCaptureInvalidated) N(cudaErrorStreamCaptureMerge)
    N(cudaErrorStreamCaptureUnmatched) N(cudaErrorStreamCaptureUnjoined) N(cudaErrorStreamCaptureIsolation)
    N(cudaErrorStreamCaptureImplicit) N(cudaErrorCapturedEvent) N(cudaErrorStreamCaptureWrongThread)
#undef N
    default:
        i = (i + 1) % 4;
        snprintf(buf[i], sizeof buf[i], "cudaError(%d)", (int)e);
        return buf[i];
    }
}

typedef cudaError_t (*action)(ctx *c);
static cudaError_t q_idle(ctx *c) { return cudaStreamQuery(c->b); }
static cudaError_t q_capturing(ctx *c) { return cudaStreamQuery(c->a); }
static cudaError_t sync_idle(ctx *c) { return cudaStreamSynchronize(c->b); }
static cudaError_t event_sync(ctx *c) { return cudaEventSynchronize(c->done); }
static cudaError_t dev_sync(ctx *c) { (void)c; return cudaDeviceSynchronize(); }
static cudaError_t malloc_(ctx *c) {
    int *p = NULL;
    cudaError_t e = cudaMalloc((void **)&p, 256);
    if (e == cudaSuccess) c->made = p; /* freed after the case, outside the capture */
    return e;
}
static cudaError_t free_(ctx *c) {
    cudaError_t e = cudaFree(c->freeme);
    if (e == cudaSuccess) c->freeme = NULL;
    return e;
}
static cudaError_t malloc_host(ctx *c) {
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, 256);
    if (e == cudaSuccess) cudaFreeHost(p);
    (void)c;
    return e;
}
static cudaError_t memcpy_sync(ctx *c) {
    return cudaMemcpy(c->dev, c->pageable, sizeof c->pageable, cudaMemcpyHostToDevice);
}
static cudaError_t copy_idle(ctx *c) {
    return cudaMemcpyAsync(c->dev, c->pinned, 256, cudaMemcpyHostToDevice, c->b);
}
static cudaError_t memset_idle(ctx *c) { return cudaMemsetAsync(c->dev, 0, 256, c->b); }
static cudaError_t launch_idle(ctx *c) {
    MOEPT__LAUNCH(rules_nop, 1, 32, 0, c->b)(c->dev);
    return cudaGetLastError();
}
static cudaError_t peek(ctx *c) { (void)c; return cudaPeekAtLastError(); }
static cudaError_t is_capturing(ctx *c) {
    cudaStreamCaptureStatus st;
    return cudaStreamIsCapturing(c->b, &st);
}
static cudaError_t get_device(ctx *c) {
    int d;
    (void)c;
    return cudaGetDevice(&d);
}
static cudaError_t set_device(ctx *c) { (void)c; return cudaSetDevice(0); }
static cudaError_t pointer_attr(ctx *c) {
    cudaPointerAttributes a;
    return cudaPointerGetAttributes(&a, c->dev);
}
static cudaError_t wait_external(ctx *c) { return cudaStreamWaitEvent(c->a, c->ext, 0); }
/* the query of an idle stream with the thread's mode relaxed around it */
static cudaError_t q_idle_relaxed(ctx *c) {
    cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
    cudaError_t e = cudaThreadExchangeStreamCaptureMode(&m);
    if (e == cudaSuccess) e = cudaStreamQuery(c->b);
    cudaThreadExchangeStreamCaptureMode(&m);
    return e;
}

static const struct { const char *name; action f; } actions[] = {
    {"cudaStreamQuery(idle)", q_idle},
    {"cudaStreamQuery(capturing)", q_capturing},
    {"cudaStreamSynchronize(idle)", sync_idle},
    {"cudaEventSynchronize(complete)", event_sync},
    {"cudaDeviceSynchronize", dev_sync},
    {"cudaMalloc", malloc_},
    {"cudaFree", free_},
    {"cudaMallocHost", malloc_host},
    {"cudaMemcpy(pageable H2D)", memcpy_sync},
    {"cudaMemcpyAsync(idle, pinned H2D)", copy_idle},
    {"cudaMemsetAsync(idle)", memset_idle},
    {"kernel launch(idle)", launch_idle},
    {"cudaPeekAtLastError", peek},
    {"cudaStreamIsCapturing(idle)", is_capturing},
    {"cudaGetDevice", get_device},
    {"cudaSetDevice(current)", set_device},
    {"cudaPointerGetAttributes", pointer_attr},
    {"cudaStreamWaitEvent(captured, external event)", wait_external},
    {"cudaStreamQuery(idle) in relaxed thread mode", q_idle_relaxed},
};

/* who captures in which mode, and who calls: "own <capture's mode>", the
   capturing thread; "other(<caller's mode>) in <capture's mode>", a second
   thread whose interaction mode is the first */
static const struct {
    const char *name;
    cudaStreamCaptureMode cap; /* the capture's mode */
    int other;                 /* 1: another thread calls, in interaction mode `mode` */
    cudaStreamCaptureMode mode;
} whos[] = {
    {"own thread-local", cudaStreamCaptureModeThreadLocal, 0, cudaStreamCaptureModeGlobal},
    {"own global", cudaStreamCaptureModeGlobal, 0, cudaStreamCaptureModeGlobal},
    {"own relaxed", cudaStreamCaptureModeRelaxed, 0, cudaStreamCaptureModeGlobal},
    {"other(global) in global", cudaStreamCaptureModeGlobal, 1, cudaStreamCaptureModeGlobal},
    {"other(global) in thread-local", cudaStreamCaptureModeThreadLocal, 1, cudaStreamCaptureModeGlobal},
    {"other(thread-local) in global", cudaStreamCaptureModeGlobal, 1, cudaStreamCaptureModeThreadLocal},
};

static void drain_reports(void) {
#ifdef MOEPT_EMU
    char buf[300];
    moept_emu_take_reports(buf, sizeof buf); /* a refused call is reported: expected here */
#endif
}

static void one_case(ctx *c, int w, int k) {
    cudaGraph_t g = NULL;
    cudaError_t call = cudaSuccess, end;
    cudaEventRecord(c->ext, c->b);
    cudaStreamSynchronize(c->b);
    cudaStreamBeginCapture(c->a, whos[w].cap);
    MOEPT__LAUNCH(rules_nop, 1, 32, 0, c->a)(c->dev);
    if (!whos[w].other) {
        call = actions[k].f(c);
    } else {
        std::thread t([&] {
            cudaSetDevice(0);
            cudaStreamCaptureMode m = whos[w].mode;
            cudaThreadExchangeStreamCaptureMode(&m);
            call = actions[k].f(c);
            cudaGetLastError();
        });
        t.join();
    }
    MOEPT__LAUNCH(rules_nop, 1, 32, 0, c->a)(c->dev);
    end = cudaStreamEndCapture(c->a, &g);
    printf("capture %-30s %-47s call=%s end=%s\n", whos[w].name, actions[k].name, ename(call), ename(end));
    if (g) cudaGraphDestroy(g);
    cudaFree(c->made);
    c->made = NULL;
    cudaDeviceSynchronize();
    cudaGetLastError();
    drain_reports();
}

static int capture_rules(void) {
    ctx c;
    memset(&c, 0, sizeof c);
    cudaStreamCreateWithFlags(&c.a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&c.b, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&c.ext, cudaEventDisableTiming);
    cudaMalloc((void **)&c.dev, 256);
    cudaMallocHost((void **)&c.pinned, 256);
    cudaEventRecord(c.done, c.b);
    cudaDeviceSynchronize();
    for (int w = 0; w < (int)(sizeof whos / sizeof whos[0]); w++)
        for (int k = 0; k < (int)(sizeof actions / sizeof actions[0]); k++) {
            if (!c.freeme) cudaMalloc((void **)&c.freeme, 256);
            one_case(&c, w, k);
        }
    cudaFree(c.freeme);
    cudaFree(c.dev);
    cudaFreeHost(c.pinned);
    cudaEventDestroy(c.done);
    cudaEventDestroy(c.ext);
    cudaStreamDestroy(c.a);
    cudaStreamDestroy(c.b);
    return 0;
}

/* after a kernel's fault (sticky): what each call answers */
static int fault_rules(void) {
    cudaStream_t a, b;
    int *p = NULL, h[4] = {0};
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
    cudaMalloc((void **)&p, 256);
    cudaDeviceSynchronize();
#ifdef MOEPT_EMU
    moept_emu_fault_next_kernel(0);
    MOEPT__LAUNCH(rules_nop, 1, 32, 0, a)(p);
#else
    MOEPT__LAUNCH(rules_nop, 1, 32, 0, a)((int *)(uintptr_t)16); /* no allocation is there */
#endif
    const char *name[] = {"cudaStreamSynchronize(faulted)", "cudaGetLastError", "cudaGetLastError again",
                          "cudaPeekAtLastError", "cudaStreamQuery(idle)", "cudaMalloc", "cudaMemcpy(D2H)",
                          "cudaPeekAtLastError after those"};
    for (int i = 0; i < 8; i++) {
        cudaError_t e;
        int *q = NULL;
        switch (i) {
        case 0: e = cudaStreamSynchronize(a); break;
        case 1: case 2: e = cudaGetLastError(); break;
        case 3: case 7: e = cudaPeekAtLastError(); break;
        case 4: e = cudaStreamQuery(b); break;
        case 5: e = cudaMalloc((void **)&q, 256); break;
        default: e = cudaMemcpy(h, p, sizeof h, cudaMemcpyDeviceToHost); break;
        }
        printf("fault %-40s %s\n", name[i], ename(e));
    }
    drain_reports();
    return 0;
}

int main(int argc, char **argv) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("skip - cuda_rules: no device\n");
        return 0;
    }
    cudaSetDevice(0);
    if (argc == 2 && !strcmp(argv[1], "capture")) return capture_rules();
    if (argc == 2 && !strcmp(argv[1], "fault")) return fault_rules();
    fprintf(stderr, "usage: cuda_rules capture | fault\n");
    return 2;
}
