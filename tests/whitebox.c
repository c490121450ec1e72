/* The white-box test programs of a build variant as one program: each of
   them includes moept.c to read its internals, and one by one they
   compiled it once each: 39 compiles of moept.c over the variants
   (docs/TESTING.md, "Times"). Here moept.c is compiled once for all; the
   Makefile links the program under each test's name (ln), and the name it
   runs as picks that test's main. The reference checker (moept_check.c, a
   test of the public API) is one of them in the variants, whose moept.c
   compile it shares too; the plain build's links moept.o. A file-scope
   name two tests share fails to compile here: give it the test's own name. */
#include "../moept.c"

#define WB_TESTS(X) X(test_props) X(test_grad) X(test_errors) X(test_ckpt) X(test_ep) X(test_fsdp) \
    X(test_refuse) X(test_slots) X(test_fp8)

#define main wb_main_test_props
#include "test_props.c"
#undef main
#define main wb_main_test_grad
#include "test_grad.c"
#undef main
#define main wb_main_test_errors
#include "test_errors.c"
#undef main
#define main wb_main_test_ckpt
#include "test_ckpt.c"
#undef main
#define main wb_main_test_ep
#include "test_ep.c"
#undef main
#define main wb_main_test_fsdp
#include "test_fsdp.c"
#undef main
#define main wb_main_test_refuse
#include "test_refuse.c"
#undef main
#undef TOK /* its sizes' names, which test_slots gives other values */
#undef DIM
#undef NB
#define main wb_main_test_slots
#include "test_slots.c"
#undef main
#define main wb_main_test_fp8
#include "test_fp8.c"
#undef main
#define main wb_main_moept_check
#include "moept_check.c"
#undef main

int main(int argc, char **argv) {
    const char *me = argc > 0 ? strrchr(argv[0], '/') : NULL;
    me = me ? me + 1 : argc > 0 ? argv[0] : "";
#define WB_RUN(t) if (strcmp(me, #t) == 0) return wb_main_##t();
    WB_TESTS(WB_RUN)
    if (strcmp(me, "moept_check") == 0) return wb_main_moept_check(argc, argv);
    fprintf(stderr, "whitebox: run it as one of its tests (a link named test_props, ...), not as %s\n", me);
    return 2;
}
