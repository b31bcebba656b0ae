# ft — two commands on a fresh machine:
#   make demo   install what ft needs (no test tools), build only ft, run a real small job on CPU
#   make test   install dependencies, build, run every test (CTest), then a short fuzz smoke
#   make fuzz   build the libFuzzer harnesses (build-fuzz/) and run each for FUZZ_SECONDS (60)
#   make bench  also install the benchmarks' anchors (deepspeed), build, run the CPU benchmarks
# Everything heavy (LibTorch, the Python venv) lives in $(FT_CACHE), outside the checkout.
# Set FT_PYTHON=/path/to/python (a Python that already imports torch) to use an existing torch and
# skip every download, e.g. on a GPU machine with no network.

export FT_CACHE ?= $(HOME)/.cache/ft
BUILD ?= build

FUZZ_SECONDS ?= 60
# What `make test` gives each harness: enough to show that it builds and runs.
FUZZ_SMOKE_SECONDS ?= 3

.PHONY: all deps build test fuzz demo bench clean format

all: build

deps:
	@bash scripts/setup.sh

build: deps
	@bash scripts/build.sh $(BUILD)

test: build
	@cd $(BUILD) && ctest --output-on-failure --timeout 300 -j 2
	@bash scripts/fuzz.sh $(FUZZ_SMOKE_SECONDS)

fuzz: deps
	@bash scripts/fuzz.sh $(FUZZ_SECONDS)

# The demo installs and builds only what it runs: `ft` (and the libraries it links), no test
# binaries, no reference libraries; `make test` adds the rest.
demo:
	@FT_SETUP=demo bash scripts/setup.sh
	@bash scripts/build.sh $(BUILD) ft
	@bash scripts/demo.sh $(BUILD)

# The benchmarks that run on a CPU in a few minutes each; the others (bench/*.sh) say their own
# commands and sizes in docs/performance.md.
bench:
	@FT_SETUP=bench bash scripts/setup.sh
	@bash scripts/build.sh $(BUILD)
	@bash bench/launch_startup.sh $(BUILD)
	@bash bench/train_step.sh $(BUILD)
	@bash bench/strategies.sh $(BUILD)
	@bash bench/host_adamw.sh $(BUILD)

format:
	@clang-format -i $$(git ls-files '*.h' '*.cpp')

clean:
	rm -rf $(BUILD) build-fuzz
