# Two entry points for newcomers (see README.md):
#   make demo   loom up (local coordinator + worker): tiny IHA pretraining, then SFT from it, on CPU
#   make test   builds everything and runs the whole ctest suite
# Both install missing Debian packages and build what is missing first.

BUILD_DIR ?= build
# The second build, against PyPI's LibTorch 2.15 with CUDA (docs/building.md, "LibTorch"): make
# test builds it and runs its LibTorch tests (label torch) after the whole suite of the first.
TORCH2_DIR ?= build-torch2
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps configure build build-torch2 demo test fuzz format clean

all: build

deps:
	@bash scripts/install-deps

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

$(TORCH2_DIR)/build.ninja:
	cmake -S . -B $(TORCH2_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DLOOM_TORCH=pypi \
	  -DLOOM_FUZZ_REPLAY=OFF $(CMAKE_ARGS)

build-torch2: deps $(TORCH2_DIR)/build.ninja
	cmake --build $(TORCH2_DIR) -j $(JOBS)

demo: build
	BUILD_DIR=$(BUILD_DIR) bash scripts/demo

# The tests start loom-train and loom-serve hundreds of times, and each would re-execute itself
# once to leave OpenBLAS's SSE-era kernels (base/blas_core.h), loading LibTorch twice: ask
# loom-train once which kernels it switches to and give the tests that OPENBLAS_CORETYPE, the
# choice each process would make itself (nothing where it keeps OpenBLAS's own; blas_core_test
# unsets it to test the switch). ctest counts CPU in half-core slots (cmake/LoomTesting.cmake,
# loom_test_cpu): two slots per core, so suites that mostly wait can share one. docs/testing.md,
# "CI time".
CTEST = ctest --output-on-failure -j $$((2 * $(JOBS))) --resource-spec-file ctest-resources.json --timeout 900
test: build build-torch2
	cd $(BUILD_DIR) && core=$$( [ -x bin/loom-train ] && bin/loom-train --help 2>&1 >/dev/null | \
	    sed -n 's/.*restarting with OPENBLAS_CORETYPE=\([A-Za-z0-9_]*\).*/\1/p'); \
	  if [ -n "$$core" ]; then export OPENBLAS_CORETYPE=$$core; fi; \
	  $(CTEST)
	cd $(TORCH2_DIR) && $(CTEST) -L torch

format:
	git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)

# The libFuzzer harnesses (clang, ASan + UBSan) in build-fuzz/; scripts/fuzz runs them
# (docs/testing.md). `make test` builds and replays them too, in $(BUILD_DIR)/fuzz.
fuzz: deps
	cmake -S . -B build-fuzz -G Ninja -DLOOM_FUZZ=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ $(CMAKE_ARGS)
	cmake --build build-fuzz --target loom_fuzzers -j $(JOBS)
