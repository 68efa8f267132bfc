# moeserve build.
#   make            build build/moeserve (CPU path always; CUDA objects too where nvcc is found)
#   make CUDA=0     skip the CUDA path even when nvcc is there
#   make test       build and run every test; the last line is "N passed, M failed"
#   make run        install what is missing, build, and serve the embedded default model over HTTP
#   make bench      CPU decode and all-to-all benchmarks (see docs/benchmarks.md)
#   make asan       build and test with AddressSanitizer + UBSan in build-asan/
#   make fuzz       build the libFuzzer targets of tests/fuzz/ (clang) into build-fuzz/
#   make fuzz-smoke run each fuzz target briefly over its corpus; the last line is "N passed, M failed"
#   make lint       cppcheck + clang-tidy on the project's C code (.clang-tidy, .cppcheck-suppressions)
#   make format     clang-format every C source
#   make clean      remove build outputs

BUILD    ?= build
CC       ?= cc
MARCH    ?= native
OPT      ?= -O3 -march=$(MARCH)
CFLAGS   ?= $(OPT) -g
CFLAGS   += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -fopenmp -I. -MMD -MP
LDLIBS   += -fopenmp -lmicrohttpd -lcjson -lpcre2-8 -lutf8proc -lm -lpthread

# ---- what we found ----
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
ifeq ($(CUDA),0)
  NVCC :=
endif
# The GPU all-to-all (kernels/cuda/a2a_*.cu) needs NCCL, and MPI's headers to compile (the other
# CUDA objects do not); it links into everything (the server's ranks use it with --device cuda).
CU_SRCS  := $(filter-out kernels/cuda/a2a_%.cu,$(wildcard kernels/cuda/*.cu))
A2A_CU_SRCS := $(wildcard kernels/cuda/a2a_*.cu)
ifneq ($(NVCC),)
  ifneq ($(CU_SRCS),)
    CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
    # Hopper (sm_90a) and Blackwell (sm_100a, B200 and GB200) in every CUDA object: the wgmma
    # kernels are Hopper's alone (kernels/cuda/hopper.cuh), the tcgen05 ones (*_sm100.cu)
    # Blackwell's alone. `make NVCC_ARCHS=...` builds for fewer.
    NVCC_ARCHS ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a
    NVCCFLAGS ?= -O3 -std=c++20 $(NVCC_ARCHS) -I.
    CFLAGS    += -DMOESERVE_CUDA=1 -I$(CUDA_HOME)/include
    LDLIBS    += -L$(CUDA_HOME)/lib64 -lcudart -lcublas -lcublasLt -lstdc++
    CU_OBJS   := $(CU_SRCS:%.cu=$(BUILD)/%.o)
    A2A_CU_OBJS := $(A2A_CU_SRCS:%.cu=$(BUILD)/%.o)
    NCCL_H    ?= $(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h))
    A2A_CU_LIBS := $(if $(NCCL_H),-lnccl)
  endif
endif
$(info moeserve: cc=$(CC) nvcc=$(if $(NVCC),$(NVCC),none) cuda objects=$(words $(CU_OBJS)))
$(if $(A2A_CU_OBJS),$(info moeserve: nccl=$(if $(NCCL_H),$(NCCL_H),none (the nccl all-to-all transport reports itself missing))))

# MPI (OpenMPI's C bindings) for the rank group and the all-to-all, on every object.
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null)
CFLAGS     += $(MPI_CFLAGS)
LDLIBS     += $(MPI_LIBS)
$(info moeserve: mpi=$(if $(MPI_LIBS),$(MPI_LIBS),none (apt-get install libopenmpi-dev)))
# libcurl relays requests between ranks (server/proxy.c).
CURL_CFLAGS := $(shell pkg-config --cflags libcurl 2>/dev/null)
CURL_LIBS   := $(shell pkg-config --libs libcurl 2>/dev/null)
CFLAGS      += $(CURL_CFLAGS)
LDLIBS      += $(CURL_LIBS)
$(info moeserve: curl=$(if $(CURL_LIBS),$(CURL_LIBS),none (apt-get install libcurl4-openssl-dev)))
LIB_SRCS  := $(wildcard common/*.c config/*.c kernels/*.c kernels/cpu/*.c runner/*.c runner/models/*.c server/*.c)
LIB_SRCS  := $(filter-out server/main.c,$(LIB_SRCS))
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/%.o) $(CU_OBJS) $(A2A_CU_OBJS)
LDLIBS    += $(A2A_CU_LIBS)
TEST_SRCS := $(wildcard tests/test_*.c)
TEST_BINS := $(TEST_SRCS:tests/%.c=$(BUILD)/tests/%)

.PHONY: all test run bench asan fuzz fuzz-bins fuzz-smoke lint format clean deps
.SECONDARY:
all: $(BUILD)/moeserve $(BUILD)/moeserve-bench $(BUILD)/bench_step $(BUILD)/quant_kl $(TEST_BINS)

$(BUILD)/moeserve: $(BUILD)/server/main.o $(LIB_OBJS)
	$(CC) -o $@ $^ $(LDLIBS)

# moeserve-bench: GSM8K and serving benchmark clients (scripts/bench/, libcurl + cJSON only).
BENCH_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard scripts/bench/*.c))
$(BUILD)/moeserve-bench: $(BENCH_OBJS)
	$(CC) -o $@ $^ $(filter -fsanitize=%,$(LDLIBS)) $(CURL_LIBS) -lcjson -lm -lpthread
$(BUILD)/tests/test_bench_stats: $(filter-out $(BUILD)/scripts/bench/main.o,$(BENCH_OBJS))

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c -o $@ $<

# Blackwell's kernels (kernels/cuda/*_sm100.cu) are built for sm_100a alone; the host takes them
# only on a device of compute capability 10.0.
$(BUILD)/kernels/cuda/%_sm100.o: NVCCFLAGS := $(filter-out -gencode=arch=compute_90a%,$(NVCCFLAGS))

# Debian packages the build and the tests need; installed only when one is missing.
DEB_PKGS := gcc make pkg-config libcjson-dev libpcre2-dev libutf8proc-dev libmicrohttpd-dev curl strace \
            libcurl4-openssl-dev libopenmpi-dev openmpi-bin python3 python3-pip
deps:
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# The HTTP tests drive the server with the openai client too (PyPI), installed when missing.
test: deps
	@$(MAKE) --no-print-directory all
	@python3 -c 'import openai' 2>/dev/null || python3 -m pip install -q openai 2>/dev/null || \
	  python3 -m pip install -q --break-system-packages openai
	@tests/run.sh

DEFAULT_MODEL ?= models/tiny-qwen3-moe
SERVE_FLAGS ?=
run: deps
	@$(MAKE) --no-print-directory $(BUILD)/moeserve
	$(BUILD)/moeserve serve --model-path $(DEFAULT_MODEL) $(SERVE_FLAGS)

bench: all $(BUILD)/bench_membw $(BUILD)/bench_a2a
	scripts/bench_cpu.sh
	OMP_NUM_THREADS=1 mpirun $(A2A_MPIRUN_FLAGS) -np 2 $(BUILD)/bench_a2a
	OMP_NUM_THREADS=1 mpirun $(A2A_MPIRUN_FLAGS) -np 4 $(BUILD)/bench_a2a

# All-to-all transports (shm, mpi) against MPI_Alltoallv; 4 ranks oversubscribe a 2-core machine.
A2A_MPIRUN_FLAGS := --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1
A2A_OBJS := $(BUILD)/kernels/a2a.o $(BUILD)/kernels/cpu/a2a_shm.o $(BUILD)/kernels/cpu/a2a_mpi.o \
            $(BUILD)/common/log.o
$(BUILD)/bench_a2a: $(BUILD)/scripts/bench_a2a.o $(A2A_OBJS)
	$(CC) -o $@ $^ $(LDLIBS)

# The GPU all-to-all (nvlink_one_sided, nccl): its test runs under mpirun on the GPU machine
# (scripts/gpu_check.sh runs it with one rank); bench_a2a_cuda needs two GPUs and mpirun -np 2.
# Without nvcc the test builds as a stub that says "skipped".
# (every CUDA object: elementwise.cu reads the payload formats of kernels/a2a.h too)
$(CU_OBJS) $(A2A_CU_OBJS): NVCCFLAGS += $(MPI_CFLAGS) $(if $(NCCL_H),,-DMOESERVE_NO_NCCL)
$(BUILD)/tests/test_cuda_a2a: $(BUILD)/tests/test_cuda_a2a.o $(LIB_OBJS) $(A2A_CU_OBJS)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS) $(A2A_CU_LIBS)
ifneq ($(A2A_CU_OBJS),)
all: $(BUILD)/bench_a2a_cuda
endif
$(BUILD)/bench_a2a_cuda: $(BUILD)/scripts/bench_a2a_cuda.o $(LIB_OBJS) $(A2A_CU_OBJS)
	$(CC) -o $@ $^ $(LDLIBS) $(A2A_CU_LIBS)

# Engine step benchmark (decode step time against the memory floor, prefill throughput).
$(BUILD)/bench_step: $(BUILD)/scripts/bench_step.o $(LIB_OBJS)
	$(CC) -o $@ $^ $(LDLIBS)

# The rate at which a weight matrix streams with no arithmetic, against a device copy (a Hopper
# device; docs/benchmarks.md): bench_stream in the wgmma kernels' TMA box shapes, bench_stream_rows
# in the tiny path's cp.async ring of row slices (kernels/cuda/moe.cu); bench_nvfp4_decode, NVFP4
# weights at decode sizes decoded into wgmma's A registers (W4A16 and W4A8) against the copy rate;
# bench_wgmma_rate, the wgmma a multiprocessor issues a cycle at decode sizes' small N.
STREAM_BENCHES := $(BUILD)/bench_stream $(BUILD)/bench_stream_rows $(BUILD)/bench_nvfp4_decode \
                  $(BUILD)/bench_wgmma_rate
ifneq ($(CU_OBJS),)
all: $(STREAM_BENCHES)
endif
$(patsubst $(BUILD)/%,$(BUILD)/scripts/%.o,$(STREAM_BENCHES)): NVCCFLAGS += $(MPI_CFLAGS)
$(STREAM_BENCHES): $(BUILD)/%: $(BUILD)/scripts/%.o $(LIB_OBJS)
	$(CC) -o $@ $^ $(LDLIBS)

# Teacher-forced KL of the FP8 and NVFP4 models against BF16 (issue 8's measure).
$(BUILD)/quant_kl: $(BUILD)/scripts/quant_kl.o $(LIB_OBJS)
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/bench_membw: scripts/bench_membw.c
	@mkdir -p $(dir $@)
	$(CC) $(OPT) -fopenmp -o $@ $<

# The sanitizer builds optimise the CPU kernels and the model's layers (still instrumented) with
# KERNEL_OPT, so that the forward passes of the end-to-end tests do not take all their time.
KERNEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard kernels/*.c kernels/cpu/*.c runner/models/*.c))
$(KERNEL_OBJS): CFLAGS += $(KERNEL_OPT)

# The whole suite (unit tests, and the real binary under mpirun -np 1 to 4) with AddressSanitizer
# and UBSan; any report ends the process that made it, so the test that ran it fails. Leaks are
# checked at every exit; tests/lsan.supp names the libraries outside the project (OpenMPI's)
# whose own allocations kept until exit are not counted, which needs full stack unwinding.
# The end-to-end tests' hang guards get more time: the server runs several times slower under
# ASan (the figures are in docs/reliability.md). intercept_tls_get_addr=0: the runtime of GCC 12
# (and LLVM up to 16) takes a dynamic TLS block that happens to start 16 bytes past a page
# boundary for an old glibc's header and reads a bogus range from it; the leak check's tracer
# then dies at exit ("LeakSanitizer has encountered a fatal error", no leak found) now and then.
# The blocks are OpenMPI's components' (dlopen'ed by MPI_Init); moeserve's own thread-local
# variables are in static TLS, which the leak check still scans.
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all
ASAN_ENV   := ASAN_OPTIONS=fast_unwind_on_malloc=0:detect_leaks=1:abort_on_error=0:intercept_tls_get_addr=0 \
              LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
              UBSAN_OPTIONS=print_stacktrace=1 BENCH_TEST_STEP_TIMEOUT=600 \
              DET_TEST_TIMEOUT=1200 EP_TEST_TIMEOUT=1200 RELIABILITY_TEST_TIMEOUT=1200 \
              MOESERVE_TEST_TIME_SCALE=4
asan:
	$(MAKE) BUILD=build-asan OPT="-O1 -g $(ASAN_FLAGS) -fno-omit-frame-pointer" \
	  KERNEL_OPT="-O2 -march=$(MARCH)" \
	  LDLIBS="$(ASAN_FLAGS) -fopenmp -lmicrohttpd -lcjson -lpcre2-8 -lutf8proc -lm -lpthread $(MPI_LIBS) $(CURL_LIBS)" CUDA=0 all
	$(ASAN_ENV) BUILD=build-asan tests/run.sh

# Fuzzing (docs/reliability.md): each tests/fuzz/fuzz_*.c is one libFuzzer target calling the
# project's own parsers; the project's objects are built with clang and the same sanitizers into
# build-fuzz/ and linked from an archive. Seeds and the kept corpus are in tests/fuzz/corpus/.
FUZZ_CC     ?= clang
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_BINS   := $(patsubst tests/fuzz/%.c,$(BUILD)/%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_SECS   ?= 10
fuzz:
	@$(MAKE) --no-print-directory BUILD=build-fuzz CC=$(FUZZ_CC) CUDA=0 \
	  OPT="-O1 -g -fno-omit-frame-pointer $(FUZZ_SAN)" FUZZ_COV=-fsanitize=fuzzer-no-link \
	  KERNEL_OPT="-O2 -march=$(MARCH)" fuzz-bins
fuzz-bins: $(FUZZ_BINS)
# Coverage feedback for the parsing side only: the kernels and the model's layers (which run
# when fuzz_api_request steps the engine) get no coverage hooks (and KERNEL_OPT), or they take all
# the time.
FUZZ_COV_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard common/*.c config/*.c runner/*.c \
                   server/*.c tests/fuzz/*.c))
$(FUZZ_COV_OBJS): CFLAGS += $(FUZZ_COV)
$(BUILD)/libmoeserve.a: $(filter-out $(BUILD)/server/http.o,$(LIB_OBJS))
	@rm -f $@
	ar rcs $@ $^
# server/http.o stays out of the archive: fuzz_api_request brings its own stand-in transport.
$(BUILD)/fuzz_%: $(BUILD)/tests/fuzz/fuzz_%.o $(BUILD)/libmoeserve.a
	$(CC) $(FUZZ_SAN) -fsanitize=fuzzer -o $@ $^ $(LDLIBS)
# Each target for FUZZ_SECS seconds over a copy of its corpus (a crash or a sanitizer report is a
# failure; its reproducer is left in build-fuzz/).
fuzz-smoke: fuzz
	@scripts/fuzz_smoke.sh $(FUZZ_SECS)

# Every finding of either tool is a failure (scripts/lint.sh says which checks and why).
lint:
	@scripts/lint.sh

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

clean:
	rm -rf $(BUILD) build-asan build-fuzz

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
