/* test_abi: moept_abi_layout reports the layout the library was compiled
   with, and it is the one a caller compiling moept.h sees (sizeof and
   offsetof here, in the caller's translation unit), for every struct the
   header's MOEPT_ABI_STRUCTS lists; and the report lists every field of
   each struct (no hole between two listed fields, or at the end, that an
   unlisted field could fill; one that fits in what was a struct's tail
   padding, as an int after moept_config's last int, is not seen). Only the
   public API: linked with moept.o. */
#include "../moept.h"
#include "testutil.h"

#include <stddef.h>

/* An honest API: the calls that copy a CUDA layer's state into the layer's
   host buffers take a non-const layer (a const one would be written through a cast) */
_Static_assert(_Generic(&moept_routing,
                        moept_status (*)(moept_layer *, const int32_t **, const float **, const float **): 1,
                        default: 0), "moept_routing takes a const layer");
_Static_assert(_Generic(&moept_routing_grads, moept_status (*)(moept_layer *, const float **): 1, default: 0),
               "moept_routing_grads takes a const layer");

static char *report(void) {
    int64_t n = moept_abi_layout(NULL, 0);
    char *buf = malloc((size_t)n + 1);
    if (buf && moept_abi_layout(buf, n + 1) != n) buf[0] = '\0';
    return buf;
}

/* the text the library must report, from this translation unit's own sizeof/offsetof */
static void test_matches_header(void) {
    char *got = report(), want[16384];
    size_t n = 0;
    n += (size_t)snprintf(want + n, sizeof want - n, "abi %d\n", MOEPT_ABI_VERSION);
#define S(T) n += (size_t)snprintf(want + n, sizeof want - n, "struct %s %lld\n", #T, (long long)sizeof(T));
#define F(T, f) n += (size_t)snprintf(want + n, sizeof want - n, "field %s.%s %lld %lld\n", #T, #f, \
                                      (long long)offsetof(T, f), (long long)sizeof(((T *)0)->f));
    MOEPT_ABI_STRUCTS(S, F)
#undef S
#undef F
    EXPECT(n < sizeof want, "the expected text outgrew its buffer");
    if (got && strcmp(got, want) != 0) { /* the first line that differs */
        size_t i = 0;
        while (got[i] && got[i] == want[i]) i++;
        while (i > 0 && want[i - 1] != '\n') i--;
        EXPECT(0, "the library says \"%.*s\", the header here \"%.*s\"", (int)strcspn(got + i, "\n"),
               got + i, (int)strcspn(want + i, "\n"), want + i);
    }
    EXPECT(got != NULL, "no memory");
    free(got);
}

/* a short buffer: truncated, NUL-terminated, the whole length returned */
static void test_truncation(void) {
    int64_t n = moept_abi_layout(NULL, 0);
    char small[8];
    memset(small, 'x', sizeof small);
    EXPECT(n > 100, "report of %lld bytes", (long long)n);
    EXPECT(moept_abi_layout(small, sizeof small) == n, "the length depends on cap");
    EXPECT(memcmp(small, "abi ", 4) == 0 && small[7] == '\0', "truncated text not NUL-terminated");
    EXPECT(moept_abi_layout(small, 0) == n && small[0] == 'a', "cap 0 wrote");
}

/* every field listed: each field starts where the previous ends, up to the next's
   alignment (min(size, 8): scalars, pointers, int64 arrays), and the struct ends
   within its widest field's alignment of the last one */
static void test_complete(void) {
    char *got = report();
    char *save = NULL, name[128] = "", prev[200] = "";
    long long size = -1, end = 0, widest = 1;
    int structs = 0, fields = 0;
    for (char *line = strtok_r(got, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char f[200];
        long long off, sz;
        if (sscanf(line, "struct %127s %lld", name, &size) == 2) {
            structs++;
            end = 0, widest = 1, prev[0] = '\0';
        } else if (sscanf(line, "field %199s %lld %lld", f, &off, &sz) == 3) {
            long long align = sz < 8 ? sz : 8;
            fields++;
            EXPECT(strncmp(f, name, strlen(name)) == 0 && f[strlen(name)] == '.', "%s outside %s", f, name);
            EXPECT(off >= end && off - end < align, "%s at %lld: a gap of %lld after %s (unlisted field?)",
                   f, off, off - end, prev[0] ? prev : "the start");
            end = off + sz, widest = align > widest ? align : widest;
            snprintf(prev, sizeof prev, "%s", f);
            EXPECT(end <= size, "%s ends at %lld past sizeof %lld", f, end, size);
            /* the struct's last field: what follows must be padding only */
            const char *next = save && *save ? save : "";
            if (strncmp(next, "field ", 6) != 0)
                EXPECT(size - end < widest, "%s: %lld bytes after %s (unlisted field?)", name, size - end, f);
        } else if (strncmp(line, "abi ", 4) != 0) {
            EXPECT(0, "unreadable line \"%s\"", line);
        }
    }
    EXPECT(structs >= 5 && fields >= 40, "%d structs, %d fields", structs, fields);
    free(got);
}

int main(void) {
    RUN(test_matches_header);
    RUN(test_truncation);
    RUN(test_complete);
    return tu_done();
}
