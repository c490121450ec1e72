# moept: `make run` trains the example on the CPU, `make test` runs every test.
# Needs only a C11 compiler and make; OpenBLAS, OpenMP, MPI and CUDA are
# used when found (and the tests that need them say "skip" otherwise).

CC      ?= cc
ARCH    ?= -march=native
OPT     ?= -O2
CFLAGS  ?= $(OPT) $(ARCH) -g
WARN     = -std=c11 -Wall -Wextra -Wshadow -Wno-unknown-pragmas
LDLIBS   = -lm -pthread
B        = build

# OpenMP if the compiler has it (threads in the builtin GEMM and the stages)
OMP := $(shell printf 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
# OpenBLAS for the MOEPT_CBLAS build, if installed
CBLAS_LIBS := $(shell printf 'int main(void){float a=0;cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,1,1,1,1,&a,1,&a,1,0,&a,1);return 0;}' | $(CC) -include cblas.h -x c - -lopenblas -o /dev/null 2>/dev/null && echo -lopenblas)

# MPI (Open MPI's mpicc), if installed
MPICC := $(shell command -v mpicc 2>/dev/null)
MPIRUN := $(shell command -v mpirun 2>/dev/null)

# CUDA: nvcc from CUDA_HOME (or PATH), NCCL from NCCL_HOME (or next to CUDA),
# each confirmed by a test compile. Override CUDA_ARCHS for other GPUs.
NVCC_PATH := $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC_PATH),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC_PATH))),/usr/local/cuda)
NVCC := $(wildcard $(CUDA_HOME)/bin/nvcc)
NCCL_HOME ?= $(CUDA_HOME)
CUDA_INC = $(sort -I$(CUDA_HOME)/include -I$(NCCL_HOME)/include)
CUDA_LIBDIRS = $(foreach d,$(sort $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib $(NCCL_HOME)/lib64 $(NCCL_HOME)/lib)),-L$(d) -Wl,-rpath,$(d))
CUDA_OK := $(if $(NVCC),$(shell printf '\043include <nccl.h>\n\043include <cublas_v2.h>\nint main(void){int v;return (int)ncclGetVersion(&v)+(int)cublasCreate(0);}' | $(CC) -x c - $(CUDA_INC) $(CUDA_LIBDIRS) -lnccl -lcublas -lcudart -o /dev/null 2>/dev/null && echo yes))
CUDA_ARCHS ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90
# NVCC_DEFS: -D options for the kernels' unit alone (tools/gpu_prebuild.sh: the grouped kernel's variants)
NVCCFLAGS ?= -O3 -std=c++17 --fmad=false -Xcompiler -Wall,-Wextra,-Wno-unknown-pragmas $(CUDA_ARCHS) $(NVCC_DEFS)
CUDA_LIBS = $(CUDA_LIBDIRS) -lcudart -lcublas -lcublasLt -lnccl -lstdc++

# the emulated GPU (tests/emu; rules at the end): needs only the CUDA, cuBLAS and NCCL headers
EMU_INC  := $(shell for d in $(CUDA_HOME)/include /usr/local/cuda/include /usr/include; do [ -f $$d/cuda_runtime.h ] && [ -f $$d/cublas_v2.h ] && echo -I$$d && break; done) $(if $(wildcard $(NCCL_HOME)/include/nccl.h),-I$(NCCL_HOME)/include)
EMU_OK   := $(if $(EMU_INC),$(shell printf '\043include <cuda_runtime.h>\n\043include <cublas_v2.h>\n\043include <nccl.h>\nint main(void){return 0;}' | $(CXX) -x c++ - $(EMU_INC) -o /dev/null 2>/dev/null && echo yes))
CXX     ?= g++
# -ffp-contract=off: no a * b + c fused where the target has FMA (g++'s C++ default), as nvcc's --fmad=false
EMU_CXX  = $(CXX) -std=c++17 -g -Wall -Wextra -Wno-unknown-pragmas -ffp-contract=off $(EMU_INC)
EMU_SRC  = tests/emu/emu_rt.cc tests/emu/emu_kernel.cc tests/emu/emu_blas.cc tests/emu/emu_lt.cc \
           tests/emu/emu_nccl.cc tests/emu/emu_hopper.cc
EMU_HDRS = tests/emu/emu_internal.h tests/emu/emu.h tests/emu/cuda_emu.h
# -fno-tree-sra: a 16-byte vector access stays one access (g++ would split it into its fields)
EMU_KFLAGS = -x c++ -include tests/emu/cuda_emu.h -fsanitize=thread --param tsan-instrument-func-entry-exit=0 \
             -fno-tree-sra
EMU_LIBS = -lstdc++ -lm -pthread


SAN = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

HDRS    = moept.h


.PHONY: bench-busy cuda emu emu-lib all test test-build test-build-stage check stress run bench bench-scenarios bench-layer bench-a2a bench-load bench-reshard fuzz fuzz-safetensors fuzz-config clean info check-cases sanitize cblas-test valgrind

# (train_mpi where mpicc is found: the README's mpirun lines run it; the test programs: below)
all: info $(B)/moept_check $(B)/train $(if $(MPICC),$(B)/train_mpi) $(B)/bench_layer $(B)/bench_a2a $(B)/bench_load $(B)/bench_reshard $(B)/bench_scenario $(B)/plan

info:
	@echo "moept build: CC=$(CC) openmp=$(if $(OMP),yes,no) openblas=$(if $(CBLAS_LIBS),yes,no) mpi=$(if $(MPICC),yes,no) cuda=$(if $(CUDA_OK),$(CUDA_HOME) (nvcc + cuBLAS + NCCL),no)"

$(B):
	@mkdir -p $(B)

$(B)/moept.o: moept.c $(HDRS) | $(B)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -c moept.c -o $@

$(B)/moept_check: tests/moept_check.c tests/testutil.h $(B)/moept.o
	$(CC) $(CFLAGS) $(WARN) $(OMP) $< $(B)/moept.o -o $@ $(LDLIBS)

# A white-box program (one that includes moept.c: it reads the internals) is one
# translation unit, compiled as the whole program where the compiler can: what
# it does not reach is not compiled (docs/TESTING.md, "Times"; the same C and
# no -ffast-math, so the same answers); a test of the public API links the
# build's moept.o.
WHOLE := $(shell printf 'int main(void){return 0;}' | $(CC) -Werror -fwhole-program -x c - -o /dev/null \
    2>/dev/null && echo -fwhole-program)
linked = $(if $(shell grep -l '^.include "\.\./moept\.c"' $(1)),$(WHOLE),$(2))

$(B)/test_%: tests/test_%.c $(B)/moept.o $(HDRS) tests/testutil.h tests/tu_exec.h
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $< $(call linked,$<,$(B)/moept.o) -o $@ $(LDLIBS)

# The white-box programs but test_alloc as one program a build (tests/whitebox.c: moept.c compiled
# once for them all, not once each), linked under each one's name; its name picks the test.
WB = test_props test_grad test_errors test_ckpt test_ep test_fsdp test_refuse test_slots test_fp8
WB_DEPS = tests/whitebox.c $(patsubst %,tests/%.c,$(WB)) tests/moept_check.c moept.c $(HDRS) \
          tests/testutil.h tests/tu_exec.h

$(B)/whitebox: $(WB_DEPS) | $(B)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $(WHOLE) $< -o $@ $(LDLIBS)

$(addprefix $(B)/,$(WB)): $(B)/whitebox
	ln -f $< $@

# every allocation through MOEPT_MALLOC/MOEPT_FREE: test_alloc poisons malloc, free & co., so a direct
# call in moept.c fails to compile; its MPI and CUDA code is compiled the same way where they build
$(B)/test_alloc: tests/test_alloc.c moept.c $(HDRS) tests/testutil.h | $(B)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $(WHOLE) -Werror=implicit-function-declaration $< -o $@ \
	    $(LDLIBS)
	$(if $(MPICC),$(MPICC) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_MPI -Werror=implicit-function-declaration \
	    -fsyntax-only $<)
	$(if $(EMU_OK),$(CC) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA $(EMU_INC) \
	    -Werror=implicit-function-declaration -fsyntax-only $<)

# The test variants, a directory each: DIR, compiler, flags, libraries. DIR/moept.o is
# compiled once, where a public-API test links it; moept_check is the white-box program's.
define variant
$(B)/$(1)/moept.o: moept.c $(HDRS)
	@mkdir -p $$(@D)
	$(2) $(3) $(WARN) -c moept.c -o $$@

$(B)/$(1)/test_%: tests/test_%.c $(B)/$(1)/moept.o $(HDRS) tests/testutil.h tests/tu_exec.h
	$(2) $(3) $(WARN) -D_DEFAULT_SOURCE $$< $$(call linked,$$<,$(B)/$(1)/moept.o) -o $$@ $(LDLIBS) $(4)

$(B)/$(1)/whitebox: $(WB_DEPS)
	@mkdir -p $$(@D)
	$(2) $(3) $(WARN) -D_DEFAULT_SOURCE $(WHOLE) $$< -o $$@ $(LDLIBS) $(4)

$(addprefix $(B)/$(1)/,$(WB) moept_check): $(B)/$(1)/whitebox
	ln -f $$< $$@
endef
# ASan + UBSan at -O0: a third of -O1's compile time (UBSan's checks are
# most of it), twice the run time, and nothing optimized out of the checks
$(eval $(call variant,san,$(CC),-O0 -g $(OMP) $(SAN)))
$(eval $(call variant,cblas,$(CC),$(CFLAGS) $(OMP) -DMOEPT_CBLAS,$(CBLAS_LIBS)))
# valgrind: a plain build (no OpenMP: libgomp's pool reads as leaks)
$(eval $(call variant,vg,$(CC),-O1 -g))
# ThreadSanitizer over the threads backend (no OpenMP: libgomp is not instrumented)
$(eval $(call variant,tsan,$(CC),-O1 -g -fsanitize=thread))

$(B)/mpi/moept.o: moept.c $(HDRS)
	@mkdir -p $(@D)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI -c moept.c -o $@

$(B)/moept_check_mpi: tests/moept_check.c tests/testutil.h $(B)/mpi/moept.o
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI $< $(B)/mpi/moept.o -o $@ $(LDLIBS)

# the same with 7-element message chunks and a tiny "INT_MAX": every
# large-count path (chunked pieces, chunked all-reduce, p2p all-gather) runs
$(B)/moept_check_mpi_chunked: tests/moept_check.c tests/testutil.h moept.c $(HDRS) | $(B)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI -DMOEPT__MPI_CHUNK=7 -DMOEPT__MPI_INT_MAX=5 tests/moept_check.c moept.c -o $@ $(LDLIBS)

$(B)/test_%_mpi: tests/test_%.c $(B)/mpi/moept.o $(HDRS) tests/testutil.h
	$(MPICC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_MPI $< $(call linked,$<,$(B)/mpi/moept.o) -o $@ \
	    $(LDLIBS)

# the kill -9 loop's worker (tests/crash.sh)
$(B)/crash_save: tests/crash_save.c tests/testutil.h moept.c $(HDRS) | $(B)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $(WHOLE) $< -o $@ $(LDLIBS)

$(B)/crash_save_mpi: tests/crash_save.c tests/testutil.h moept.c $(HDRS) | $(B)
	$(MPICC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $(WHOLE) -DMOEPT_MPI $< -o $@ $(LDLIBS)

$(B)/train_mpi: examples/train.c $(B)/mpi/moept.o
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI $< $(B)/mpi/moept.o -o $@ $(LDLIBS)

# a shared library for bindings (moept_torch.py loads it through ctypes)
$(B)/libmoept.so: moept.c $(HDRS) | $(B)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -fPIC -shared moept.c -o $@ $(LDLIBS)

$(B)/train: examples/train.c $(B)/moept.o
	$(CC) $(CFLAGS) $(WARN) $(OMP) $< $(B)/moept.o -o $@ $(LDLIBS)

# The benchmarks as one program (bench/benches.c: moept.c compiled once for all five), linked under
# each one's name; its name picks the benchmark. With OpenBLAS found, bench_layer also times the floor
# through OpenBLAS, same process. (make bench's other builds compile a benchmark's file alone.)
BENCHES = bench_layer bench_a2a bench_load bench_reshard bench_scenario
$(B)/benches: bench/benches.c $(patsubst %,bench/%.c,$(BENCHES)) bench/peak.h bench/bench_shape.h \
              bench/bench_threads.h moept.c $(HDRS) | $(B)
	$(CC) $(CFLAGS) $(WARN) $(OMP) $(if $(CBLAS_LIBS),-DBENCH_CBLAS) $< -o $@ $(LDLIBS) $(CBLAS_LIBS)

$(addprefix $(B)/,$(BENCHES)): $(B)/benches
	ln -f $< $@

$(B)/bench_adamw: bench/bench_adamw.c $(B)/moept.o
	$(CC) $(CFLAGS) $(WARN) $(OMP) $< $(B)/moept.o -o $@ $(LDLIBS)

$(B)/hf_resave: tools/hf_resave.c $(B)/moept.o
	$(CC) $(CFLAGS) $(WARN) $(OMP) $< $(B)/moept.o -o $@ $(LDLIBS)

$(B)/bench_scenario_mpi: bench/bench_scenario.c moept.c $(HDRS) | $(B)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI $< -o $@ $(LDLIBS)

# the planner (tools/plan.c): memory, bytes and time per step at cluster scale, and one layer's bytes by
# kind (linked with moept.o: --check holds that model to layers it makes)
$(B)/plan: tools/plan.c $(B)/moept.o
	$(CC) $(CFLAGS) $(WARN) $(OMP) $< $(B)/moept.o -o $@ $(LDLIBS)

$(B)/bench_a2a_mpi: bench/bench_a2a.c moept.c $(HDRS) | $(B)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_MPI $< -o $@ $(LDLIBS)

# the builtin GEMM against the measured FMA peak and OpenBLAS (when found), same run
$(B)/bench_gemm: bench/bench_gemm.c bench/peak.h bench/bench_shape.h moept.c $(HDRS) | $(B)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) $(if $(CBLAS_LIBS),-DBENCH_CBLAS) $< -o $@ $(LDLIBS) $(CBLAS_LIBS)

$(B)/cblas/bench_layer: bench/bench_layer.c bench/peak.h bench/bench_shape.h moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/cblas
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CBLAS $< -o $@ $(LDLIBS) $(CBLAS_LIBS)

# CUDA executor: nvcc with the ptxas report kept (tests/check_ptxas.sh reads
# it: no kernel may spill to local memory); moept.c with -DMOEPT_CUDA.
$(B)/cuda/moept_kernels.o: moept_kernels.cu moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/cuda
	$(NVCC) $(NVCCFLAGS) -Xcompiler -fPIC -Xptxas -v -c moept_kernels.cu -o $@ 2> $(B)/cuda/ptxas.txt || \
	    { cat $(B)/cuda/ptxas.txt; exit 1; }
	@grep -v '^ptxas info' $(B)/cuda/ptxas.txt >&2 || true

$(B)/cuda/ptxas.txt: $(B)/cuda/moept_kernels.o ;

# the CUDA layers' shared library for moept_torch.py (CPU layers too); the kernels' object is
# position-independent for it (the programs link it as well)
$(B)/libmoept_cuda.so: moept.c $(B)/cuda/moept_kernels.o $(HDRS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -fPIC -shared -DMOEPT_CUDA $(CUDA_INC) moept.c $(B)/cuda/moept_kernels.o \
	    -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/cuda/moept.o: moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/cuda
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(CUDA_INC) -c moept.c -o $@

CUDA_OBJS = $(B)/cuda/moept.o $(B)/cuda/moept_kernels.o

$(B)/moept_check_cuda: tests/moept_check.c tests/testutil.h $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/test_cuda: tests/test_cuda.c tests/testutil.h $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/test_slots_cuda: tests/test_slots.c tests/testutil.h tests/tu_exec.h $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/test_refuse_cuda: tests/test_refuse.c tests/testutil.h tests/tu_exec.h $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/train_cuda: examples/train.c $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

# a kernel of the test's own loses the context (tests/test_fault.cu)
$(B)/test_fault: tests/test_fault.cu tests/testutil.h $(CUDA_OBJS)
	$(NVCC) $(NVCCFLAGS) -Itests -c tests/test_fault.cu -o $(B)/cuda/test_fault.o
	$(CC) $(CFLAGS) $(OMP) $(B)/cuda/test_fault.o $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

# the FP8 white boxes, test_q8 (FP8's quantizers, and the kernel form's fused ones against the separate
# passes, bitwise) and bench_q8 (the quantizing passes against a copy), one program (tests/q8.cu: the
# kernels' unit included once for both, so moept.o alone beside it) linked under each name: config.fp8
# runs on compute capability 9.0 alone, so sm_90a code alone (a CUDA_ARCHS given on the command line wins)
Q8_DEPS = tests/q8.cu tests/test_q8.cu bench/bench_q8.cu bench/bench_shape.h tests/testutil.h moept_kernels.cu \
          moept.c $(HDRS)
$(B)/cuda/q8: CUDA_ARCHS = -gencode arch=compute_90a,code=sm_90a
$(B)/cuda/q8: $(Q8_DEPS) $(B)/cuda/moept.o
	$(NVCC) $(NVCCFLAGS) -Itests -c tests/q8.cu -o $(B)/cuda/q8.o
	$(CC) $(CFLAGS) $(OMP) $(B)/cuda/q8.o $(B)/cuda/moept.o -o $@ $(CUDA_LIBS) $(LDLIBS)

$(B)/test_q8_cuda $(B)/bench_q8_cuda: $(B)/cuda/q8
	ln -f $< $@

# CUDA's answers to the calls the emulator has rules for (tests/cuda_rules.txt: a real GPU's)
$(B)/cuda_rules: tests/cuda_rules.cu | $(B)
	$(NVCC) $(NVCCFLAGS) tests/cuda_rules.cu -o $@

# cuBLASLt's answers to block-scaled FP8 matmuls (tests/lt_rules.txt: a real GPU's)
$(B)/lt_rules: tests/lt_rules.cu | $(B)
	@mkdir -p $(B)/cuda
	$(NVCC) $(NVCCFLAGS) -c tests/lt_rules.cu -o $(B)/cuda/lt_rules.o
	$(CC) $(B)/cuda/lt_rules.o -o $@ $(CUDA_LIBDIRS) -lcublasLt -lcudart -lstdc++ -lm

$(B)/bench_cuda: bench/bench_cuda.c bench/bench_shape.h $(CUDA_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(CUDA_INC) $< $(CUDA_OBJS) -o $@ $(CUDA_LIBS) $(LDLIBS)

# one process per GPU (the deployment users run): MPI + CUDA, each process on
# device local_rank % device_count, the NCCL ids broadcast over MPI
$(B)/cuda-mpi/moept.o: moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/cuda-mpi
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI $(CUDA_INC) -c moept.c -o $@

CUDA_MPI_OBJS = $(B)/cuda-mpi/moept.o $(B)/cuda/moept_kernels.o

$(B)/moept_check_cuda_mpi: tests/moept_check.c tests/testutil.h $(CUDA_MPI_OBJS)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI $(CUDA_INC) $< $(CUDA_MPI_OBJS) -o $@ \
	    $(CUDA_LIBS) $(LDLIBS)

$(B)/train_cuda_mpi: examples/train.c $(CUDA_MPI_OBJS)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI $(CUDA_INC) $< $(CUDA_MPI_OBJS) -o $@ \
	    $(CUDA_LIBS) $(LDLIBS)

# The builtin GEMM's other kernels, each over the reference cases and the
# gradient checks: the portable C kernel (vector extensions, and scalar),
# -march=x86-64-v3 (AVX2+FMA, what a distribution ships) and x86-64-v4
# (AVX-512) where this CPU runs them; aarch64 (NEON) as a static cross
# build run under qemu-user. tests/run.sh skips, with the reason, what
# this machine cannot build or run.
ARCH_X86 := $(filter x86_64,$(shell uname -m))
CPUFLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
GEMM_V3 := $(if $(ARCH_X86),$(if $(filter avx2,$(CPUFLAGS)),$(if $(filter fma,$(CPUFLAGS)),yes)))
GEMM_V4 := $(if $(ARCH_X86),$(if $(filter avx512f,$(CPUFLAGS)),yes))
# the kernel the plain build's flags select (v4, v3 or neither): tests/suites runs it once
GEMM_PLAIN := $(if $(ARCH_X86),$(shell $(CC) $(ARCH) -dM -E -x c /dev/null 2>/dev/null | \
    awk '/ __AVX512F__ / { a = 1 } / __AVX2__ / { b = 1 } / __FMA__ / { c = 1 } END { print a ? "v4" : b && c ? "v3" : "" }'))
AARCH64_CC := $(shell command -v aarch64-linux-gnu-gcc 2>/dev/null)
QEMU_AARCH64 := $(shell command -v qemu-aarch64 2>/dev/null || command -v qemu-aarch64-static 2>/dev/null)
A64_OK := $(if $(AARCH64_CC),$(if $(QEMU_AARCH64),yes))
GEMM_FLAGS_portable = -DMOEPT_GEMM_PORTABLE
GEMM_FLAGS_scalar = -DMOEPT_GEMM_PORTABLE -DMOEPT__GEMM_SCALAR -DMOEPT_NO_VEC
GEMM_FLAGS_v3 = -march=x86-64-v3
GEMM_FLAGS_v4 = -march=x86-64-v4

$(foreach k,portable scalar v3 v4,$(eval $(call variant,gemm-$(k),$(CC),$(OPT) -g $(GEMM_FLAGS_$(k)) $(OMP))))
# static, so qemu-user needs no aarch64 libraries at run time; no OpenMP
# (the threads backend's pthreads still run the EP suite's ranks)
$(eval $(call variant,aarch64,$(AARCH64_CC),-O2 -static))

VALGRIND := $(shell command -v valgrind 2>/dev/null)
CASES = $(wildcard tests/cases/*.safetensors)

# sanitizer runtimes: a toolchain without them skips those suites (tests/run.sh says why)
SAN_OK  := $(shell echo 'int main(void){return 0;}' | $(CC) -x c -fsanitize=address,undefined - -o /dev/null 2>/dev/null && echo yes)
TSAN_OK := $(shell echo 'int main(void){return 0;}' | $(CC) -x c -fsanitize=thread - -o /dev/null 2>/dev/null && echo yes)

# What to build and run comes from tests/suites (tests/run.sh --bins prints a
# selection's build outputs); the suites print "ok/FAIL/skip - name" lines
# and tests/run.sh totals them.
# torch and transformers for moept_torch.py's tests and examples/hf_swap.py --check: the first of
# python3 and Debian's /usr/bin/python3 that finds both (looked up, not imported: quick; only for make
# test); TF440: transformers 4.40 installed apart (pip --target; .ci/run does), run through PYTHONPATH
TORCH_OK := $(strip $(if $(filter test test-build test-build-stage,$(MAKECMDGOALS)),\
    $(firstword $(foreach p,python3 /usr/bin/python3,$(shell $(p) -c 'import importlib.util as u, sys; \
    sys.exit(not (u.find_spec("torch") and u.find_spec("transformers")))' 2>/dev/null && echo $(p))))))
TF440_DIR ?= /opt/moept/transformers-4.40
TF440 := $(wildcard $(TF440_DIR)/transformers)

TEST_ENV = B="$(B)" CASES="$(CASES)" MPIRUN="$(if $(MPICC),$(MPIRUN))" SAN="$(SAN_OK)" TSAN="$(TSAN_OK)" \
           CBLAS="$(if $(CBLAS_LIBS),yes)" VALGRIND="$(VALGRIND)" GEMM_V3="$(GEMM_V3)" GEMM_V4="$(GEMM_V4)" \
           GEMM_PLAIN="$(GEMM_PLAIN)" \
           ARCH_X86="$(ARCH_X86)" QEMU_AARCH64="$(if $(A64_OK),$(QEMU_AARCH64))" EMU="$(EMU_OK)" \
           EMU_INC="$(EMU_INC)" CUDA="$(CUDA_OK)" NVCC="$(NVCC)" TORCH="$(TORCH_OK)" \
           TF440="$(if $(TF440),$(TF440_DIR))"
suite_outputs = $(sort $(shell $(TEST_ENV) sh tests/run.sh --bins $(1)))
SUITE_BINS := $(call suite_outputs)
CHECK_BINS := $(call suite_outputs,--check)
all: $(filter $(B)/test_%,$(call suite_outputs,cpu))
cuda: $(call suite_outputs,cuda)
emu: $(call suite_outputs,emu)

# the binaries build in parallel, a job a core, the longest compiles first (so
# that the build does not end on one of them alone). make test builds what the
# suites before tests/suites' first "later" line run, then starts them while
# the rest builds beside them, niced (-k: a failed program fails its suites
# alone), a stage a "later" line: its compiles take the cores the suites leave
# idle. tests/run.sh waits at each such line for its stage's exit status
# (LATE_BUILD.N.rc); an interrupted make test stops the build.
NPROC := $(shell nproc 2>/dev/null || echo 1)
LONGEST = $(if $(filter $(B)/emu-san/%,$(SUITE_BINS)),$(B)/emu-san/moept_kernels.o) \
          $(if $(filter $(B)/test_cuda,$(SUITE_BINS)),$(B)/cuda/moept_kernels.o) \
          $(if $(filter $(B)/emu/%,$(SUITE_BINS)),$(B)/emu/moept_kernels.o)
test-build: $(LONGEST) all $(SUITE_BINS)
# (STAGE=N: what the suites before the N-th "later" line run)
STAGE = 1
test-build-stage: all $(if $(filter test-build-stage,$(MAKECMDGOALS)),$(call suite_outputs,--stage $(STAGE)))

LATE_BUILD = $(B)/late_build
LATE_MAKE = $(MAKE) --no-print-directory -k -j$(NPROC) # (not $(MAKE) in a recipe: make -n runs that line)
LATER = $(shell grep -c '^later' tests/suites)
test:
	@$(MAKE) --no-print-directory -j$(NPROC) test-build-stage
	@rm -f $(LATE_BUILD).*; \
	{ trap 'kill $$m 2>/dev/null; exit 143' TERM; \
	  n=1; while [ $$n -le $(LATER) ]; do \
	    if [ $$n -lt $(LATER) ]; then t="test-build-stage STAGE=$$((n + 1))"; else t=test-build; fi; \
	    nice -n 19 $(LATE_MAKE) $$t >$(LATE_BUILD).$$n.log 2>&1 & m=$$!; \
	    wait $$m; echo $$? >$(LATE_BUILD).$$n.tmp; mv $(LATE_BUILD).$$n.tmp $(LATE_BUILD).$$n.rc; n=$$((n + 1)); \
	  done; } & late=$$!; \
	trap 'kill $$late 2>/dev/null; exit 130' INT TERM HUP; \
	$(TEST_ENV) LATE_BUILD=$(LATE_BUILD) LATE_BUILD_PID=$$late sh tests/run.sh; rc=$$?; wait $$late; exit $$rc

# the edit-compile loop's subset (tests/suites' "check" lines), about a minute
check:
	@$(MAKE) --no-print-directory -j$(NPROC) $(CHECK_BINS)
	@$(TEST_ENV) sh tests/run.sh --check

# the example's 200 steps alone and beside a busy process per core, one run
bench-busy: $(B)/train
	sh bench/busy.sh $(B)/train 200

# the long runs: the kill -9 loop with 50 kills a mode (make test runs 5), and 10 kills of one of
# 4 processes of the emulated GPUs' moept_check_mpi (make test runs 2)
STRESS_KILLS ?= 50
stress: $(B)/crash_save $(if $(MPICC),$(B)/crash_save_mpi) $(if $(and $(MPICC),$(EMU_OK)),$(B)/emu/moept_check_mpi) \
        $(if $(EMU_OK),$(B)/emu/moept_check $(B)/emu/test_q8 $(B)/emu/bench_cuda $(B)/emu/bench_q8 \
            $(B)/emu/lt_rules $(B)/emu/train $(B)/train) \
        $(if $(and $(EMU_OK),$(SAN_OK)),$(B)/emu-san/moept_check $(B)/emu-san/test_range)
	@MPIRUN="$(if $(MPICC),$(MPIRUN),)" EMU="$(EMU_OK)" SAN="$(SAN_OK)" KILLS=$(STRESS_KILLS) sh tests/stress.sh

run: $(B)/train
	$(B)/train

bench: bench-layer bench-a2a bench-load bench-reshard bench-scenarios

# the scenario matrix (bench/scenarios); SLOW=1 adds the rows marked slow
bench-scenarios: $(B)/bench_scenario $(if $(MPICC),$(B)/bench_scenario_mpi) $(B)/plan
	python3 bench/run_scenarios.py $(if $(SLOW),--slow) $(if $(MPICC),,--only threads)
	$(B)/plan --check --scenarios $(B)/scenarios.csv

bench-reshard: $(B)/bench_reshard
	$(B)/bench_reshard

bench-load: $(B)/bench_load
	$(B)/bench_load

# the x86-64-v3 build (AVX2+FMA: what a distribution ships) beside -march=native
$(B)/v3/bench_%: bench/bench_%.c bench/peak.h bench/bench_shape.h moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/v3
	$(CC) $(OPT) -g -march=x86-64-v3 $(WARN) -D_DEFAULT_SOURCE $(OMP) $(if $(CBLAS_LIBS),-DBENCH_CBLAS) $< -o $@ \
	    $(LDLIBS) $(CBLAS_LIBS)

bench-layer: $(B)/bench_layer $(B)/bench_gemm $(if $(CBLAS_LIBS),$(B)/cblas/bench_layer) \
             $(if $(GEMM_V3),$(B)/v3/bench_layer $(B)/v3/bench_gemm)
	python3 bench/run_bench_layer.py

bench-a2a: $(B)/bench_a2a $(if $(MPICC),$(B)/bench_a2a_mpi)
	sh bench/run_bench_a2a.sh

# libFuzzer (ASan + UBSan) from the committed corpora (new finds are added to
# them): fuzz_safetensors over the safetensors parser and the checkpoint
# indexes, fuzz_config over config.json (the strict JSON reader,
# moept_config_from_hf, the FP8 block). make fuzz runs each FUZZ_SECONDS;
# make fuzz-config FUZZ_SECONDS=600 one of them.
FUZZ_SECONDS ?= 60
FUZZ_CC = clang -O1 -g -std=c11 -D_DEFAULT_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
$(B)/fuzz_safetensors: tests/fuzz/fuzz_safetensors.c moept.c $(HDRS) | $(B)
	$(FUZZ_CC) $< -o $@ -lm -pthread

$(B)/fuzz_config: tests/fuzz/fuzz_config.c moept.c $(HDRS) | $(B)
	$(FUZZ_CC) $< -o $@ -lm -pthread

fuzz-safetensors: $(B)/fuzz_safetensors
	$(B)/fuzz_safetensors -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=10 tests/fuzz/corpus

fuzz-config: $(B)/fuzz_config
	$(B)/fuzz_config -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=10 -dict=tests/fuzz/config.dict \
	    tests/fuzz/corpus_config

fuzz: fuzz-safetensors fuzz-config

clean:
	rm -rf $(B)

# ---- the emulated GPU (tests/emu): moept_kernels.cu run on the CPU ----------
# The kernels' unit is C++ with -fsanitize=thread's instrumentation but not its
# runtime: every load and store calls tests/emu's checks. Needs only the CUDA,
# cuBLAS and NCCL headers (for their declarations), no GPU and no CUDA library.
# (an object a rule: make -j compiles them side by side)
$(B)/emu/emu_%.o: tests/emu/emu_%.cc $(EMU_HDRS)
	@mkdir -p $(@D)
	$(EMU_CXX) -O2 -c $< -o $@

$(B)/emu/rt.o: $(patsubst tests/emu/%.cc,$(B)/emu/%.o,$(EMU_SRC))
	ld -r $^ -o $@

$(B)/emu/moept_kernels.o: moept_kernels.cu moept.c $(HDRS) tests/emu/cuda_emu.h | $(B)
	@mkdir -p $(B)/emu
	$(EMU_CXX) -O2 $(EMU_KFLAGS) -c moept_kernels.cu -o $@

# moept.c with -DMOEPT_CUDA sees the CUDA headers' declarations alone: where nvcc is found, the CUDA
# build's object (and its MPI one's) is the emulated GPU's too, compiled once
ifeq ($(CUDA_OK),yes)
$(B)/emu/moept.o: $(B)/cuda/moept.o
	@mkdir -p $(@D)
	ln -f $< $@
$(B)/emu-mpi/moept.o: $(B)/cuda-mpi/moept.o
	@mkdir -p $(@D)
	ln -f $< $@
else
$(B)/emu/moept.o: moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/emu
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(EMU_INC) -c moept.c -o $@
$(B)/emu-mpi/moept.o: moept.c $(HDRS) | $(B)
	@mkdir -p $(B)/emu-mpi
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI $(EMU_INC) -c moept.c -o $@
endif

EMU_OBJS = $(B)/emu/moept.o $(B)/emu/moept_kernels.o $(B)/emu/rt.o

# a program of yours on the emulated GPU (docs/CUDA.md, "Your program on the emulated GPU"): the kernels
# and the emulator in one archive, linked in place of moept_kernels.o and the CUDA libraries
$(B)/emu/libmoept_emu.a: $(B)/emu/moept_kernels.o $(B)/emu/rt.o
	rm -f $@
	ar rcs $@ $^
emu-lib: $(B)/emu/libmoept_emu.a

$(B)/emu/moept_check: tests/moept_check.c tests/testutil.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

# test_alloc on a CUDA layer: moept.c compiled in, its allocations counted (the host's bytes at two sizes)
$(B)/emu/test_alloc: tests/test_alloc.c moept.c $(HDRS) tests/testutil.h $(B)/emu/moept_kernels.o $(B)/emu/rt.o
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests \
	    -Werror=implicit-function-declaration $< $(B)/emu/moept_kernels.o $(B)/emu/rt.o -o $@ $(EMU_LIBS)

$(B)/emu/test_cuda: tests/test_cuda.c tests/testutil.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_replay: tests/test_replay.c tests/testutil.h tests/tu_exec.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_router_io: tests/test_router_io.c tests/testutil.h tests/tu_exec.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_slots: tests/test_slots.c tests/testutil.h tests/tu_exec.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_refuse: tests/test_refuse.c tests/testutil.h tests/tu_exec.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_range: tests/test_range.c tests/testutil.h tests/tu_exec.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) -D_DEFAULT_SOURCE $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/test_fault: tests/test_fault.cu tests/testutil.h $(EMU_OBJS)
	$(EMU_CXX) -O1 $(EMU_KFLAGS) -DMOEPT_EMU -Itests -c tests/test_fault.cu -o $(B)/emu/test_fault.o
	$(CC) $(CFLAGS) $(OMP) $(B)/emu/test_fault.o $(EMU_OBJS) -o $@ $(EMU_LIBS)

# the FP8 white boxes, test_q8 and bench_q8, as one program (tests/q8.cu), as the GPU's above
$(B)/emu/q8: $(Q8_DEPS) $(B)/emu/moept.o $(B)/emu/rt.o
	$(EMU_CXX) -O1 $(EMU_KFLAGS) -Itests -c tests/q8.cu -o $(B)/emu/q8.o
	$(CC) $(CFLAGS) $(OMP) $(B)/emu/q8.o $(B)/emu/moept.o $(B)/emu/rt.o -o $@ $(EMU_LIBS)

$(B)/emu/test_q8 $(B)/emu/bench_q8: $(B)/emu/q8
	ln -f $< $@

$(B)/emu/lt_rules: tests/lt_rules.cu $(B)/emu/rt.o
	$(EMU_CXX) -O1 $(EMU_KFLAGS) -DMOEPT_EMU -Itests -c tests/lt_rules.cu -o $(B)/emu/lt_rules.o
	$(EMU_CXX) $(B)/emu/lt_rules.o $(B)/emu/rt.o -o $@ $(EMU_LIBS)

$(B)/emu/cuda_rules: tests/cuda_rules.cu $(B)/emu/rt.o
	$(EMU_CXX) -O1 $(EMU_KFLAGS) -DMOEPT_EMU -Itests -c tests/cuda_rules.cu -o $(B)/emu/cuda_rules.o
	$(EMU_CXX) $(B)/emu/cuda_rules.o $(B)/emu/rt.o -o $@ $(EMU_LIBS)

$(B)/emu/train: examples/train.c $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(EMU_INC) $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

# the planner's --check with CUDA layers on the emulated GPU beside the CPU's
$(B)/emu/plan: tools/plan.c $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

$(B)/emu/bench_cuda: bench/bench_cuda.c bench/bench_shape.h $(EMU_OBJS)
	$(CC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA $(EMU_INC) $< $(EMU_OBJS) -o $@ $(EMU_LIBS)

# one process per emulated GPU: MPI + the emulated CUDA, its NCCL across
# processes through shared anonymous memory files (tests/emu/emu_nccl.cc)
EMU_MPI_OBJS = $(B)/emu-mpi/moept.o $(B)/emu/moept_kernels.o $(B)/emu/rt.o

$(B)/emu/moept_check_mpi: tests/moept_check.c tests/testutil.h $(EMU_MPI_OBJS)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI -DMOEPT_EMU $(EMU_INC) $< $(EMU_MPI_OBJS) -o $@ \
	    $(EMU_LIBS)

$(B)/emu/train_mpi: examples/train.c $(EMU_MPI_OBJS)
	$(MPICC) $(CFLAGS) $(WARN) $(OMP) -DMOEPT_CUDA -DMOEPT_MPI $(EMU_INC) $< $(EMU_MPI_OBJS) -o $@ $(EMU_LIBS)

# compiled with the kernels' instrumentation, linked without the tsan runtime
# (its interceptors would see the uninstrumented emulator's threads and fibers)
$(B)/emu/test_emu: tests/emu/test_emu.cc $(B)/emu/rt.o
	$(EMU_CXX) -O1 $(EMU_KFLAGS) -c tests/emu/test_emu.cc -o $(B)/emu/test_emu.o
	$(EMU_CXX) $(B)/emu/test_emu.o $(B)/emu/rt.o -o $@ $(EMU_LIBS)

# the same under ASan + UBSan (no per-access hooks: ASan and the tsan
# instrumentation do not mix; ASan sees the kernels' stacks and host memory)
$(B)/emu-san/emu_%.o: tests/emu/emu_%.cc $(EMU_HDRS)
	@mkdir -p $(@D)
	$(EMU_CXX) -O1 $(SAN) -c $< -o $@

$(B)/emu-san/moept_kernels.o: moept_kernels.cu moept.c $(HDRS) $(EMU_HDRS)
	@mkdir -p $(@D)
	$(EMU_CXX) -O1 $(SAN) -x c++ -include tests/emu/cuda_emu.h -c moept_kernels.cu -o $@

EMU_SAN_OBJS = $(patsubst tests/emu/%.cc,$(B)/emu-san/%.o,$(EMU_SRC)) $(B)/emu-san/moept_kernels.o
$(B)/emu-san/test_range: tests/test_range.c tests/testutil.h tests/tu_exec.h moept.c $(HDRS) $(EMU_SAN_OBJS)
	$(CC) -O0 -g $(WARN) $(SAN) -D_DEFAULT_SOURCE -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) -Itests $< moept.c \
	    $(EMU_SAN_OBJS) -o $@ $(EMU_LIBS)

# (moept.c at -O0: a third of -O1's compile, and the same run time: the kernels' unit is the work)
$(B)/emu-san/moept_check: tests/moept_check.c tests/testutil.h moept.c $(HDRS) $(EMU_SAN_OBJS)
	$(CC) -O0 -g $(WARN) $(SAN) -DMOEPT_CUDA -DMOEPT_EMU $(EMU_INC) tests/moept_check.c moept.c $(EMU_SAN_OBJS) -o $@ \
	    $(EMU_LIBS)

