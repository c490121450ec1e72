/* tools/cupti_trace.c - where a CUDA program's GPU time goes, on a machine
   without Nsight Systems: a CUDA injection library (the driver loads the
   file named by CUDA_INJECTION64_PATH and calls its InitializeInjection)
   that records, through CUPTI's activity API, every kernel, copy and memset
   and every CUDA runtime call, and writes them at exit as CSV to
   $CUPTI_TRACE (default cupti_trace.csv):

       kind,name,stream,start_ns,end_ns,bytes

   kind K (kernel), C (copy; name is its kind number), S (memset), R
   (runtime call; name is the call's). One clock for all rows, so a host
   call and the GPU work it waits for line up. tools/cupti_summary.py sums
   a layer step of it. Build (tools/gpu_prebuild.sh does, where CUPTI's
   headers are):

       cc -O2 -shared -fPIC -I$CUPTI/include tools/cupti_trace.c \
          -L$CUPTI/lib -l:libcupti.so.13 -Wl,-rpath,$CUPTI/lib -o cupti_trace.so

   Records CUPTI dropped (its buffers full) are counted in a last row,
   D,dropped,0,0,0,<count>.

   A tool, not part of the library: it prints and exits on CUPTI errors. */
#include <cupti.h>

#include <stdio.h>
#include <stdlib.h>

#define CUPTI_CK(call)                                                                  \
    do {                                                                                \
        CUptiResult r_ = (call);                                                        \
        if (r_ != CUPTI_SUCCESS) {                                                      \
            const char *s_ = "?";                                                       \
            cuptiGetResultString(r_, &s_);                                              \
            fprintf(stderr, "cupti_trace: %s: %s\n", #call, s_);                        \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

static FILE *trace_out;
static size_t trace_dropped;

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = (size_t)16 << 20;
    *buf = aligned_alloc(8, *size); /* NULL: CUPTI drops the records and counts them */
    *max_records = 0;
}

static void write_record(const CUpti_Activity *r) {
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        fprintf(trace_out, "K,\"%s\",%u,%llu,%llu,0\n", k->name, k->streamId, (unsigned long long)k->start,
                (unsigned long long)k->end);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
        fprintf(trace_out, "C,%u,%u,%llu,%llu,%llu\n", (unsigned)m->copyKind, m->streamId,
                (unsigned long long)m->start, (unsigned long long)m->end, (unsigned long long)m->bytes);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
        fprintf(trace_out, "S,memset,%u,%llu,%llu,%llu\n", m->streamId, (unsigned long long)m->start,
                (unsigned long long)m->end, (unsigned long long)m->bytes);
        break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
        const char *name = "?";
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        fprintf(trace_out, "R,%s,0,%llu,%llu,0\n", name, (unsigned long long)a->start,
                (unsigned long long)a->end);
        break;
    }
    default:
        break;
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid) {
    (void)size;
    CUpti_Activity *r = NULL;
    while (trace_out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) write_record(r);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) trace_dropped += dropped;
    free(buf);
}

static void trace_flush(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                        CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) cuptiActivityDisable(kinds[i]);
    if (!trace_out) return;
    fprintf(trace_out, "D,dropped,0,0,0,%zu\n", trace_dropped);
    fclose(trace_out);
    trace_out = NULL; /* a buffer CUPTI hands back later is freed unread */
}

int InitializeInjection(void) {
    const char *path = getenv("CUPTI_TRACE");
    trace_out = fopen(path ? path : "cupti_trace.csv", "w");
    if (!trace_out) return 0;
    fprintf(trace_out, "kind,name,stream,start_ns,end_ns,bytes\n");
    CUPTI_CK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    CUPTI_CK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME));
    atexit(trace_flush);
    return 1;
}
