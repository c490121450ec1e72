/* test_fault: the lost-context path on one GPU, as a user meets it. A layer
   runs a good step; then a kernel of this program writes where no memory
   is, which loses the device's context (a sticky error: CUDA Runtime API,
   cudaGetLastError, and the cudaError descriptions: the process must be
   ended). From then on every call of the layer that needs the device fails
   with MOEPT_ERR_DEVICE and a message naming the lost context; a host copy
   that was current stays readable. On a real GPU the write goes to an
   unmapped address; the emulator faults on any access outside an
   allocation, so there it writes one element past a small one (a GPU
   would not fault on that: its allocations are rounded up). Without a
   device every check is skipped. Built by nvcc (build/test_fault) and on
   the emulated GPU (build/emu/test_fault). */
#include "../moept.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef MOEPT_EMU
#include "emu/emu.h"
#endif
#ifndef MOEPT__LAUNCH /* nvcc; the emulator's is in tests/emu/cuda_emu.h */
#define MOEPT__LAUNCH(k, g, b, smem, s) k<<<(g), (b), (smem), (s)>>>
#endif

__global__ void fault_write(float *p) { p[threadIdx.x] = 1.0f; }

static void test_fault(void) {
    moept_config cfg = {};
    cfg.family = MOEPT_FAMILY_MIXTRAL;
    cfg.hidden_size = 16;
    cfg.intermediate_size = 24;
    cfg.num_experts = 4;
    cfg.top_k = 2;
    cfg.max_tokens = 8;
    const int64_t D = cfg.hidden_size, T = 8;
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    moept_cuda_options o = {};
    o.stream = s;
    moept_layer *L = NULL;
    EXPECT(moept_create_cuda(&cfg, NULL, NULL, &o, &L) == MOEPT_OK, "create: %s", moept_last_error(NULL));
    if (!L) return;
    moept_init_params(L, 5);
    unsigned long long r = 3;
    float *h = (float *)malloc((size_t)(T * D) * sizeof(float)), *w = (float *)malloc((size_t)(4 * D) * 4);
    for (int64_t i = 0; i < T * D; i++) h[i] = (float)tu_rand(&r);
    float *x, *y, *dx, *small;
    cudaMalloc((void **)&x, (size_t)(T * D) * 4);
    cudaMalloc((void **)&y, (size_t)(T * D) * 4);
    cudaMalloc((void **)&dx, (size_t)(T * D) * 4);
    cudaMalloc((void **)&small, 4);
    cudaMemcpy(x, h, (size_t)(T * D) * 4, cudaMemcpyHostToDevice);
    moept_status st = moept_forward(L, x, T, y);
    if (!st) st = moept_backward(L, x, y, dx);
    if (!st) st = moept_get_param(L, "gate.weight", w, 4 * D); /* the host copy is current now */
    EXPECT(st == MOEPT_OK, "the good step: %s", moept_last_error(L));
#ifdef MOEPT_EMU
    float *bad = small + 1;
#else
    float *bad = (float *)(uintptr_t)16; /* no allocation is there */
#endif
    MOEPT__LAUNCH(fault_write, 1, 1, 0, s)(bad);
    cudaError_t e = cudaStreamSynchronize(s);
    EXPECT(e != cudaSuccess, "the faulting kernel's stream synchronized clean");
    /* the thread's last error holds the fault until read; the reset does not mend the context, which
       is what moept asks (tests/cuda_rules.txt: a GPU's answers after a fault) */
    cudaError_t g1 = cudaGetLastError();
    EXPECT(g1 != cudaSuccess, "the thread's last error did not hold the fault");
#ifdef MOEPT_EMU
    char rep[300];
    EXPECT(moept_emu_take_reports(rep, sizeof rep) >= 1, "the emulator saw no fault"); /* expected */
#endif
    double norm;
    moept_adamw opt = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f};
    const char *what[5] = {"forward", "backward", "zero_grad", "grad_norm", "adamw_step"};
    for (int k = 0; k < 5; k++) {
        st = k == 0 ? moept_forward(L, x, T, y) : k == 1 ? moept_backward(L, x, y, dx)
           : k == 2 ? moept_zero_grad(L) : k == 3 ? moept_grad_norm(L, &norm) : moept_adamw_step(L, &opt);
        EXPECT(st == MOEPT_ERR_DEVICE && strstr(moept_last_error(L), "context of device"),
               "after the fault, %s: %d (%s)", what[k], (int)st, moept_last_error(L));
    }
    /* the parameters' one home was the device: lost with it (a checkpoint is the way back) */
    st = moept_get_param(L, "gate.weight", w, 4 * D);
    EXPECT(st == MOEPT_ERR_DEVICE && strstr(moept_last_error(L), "context of device"),
           "after the fault, get_param: %d (%s)", (int)st, moept_last_error(L));
    moept_destroy(L); /* frees host memory; the device calls fail, as the context is gone */
    free(h);
    free(w);
}

int main(void) {
    if (moept_cuda_device_count() < 1) {
        tu_skip("cuda: a kernel fault loses the context: every later call ERR_DEVICE", "no CUDA device");
        return tu_done();
    }
    tu_run("cuda: a kernel fault loses the context: every later call ERR_DEVICE, a parameter read too",
           test_fault);
    return tu_done();
}
